"""Calls that once failed deep inside (a traceback from torch or the generated code) are
either computed (X requiring gradients, int32 token ids, a sequence of one, fused blocks, a
dataset of batch-second batches) or refused before any work, the message naming the
argument, what was expected and what was given. References by autograd."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
from families import gpt2_block, gpt2_lm, llama_lm
from reference import Reference, randomise, relative

import curvgap

DTYPE = torch.float64


def _layer(batch_first: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    return randomise(torch.nn.TransformerEncoderLayer(8, 2, 12, batch_first=batch_first,
                                                      dtype=DTYPE))


def _rows(B: int = 2, L: int = 5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(B, L, 8, generator=generator, dtype=DTYPE),
            torch.randn(B, L, 8, generator=generator, dtype=DTYPE))


def _n(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# 1. X requiring gradients ---------------------------------------------------------------------
def test_X_that_requires_grad_is_read_as_its_values():
    layer, (X, T) = _layer(), _rows()
    X.requires_grad_(True)
    c = curvgap.curvature(layer)
    ref = Reference(layer, X, T)
    assert relative(c.gradient(X, T), ref.gradient()) <= 1e-10
    v = torch.randn(_n(layer), dtype=DTYPE)
    assert relative(c.hvp(X, T, v), ref.hvp(v)) <= 1e-10
    assert X.requires_grad and X.grad is None  # X itself untouched


# 2. (L, d) for a batch-first layer --------------------------------------------------------------
def test_a_sequence_without_its_batch_is_refused():
    layer, (X, T) = _layer(), _rows()
    with pytest.raises(ValueError, match=r"^X: expected shape \(B, L, d\) \(a batch of "
                                         r"sequences.*got shape \(5, 8\); for one sequence "
                                         r"pass X\.unsqueeze\(0\)"):
        curvgap.curvature(layer).gradient(X[0], T[0])
    with pytest.raises(ValueError, match=r"^X: expected shape \(L, B, d\).*got shape \(5, 8\)"):
        curvgap.curvature(_layer(batch_first=False)).gradient(X[0], T[0])


# 3. a sequence of length one -------------------------------------------------------------------
@pytest.mark.parametrize("make", ["layer", "gpt2_lm", "gpt2_block", "llama_lm"])
def test_a_sequence_of_one_position(make):
    """A softmax over one key is 1: the attention's output is its value, the queries and
    keys do not reach the output (their gradients are zero)."""
    if make == "layer":
        module, (X, T), loss, inputs, twin = _layer(), _rows(L=1), "mse", {}, False
    else:
        case = {"gpt2_lm": gpt2_lm, "gpt2_block": gpt2_block, "llama_lm": llama_lm}[make]()
        module, X, T, loss, inputs = case.module, case.X[:, :1], case.T[:, :1], case.loss, {
            k: v for k, v in case.inputs.items() if not isinstance(v, torch.Tensor)}
        twin = case.float32_inside
    c = curvgap.curvature(module, loss)
    ref = Reference(module, X, T, loss, twin=twin, **inputs)
    assert relative(c.gradient(X, T, **inputs), ref.gradient()) <= 1e-10
    v = torch.randn(_n(module), generator=torch.Generator().manual_seed(1), dtype=DTYPE)
    assert relative(c.hvp(X, T, v, **inputs), ref.hvp(v)) <= 1e-10


# 4. a direction with a NaN -----------------------------------------------------------------------
@pytest.mark.parametrize("function", ["hvp", "gnvp"])
def test_v_with_a_nan_is_refused(function):
    layer, (X, T) = _layer(), _rows()
    v = torch.randn(_n(layer), dtype=DTYPE)
    v[3] = math.nan
    with pytest.raises(ValueError, match=r"^v: expected finite values, got NaN at index 3$"):
        getattr(curvgap.curvature(layer), function)(X, T, v)
    V = torch.randn(_n(layer), 2, dtype=DTYPE)
    V[7, 1] = math.inf
    with pytest.raises(ValueError, match=r"^v: expected finite values, got inf at index "
                                         r"\(7, 1\)$"):
        getattr(curvgap.curvature(layer), function)(X, T, V)


# 5. token ids of any integer dtype; of shape (B, L) -----------------------------------------------
def test_token_ids_of_any_integer_dtype():
    case = gpt2_lm()
    c = curvgap.curvature(case.module, case.loss)
    ref = Reference(case.module, case.X, case.T, case.loss, **case.inputs)
    for dtype in (torch.int32, torch.int16, torch.uint8):
        assert relative(c.gradient(case.X.to(dtype), case.T, **case.inputs),
                        ref.gradient()) <= 1e-10


def test_token_ids_with_a_trailing_axis_are_refused():
    case = gpt2_lm()
    with pytest.raises(ValueError, match=r"^X: expected token ids of shape \(B, L\), got shape "
                                         r"\(2, 5, 1\)$"):
        curvgap.curvature(case.module, case.loss).gradient(case.X[..., None], case.T,
                                                           **case.inputs)


# 6. indices past a table -------------------------------------------------------------------------
@pytest.mark.parametrize("bad, shown", [(20, "20"), (16, "16"), (-1, "-1")])
def test_position_ids_outside_the_table_are_refused(bad, shown):
    case = gpt2_lm()
    positions = torch.arange(5).expand(2, 5).clone()
    positions[1, 3] = bad
    with pytest.raises(ValueError, match=rf"^position_ids: expected indices in \[0, 16\) \(the "
                                         rf"module's table has 16 rows\), got {shown} at index "
                                         rf"\(1, 3\)$"):
        curvgap.curvature(case.module, case.loss).gradient(case.X, case.T,
                                                           position_ids=positions, **case.inputs)


def test_a_sequence_longer_than_the_position_table_is_refused():
    case = gpt2_lm()  # n_positions = 16
    generator = torch.Generator().manual_seed(0)
    ids, T = (torch.randint(0, 30, (2, 20), generator=generator) for _ in range(2))
    with pytest.raises(ValueError, match=r"^X: a sequence of 20 positions, but the module's "
                                         r"position table has 16 rows$"):
        curvgap.curvature(case.module, case.loss).gradient(ids, T, **case.inputs)


# 7. keyword inputs of another batch or length ------------------------------------------------------
def test_a_padding_mask_of_another_length_is_refused():
    layer, (X, T) = _layer(), _rows()
    mask = torch.zeros(2, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"^src_key_padding_mask: expected shape \(2, 5\) to "
                                         r"match X's batch and sequence, got \(2, 4\)$"):
        curvgap.curvature(layer).gradient(X, T, src_key_padding_mask=mask)
    case = gpt2_lm()
    with pytest.raises(ValueError, match=r"^attention_mask: expected shape \(2, 5\) to match "
                                         r"X's batch and sequence, got \(2, 6\)$"):
        curvgap.curvature(case.module, case.loss).gradient(
            case.X, case.T, attention_mask=torch.ones(2, 6, dtype=torch.long), **case.inputs)


def test_a_loader_whose_last_batch_is_shorter_than_a_keyword_mask():
    layer, (X, T) = _layer(), _rows(B=5)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, T), batch_size=2)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"^src_key_padding_mask: expected shape \(1, 5\) to "
                                         r"match X's batch and sequence, got \(2, 5\)$"):
        curvgap.curvature(layer).gradient(loader, src_key_padding_mask=mask)


# 8. a submodule replaced between calls --------------------------------------------------------------
def test_a_submodule_replaced_by_one_without_bias():
    torch.manual_seed(0)
    block = randomise(torch.nn.Sequential(
        torch.nn.LayerNorm(8, dtype=DTYPE), torch.nn.Linear(8, 12, dtype=DTYPE),
        torch.nn.GELU(), torch.nn.Linear(12, 8, dtype=DTYPE)))
    X, T = _rows()
    c = curvgap.curvature(block)
    c.gradient(X, T)
    block[1] = randomise(torch.nn.Linear(8, 12, bias=False, dtype=DTYPE), seed=3)
    ref = Reference(block, X, T)
    assert relative(c.gradient(X, T), ref.gradient()) <= 1e-10
    v = torch.randn(_n(block), dtype=DTYPE)
    assert relative(c.hvp(X, T, v), ref.hvp(v)) <= 1e-10


# 9. meta tensors -----------------------------------------------------------------------------------
def test_meta_tensors_are_refused():
    X, T = (t.to("meta") for t in _rows())
    with pytest.raises(ValueError, match=r"^X: expected a tensor with data \(cpu or cuda\), got "
                                         r"a meta tensor$"):
        curvgap.curvature(_layer().to("meta")).gradient(X, T)
    with pytest.raises(ValueError, match=r"^module: expected parameters with data \(cpu or "
                                         r"cuda\), got a meta tensor for 'self_attn.in_proj_"
                                         r"weight'"):
        curvgap.curvature(_layer().to("meta")).gradient(*_rows())


# 10. fused blocks ----------------------------------------------------------------------------------
@pytest.mark.slow  # torch.compile: seconds
def test_fused_blocks_run_unfused_and_say_so():
    layer, (X, T) = _layer(), _rows(L=3)
    ref = Reference(layer, X, T)
    c = curvgap.curvature(layer, fused=True)
    with pytest.warns(UserWarning, match="fused=True: Hessian blocks, Jacobians and diagonals"):
        assert relative(c.diagonal(X, T), ref.diagonal()) <= 1e-10
    with warnings.catch_warnings():  # said once
        warnings.simplefilter("error")
        assert relative(c.loss_hessian(X, T), ref.hessian()) <= 1e-10
        assert relative(c.diagonal(X, T), ref.diagonal()) <= 1e-10


# 11. results that cannot fit in memory ----------------------------------------------------------------
def _wide_layer() -> torch.nn.Module:
    """A GPT-2-width block (d = 768, 7.1 million parameters), float32."""
    return torch.nn.TransformerEncoderLayer(768, 12, 3072, batch_first=True).eval()


def test_a_hessian_larger_than_memory_is_refused_before_any_work():
    layer = _wide_layer()
    n = _n(layer)
    X = torch.randn(1, 4, 768)
    with pytest.raises(MemoryError, match=rf"^loss_hessian: the \({n}, {n}\) Hessian takes "
                                          rf"201 TB \({n * n * 4} bytes\), more than the .* of "
                                          rf"memory at hand \(cpu\); compute it in parts: "
                                          rf"hessian_operator.*wrt=.*diagonal"):
        curvgap.curvature(layer).loss_hessian(X, X)


def test_a_diagonal_allowed_more_than_memory_is_refused():
    layer = _wide_layer()
    X = torch.randn(1, 512, 768)
    with pytest.raises(MemoryError, match=r"^diagonal: the dense route that "
                                          r"max_memory \(1000000000000000 bytes\) allows takes .* more than the .* "
                                          r"of memory at hand \(cpu\); compute it in parts: a "
                                          r"max_memory below"):
        curvgap.curvature(layer).diagonal(X, X, max_memory=1e15)


# 12. the command line's output folder ------------------------------------------------------------------
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_bench_checks_its_output_folder_before_it_runs():
    run = subprocess.run([sys.executable, "-m", "curvgap.cli", "bench", "--quick", "--out",
                          "/proc/nope"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == (
        "curvgap: error: --out: expected a folder that can be made and written, got "
        "'/proc/nope' (FileNotFoundError: No such file or directory)")


# issue item 2: a dataset of batch-second batches --------------------------------------------------------
def test_batch_second_batches_are_weighted_by_their_samples():
    layer = _layer(batch_first=False)
    X, T = (t.transpose(0, 1).contiguous() for t in _rows(B=4))  # (L, B, d)
    batches = [(X[:, :1], T[:, :1]), (X[:, 1:], T[:, 1:])]  # 1 and 3 samples
    c = curvgap.curvature(layer)
    ref = Reference(layer, X, T)
    assert relative(c.loss(batches), ref.loss().detach()) <= 1e-10
    assert relative(c.gradient(batches), ref.gradient()) <= 1e-10
    v = torch.randn(_n(layer), dtype=DTYPE)
    assert relative(c.hvp(batches, v), ref.hvp(v)) <= 1e-10
