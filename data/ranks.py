"""The ranks of a ``torch.distributed`` process group, when one is initialised: what each
rank contributed to a mean over a dataset, and the sum over ranks (``all_reduce``; gloo on
CPU, NCCL on GPU).

A collective waits for every rank. A rank that fails inside the pass still reaches the
collective and says so, so every other rank raises :class:`RankError` at once; a rank that
dies or never arrives makes the others raise it when the backend notices (a closed
connection) or at the process group's timeout (``init_process_group(timeout=...)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


class RankError(RuntimeError):
    """Another rank of the process group failed, died or did not arrive in time."""


@dataclass(frozen=True)
class Contribution:
    """What one rank brings to a mean over samples: how many samples, the shape and dtype
    of its sum (``None`` when it had none), a fingerprint of the call's other arguments
    (equal on every rank), and the error it raised (``None`` if none)."""

    count: int
    layout: tuple[tuple[int, ...], str] | None
    arguments: str
    failure: str | None


def current() -> tuple[int, int] | None:
    """``(rank, world size)`` of the default process group, or ``None`` when none is
    initialised (one process)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


def _collective_failed(what: str, step: str, error: Exception) -> RankError:
    rank, size = current()
    said = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return RankError(f"{what} over the dataset, rank {rank} of {size}: {step} failed: another "
                     f"rank stopped (raised, was killed) or did not reach it within the process "
                     f"group's timeout (init_process_group(timeout=...)); the backend said: "
                     f"{said}")


def gather(mine: Contribution, what: str) -> list[Contribution]:
    """Every rank's :class:`Contribution`, in rank order (the same list on every rank)."""
    everyone: list[Any] = [None] * current()[1]
    try:
        dist.all_gather_object(everyone, mine)
    except Exception as error:  # the backend's own error types differ by backend
        raise _collective_failed(what, "gathering every rank's sample count", error) from error
    return everyone


def sum_over_ranks(total: torch.Tensor, what: str) -> None:
    """Replace ``total`` by its sum over every rank, in place (the same on every rank)."""
    try:
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    except Exception as error:
        raise _collective_failed(what, "the all_reduce of the ranks' sums", error) from error


def device() -> torch.device:
    """Where a rank holds the sums it reduces: its GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
