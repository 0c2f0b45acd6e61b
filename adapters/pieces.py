"""The module's parameters as the runners hold them: per parameter of the module chosen (in the
order chosen), its name, the runners' names for it (none where the output does not depend on it;
several for a tied weight read in several places, whose derivatives add up) and its number of
entries — a :data:`Piece`. Results over the runners' parameters are laid out over the
module's, and directions over the module's split into the runners'."""

from __future__ import annotations

import torch

from ..models.arrays import ARRAYS, flat_slots, written
from ..runtime.loading import checks
from .traced import Traced

#: ``(module parameter, the runners' names for it, entries)``
Piece = tuple[str, tuple[str, ...], int]


def pieces_of(module: torch.nn.Module, traced: Traced, names: list[str]) -> list[Piece]:
    """Per module parameter of ``names`` (in that order): its name, the runner's names for it
    (none: the output does not depend on it; several: a tied weight read in several
    places, whose derivatives add up) and its number of entries."""
    ours: dict[str, tuple[str, ...]] = {}
    for name, source in traced.names.items():
        ours[source] = (*ours.get(source, ()), name)
    return [(n, ours.get(n, ()), module.get_parameter(n).numel()) for n in names]


def used_of(traced: Traced, pieces: list[Piece]) -> list[str]:
    """The runner's parameters among ``pieces``, in the runner's order."""
    order = {name: k for k, name in enumerate(traced.names)}
    return sorted((r for _, ours, _ in pieces for r in ours), key=order.get)


def _same(pieces: list[Piece], used: list[str]) -> bool:
    """Whether ``pieces`` are the ``used`` parameters one to one, in order."""
    return [ours for _, ours, _ in pieces] == [(name,) for name in used]


def spread(values: torch.Tensor, pieces: list[Piece], used: list[str], axis: int = 0
            ) -> torch.Tensor:
    """``values`` (along ``axis``: the ``used`` parameters' entries, concatenated) in the
    order of ``pieces``: zeros where a piece is not used, the sum where it is used in
    several places."""
    if _same(pieces, used):
        return values
    sizes = {r: size for _, ours, size in pieces for r in ours}
    offsets, offset = {}, 0
    for name in used:
        offsets[name] = offset
        offset += sizes[name]
    parts = []
    for _, ours, size in pieces:
        if not ours:
            shape = list(values.shape)
            shape[axis] = size
            parts.append(values.new_zeros(shape))
        else:
            parts.append(sum(values.narrow(axis, offsets[r], size) for r in ours))
    return torch.cat(parts, axis)


def directions(v: torch.Tensor, pieces: list[Piece], params: dict) -> list[dict]:
    """Per column of ``v`` (``(n,)`` or ``(n, k)``: the entries of ``pieces`` in the module's
    order; checked as a generated module checks ``v``), the direction of each runner
    parameter: a view of ``v`` shaped as the parameter (a tied weight's for each place it is
    read)."""
    sizes = {name: size for name, _, size in pieces}
    columns = checks("torch")._split_directions(v, [name for name, _, _ in pieces], sizes, None)
    return [{runner: views[name].reshape(params[runner].shape)
             for name, ours, _ in pieces for runner in ours} for views in columns]


def empty(pieces: list[Piece], like: torch.Tensor, columns: int | None = None
           ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """An empty result over ``pieces`` (in their order) in ``like``'s dtype and
    device, ``(n,)``, or ``(n, columns)``; for ``(n,)``, the slice of each piece by the
    runner's name of the last place it is read: the runner writes its result there (a tied
    weight's other places are added to it)."""
    out, slots = flat_slots(ARRAYS["torch"], [(k, size) for k, (*_, size) in enumerate(pieces)],
                            like, columns)
    return out, {pieces[k][1][-1]: slot for k, slot in slots.items() if pieces[k][1]}


def assembled(out: torch.Tensor, columns: list[dict], pieces: list[Piece], function: str,
              quantity: str, X: torch.Tensor) -> torch.Tensor:
    """``out`` (from :func:`empty`) holding the runner's results (per column, runner name
    → array) in the order of ``pieces``: zeros where a piece is not used, the
    sum where a tied weight is read in several places, each result copied unless the
    runner wrote it there. FloatingPointError where it is not finite (every input was
    checked finite: the arithmetic overflowed), as a generated module says it."""
    for j, values in enumerate(columns):
        column = out[:, j] if out.ndim == 2 else out
        offset = 0
        for _, ours, size in pieces:
            slot = column[offset:offset + size]
            if not ours:
                slot.zero_()
            else:
                written(slot, values[ours[-1]])
                for name in ours[:-1]:
                    slot.add_(values[name].reshape(-1))
            offset += size
    return checks("torch")._checked(out, out.dtype, function, quantity, {"X": X})


def refuse_tied(pieces: list[Piece], what: str) -> None:
    tied = [n for n, ours, _ in pieces if len(ours) > 1]
    if tied:
        raise NotImplementedError(
            f"{what}: {tied[0]} is a tied weight read in several places; its {what} needs "
            f"the blocks between those places: use loss_hessian(wrt={tied[0]!r}) (or "
            f"untie it)")
