"""Reading a module's computation: blocks of one's own architecture, the module's own order and
layout, what a curvature object does when its module changes, repeated blocks derived once,
refusals that name the operation and its path, the axes a reshape splits."""

from __future__ import annotations

import shutil
import subprocess
import types

import pytest
import sympy as sp
import torch
from families import (
    D_FF,
    DTYPE,
    HEADS,
    D,
    DifferentialAttention,
    GatedResidual,
    encoder_layer,
    gpt2_model,
)
from reference import Reference, randomise, relative
from torch.nn.attention import SDPBackend, sdpa_kernel

import curvgap
from curvgap.adapters import UnsupportedLayer
from curvgap.adapters.axes import Axis, Changes, ShapeError, Size, align, regroup


def rows(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 5, D, generator=generator, dtype=DTYPE) for _ in range(2))


@pytest.mark.parametrize("block", [DifferentialAttention(D, 3), GatedResidual(D, D_FF)],
                         ids=["differential attention", "gated residual"])
def test_a_block_no_library_ships_is_derived_exactly(block, tmp_path):
    module = randomise(block.to(DTYPE))
    X, T = rows()
    c = curvgap.curvature(module)
    ref = Reference(module, X, T)
    gradient = c.gradient(X, T)
    assert relative(gradient, ref.gradient()) <= 1e-10
    v = torch.randn_like(gradient)
    assert relative(c.hvp(X, T, v), ref.hvp(v)) <= 1e-10
    assert relative(c.loss_hessian(X, T), ref.hessian()) <= 1e-10
    tex = c.latex(X)
    assert r"\begin{document}" in tex and "softmax" in tex.lower()
    if shutil.which("pdflatex"):
        (tmp_path / "block.tex").write_text(tex)
        done = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error",
                               "block.tex"], cwd=tmp_path, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout[-2000:]


def test_results_follow_the_modules_order_and_layout():
    """Rows in ``named_parameters`` order, each parameter's entries in its own row-major
    layout; ``wrt`` picks blocks by the module's names, in the order given."""
    case = encoder_layer()
    c = curvgap.curvature(case.module)
    names = ["linear2.weight", "self_attn.in_proj_weight"]
    ref = Reference(case.module, case.X, case.T, wrt=names)
    assert relative(c.gradient(case.X, case.T, wrt=names), ref.gradient()) <= 1e-10
    assert relative(c.loss_hessian(case.X, case.T, wrt=names), ref.hessian()) <= 1e-10
    slices = c.layer_slices()
    assert list(slices) == [n for n, _ in case.module.named_parameters()]
    weight = case.module.linear1.weight
    J = c.jacobian(case.X, "linear1.weight")
    reference = torch.autograd.functional.jacobian(
        lambda w: torch.func.functional_call(case.module, {"linear1.weight": w}, (case.X,)),
        weight.detach())  # (B, L, d, d_ff, d): the weight's own layout
    assert J.shape == (2, 5 * D, weight.numel())
    assert relative(J, reference.reshape(J.shape)) <= 1e-10


def test_input_blocks_are_per_sample():
    case = encoder_layer(True, "gelu")
    c = curvgap.curvature(case.module)
    X, T = case.X, case.T
    H = c.loss_hessian(X, T, wrt="X")
    for b in range(X.shape[0]):
        def loss(x, b=b):
            out = case.module(x.reshape(1, *X.shape[1:]))
            return torch.nn.functional.mse_loss(out, T[b:b + 1])
        with sdpa_kernel(SDPBackend.MATH):  # the kernel with second derivatives
            reference = torch.autograd.functional.hessian(loss, X[b].reshape(-1))
        assert relative(H[b], reference) <= 1e-10
    mixed = c.loss_hessian_mixed(X, T, wrt="linear2.bias")
    assert mixed.shape == (X.shape[0], X[0].numel(), D)


def test_a_batch_of_one_is_read_and_exact():
    case = gpt2_model()  # keyword inputs too: the encoder's embeddings and its mask
    X, mask = case.inputs["inputs_embeds"][:1], case.inputs["attention_mask"][:1]
    inputs = {**case.inputs, "inputs_embeds": X, "attention_mask": mask}
    T = case.T[:1]
    c = curvgap.curvature(case.module)
    reference = Reference(case.module, None, T, **inputs)
    assert relative(c.gradient(None, T, **inputs), reference.gradient()) <= 1e-10
    v = torch.randn(reference.gradient().numel(), generator=torch.Generator().manual_seed(3),
                    dtype=DTYPE)
    assert relative(c.hvp(None, T, v, **inputs), reference.hvp(v)) <= 1e-10
    # the same reading serves a batch of three
    X3, T3 = torch.cat([X] * 3), torch.cat([T] * 3)
    three = {**inputs, "inputs_embeds": X3, "attention_mask": torch.cat([mask] * 3)}
    assert relative(c.gradient(None, T3, **three),
                    Reference(case.module, None, T3, **three).gradient()) <= 1e-10


