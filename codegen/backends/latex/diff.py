"""What changes in the formulas when the architecture changes: two documents' contexts
(:func:`~.document.document_context`) compared formula by formula as printed.

Both documents name their symbols after what they are (the module's parameters and sizes,
what each intermediate computes), so a formula prints the same in both exactly where its
mathematics is the same. :func:`diff_context` gives

- the symbols that are new, gone or of another shape;
- the architectures side by side, aligned line by line (:func:`side_by_side`);
- each loss-Hessian block :math:`H_{V,W}` new, gone, changed or the same; a changed block
  names the derivatives it reads that changed: :math:`J_V`, :math:`J_W`, the second
  derivative :math:`\\partial^2 Z / \\partial V \\partial W` or its own contraction (the loss);
- the first derivatives (the chain of stored derivatives that gives :math:`J_V`) of every
  variable whose chain changed, side by side.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass

from .document import Formula, Section

#: characters per printed line in one of the two columns (landscape A4, small type)
COLUMN = 46
#: formulas kept on each side of a change when a run of formulas the same in both is left out
CONTEXT = 2


@dataclass(frozen=True)
class Row:
    """One line of a side-by-side comparison: ``mark`` is ``"same"``, ``"changed"``,
    ``"new"`` (only on the right), ``"gone"`` (only on the left) or ``"skipped"`` (``count``
    formulas the same in both, left out); ``left`` and ``right`` are the two formulas' printed
    lines (the first with its left-hand side), empty where there is none."""

    mark: str
    left: tuple[str, ...] = ()
    right: tuple[str, ...] = ()
    count: int = 0


@dataclass(frozen=True)
class Comparison:
    """A titled side-by-side comparison."""

    title: str
    rows: tuple[Row, ...]


@dataclass(frozen=True)
class BlockChange:
    """What happened to the loss-Hessian block of the variables ``pair`` (their symbols):
    ``status`` is ``"new"``, ``"gone"``, ``"changed"`` or ``"same"``; ``changed`` lists, as
    LaTeX, the derivatives it reads that differ."""

    pair: tuple[str, str]
    status: str
    changed: tuple[str, ...] = ()


def statement(formula: Formula) -> tuple[str, ...]:
    """A formula as stated: its matrix form where it has one, else its index form."""
    lhs, lines = _stated(formula)
    return (f"{lhs} = {lines[0]}", *lines[1:])


def _stated(formula: Formula) -> tuple[str, list[str]]:
    if formula.matrix_lines is not None:
        return formula.matrix_lhs, formula.matrix_lines
    return formula.lhs, formula.index_lines


def side_by_side(left: Sequence[Formula], right: Sequence[Formula],
                 context: int | None = CONTEXT) -> tuple[Row, ...]:
    """``left`` and ``right`` aligned on the longest common runs of equal formulas
    (:mod:`difflib`); between them, a formula of one side is paired with the other side's of
    the same left-hand side (``"changed"``), else it is ``"gone"`` or ``"new"``. Runs of equal
    formulas longer than ``2 context + 1`` keep ``context`` formulas beside each change
    (``None``: keep them all)."""
    a, b = [statement(f) for f in left], [statement(f) for f in right]
    rows: list[Row] = []
    opcodes = difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes()
    for n, (tag, i1, i2, j1, j2) in enumerate(opcodes):
        if tag != "equal":
            rows += _paired(left[i1:i2], right[j1:j2])
            continue
        same = [Row("same", x, x) for x in a[i1:i2]]
        head = 0 if n == 0 else context
        tail = 0 if n == len(opcodes) - 1 else context
        if context is None or len(same) <= head + tail + 1:
            rows += same
        else:
            rows += same[:head]
            rows.append(Row("skipped", count=len(same) - head - tail))
            rows += same[len(same) - tail:]
    return tuple(rows)


def _paired(left: Sequence[Formula], right: Sequence[Formula]) -> list[Row]:
    """Formulas that differ, paired by their left-hand sides."""
    lhs = [[f.matrix_lhs for f in side] for side in (left, right)]  # the bare symbol
    rows: list[Row] = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=lhs[0], b=lhs[1],
                                                        autojunk=False).get_opcodes():
        if tag == "equal":
            rows += [Row("changed", statement(x), statement(y))
                     for x, y in zip(left[i1:i2], right[j1:j2], strict=True)]
        else:
            rows += [Row("gone", statement(x)) for x in left[i1:i2]]
            rows += [Row("new", (), statement(y)) for y in right[j1:j2]]
    return rows


def _section(context: dict, title: str) -> Section | None:
    return next((s for s in context["sections"] if s.title == title), None)


def _by_key(section: Section | None) -> dict[tuple[str, ...], list[Formula]]:
    """The formulas of ``section``'s blocks, by the variables they derive along."""
    found: dict[tuple[str, ...], list[Formula]] = {}
    for block in section.blocks if section else ():
        found.setdefault(block.key, []).extend(block.formulas)
    return found


