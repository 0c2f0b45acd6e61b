"""Curvature over a dataset on several processes: real gloo process groups on 127.0.0.1
(``distributed_worker.py`` is one rank), against the same functions on one process over
the union of the shards, which are uneven and, with three ranks, one empty."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import distributed_worker as worker
import pytest
import torch

import curvgap

WORKER = Path(__file__).with_name("distributed_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(scenario: str, world: int, out: Path, timeout: float = 60.0,
           wait: float = 900.0, until_rank0: bool = False
           ) -> list[tuple[int | None, float, str]]:
    """Run ``world`` ranks of ``scenario`` (process group timeout ``timeout`` s): each rank's
    exit code (``None``: still running after ``wait`` s, or when rank 0 ended if
    ``until_rank0``, then killed), seconds until it ended, and output."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": str(world), "GLOO_SOCKET_IFNAME": "lo",
           "CURVGAP_TEST_TIMEOUT": str(timeout), "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    processes = [subprocess.Popen([sys.executable, str(WORKER), scenario, str(out)],
                                  env={**env, "RANK": str(rank)}, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
                 for rank in range(world)]
    ended = [None] * world
    while None in ended[:1 if until_rank0 else world] and time.monotonic() - start < wait:
        for rank, process in enumerate(processes):
            if ended[rank] is None and process.poll() is not None:
                ended[rank] = time.monotonic() - start
        time.sleep(0.1)
    runs = []
    for rank, process in enumerate(processes):
        if ended[rank] is None:
            process.kill()
        output = process.communicate()[0]
        runs.append((None if ended[rank] is None else process.returncode,
                     ended[rank] or wait, output))
    return runs


@pytest.fixture(scope="module")
def single_process() -> dict[str, torch.Tensor]:
    """Every result on one process (no process group) over all the samples."""
    torch.manual_seed(0)
    return worker.results(0, 1)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _check_world(world: int, single_process: dict, tmp_path: Path) -> None:
    runs = launch("results", world, tmp_path)
    for rank, (code, _, output) in enumerate(runs):
        assert code == 0, f"rank {rank} failed:\n{output[-3000:]}"
    found = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world)]
    for name, expected in single_process.items():
        for rank in range(world):
            assert found[rank][name].shape == expected.shape, name
            assert _relative(found[rank][name], expected) <= 1e-12, (name, rank)
            assert torch.equal(found[rank][name], found[0][name]), (name, rank)


@pytest.mark.slow
def test_three_ranks_with_an_empty_shard_give_the_single_process_results(single_process,
                                                                         tmp_path):
    _check_world(3, single_process, tmp_path)


@pytest.mark.slow
def test_two_uneven_ranks_give_the_single_process_results(single_process, tmp_path):
    _check_world(2, single_process, tmp_path)


def test_a_loaders_results_are_the_means_over_its_samples():
    """Over batches of 4 of 13 samples, the results are those of one batch of all 13,
    whose functions are checked against autograd elsewhere (a post-LN ReLU layer: the
    module the quick real-layer tests generate)."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 12, dropout=0.0, batch_first=True,
                                             dtype=torch.float64).eval()
    X = torch.randn(worker.SAMPLES, 5, 8, dtype=torch.float64)
    T = torch.randn_like(X)
    data = worker.TensorDataset(X, T)
    c, loader = curvgap.curvature(layer), worker.shard(data, 0, 1)
    n = sum(p.numel() for p in layer.parameters())
    V = worker.directions(n, 3)
    assert _relative(c.loss_hessian(loader), c.loss_hessian(X, T)) <= 1e-13
    assert _relative(c.hvp(loader, V), c.hvp(X, T, V)) <= 1e-13
    assert _relative(c.diagonal(loader, part="functional"),
                     c.diagonal(X, T, part="functional")) <= 1e-13
    assert _relative(c.hessian_operator(loader) @ V, c.hvp(X, T, V)) <= 1e-13


@pytest.mark.slow
def test_a_rank_that_raises_stops_the_others_with_its_error(tmp_path):
    runs = launch("raise", 2, tmp_path)
    assert [code for code, _, _ in runs] == [1, 1]
    raised = (tmp_path / "rank1.err").read_text()
    assert raised.startswith("ValueError: "), raised  # the malformed batch's own error
    said = (tmp_path / "rank0.err").read_text()
    assert said == f"RankError: hvp over the dataset, rank 0 of 2: rank 1 raised {raised}"


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["die", "hang"])
def test_a_rank_that_dies_or_never_arrives_stops_the_others_at_the_timeout(scenario,
                                                                          tmp_path):
    """Both ranks start (a barrier, under a generous limit), then rank 1 exits or sleeps for
    600 s: rank 0 raises at the 5 s timeout, long before the sleeping rank would arrive."""
    runs = launch(scenario, 2, tmp_path, timeout=5.0, wait=450.0, until_rank0=True)
    code, _, output = runs[0]
    assert code == 1, output[-3000:]
    said = (tmp_path / "rank0.err").read_text()
    assert said.startswith("RankError: hvp over the dataset, rank 0 of 2: gathering every "
                           "rank's sample count failed: another rank stopped"), said
    if scenario == "hang":  # rank 0 did not wait for it: it was still asleep, then killed
        assert runs[1][0] is None


@pytest.mark.slow
def test_ranks_given_different_vectors_refuse(tmp_path):
    runs = launch("differ", 2, tmp_path)
    assert [code for code, _, _ in runs] == [1, 1]
    for rank in range(2):
        said = (tmp_path / f"rank{rank}.err").read_text()
        assert said == ("ValueError: hvp: expected the same arguments and weights on every "
                        "rank (the result is one mean over every rank's shard), got others on "
                        "rank 1 than on rank 0"), said


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "digits_vit_top_eigenvalue.py"


def _top_eigenvalue(command: list[str]) -> tuple[int, float]:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(command + [str(EXAMPLE), "--epochs", "4"], capture_output=True,
                         text=True, timeout=1200, env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    found = re.findall(r"top Hessian eigenvalue over the 1438 training images, (\d) process"
                       r"(?:es)?: (\S+)", run.stdout)
    assert len(found) == 1, run.stdout
    return int(found[0][0]), float(found[0][1])


@pytest.mark.slow
def test_the_torchrun_example_runs_and_agrees_with_one_process():
    one = _top_eigenvalue([sys.executable])
    two = _top_eigenvalue([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                           "2", "--master_addr", "127.0.0.1", "--master_port",
                           str(_free_port())])
    assert one[0] == 1 and two[0] == 2
    assert abs(two[1] - one[1]) <= 1e-8 * abs(one[1])


@pytest.mark.slow
def test_the_distributed_benchmark_runs_and_its_processes_agree(tmp_path):
    from curvgap.benchmarks.distributed import run_distributed

    results = run_distributed(quick=True, out=tmp_path, report=lambda line: None)
    assert [row["function"] for row in results["rows"]] == ["hvp", "gnvp"]
    for row in results["rows"]:
        two = row["2 processes, 1 thread each"]
        assert two["samples_per_second"] > 0 and two["relative_difference"] <= 1e-12
    assert json.loads((tmp_path / "distributed.json").read_text())["rows"] == results["rows"]