def test_weights_are_read_at_call_time_and_a_changed_module_is_read_again():
    case = encoder_layer()
    module, X, T = case.module, case.X, case.T
    c = curvgap.curvature(module)
    c.gradient(X, T)
    with torch.no_grad():
        module.linear1.weight.mul_(1.5)
    assert relative(c.gradient(X, T), Reference(module, X, T).gradient()) <= 1e-10
    module.activation = torch.nn.functional.gelu  # another computation: read again
    assert relative(c.gradient(X, T), Reference(module, X, T).gradient()) <= 1e-10
    module.norm_first = True
    assert relative(c.gradient(X, T), Reference(module, X, T).gradient()) <= 1e-10
    module.linear1 = torch.nn.Linear(D, 7, dtype=DTYPE)
    module.linear2 = torch.nn.Linear(7, D, dtype=DTYPE)
    assert relative(c.gradient(X, T), Reference(module, X, T).gradient()) <= 1e-10
    module.train()  # dropout 0.1, random: refused, naming where
    with pytest.raises(UnsupportedLayer, match=r"dropout.*training mode.*module.eval\(\)"):
        c.gradient(X, T)


class Scaled(torch.nn.Module):
    """``tanh(x A) B^T + b``, times a plain tensor attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(D, D, bias=False, dtype=DTYPE)
        self.b = torch.nn.Linear(D, D, dtype=DTYPE)
        self.scale = torch.tensor(2.0, dtype=DTYPE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))) * self.scale


def _relu_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.b(torch.relu(self.a(x))) * self.scale


def _untie(module: torch.nn.Module) -> None:
    module.b.weight = torch.nn.Parameter(module.a.weight.detach().clone())


def _hook(module: torch.nn.Module) -> None:
    module.a.register_forward_hook(lambda layer, inputs, output: 2 * output)


@pytest.mark.parametrize("change", [
    lambda m: setattr(m, "a", torch.nn.Linear(D, D, dtype=DTYPE)),  # now with a bias
    lambda m: setattr(m, "b", torch.nn.Linear(D, D, bias=False, dtype=DTYPE)),  # without
    lambda m: setattr(m, "a", torch.nn.Linear(D, D, bias=False, dtype=DTYPE)),  # same shapes
    lambda m: setattr(m.b, "weight", m.a.weight),  # tied
    _untie,
    lambda m: setattr(m, "scale", torch.tensor(5.0, dtype=DTYPE)),  # a tensor attribute
    lambda m: m.scale.fill_(3.0),  # changed in place
    lambda m: setattr(m, "forward", types.MethodType(_relu_forward, m)),  # on the instance
    lambda m: setattr(m.b.bias, "requires_grad", False),  # frozen
    _hook,
], ids=["bias added", "bias removed", "submodule swapped", "tied", "untied",
        "tensor attribute set", "tensor attribute in place", "forward replaced", "frozen",
        "forward hook"])
def test_a_module_changed_after_a_call_is_never_answered_with_the_old_reading(change):
    """Each change after the first call: the next answers are the changed module's."""
    generator = torch.Generator().manual_seed(0)
    X, T = (torch.randn(2, 4, D, generator=generator, dtype=DTYPE) for _ in range(2))
    module = randomise(Scaled())
    c = curvgap.curvature(module)
    if change is _untie:  # untie what was tied
        module.b.weight = module.a.weight
        c.gradient(X, T)
    c.gradient(X, T)
    change(module)
    wrt = [n for n, p in module.named_parameters() if p.requires_grad]
    ref = Reference(module, X, T, wrt=wrt)
    assert relative(c.loss(X, T), ref.loss().detach()) <= 1e-10
    gradient = c.gradient(X, T, wrt=wrt)
    assert gradient.shape == ref.gradient().shape
    assert relative(gradient, ref.gradient()) <= 1e-10
    assert c.gradient(X, T).numel() == sum(p.numel() for p in module.parameters()
                                           if p.requires_grad)


def test_a_class_whose_forward_is_replaced_is_read_again(monkeypatch):
    generator = torch.Generator().manual_seed(0)
    X, T = (torch.randn(2, 4, D, generator=generator, dtype=DTYPE) for _ in range(2))
    module = randomise(Scaled())
    c = curvgap.curvature(module)
    c.gradient(X, T)
    monkeypatch.setattr(Scaled, "forward", _relu_forward)
    assert relative(c.gradient(X, T), Reference(module, X, T).gradient()) <= 1e-10