def _both(a: dict, b: dict, title: str) -> list[dict[tuple[str, ...], list[Formula]]]:
    """The formulas of the section ``title`` of each document, by their blocks' keys."""
    return [_by_key(_section(context, title)) for context in (a, b)]


def _texts(formulas: list[Formula]) -> list[tuple[str, ...]]:
    """The formulas as printed, index form and matrix form: equal exactly where both are."""
    return [(f.lhs, *f.index_lines, f.matrix_lhs, *(f.matrix_lines or ())) for f in formulas]


def _pair(pair: tuple[str, ...]) -> tuple[str, ...]:
    """A pair of variables in a fixed order (a block and its transpose are one)."""
    return tuple(sorted(pair))


def block_changes(a: dict, b: dict) -> list[BlockChange]:
    """Each loss-Hessian block of the documents ``a`` and ``b`` (contexts): those of ``b`` in
    its order, then those gone from ``a``. A block in both changed where its statement did
    (the loss's part) or where a derivative it reads did: ``changed`` names them, from
    ``"J_V"``, ``"J_W"`` (the variables' symbols), ``"second"`` and ``"statement"`` (the
    block's own formula as printed: its loss's part, or a matrix form found on one side);
    ``"transposed"`` where the two documents order the pair's variables differently (the
    block is the other's transpose, compared through its Jacobians only)."""
    blocks = _both(a, b, "Loss Hessian")
    firsts = _both(a, b, "First derivatives")
    seconds = [{_pair(k): v for k, v in side.items()}
               for side in _both(a, b, "Second derivatives")]
    before = {_pair(k): v for k, v in blocks[0].items()}
    orders = [{_pair(k): k for k in blocks[0]}]
    changes = []
    for pair, formulas in blocks[1].items():
        old = before.pop(_pair(pair), None)
        if old is None:
            changes.append(BlockChange(pair, "new"))
            continue
        changed = [f"J_{{{v}}}" for v in dict.fromkeys(pair)
                   if _texts(firsts[0].get((v,), [])) != _texts(firsts[1].get((v,), []))]
        if orders[0][_pair(pair)] != tuple(pair):  # stated as the transpose: not comparable
            changed.append("transposed")
        else:
            if _texts(seconds[0].get(_pair(pair), [])) != _texts(seconds[1].get(_pair(pair),
                                                                                 [])):
                changed.append("second")
            if [statement(f) for f in old] != [statement(f) for f in formulas]:  # the loss's
                changed.append("statement")
        changes.append(BlockChange(pair, "changed" if changed else "same", tuple(changed)))
    changes += [BlockChange(pair, "gone") for pair in before]
    return changes


#: how a cell of the blocks' grid shows each kind of change
CELLS = {"new": "+", "gone": "-", "same": r"\cdot"}


