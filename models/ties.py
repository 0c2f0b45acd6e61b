"""Tied parameters: a part's parameter that is another one, or that one transposed.

A tied parameter ``t`` reads its source ``s`` as ``t = s`` or ``t = s^T`` (``{"head.W_H":
"embedding.W_E.T"}``: a language-model head tied to its token embedding). It leaves the
chain's parameters, and every derivative over ``s`` sums its places: with ``S`` stacking the
identity and the transpositions (``vec_r(t) = P vec_r(s)``, ``P`` the commutation matrix
for ``s^T``), the gradient is ``S^T ∇``, a product ``S^T H S v`` and the Hessian ``S^T H S``.
``S`` is never formed: directions are read through it (:meth:`Ties.untie`), results folded
back (:meth:`Ties.folded`) and Hessian axes summed by an index map (:meth:`Ties.index`,
:meth:`Ties.fold_axes`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from .arrays import Array, NumpyArrays, TorchArrays


class Ties(Mapping[str, str]):
    """Tied parameter → the parameter it reads (its source), from ``ties`` (tied → source, with
    ``".T"`` appended where it is read transposed) checked against the chain's parameter
    ``names``; :attr:`transposed` holds the tied names read transposed."""

    def __init__(self, ties: Any, names: list[str]) -> None:
        if not isinstance(ties, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in ties.items()):
            raise TypeError(f"ties: expected a dict of parameter names (tied → source, or "
                            f"source + '.T' read transposed), got {ties!r}")
        sources = {tied: source.removesuffix(".T") for tied, source in ties.items()}
        for tied, source in sources.items():
            if tied not in names or source not in names:
                raise ValueError(f"ties: expected names of the parts' parameters (such as "
                                 f"{names[-1]!r}), got {tied!r} → {ties[tied]!r}")
            if tied == source or source in sources:
                raise ValueError(f"ties: expected {tied!r} tied to an untied parameter, got "
                                 f"{source!r}")
        self._sources = sources
        self.transposed = {tied for tied, source in ties.items() if source.endswith(".T")}

    def __getitem__(self, tied: str) -> str:
        return self._sources[tied]

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)

    def as_tied(self, tied: str, value: Array) -> Array:
        """``value``, of the shape of ``tied``'s source, as ``tied`` reads it (a view)."""
        return value.T if tied in self.transposed else value

    def untie(self, values: dict[str, Array]) -> dict[str, Array]:
        """``values`` (parameters, or directions) with each tied parameter whose source is
        there as it reads its source."""
        if not self:
            return values
        return {**values, **{tied: self.as_tied(tied, values[source])
                             for tied, source in self.items() if source in values}}

    def folded(self, pieces: dict[str, Array], out: dict[str, Array] | None = None
               ) -> dict[str, Array]:
        """Per-parameter results (name → array shaped as the parameter) with each tied
        parameter's added, in its source's layout, to its source's (in place where the
        source's result was written into its array of ``out``)."""
        for tied, source in self.items():
            if tied in pieces:
                value = self.as_tied(tied, pieces.pop(tied))
                if out and source in out:
                    pieces[source] += value
                else:
                    pieces[source] = pieces[source] + value
        return pieces

    def checked_shapes(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """``shapes`` (every parameter's) without the tied ones, each checked against its
        source's."""
        for tied, source in self.items():
            expected = shapes[source][::-1] if tied in self.transposed else shapes[source]
            if shapes[tied] != expected:
                how = " transposed" if tied in self.transposed else ""
                raise ValueError(f"sizes: {tied} is {source}{how}, so its shape must be "
                                 f"{expected}; these sizes give {shapes[tied]}")
            del shapes[tied]
        return shapes

    def in_source_layout(self, J: Array, tied: str, shape: tuple[int, ...]) -> Array:
        """The Jacobian ``J`` over ``tied`` (its last axis) over its source, of ``shape``."""
        if tied not in self.transposed:
            return J
        rows, cols = shape
        return J[..., np.arange(rows * cols).reshape(cols, rows).T.reshape(-1)]

    def index(self, params: dict[str, Array], names: list[str]
              ) -> tuple[np.ndarray, int] | None:
        """For the entries of ``names`` (in order, ties included: the rows of a Hessian),
        ``(position of each in the result over the untied ones, the result's size)``, a tied
        entry at its source's; None when no tie is among them."""
        if not any(n in self for n in names):
            return None
        starts, offset = {}, 0
        for name in names:
            if name not in self:
                starts[name], offset = offset, offset + int(np.prod(params[name].shape))
        index = []
        for name in names:
            if name in self:  # a transposed tie's entry (i, j) is its source's (j, i)
                source = params[self[name]]
                index.append(starts[self[name]] + self.as_tied(
                    name, np.arange(int(np.prod(source.shape))).reshape(source.shape)
                ).reshape(-1))
            else:
                index.append(starts[name] + np.arange(int(np.prod(params[name].shape))))
        return np.concatenate(index), offset

    @staticmethod
    def fold_axes(value: Array, tie: tuple | None, axes: tuple[int, ...],
                  arrays: NumpyArrays | TorchArrays) -> Array:
        """``value`` with its ``axes`` (laid out over the entries :meth:`index` was given)
        summed into the untied entries by the index map ``tie``."""
        if tie is None:
            return value
        index, n = tie
        for axis in axes:
            value = arrays.index_add(value, axis, index, n)
        return value

    def groups(self, names: list[str], shared: list[list[str]] | None = None
               ) -> list[list[str]]:
        """The groups ``shared`` (ValueError where one names a tied parameter or a source),
        then each source among ``names`` with its tied parameters among them, source first."""
        if any(n in self or n in self.values() for group in shared or [] for n in group):
            raise ValueError(f"shared: expected names outside the ties {dict(self)} (their "
                             f"places are folded already), got {shared!r}")
        return [*(shared or []), *([source, *tied] for source in names if (
            tied := [t for t, s in self.items() if s == source and t in names]))]

    def layouts(self, names: list[str], shapes: dict[str, tuple[int, ...]]
                ) -> dict[str, np.ndarray]:
        """For each transposed tied parameter among ``names`` (of ``shapes``), the index that
        reads its ``vec_r`` in its source's layout."""
        return {t: np.arange(int(np.prod(shapes[t]))).reshape(shapes[t]).T.reshape(-1)
                for t in names if t in self.transposed}

    def folded_flat(self, arrays: NumpyArrays | TorchArrays, flat: Array, names: list[str],
                    shapes: dict[str, tuple[int, ...]]) -> Array:
        """``flat`` (the entries of ``names``, in order) with each tied parameter's entries
        added, in its source's layout, to its source's, and left out."""
        if not any(n in self for n in names):
            return flat
        starts, offset = {}, 0
        for name in names:
            starts[name] = offset
            offset += int(np.prod(shapes[name]))
        pieces = {name: flat[starts[name]:starts[name] + int(np.prod(shapes[name]))]
                  for name in names}
        index = self.layouts(names, shapes)
        for tied, source in self.items():
            if tied in pieces:
                value = pieces.pop(tied)
                pieces[source] = pieces[source] + (value if tied not in index
                                                   else value[index[tied]])
        return arrays.cat(list(pieces.values()))


def shared_places(groups: list[list[str]] | None, part_keys: list[dict[str, str]],
                  chosen: list[list[str]], shapes: dict[str, tuple[int, ...]],
                  layouts: dict[str, np.ndarray] | None = None) -> tuple[dict, dict]:
    """For ``groups`` (each a list of names of ``PARAMS`` that are one parameter read in
    several places, its source first: a module's weight tied across parts, held once per
    place, or a chain's tie), each place ``(part index, its name there)`` → the group's other
    places, and → the group's first place with the index that reads the place's entries (its
    ``vec_r``) in the source's layout (``layouts`` of its name, for a transposed place; None:
    the same layout). ValueError where a name is not a parameter asked, is in two groups, or
    a group's shapes differ (a transposed place's read reversed); NotImplementedError where
    two places are in one part."""
    if not groups:
        return {}, {}
    layouts = layouts or {}
    where = {key: (k, name) for k, keys in enumerate(part_keys) for name, key in keys.items()}
    asked = {(k, name) for k, names in enumerate(chosen) for name in names}
    shared, homes = {}, {}
    for group in groups:
        places = [where.get(key) for key in group]
        if len(group) < 2 or any(p is None or p not in asked or p in shared for p in places):
            raise ValueError(f"shared: expected groups of two or more names of parameters "
                             f"asked for, each in one group, got {group!r}")
        read = [shapes[key][::-1] if key in layouts else shapes[key] for key in group]
        if len(set(read)) > 1:
            raise ValueError(f"shared: expected the places of one parameter, of one shape, got "
                             f"{group!r} (shapes {read})")
        if len({k for k, _ in places}) < len(places):
            raise NotImplementedError(
                f"diagonal: {group[0]} is read in several places of one part; its diagonal "
                f"needs the blocks between those places inside the part: use "
                f"loss_hessian(wrt={group[0]!r}), or leave it out of wrt")
        for key, place in zip(group, places):
            shared[place] = [other for other in places if other != place]
            homes[place] = places[0], layouts.get(key)
    return shared, homes
