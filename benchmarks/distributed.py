"""``curvgap bench --distributed``: curvature over a dataset on 1 and 2 processes.

The digits ViT (:mod:`curvgap.analysis.vit`, ``n = 3,322`` parameters) over its training set
(1,438 images; the quick run's first 256) in batches of 128: one pass of its exact HVP (a
Lanczos product), its Gauss–Newton product and its exact diagonal, as samples per second,

* on one process with one torch thread and with every thread (no process group), and
* on ``2`` gloo processes on 127.0.0.1, one thread each, each passing every second image,
  the sums added by ``all_reduce`` (:mod:`curvgap.data`).

Speed-up is the two processes' throughput over one process's; the table also gives the
largest relative difference between their results (the same mean, summed in another
order).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, Subset, TensorDataset

from ..codegen.output import write_file
from .suite import machine

BATCH = 128
#: Passes timed per function (the median is reported), and the quick run's.
REPEATS, QUICK_REPEATS = {"hvp": 5, "gnvp": 5, "diagonal": 1}, {"hvp": 1, "gnvp": 1}


def _workload(rank: int, world: int, quick: bool) -> tuple[dict, DataLoader, torch.Tensor]:
    """The ViT's parameters, this rank's loader (every ``world``-th image) and a direction."""
    from ..analysis import vit

    data = vit.digits()
    images = TensorDataset(data.train_x, data.train_y[:, None])
    total = 256 if quick else len(images)
    loader = DataLoader(Subset(images, range(rank, total, world)), batch_size=BATCH)
    params = vit.init_params(seed=0)
    n = sum(p.numel() for p in params.values())
    v = torch.randn(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return params, loader, v


def _passes(params: dict, loader: DataLoader, v: torch.Tensor, quick: bool
            ) -> dict[str, tuple[float, torch.Tensor]]:
    """Per function, the median seconds of a pass (after a warm-up pass) and its result."""
    from ..analysis.vit import MODEL

    functions: dict[str, Callable[[], torch.Tensor]] = {
        "hvp": lambda: MODEL.hvp(params, loader, v),
        "gnvp": lambda: MODEL.gnvp(params, loader, v),
        "diagonal": lambda: MODEL.diagonal(params, loader)}
    timed = {}
    for name, repeats in (QUICK_REPEATS if quick else REPEATS).items():
        result = functions[name]()
        times = []
        for _ in range(repeats):
            if dist.is_initialized():
                dist.barrier()
            start = time.perf_counter()
            result = functions[name]()
            times.append(time.perf_counter() - start)
        timed[name] = sorted(times)[len(times) // 2], result
    return timed


def _rank(rank: int, world: int, port: int, quick: bool, out: str) -> None:
    """One process of the two-process run; rank 0 saves its times and results."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=5))
    try:
        timed = _passes(*_workload(rank, world, quick), quick)
        if rank == 0:
            torch.save(timed, Path(out) / "ranks.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_process(quick: bool, threads: int) -> dict[str, tuple[float, torch.Tensor]]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _passes(*_workload(0, 1, quick), quick)
    finally:
        torch.set_num_threads(before)


def run_distributed(quick: bool = False, out: Path | None = None,
                    report: Callable[[str], None] = print) -> dict:
    """The 1- and 2-process table; returns (and writes to ``out/distributed.json``) it."""
    cores = os.cpu_count() or 1
    samples = 256 if quick else 1438
    report(f"curvgap bench --distributed: digits ViT (n = 3,322) over {samples} training "
           f"images, batches of {BATCH}, float64, {cores} cores")
    report(f"  machine: {machine()}")
    runs = {}
    for label, threads in (("1 process, 1 thread", 1), (f"1 process, {cores} threads", cores)):
        report(f"  {label} ...")
        runs[label] = _one_process(quick, threads)
    report("  2 processes (gloo, 127.0.0.1), 1 thread each ...")
    with tempfile.TemporaryDirectory() as folder:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        mp.start_processes(_rank, args=(2, _free_port(), quick, folder), nprocs=2,
                           start_method="spawn")
        runs["2 processes, 1 thread each"] = torch.load(Path(folder) / "ranks.pt")
    reference = runs["1 process, 1 thread"]
    rows = []
    for name in reference:
        row = {"function": name}
        for label, timed in runs.items():
            seconds, result = timed[name]
            row[label] = {"seconds": seconds, "samples_per_second": samples / seconds}
            expected = reference[name][1]
            row[label]["relative_difference"] = float(
                (result - expected).abs().max() / expected.abs().max())
        two = row["2 processes, 1 thread each"]["samples_per_second"]
        row["speedup_over_1_thread"] = two / row["1 process, 1 thread"]["samples_per_second"]
        row["speedup_over_all_threads"] = two / row[f"1 process, {cores} threads"][
            "samples_per_second"]
        rows.append(row)
    results = {"quick": quick, "samples": samples, "batch": BATCH, "machine": machine(),
               "rows": rows}
    _print_table(results, cores, report)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_file(out / "distributed.json", json.dumps(results, indent=2))
        report(f"  wrote {out / 'distributed.json'}")
    return results


def _print_table(results: dict, cores: int, report: Callable[[str], None]) -> None:
    report("\ndistributed summary (samples/s; speed-up = 2 processes over 1 process)")
    report(f"  {'function':<10}{'1 proc, 1 thr':>15}{f'1 proc, {cores} thr':>15}"
           f"{'2 procs':>10}{'vs 1 thr':>10}{'vs ' + str(cores) + ' thr':>10}"
           f"{'max rel diff':>14}")
    for row in results["rows"]:
        one, every = row["1 process, 1 thread"], row[f"1 process, {cores} threads"]
        two = row["2 processes, 1 thread each"]
        report(f"  {row['function']:<10}{one['samples_per_second']:>15,.0f}"
               f"{every['samples_per_second']:>15,.0f}{two['samples_per_second']:>10,.0f}"
               f"{row['speedup_over_1_thread']:>9.2f}×{row['speedup_over_all_threads']:>9.2f}×"
               f"{two['relative_difference']:>14.1e}")