def test_a_hessian_operator_keeps_the_weights_it_was_built_with():
    case = encoder_layer()
    c = curvgap.curvature(case.module)
    operator = c.hessian_operator(case.X, case.T)
    v = torch.randn(operator.shape[0], dtype=DTYPE)
    before = operator @ v
    with torch.no_grad():
        case.module.linear1.weight.mul_(2.0)
    assert torch.equal(operator @ v, before)


@pytest.mark.parametrize("part", ["full", "gauss_newton", "functional"])
def test_an_operator_keeps_its_point_between_products(part, monkeypatch):
    """A model's operator runs its forward pass once for all its products (it keeps that
    point's forward values and adjoints), and each product still equals autograd's, vector
    after vector and for a matrix."""
    from curvgap.models import Chain

    case = gpt2_model()
    c = curvgap.curvature(case.module)
    forwards = []
    saved = Chain._saved
    monkeypatch.setattr(Chain, "_saved", lambda self, *a, **k: forwards.append(1)
                        or saved(self, *a, **k))
    operator = c.hessian_operator(case.X, case.T, part=part, **case.inputs)
    ref = Reference(case.module, case.X, case.T, **case.inputs)
    generator = torch.Generator().manual_seed(7)
    V = torch.randn(operator.shape[0], 3, generator=generator, dtype=DTYPE)

    def expected(v: torch.Tensor) -> torch.Tensor:
        if part == "full":
            return ref.hvp(v)
        return ref.gnvp(v) if part == "gauss_newton" else ref.hvp(v) - ref.gnvp(v)

    before = len(forwards)
    for k in range(3):
        assert relative(operator @ V[:, k], expected(V[:, k])) <= 1e-10
    together = operator @ V
    for k in range(3):
        assert relative(together[:, k], expected(V[:, k])) <= 1e-10
    # one forward pass per kind of product (the functional part takes two kinds)
    assert len(forwards) - before == (2 if part == "functional" else 1)


def test_repeated_blocks_are_derived_once():
    """A 4-layer encoder is two programs whatever its depth: the blocks under the linear
    loss that passes cotangents down, and the top one under the model's loss."""
    layer = torch.nn.TransformerEncoderLayer(D, HEADS, D_FF, batch_first=True, dtype=DTYPE)
    model = randomise(torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False))
    X, T = rows()
    c = curvgap.curvature(model)
    assert relative(c.gradient(X, T), Reference(model, X, T).gradient()) <= 1e-10
    (read,) = c._traced.values()
    assert read.trace.paths == [f"layers.{k}" for k in range(4)]
    assert len({p.fingerprint for p in read.trace.programs}) == 2


def test_parameters_the_output_does_not_read_have_exact_zeros():
    """GPT-2 on ``inputs_embeds`` never reads its token table ``wte``, nor the rows of
    ``wpe`` past the input's length."""
    case = gpt2_model(mask=False)
    c = curvgap.curvature(case.module)
    gradient = c.gradient(case.X, case.T, **case.inputs)
    slices = c.layer_slices()
    assert torch.count_nonzero(gradient[slices["wte.weight"]]) == 0
    position = gradient[slices["wpe.weight"]].reshape(-1, D)
    assert torch.count_nonzero(position[5:]) == 0 and torch.count_nonzero(position[:5]) > 0
    H = c.loss_hessian(case.X, case.T, wrt=["wpe.weight", "h.1.mlp.c_fc.weight"],
                       **case.inputs)
    ref = Reference(case.module, case.X, case.T, wrt=["wpe.weight", "h.1.mlp.c_fc.weight"],
                    **case.inputs)
    assert relative(H, ref.hessian()) <= 1e-10


