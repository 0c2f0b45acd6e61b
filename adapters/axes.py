"""Axes of a traced module's tensors, split into factors where a reshape splits them.

A *size class* (:class:`Size`) is an extent that several tensors share (a layer's width, its
heads, the sequence length); classes that an operation aligns are unified, and a class that a
reshape cuts into factors (``d`` into heads × head width) is split everywhere it occurs, so
that every tensor's axes are products of the same factors and a reshape is a regrouping of
them (a view, never a copy). An :class:`Axis` is one axis of one tensor; its size class
decides whether it has parts.
"""

from __future__ import annotations

import sympy as sp


class ShapeError(ValueError):
    """A reshape or alignment that no split into common factors expresses."""


class Changes:
    """The unifications and splits of one reading's size classes (a pass is repeated until
    one makes none), and how many classes it has made (their order of birth)."""

    def __init__(self) -> None:
        self.count = 0
        self.made = 0


class Size:
    """A size class: an extent (an int, or a SymPy symbol for a dimension bound at call
    time), unified with others (union-find, the oldest class the root) and possibly split
    into ``parts`` (row-major); ``changes`` counts what happens to the classes of its
    reading."""

    def __init__(self, extent: int | sp.Expr, changes: Changes) -> None:
        self.extent = extent
        self.changes = changes
        self.order = changes.made
        changes.made += 1
        self.parent: Size | None = None
        self.parts: list[Size] | None = None

    def root(self) -> Size:
        size = self
        while size.parent is not None:
            size = size.parent
        return size

    def leaves(self) -> list[Size]:
        """The unsplit classes this one is made of, row-major."""
        root = self.root()
        if root.parts is None:
            return [root]
        return [leaf for part in root.parts for leaf in part.leaves()]

    def __repr__(self) -> str:
        return f"Size({self.order}: {self.extent})"


class Axis:
    """One axis of one tensor, of size class ``size``; split into parts (axes of its own) when
    its class is."""

    def __init__(self, size: Size) -> None:
        self.size = size
        self.parts: list[Axis] | None = None

    def leaves(self) -> list[Axis]:
        """The unsplit axes this one is made of, row-major."""
        root = self.size.root()
        if root.parts is None:
            return [self]
        if self.parts is None or [p.size.root() for p in self.parts] != [
                p.root() for p in root.parts]:
            self.parts = [Axis(part) for part in root.parts]
        return [leaf for part in self.parts for leaf in part.leaves()]

    @property
    def extent(self) -> int | sp.Expr:
        return self.size.root().extent

    def __repr__(self) -> str:
        return f"Axis({self.size.root()!r})"


def unify(a: Size, b: Size) -> None:
    """Make ``a`` and ``b`` one class (their factors aligned first)."""
    ra, rb = a.root(), b.root()
    if ra is rb:
        return
    if sp.simplify(ra.extent - rb.extent) != 0:
        raise ShapeError(f"sizes {ra.extent} and {rb.extent} cannot be aligned")
    if ra.parts is not None or rb.parts is not None:
        align(ra.leaves(), rb.leaves())
    old, new = sorted((ra, rb), key=lambda s: s.order)
    if new.parts is not None and old.parts is None:
        old.parts = new.parts
    new.parent = old
    old.changes.count += 1


def extent_of(value: int | sp.Expr) -> int | sp.Expr:
    """``value`` as a Python int when it is a number, else as a SymPy expression."""
    value = sp.sympify(value)
    return int(value) if value.is_Integer else value


def split(size: Size, extents: list[int | sp.Expr]) -> None:
    """Split the (unsplit) class ``size`` into factors of ``extents``, row-major."""
    root = size.root()
    assert root.parts is None, "split an unsplit class"
    extents = [extent_of(e) for e in extents]
    if any(not isinstance(e, int) for e in extents):
        raise ShapeError(f"cannot split the size {root.extent} (bound at call time) into "
                         f"{list(extents)}")
    root.parts = [Size(extent, root.changes) for extent in extents]
    root.changes.count += 1


def align(xs: list[Size], ys: list[Size]) -> None:
    """Unify two sequences of classes of equal total extent, factor by factor, splitting a
    class where the other side's boundary falls inside it."""
    xs, ys = [x.root() for x in xs], [y.root() for y in ys]
    while xs and ys:
        x, y = xs[0].root(), ys[0].root()
        if x.parts is not None or y.parts is not None:
            xs = x.leaves() + xs[1:] if x.parts is not None else xs
            ys = y.leaves() + ys[1:] if y.parts is not None else ys
            continue
        if sp.simplify(x.extent - y.extent) == 0:
            unify(x, y)
            xs, ys = xs[1:], ys[1:]
            continue
        big, small = (x, y) if _divides(y.extent, x.extent) else (y, x)
        if not _divides(small.extent, big.extent):
            raise ShapeError(f"sizes {x.extent} and {y.extent} have no common factors")
        split(big, [small.extent, sp.sympify(big.extent) / small.extent])
    if xs or ys:
        raise ShapeError("shapes of different sizes cannot be aligned")


def _divides(small: int | sp.Expr, big: int | sp.Expr) -> bool:
    if isinstance(small, int) and isinstance(big, int):
        return small > 0 and big % small == 0
    ratio = sp.simplify(sp.sympify(big) / small)
    return ratio.is_integer is True or ratio == 1


def regroup(leaves: list[Axis], extents: list[int | sp.Expr]) -> list[list[Axis]]:
    """The axes ``leaves`` (row-major) grouped into dimensions of ``extents`` (a reshape),
    splitting classes where a dimension's boundary falls inside one; ``[]`` for a dimension of
    size one."""
    pending = list(leaves)
    groups: list[list[Axis]] = []
    for extent in extents:
        group: list[Axis] = []
        remaining = sp.sympify(extent)
        while remaining != 1:
            if not pending:
                raise ShapeError(f"cannot reshape into {list(extents)}")
            axis = pending.pop(0)
            if axis.size.root().parts is not None:
                pending = axis.leaves() + pending
                continue
            if sp.simplify(axis.extent - remaining) == 0 or _divides(axis.extent, remaining):
                group.append(axis)
                remaining = sp.simplify(remaining / axis.extent)
                continue
            if not _divides(remaining, axis.extent):
                raise ShapeError(f"cannot reshape a dimension of {axis.extent} into "
                                 f"{list(extents)}")
            split(axis.size, [remaining, sp.sympify(axis.extent) / remaining])
            pending = axis.leaves() + pending
        groups.append(group)
    while pending and pending[0].extent == 1:
        pending.pop(0)
    if pending:
        raise ShapeError(f"cannot reshape into {list(extents)}: entries left over")
    return groups