def _cell(change: BlockChange) -> str:
    """A block's cell in the grid: ``+`` new, ``-`` gone, ``·`` the same; a changed block
    lists what changed: ``J`` an output Jacobian, ``\\partial^2`` the second derivative,
    ``H`` the block's own statement, ``\\top`` stated as the transpose."""
    if change.status != "changed":
        return CELLS[change.status]
    codes = {"J": any(c.startswith("J_") for c in change.changed),
             r"\partial^2": "second" in change.changed, "H": "statement" in change.changed,
             r"\top": "transposed" in change.changed}
    return ",".join(code for code, there in codes.items() if there)


def block_grid(changes: list[BlockChange]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """The blocks as an upper-triangular grid: the variables (in order of first appearance)
    and the rows, each a variable and its blocks' cells (:func:`_cell`; ``""`` below the
    diagonal)."""
    variables = list(dict.fromkeys(v for c in changes for v in c.pair))
    cells = {_pair(c.pair): _cell(c) for c in changes}
    return variables, [(v, [cells.get(_pair((v, w)), "") if n <= m else ""
                            for m, w in enumerate(variables)]) for n, v in enumerate(variables)]


def jacobian_changes(a: dict, b: dict) -> dict[str, list[str]]:
    """The variables (their symbols) whose output Jacobian is ``"changed"``, ``"new"``,
    ``"gone"`` or ``"same"`` from ``a`` to ``b``."""
    firsts = _both(a, b, "First derivatives")
    found: dict[str, list[str]] = {"changed": [], "new": [], "gone": [], "same": []}
    for key in dict.fromkeys(k for k in [*firsts[1], *firsts[0]] if len(k) == 1):
        old, new = firsts[0].get(key), firsts[1].get(key)
        status = ("new" if old is None else "gone" if new is None else
                  "same" if _texts(old) == _texts(new) else "changed")
        found[status].append(key[0])
    return found


def _symbols(a: dict, b: dict) -> list[tuple[str, str, str]]:
    """The symbols new, gone or of another shape: (symbol, shape before, shape after), a
    shape ``""`` where the symbol is not."""
    before = {row[0]: row[1] for row in a["symbols"]}
    after = {row[0]: row[1] for row in b["symbols"]}
    rows = [(s, before.get(s, ""), shape) for s, shape in after.items()
            if before.get(s) != shape]
    return rows + [(s, shape, "") for s, shape in before.items() if s not in after]


def _architecture(context: dict) -> list[Formula]:
    section = _section(context, "Architecture")
    return [f for block in section.blocks for f in block.formulas] if section else []


def diff_context(a: dict, b: dict, labels: tuple[str, str]) -> dict:
    """Everything the template ``diff.tex.jinja`` needs to typeset what changes from the
    document ``a`` to the document ``b`` (contexts, printed in lines of :data:`COLUMN`
    characters), headed by ``labels``."""
    changes = block_changes(a, b)
    variables, grid = block_grid(changes)
    firsts = _both(a, b, "First derivatives")
    jacobians = jacobian_changes(a, b)
    derivatives = [
        Comparison(f"$J_{{{v}}}$ ({status})", side_by_side(firsts[0].get((v,), []),
                                                           firsts[1].get((v,), [])))
        for status in ("changed", "new", "gone") for v in jacobians[status]]
    counts = {s: sum(c.status == s for c in changes) for s in ("changed", "new", "gone", "same")}
    return dict(
        labels=labels, headings=tuple(c["heading"].rstrip(".") for c in (a, b)),
        symbols=_symbols(a, b),
        architecture=Comparison("Architecture", side_by_side(_architecture(a),
                                                             _architecture(b), None)),
        blocks=changes, counts=counts, variables=variables, grid=grid, jacobians=jacobians,
        derivatives=derivatives)


#: the margin's mark of each kind of row
MARKS = {"same": "", "changed": r"$\ne$", "new": "$+$", "gone": "$-$"}


def diff_document(a: dict, b: dict, labels: tuple[str, str]) -> str:
    """The LaTeX document of what changes from the document ``a`` to the document ``b``
    (contexts printed in lines of :data:`COLUMN` characters)."""
    from . import BACKEND

    return BACKEND.render_template("diff.tex.jinja",
                                   dict(diff_context(a, b, labels), marks=MARKS))
