"""One rank of the multi-process tests (``tests/test_distributed.py``), started as its own
process with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1`` and ``MASTER_PORT`` set:
``python distributed_worker.py SCENARIO OUT``. It joins a gloo process group, computes the
dataset-level results on its shard of the problems below and saves them to
``OUT/rank<r>.pt``; an error is written to ``OUT/rank<r>.err`` (its type and message) and
the process exits with status 1.

Scenarios: ``results`` (every result), ``raise`` (rank 1 has a malformed batch), ``die``
(rank 1 exits before the pass), ``hang`` (rank 1 never arrives), ``differ`` (rank 1 is
given another vector).
"""

from __future__ import annotations

import datetime
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Subset, TensorDataset

import curvgap
from curvgap.models import Model

SAMPLES = 13
BATCH = 4
#: Samples of each rank's shard, by world size: uneven, and one rank empty with three.
SHARDS = {1: [SAMPLES], 2: [4, 9], 3: [6, 0, 7]}


def layer_problem() -> tuple[torch.nn.Module, TensorDataset]:
    """A pre-LN GELU encoder layer (``L = 5, d = 8, d_k = 4, d_ff = 12``) and its data."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 12, batch_first=True, dropout=0.0,
                                             activation="gelu", norm_first=True,
                                             dtype=torch.float64).eval()
    X = torch.randn(SAMPLES, 5, 8, dtype=torch.float64)
    return layer, TensorDataset(X, torch.randn_like(X))


def encoder_problem() -> tuple[torch.nn.Module, TensorDataset]:
    """A two-layer ``nn.TransformerEncoder`` of that layer with a final norm, and its
    data."""
    layer, data = layer_problem()
    norm = torch.nn.LayerNorm(8, eps=1e-6, dtype=torch.float64)
    encoder = torch.nn.TransformerEncoder(layer, 2, norm=norm, enable_nested_tensor=False)
    encoder = encoder.eval()
    return encoder, data


def vit_problem() -> tuple[Model, dict, TensorDataset]:
    """The digits ViT (a :class:`curvgap.models.Model`), random weights, random images."""
    model = Model("digits_vit")
    gen = torch.Generator().manual_seed(1)
    params = {name: 0.3 * torch.randn(*shape, generator=gen, dtype=torch.float64)
              for name, shape in model.parameter_shapes(
                  {"L": 4, "d": 16, "d_k": 16, "d_ff": 64, "p": 16, "c": 10}).items()}
    X = torch.rand(SAMPLES, 4, 16, generator=gen, dtype=torch.float64)
    T = torch.randint(0, 10, (SAMPLES, 1), generator=gen)
    return model, params, TensorDataset(X, T)


def shard(data: TensorDataset, rank: int, world: int) -> DataLoader:
    """Rank ``rank``'s contiguous shard of ``data``, in batches of ``BATCH``."""
    sizes = SHARDS[world]
    start = sum(sizes[:rank])
    return DataLoader(Subset(data, range(start, start + sizes[rank])), batch_size=BATCH)


def top_eigenvalue(operator) -> float:
    """The largest eigenvalue by Lanczos (scipy), from one start on every rank."""
    from scipy.sparse.linalg import eigsh

    start = np.random.default_rng(0).standard_normal(operator.shape[0])
    return float(eigsh(operator.to_scipy(), k=1, which="LA", v0=start, tol=1e-12)[0][0])


def directions(n: int, k: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(n + k)
    return torch.randn(n, *([k] if k else []), generator=gen, dtype=torch.float64)


def results(rank: int, world: int) -> dict[str, torch.Tensor]:
    """Every dataset-level result on this rank's shards."""
    out = {}
    layer, data = layer_problem()
    c, loader = curvgap.curvature(layer), shard(data, rank, world)
    n = sum(p.numel() for p in layer.parameters())
    out["layer.loss"] = c.loss(loader)
    out["layer.gradient"] = c.gradient(loader)
    out["layer.loss_hessian"] = c.loss_hessian(loader)
    out["layer.gauss_newton"] = c.loss_hessian(loader, wrt="linear1.weight", part="gauss_newton")
    out["layer.hvp"] = c.hvp(loader, directions(n, 3))
    out["layer.gnvp"] = c.gnvp(loader, directions(n))
    out["layer.diagonal"] = c.diagonal(loader, part="functional")
    out["layer.top_eigenvalue"] = torch.tensor(top_eigenvalue(c.hessian_operator(loader)))
    try:
        import curvlinops
    except ImportError:  # an optional extra: the single-process run skips it too
        pass
    else:  # one seed on every rank: the same random vectors, so the same products
        torch.manual_seed(0)
        operator = c.hessian_operator(loader, part="gauss_newton")
        out["layer.hutchinson_trace"] = torch.as_tensor(
            curvlinops.hutchinson_trace(operator, num_matvecs=6))
    encoder, data = encoder_problem()
    c, loader = curvgap.curvature(encoder), shard(data, rank, world)
    n = sum(p.numel() for p in encoder.parameters())
    out["encoder.hvp"] = c.hvp(loader, directions(n))
    out["encoder.loss_hessian"] = c.loss_hessian(loader, wrt="layers.1.linear2.weight")
    model, params, data = vit_problem()
    loader = shard(data, rank, world)
    n = sum(p.numel() for p in params.values())
    out["vit.loss_hessian"] = model.loss_hessian(params, loader)
    out["vit.gnvp"] = model.gnvp(params, loader, directions(n, 2))
    out["vit.diagonal"] = model.diagonal(params, loader)
    return out


def failing(scenario: str, rank: int, world: int) -> dict[str, torch.Tensor]:
    """A pass in which rank 1 misbehaves as ``scenario`` says."""
    layer, data = layer_problem()
    c, loader = curvgap.curvature(layer), shard(data, rank, world)
    v = directions(sum(p.numel() for p in layer.parameters()))
    if rank == 1 and scenario == "raise":
        X, T = data.tensors
        loader = [(X[:2], T[:2]), (X[2:4, :, :6], T[2:4])]  # a batch of the wrong width
    if rank == 1 and scenario == "die":
        os._exit(3)
    if rank == 1 and scenario == "hang":
        time.sleep(600)
    if rank == 1 and scenario == "differ":
        v = 2 * v
    return {"hvp": c.hvp(loader, v)}


def main() -> int:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    # start-up (imports, rendezvous) under any load: a generous limit, then every rank is
    # here, and the scenario's collectives get the timeout under test
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    dist.barrier()
    timeout = datetime.timedelta(seconds=float(os.environ.get("CURVGAP_TEST_TIMEOUT", "60")))
    dist.distributed_c10d._set_pg_timeout(timeout)
    try:
        found = results(rank, world) if scenario == "results" else failing(scenario, rank,
                                                                            world)
        torch.save(found, out / f"rank{rank}.pt")
    except Exception as error:
        (out / f"rank{rank}.err").write_text(f"{type(error).__name__}: {error}")
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        # out now, past gloo's teardown: with the other rank gone its destructor can abort the
        # process (SIGABRT, seen under load), which is torch's exit, not the error under test
        os._exit(1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
