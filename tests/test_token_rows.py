"""Token ids as the input: their one-hot rows are data, not a variable (as autograd takes no
derivative in integer ids), and the generated code gathers and scatters the rows at the ids
(no product with a one-hot matrix is formed), in both backends, padding rows included."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

import curvgap
from curvgap.codegen.cache import module_for
from tests.reference import Reference, randomise, relative

DTYPE = torch.float64
VOCABULARY, PADDING = 11, 3


class TiedLM(torch.nn.Module):
    """Token ids to logits through a table with a padding row, its head tied to the table."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(VOCABULARY, 6, padding_idx=PADDING)
        self.hidden = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, VOCABULARY, bias=False)
        self.head.weight = self.table.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.table(ids))))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCABULARY, (3, 5), generator=generator)
    ids[0, :2] = PADDING  # padded positions: the table's padding row is a constant there
    targets = torch.randint(0, VOCABULARY, (3, 5), generator=generator)
    return ids, targets.masked_fill(ids == PADDING, -100)


def _token_part_source(c: curvgap.adapters.Curvature) -> str:
    runner = next(iter(c._traced.values())).runner()
    module = runner.modules[0] if hasattr(runner, "modules") else runner
    return Path(module.__file__).read_text()


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["unfused", "fused"])
def test_a_token_models_products_are_autograds_with_padding_and_a_tied_head(fused):
    module = randomise(TiedLM().to(DTYPE))
    ids, T = _batch()
    ref = Reference(module, ids, T, "cross_entropy")
    c = curvgap.curvature(module, "cross_entropy", fused=fused)
    gradient = c.gradient(ids, T)
    assert relative(gradient, ref.gradient()) <= 1e-10
    v = torch.randn(gradient.numel(), generator=torch.Generator().manual_seed(1), dtype=DTYPE)
    assert relative(c.hvp(ids, T, v), ref.hvp(v)) <= 1e-10
    assert relative(c.gnvp(ids, T, v), ref.gnvp(v)) <= 1e-10


def test_the_generated_code_forms_no_product_with_the_one_hot_rows():
    module = randomise(TiedLM().to(DTYPE))
    ids, T = _batch()
    c = curvgap.curvature(module, "cross_entropy")
    c.hvp(ids, T, torch.ones(sum(p.numel() for p in module.parameters()), dtype=DTYPE))
    source = _token_part_source(c)
    groups = source[source.index("def _forward(ns):"):source.index("_GROUPS = {")]
    uses = [line.strip() for line in groups.splitlines() if re.search(r"\bX\b", line)
            and not line.strip().startswith(('"""', "#"))]
    assert uses and all(use == 'X = ns["X"]' for use in uses), uses
    assert "_gather_rows(ns, " in groups and "_scatter_rows(ns, " in groups
    assert "g_X" not in groups and "u_X" not in groups  # no derivative in the ids


def test_derivatives_in_token_ids_are_refused_by_name():
    module = randomise(TiedLM().to(DTYPE))
    ids, T = _batch()
    c = curvgap.curvature(module, "cross_entropy")
    for call in (lambda: c.gradient(ids, T, wrt="X"),
                 lambda: c.hvp(ids, T, torch.zeros(3, 5 * VOCABULARY, dtype=DTYPE), wrt="X"),
                 lambda: c.loss_hessian_mixed(ids, T)):
        with pytest.raises(ValueError, match=r"wrt: .*token ids.*inputs_embeds"):
            call()


