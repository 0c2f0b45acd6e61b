"""``fused=True`` over many calls: each generated group compiles once per set of sizes, whatever
route (gradient, HVP, GN product) calls it, and past torch's recompile limit a group runs
uncompiled, said once, with the same results (checked against reverse-over-reverse
autograd); a config's guards (eps = 0) compile as assertions and still raise their worded
errors. Agreement of the fused sweeps on real families is in ``test_families``."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from reference import Reference, relative

import curvgap
from curvgap.codegen.cache import module_for
from curvgap.codegen.resources import CONFIGS
from curvgap.codegen.verify import batch_loss, random_case
from curvgap.derivations.config import load

DTYPE = torch.float64


@pytest.mark.slow
def test_routes_share_compiled_groups_and_a_limit_runs_them_uncompiled(monkeypatch, capfd):
    # a layer no other test compiles, so that the limit below counts this test's sizes only
    layer = torch.nn.TransformerEncoderLayer(6, 3, 10, dropout=0.0, activation="gelu",
                                             batch_first=True, norm_first=True, dtype=DTYPE)
    layer.eval()
    c = curvgap.curvature(layer, fused=True)
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    generator = torch.Generator().manual_seed(4)
    n = sum(p.numel() for p in layer.parameters())
    v = torch.randn(n, generator=generator, dtype=DTYPE)

    def agree(B: int) -> None:
        X, T = (torch.randn(B, 5, 6, generator=generator, dtype=DTYPE) for _ in range(2))
        ref = Reference(layer, X, T)
        # the routes share the forward and adjoint groups: at one compile per group and
        # size, none of them may need a second
        for _ in range(2):
            assert relative(c.gradient(X, T), ref.gradient()) <= 1e-10
            assert relative(c.hvp(X, T, v), ref.hvp(v)) <= 1e-10
            assert relative(c.gnvp(X, T, v), ref.gnvp(v)) <= 1e-10

    agree(2)
    assert "uncompiled" not in capfd.readouterr().err
    agree(3)  # new sizes: past the limit of one, each group says so once and runs as is
    said = [line for line in capfd.readouterr().err.splitlines() if "uncompiled" in line]
    assert said and len(said) == len(set(said))
    assert all("recompile_limit" in line for line in said)


@pytest.mark.slow
def test_a_config_with_guards_compiles_and_its_guard_still_raises():
    """The paper's block has eps = 0: its LayerNorms guard the row variances. Fused, the guard
    is an assertion in the compiled code; the HVP agrees with double backward through the
    plain PyTorch forward pass, and a zero input still gets the guard's worded error."""
    config = load(CONFIGS / "paper_block.toml")
    fused = module_for(config, "torch", fused=True)
    params, X, T = random_case(module_for(config, "torch"), {"L": 3, "d": 4, "d_k": 2,
                                                             "d_ff": 5}, batch=2)
    v = torch.randn(sum(p.numel() for p in params.values()), dtype=DTYPE,
                    generator=torch.Generator().manual_seed(2))
    leaves = {k: t.clone().requires_grad_() for k, t in params.items()}
    gradient = torch.autograd.grad(batch_loss(config, leaves, X, T), list(leaves.values()),
                                   create_graph=True)
    flat = torch.cat([g.reshape(-1) for g in gradient])
    reference = torch.cat([h.reshape(-1) for h in torch.autograd.grad(flat @ v,
                                                                      list(leaves.values()))])
    for _ in range(2):  # compiled on the first call, run compiled on the second
        assert relative(fused.hvp(params, X, T, v), reference) <= 1e-10
    with pytest.raises(ValueError, match=r"X: LayerNorm_1 needs every row variance > 0 .*"
                                         r"sample 0, row 0"):
        fused.hvp(params, torch.zeros_like(X), T, v)
