"""The direct array calls printed for einsums compute what the einsum computes."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from curvgap.codegen import calls
from curvgap.codegen.backends import MODULE_BACKENDS
from curvgap.codegen.ir import Contract

SIZES = {"b": 3, "a": 4, "c": 5, "d": 2, "e": 6, "f": 7, "g": 8}

# (spec, the kind of call expected; None: stays an einsum)
CASES = [
    ("bac->ba", calls.Sum),
    ("bacd->bd", calls.Sum),
    ("bad->bda", calls.Permute),
    ("ca->ac", calls.Permute),
    ("bac,bac->ba", calls.ProductSum),
    ("bacd,bacd->bc", calls.ProductSum),
    ("bac,ba->bac", calls.Product),
    ("bad,bae->bade", calls.Product),
    ("bad,bace->bacde", calls.Product),
    ("ce,ba->ceba", calls.Product),
    ("bad,dc->bac", calls.Matmul),       # (B, L, d) @ (d, c): broadcast over b
    ("dc,bad->bac", calls.Matmul),       # the same with the operands swapped
    ("bad,bcd->bac", calls.Matmul),      # right operand transposed
    ("bda,bdc->bac", calls.Matmul),      # left operand transposed
    ("ec,baed->bacd", calls.Matmul),     # a matrix against a batch of matrices
    ("bcd,bad->bac", calls.Matmul),
    ("bae,bad->baed", calls.Product),
    ("bda,bdc->ac", calls.MergedMatmul),  # a weight's gradient over batch and sequence
    ("bdc,bda->ac", calls.MergedMatmul),  # the same with the operands swapped
    ("bgacd,bge->acde", calls.MergedMatmul),  # a per-head weight's gradient
    ("ab,bcd->acd", calls.MergedMatmul),  # one summed index, the output's last two axes
    ("cab,dab->cd", calls.MergedMatmul),  # right operand transposed
    ("bfda,bfec->acde", None),           # the output interleaves the operands' axes
    ("bfa,bcdfe->acde", None),           # a summed run split by free axes
    ("bfgc,bfg->bfc", None),             # matrix-vector with a shared row index
    ("bac,bcda->bacd", None),            # the summed-free index c kept: not a matmul
    ("bad,bae->bead", None),             # an outer product with axes out of order
    ("baa->ba", None),                   # a diagonal
]


@pytest.mark.parametrize("spec, kind", CASES)
def test_call_kind(spec, kind):
    call = calls.classify(spec)
    assert (call is None) if kind is None else isinstance(call, kind)


@pytest.mark.parametrize("spec, kind", CASES)
def test_printed_call_equals_einsum(spec, kind):
    rng = np.random.default_rng(0)
    inputs = spec.split("->")[0].split(",")
    arrays = [rng.standard_normal([SIZES[c] for c in s]) for s in inputs]
    names = tuple(f"x{k}" for k in range(len(arrays)))
    expected = np.einsum(spec, *arrays)
    for backend in MODULE_BACKENDS:
        printer = backend.printer()
        for row_major in (False, True):
            line = printer.statement(Contract("out", spec, names, row_major))
            helper = importlib.import_module(f"curvgap.generated.{backend.name}.ffn")
            scope = {printer.module: importlib.import_module(backend.array_module),
                     "_row_major_einsum": helper._row_major_einsum,
                     **{n: backend.from_torch(torch.from_numpy(a)) for n, a in zip(names, arrays)}}
            exec(line, scope)  # noqa: S102 - a generated line of our own printer
            result = np.asarray(scope["out"])
            np.testing.assert_allclose(result, expected, rtol=1e-14, atol=1e-14)
            assert result.shape == expected.shape
            if row_major or kind is calls.Permute:
                assert result.flags["C_CONTIGUOUS"], line


@pytest.mark.parametrize("spec", ["bfad,bfce->acde", "bacd,bc->abd", "ab,bc->ca"])
def test_a_large_row_major_einsum_made_in_slices_equals_einsum(spec, monkeypatch):
    rng = np.random.default_rng(1)
    inputs = spec.split("->")[0].split(",")
    arrays = [rng.standard_normal([SIZES[c] for c in s]) for s in inputs]
    expected = np.einsum(spec, *arrays)
    for backend in MODULE_BACKENDS:
        module = importlib.import_module(f"curvgap.generated.{backend.name}.ffn")
        monkeypatch.setattr(module, "_SLICED", 0)  # every result is "large"
        result = module._row_major_einsum(spec, *(backend.from_torch(torch.from_numpy(a))
                                                  for a in arrays))
        result = np.asarray(result)
        assert result.flags["C_CONTIGUOUS"]
        np.testing.assert_allclose(result, expected, rtol=1e-14, atol=1e-14)
