"""The largest eigenvalue of the digits ViT's loss Hessian over its whole training set,
on one process or many:

    python examples/digits_vit_top_eigenvalue.py
    torchrun --nproc_per_node 2 examples/digits_vit_top_eigenvalue.py

Rank 0 trains the ViT (``curvgap.analysis.vit``: post-LN, one block, 3,322 parameters) and
sends its weights to the others. Each rank takes every world-th training image as its
shard; a product of the Hessian with a vector is the exact HVP over the rank's shard,
summed over the ranks (``all_reduce``), i.e. over the whole training set. Every rank runs
the same Lanczos (scipy's ``eigsh``, one start vector), so the ranks stay in step: each
product is a collective that every rank calls with the same vector.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from scipy.sparse.linalg import eigsh
from torch.utils.data import DataLoader, Subset, TensorDataset

from curvgap.analysis import vit
from curvgap.operators import CurvatureOperator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=40, help="Adam epochs (default 40)")
    parser.add_argument("--batch", type=int, default=128, help="images per batch")
    args = parser.parse_args()

    if "RANK" in os.environ:  # started by torchrun
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    say = print if rank == 0 else (lambda line: None)

    data = vit.digits()
    if rank == 0:
        params, _ = vit.train(data, args.epochs, progress=say)
    else:
        params = vit.init_params()  # the shapes; rank 0's values arrive below
    if dist.is_initialized():
        for value in params.values():
            dist.broadcast(value, src=0)

    training = TensorDataset(data.train_x, data.train_y[:, None])
    shard = DataLoader(Subset(training, range(rank, len(training), world)),
                       batch_size=args.batch)
    n = sum(value.numel() for value in params.values())
    hessian = CurvatureOperator(lambda V: vit.MODEL.hvp(params, shard, V), n,
                                torch.float64, torch.device("cpu"))

    start = time.perf_counter()
    first = np.random.default_rng(0).standard_normal(n)
    top = eigsh(hessian.to_scipy(), k=1, which="LA", v0=first, tol=1e-10)[0][0]
    say(f"top Hessian eigenvalue over the {len(training)} training images, {world} "
        f"process{'es' if world > 1 else ''}: {top:.12g} ({time.perf_counter() - start:.1f} s)")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