def test_numpy_and_torch_gather_and_scatter_alike():
    module = randomise(TiedLM().to(DTYPE))
    ids, T = _batch()
    c = curvgap.curvature(module, "cross_entropy")
    X, target, traced, params = c._prepared(ids, T, {})
    (program,) = traced.trace.programs
    assert program.tokens
    torch_module, numpy_module = (module_for(program, backend) for backend in ("torch", "numpy"))
    arrays = {name: value.numpy() for name, value in params.items()}
    v = torch.randn(sum(value.numel() for name, value in params.items()
                        if name in dict(torch_module.PARAMS)),
                    generator=torch.Generator().manual_seed(2), dtype=DTYPE)
    for function, extra in (("gradient", ()), ("hvp", (v,)), ("gnvp", (v,))):
        expected = getattr(torch_module, function)(params, X, target, *extra)
        got = getattr(numpy_module, function)(arrays, X.numpy(), target.numpy(),
                                              *(e.numpy() for e in extra))
        np.testing.assert_allclose(got, expected.numpy(), rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="v_X: expected None"):
        torch_module.jvp(params, X, v_X=torch.zeros_like(X).reshape(X.shape[0], -1))
    with pytest.raises(ValueError, match="X: expected an input that is a variable"):
        torch_module.loss_hessian_mixed(params, X, target)


def test_blocks_over_the_token_part_of_a_chained_model_are_autograds():
    """A model read as several parts, its token table the lowest: blocks over the first part's
    parameters (the tied table among them) need no derivative in the ids."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=8, n_layer=1, n_head=2, n_positions=5, vocab_size=VOCABULARY,
                        bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    module = randomise(GPT2LMHeadModel(config).to(DTYPE).eval())
    ids = torch.randint(0, VOCABULARY, (2, 5), generator=torch.Generator().manual_seed(5))
    X, T = ids[:, :-1], ids[:, 1:]
    c = curvgap.curvature(module, "cross_entropy")
    wrt = ["transformer.wpe.weight", "transformer.wte.weight"]
    ref = Reference(module, X, T, "cross_entropy", wrt=wrt, use_cache=False)
    assert relative(c.loss_hessian(X, T, wrt=wrt, use_cache=False), ref.hessian()) <= 1e-10
    assert relative(c.diagonal(X, T, wrt=wrt[:1], use_cache=False),
                    Reference(module, X, T, "cross_entropy", wrt=wrt[:1],
                              use_cache=False).diagonal()) <= 1e-10


def test_a_tied_tables_exact_diagonal_includes_the_blocks_between_its_places():
    """GPT-2's head is its token table: the table's diagonal is ``Σ_{p,q} diag(H_pq)`` over
    the two places it is read, the blocks between them included (double backward on unit
    vectors, on the module itself)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=8, n_layer=1, n_head=2, n_positions=5, vocab_size=VOCABULARY,
                        bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    module = randomise(GPT2LMHeadModel(config).to(DTYPE).eval())
    assert module.lm_head.weight is module.transformer.wte.weight
    ids = torch.randint(0, VOCABULARY, (2, 5), generator=torch.Generator().manual_seed(6))
    X, T = ids[:, :-1], ids[:, 1:]
    c = curvgap.curvature(module, "cross_entropy")
    name = "transformer.wte.weight"
    expected = Reference(module, X, T, "cross_entropy", wrt=[name], use_cache=False).diagonal()
    whole = c.diagonal(X, T, use_cache=False)  # every parameter
    assert c.diagonal_cost.route == "chunked"
    assert relative(whole[c.layer_slices()[name]], expected) <= 1e-10
    assert relative(c.diagonal(X, T, wrt=name, chunk=3, use_cache=False), expected) <= 1e-10
    assert abs(float(c.hessian_trace(X, T, wrt=name, use_cache=False)) - float(expected.sum())) \
        <= 1e-10 * float(expected.abs().sum())
    ref = Reference(module, X, T, "cross_entropy", wrt=[name], use_cache=False)
    n = expected.numel()
    gauss_newton = torch.stack([ref.gnvp(torch.nn.functional.one_hot(torch.tensor(i), n)
                                         .to(DTYPE))[i] for i in range(n)])
    assert relative(c.diagonal(X, T, wrt=name, part="gauss_newton", use_cache=False),
                    gauss_newton) <= 1e-10