class Sorting(torch.nn.Module):
    """A block that sorts its features: no derivative curvgap represents."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(D, D, dtype=DTYPE)
        self.mix = torch.nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sort(self.linear(x), dim=-1).values


def test_an_operation_outside_the_vocabulary_is_refused_with_its_path():
    model = torch.nn.Sequential(torch.nn.Linear(D, D, dtype=DTYPE), Sorting())
    X, T = rows()
    with pytest.raises(UnsupportedLayer, match=r"^1: operation sort .*curvgap needs an "
                                               r"operation it can derive"):
        curvgap.curvature(model).gradient(X, T)


@pytest.mark.parametrize("call, error, message", [
    (lambda c, X, T: c.gradient(X.tolist(), T), TypeError, r"X: expected a tensor .*got a list"),
    (lambda c, X, T: c.gradient(X, T, wrt=[]), ValueError, r"wrt: expected 'X' or a non-empty "
                                                           r"list of parameter names, got \[\]"),
    (lambda c, X, T: c.gradient(X, T, wrt=5), TypeError, r"wrt: expected 'X', a parameter "
                                                         r"name or a list of names, got an int"),
    (lambda c, X, T: c.gradient(X, T, wrt=[torch.nn.Parameter(torch.zeros(2))]), ValueError,
     r"wrt: expected the module's parameters or their names, got a tensor of shape \(2,\)"),
    (lambda c, X, T: c.hvp(X, T, [0.0]), TypeError, r"v: expected a torch.Tensor or a numpy "),
    (lambda c, X, T: c.hvp(X, T, torch.zeros(10, 0, dtype=DTYPE)), ValueError,
     r"v: expected shape \(\d+,\) or \(\d+, k\), k >= 1"),
    (lambda c, X, T: c.gradient(X.long(), T), ValueError,
     r"X: TransformerEncoderLayer does not run on these inputs"),
    (lambda c, X, T: c.gradient(X.bool(), T), TypeError,
     r"X: expected a floating-point tensor .* or integer token ids, got dtype torch.bool"),
])
def test_bad_calls_are_refused_naming_the_argument(call, error, message):
    case = encoder_layer()
    c = curvgap.curvature(case.module)
    with pytest.raises(error, match=message):
        call(c, case.X, case.T)


def test_fused_takes_a_bool_and_the_torch_backend():
    with pytest.raises(TypeError, match=r"fused: expected True or False, got 'yes'"):
        curvgap.curvature(encoder_layer().module, fused="yes")
    from curvgap.codegen.cache import module_for
    from curvgap.derivations.config import validate

    with pytest.raises(ValueError, match=r"fused: expected False, or True with the torch "
                                         r"backend .*got True with 'numpy'"):
        module_for(validate({"name": "ffn", "kind": "ffn"}), "numpy", fused=True)


class Tokens(torch.nn.Module):
    """Token ids embedded, and (``scaled``) read as numbers besides."""

    def __init__(self, scaled: bool = False) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(11, D, dtype=DTYPE)
        self.scaled = scaled

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.embedding(ids) * (ids > 0).unsqueeze(-1)  # a mask from the ids: a constant
        return out * ids.unsqueeze(-1).to(DTYPE) if self.scaled else out


def test_token_ids_are_read_as_one_hot_rows_and_nothing_else():
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 11, (2, 5), generator=generator)
    T = torch.randn(2, 5, D, generator=generator, dtype=DTYPE)
    module = randomise(Tokens())
    c = curvgap.curvature(module)
    assert relative(c.gradient(ids, T), Reference(module, ids, T).gradient()) <= 1e-12
    with pytest.raises(ValueError, match=r"X: expected token ids in \[0, 11\), got ids from 11 "
                                         r"to 11"):
        c.gradient(torch.full((2, 5), 11), T)
    with pytest.raises(UnsupportedLayer, match=r"token ids read only as an embedding's indices"):
        curvgap.curvature(Tokens(scaled=True)).gradient(ids, T)


def test_a_cross_entropy_target_on_the_meta_device_is_refused():
    case = encoder_layer()
    c = curvgap.curvature(case.module, loss="cross_entropy")
    labels = torch.empty(case.X.shape[:2], dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match=r"target: expected class indices with values, got a "
                                         r"tensor on the meta device"):
        c.loss(case.X, labels)


def test_a_reshape_splits_a_size_everywhere_it_occurs():
    changes = Changes()
    width, rows_ = Size(8, changes), Size(sp.Symbol("L", positive=True, integer=True), changes)
    a, b = Axis(rows_), Axis(width)
    heads = regroup([a, b], [rows_.extent, 2, 4])
    assert [len(d) for d in heads] == [1, 1, 1] and b.leaves() == heads[1] + heads[2]
    other = Axis(Size(8, changes))
    align([other.size], [width])  # another tensor's width of the same class
    assert [leaf.extent for leaf in other.leaves()] == [2, 4]
    with pytest.raises(ShapeError):
        regroup([Axis(Size(6, changes))], [4])
    with pytest.raises(ShapeError):
        regroup([Axis(rows_)], [2, rows_.extent / 2])  # the sequence is never split


def test_an_operation_has_one_rule():
    """A second rule for an operation is an error naming both (it used to replace the first
    silently)."""
    from curvgap.adapters.rules import RULES, rule

    def again(reader, node, *args):  # pragma: no cover - never called
        raise AssertionError

    before = dict(RULES)
    with pytest.raises(RuntimeError, match=r"two rules for aten.linear.default: "
                                           r"curvgap.adapters.rules.linear.read_linear and "):
        rule(torch.ops.aten.linear.default)(again)
    assert RULES == before
