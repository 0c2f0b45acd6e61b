"""A config's derivation as a LaTeX document, in the order of the paper's appendix.

:func:`document_context` turns a :class:`~curvgap.derivations.derivation.Derivation` into
sections of numbered formulas, each in the engine's index form (always exact) and, where
:mod:`~curvgap.derivations.matrixform` recognises the structure, in the paper's matrix
form; the template ``templates/latex/document.tex.jinja`` lays them out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import sympy as sp

from ....derivations import matrixform as mf
from ....derivations.config import Config
from ....derivations.decomposition import decomposed_forms
from ....derivations.derivation import Derivation
from ....derivations.description import describe
from ....derivations.graph import Assign, Graph
from ....derivations.indexform import Index
from ....derivations.paper import WEIGHTS, BlockObjects
from ....derivations.program import Program
from ....derivations.softmax import RowSoftmax
from ..backend import Backend
from .names import program_names, size_hints, size_table
from .printer import LatexPrinter, Notation, ScalarPrinter, Symbol, tex_text, width

#: Printed width of one line of a display, in characters (article, 10pt, 2 cm margins).
LINE = 62


@dataclass
class Formula:
    lhs: str                      # index form, with indices
    index_lines: list[str]
    matrix_lhs: str
    matrix_lines: list[str] | None
    shape: str                    # e.g. "(L d) \times d_k"
    layout: str                   # which indices are rows and which are columns
    note: str = ""


@dataclass
class Block:
    title: str
    formulas: list[Formula] = field(default_factory=list)
    text: str = ""
    #: the symbols of the variables it derives along (``("W_{q}",)``; a pair for a
    #: second derivative or a Hessian block; ``("W_{q}", r"\ell")`` for the loss's tangents):
    #: how two documents' blocks are matched
    key: tuple[str, ...] = ()


@dataclass
class Section:
    title: str
    text: str
    blocks: list[Block] = field(default_factory=list)
    appendix: bool = False  # the derivations behind the statements
    #: which forms of each formula print: ``"both"``, ``"statement"`` (the matrix form where
    #: there is one) or ``"index"`` (the index forms of statements made elsewhere: not counted)
    forms: str = "both"

    @property
    def counts(self) -> tuple[int, int]:
        if self.forms == "index":
            return 0, 0
        formulas = [f for b in self.blocks for f in b.formulas]
        return sum(f.matrix_lines is not None for f in formulas), len(formulas)


def _lines(printer: LatexPrinter, expr, lhs: str, line: int = LINE) -> list[str]:
    """The right-hand side split into lines of ``line`` characters that fit beside ``lhs``."""
    return _pack(printer.chunks(expr), lhs, line)


def _function_lines(expr: sp.Expr, lhs: str) -> list[str]:
    """A scalar function's definition split between its terms."""
    terms = sp.Add.make_args(expr)
    chunks = []
    for n, term in enumerate(terms):
        text = ScalarPrinter().doprint(term)
        chunks.append([text if n == 0 or text.startswith("-") else f"+ {text}"])
    return _pack(chunks, lhs)


def _functions(functions: dict[str, sp.Expr]) -> list[tuple[str, list[str]]]:
    """The named elementwise functions' definitions, an inner function that several of them
    apply a function to (GELU's ``tanh`` and ``sech`` argument) named ``u`` once, first."""
    inner: dict[sp.Expr, sp.Symbol] = {}
    for expr in functions.values():
        for call in sorted(expr.atoms(sp.Function), key=sp.default_sort_key):
            argument = call.args[0] if call.args else None
            if (argument is not None and not argument.is_Atom and argument not in inner
                    and width(sp.latex(argument)) > 12):
                inner[argument] = sp.Symbol("u(x)" if not inner else f"u_{{{len(inner) + 1}}}(x)")
    lines = [(sp.latex(u), _function_lines(argument, sp.latex(u)))
             for argument, u in inner.items()]
    for name, expr in functions.items():
        reduced = expr.xreplace(inner) if inner else expr
        lines.append((rf"{name}(x)", _function_lines(reduced, rf"{name}(x)")))
    return lines


def _pack(chunks: list[list[str]], lhs: str, line: int = LINE) -> list[str]:
    budget = line - width(lhs) - 2
    lines, current = [], ""
    for term in chunks:
        for piece in term:
            candidate = f"{current} {piece}".strip()
            if current and width(candidate) > budget:
                lines.append(current)
                current, budget = piece, line - 6
            else:
                current = candidate
    lines.append(current)
    return lines


def _size_text(dims: Iterable[sp.Expr], notation: Notation, joint: str = " ") -> str:
    """The product of ``dims`` (``(L d)``; ``\\cdot`` between two numbers), or their list
    joined by ``joint``."""
    printed = [LatexPrinter(notation).doprint(d) for d in dims]
    if not printed:
        return "1"
    if joint != " ":
        return joint.join(printed)
    text = printed[0]
    for before, after in zip(printed, printed[1:], strict=False):
        text += (r" \cdot " if before[-1].isdigit() and after[0].isdigit() else " ") + after
    return f"({text})" if len(printed) > 1 else text


class Builder:
    """Formats the assignments of one graph (the derivation's or the paper objects')."""

    def __init__(self, graph: Graph, notation: Notation,
                 directions: dict[str, tuple[tuple[Index, ...], tuple[Index, ...]]],
                 printer: type[LatexPrinter] = LatexPrinter,
                 forms: dict[str, mf.MatExpr] | None = None, line: int = LINE) -> None:
        self.graph = graph
        self.line = line  # characters per printed line
        self.forms = forms or {}  # matrix forms stated otherwise, where no rule applies
        self.printer = printer
        self.notation = notation
        self.directions = directions
        self.layouts: dict[str, mf.Layout | None] = {}
        for assign in graph.assigns:
            first, second = directions.get(assign.group, ((), ()))
            self.layouts[assign.target.name] = mf.tensor_layout(assign.target.indices, first,
                                                                second)

    def matrix(self, assign: Assign) -> tuple[tuple, tuple, mf.MatExpr | None] | None:
        """The row and column indices of ``assign``'s target in the paper layout and its
        matrix form (``None`` where no rule applies); ``None`` for a tensor that is not a
        matrix."""
        layout = self.layouts.get(assign.target.name)
        if layout is None or assign.reduction is not None:
            return None
        indices = assign.target.indices
        rows, cols = (tuple(indices[k] for k in part) for part in layout)
        matrix = mf.to_matrix(assign.expr, rows, cols, self.layouts)
        form = self.forms.get(assign.target.name)
        if matrix is None and form is not None:
            shape = tuple(sp.Mul(*(i.dim for i in part)) for part in (rows, cols))
            matrix = (form if form.shape() == shape else  # a scalar's block: one row
                      mf.MatTranspose(form) if form.shape()[::-1] == shape else None)
        return rows, cols, matrix

    def formula(self, assign: Assign, matrix_lhs: str | None = None, note: str = "") -> Formula:
        target, expr = assign.target, assign.expr
        first, second = self.directions.get(assign.group, ((), ()))
        printer = self.printer(self.notation)
        role_rows = tuple(i for i in target.indices if i not in first and i not in second)
        printer.name_indices(expr, role_rows, first, second)
        symbol = self.notation(target.name)
        lhs = printer.doprint(target[target.indices].terms[0].factors[0])
        if assign.reduction == "max":
            source = expr.terms[0].factors[0]
            lhs_source = printer.doprint(source)
            lines = [rf"\max_{{{printer.index_name(source.indices[-1])}}} {lhs_source}"]
            return Formula(lhs, lines, symbol, None, _size_text(target.shape, self.notation),
                           "a constant shift (not differentiated)", note)
        if assign.reduction == "causal":
            i, j = (printer.index_name(k) for k in target.indices)
            lines = [rf"0 \text{{ if }} {j} \le {i}, \quad -\infty \text{{ if }} {j} > {i}"]
            return Formula(lhs, lines, symbol, None, _size_text(target.shape, self.notation),
                           "the causal mask (a constant)", note)
        if assign.reduction == "rotary":
            i, s_, t, m = (printer.index_name(k) for k in target.indices)
            kind = assign.scaling[0] if assign.scaling else "none"
            angle = (rf"{i}\, {assign.base:g}^{{-{m}/d_{{r}}}}" if kind == "none"
                     else rf"{i}\, \omega_{{{m}}}")
            lines = [rf"\cos({angle})\, \delta_{{{s_}{t}}} + \sin({angle})\, "
                     rf"\epsilon_{{{s_}{t}}}, \quad \epsilon = "
                     r"\begin{pmatrix} 0 & -1 \\ 1 & 0 \end{pmatrix}"]
            return Formula(lhs, lines, symbol, None, _size_text(target.shape, self.notation),
                           "the rotary rotations (a constant; the first two chunks of a head "
                           "turn, any others are the identity"
                           + ("" if kind == "none" else
                              f"; $\\omega_m$ the {kind} scaling's frequencies") + ")",
                           note)
        if assign.reduction == "relative":
            i, j, u = (printer.index_name(k) for k in target.indices)
            lines = [rf"\delta_{{{u}\, \operatorname{{bucket}}({j} - {i})}}"]
            return Formula(lhs, lines, symbol, None, _size_text(target.shape, self.notation),
                           "the relative-position buckets (a constant; T5's, up to "
                           f"distance {assign.relative[0]})", note)
        if assign.reduction in ("rows_mean", "rows_first", "rows_rest"):
            o, i = (printer.index_name(k) for k in target.indices)
            lines = [{"rows_mean": r"\frac{1}{L}", "rows_first": rf"\delta_{{{i} 0}}",
                      "rows_rest": rf"1 - \delta_{{{i} 0}}"}[assign.reduction]]
            return Formula(lhs, lines, symbol, None, _size_text(target.shape, self.notation),
                           "weights over the rows (a constant; $n_1 = 1$)", note)
        layout = self.matrix(assign)
        matrix = None
        if layout is not None:
            rows, cols, matrix = layout
            shape = (rf"{_size_text((i.dim for i in rows), self.notation)} \times "
                     rf"{_size_text((i.dim for i in cols), self.notation)}")
            described = (f"rows ${', '.join(printer.index_name(i) for i in rows)}$, " if rows
                         else "one row, ")
            described += (f"columns ${', '.join(printer.index_name(i) for i in cols)}$" if cols
                          else "one column")
        else:
            shape = _size_text((i.dim for i in target.indices), self.notation, r" \times ")
            described = "a tensor of order " + str(len(target.indices))
        matrix_lhs = matrix_lhs or symbol
        matrix_lines = None if matrix is None else _lines(printer, matrix, matrix_lhs, self.line)
        return Formula(lhs, _lines(printer, expr, lhs, self.line), matrix_lhs, matrix_lines,
                       shape, described, note)

    def blocks(self, assigns: list[Assign], titles: dict[str, str] | None = None
               ) -> list[Block]:
        """``assigns`` as blocks by sublayer, in order, merging runs of one sublayer."""
        out: list[Block] = []
        for assign in assigns:
            title = ((titles or {}).get(assign.target.name)
                     or tex_text(assign.sublayer) or "Parameters")
            if not out or out[-1].title != title:
                out.append(Block(title))
            out[-1].formulas.append(self.formula(assign))
        return out


def builder_for(der: Derivation, notation: Notation,
                printer: type[LatexPrinter] = LatexPrinter, line: int = LINE) -> Builder:
    """The builder of ``der``'s document, with the loss-Hessian blocks' decompositions."""
    return Builder(der.graph, notation, der.directions(), printer, decomposed_forms(der), line)


def _notation(der: Derivation, notation: Notation | None = None) -> Notation:
    """Symbols for every derived tensor of ``der``, from its groups, added to ``notation``
    (which holds the base symbols; default a new one)."""
    notation = notation or Notation()
    graph = der.graph
    forward = [a.target.name for a in graph.assigns if a.group in ("forward", "loss")]
    variables = [v.name for v in der.variables]
    for v in variables:
        sup = notation(v)
        for node in forward:
            notation.derived(f"d{node}_{v}", node, "dot", sup)
        notation.symbols[f"jacobian_{v}"] = rf"J_{{{sup}}}"
        notation.symbols[f"hvp_{v}"] = rf"(Hv)_{{{sup}}}"
        notation.symbols[f"v_{v}"] = rf"v_{{{sup}}}"
        for w in variables:
            both = f"{sup},{notation(w)}"
            for node in forward:
                notation.derived(f"d2{node}_{v}{w}", node, "ddot", both)
            notation.symbols[f"output_hessian_{v}_{w}"] = (
                rf"\frac{{\partial^2 Z}}{{\partial {sup}\,\partial {notation(w)}}}")
            notation.symbols[f"gauss_newton_{v}_{w}"] = rf"H^{{\mathrm{{GN}}}}_{{{both}}}"
            notation.symbols[f"functional_{v}_{w}"] = rf"H^{{\mathrm{{F}}}}_{{{both}}}"
    for assign in graph.assigns:
        if isinstance(assign.rule, RowSoftmax):
            _centred_notation(notation, assign.target.name, assign.rule.source, variables)
    for name in [*forward, *variables]:
        notation.derived(f"g_{name}", name, "bar", "")
        base = notation.base(name)
        for label in ("params", "X"):
            notation.derived(f"d{name}_v{label}", name, "dot", "v")
            notation.symbols[f"dg_{name}_v{label}"] = Symbol(  # the adjoint's tangent
                rf"\bar{{{base.head}}}", base.sub, ",".join(s for s in (base.sup, "v") if s),
                "dot").latex()
    return notation


def _centred_notation(notation: Notation, node: str, source: str, variables: list[str]) -> None:
    """Symbols of a softmax node's centred factors (a ring on the head): ``dc<A>_<v>`` the
    centred tangent of its argument, ``d2c<A>_<vw>`` the centred second tangent (``_2``,
    ``_3`` its further coefficient classes), ``gc_<A>`` the centred adjoint."""
    argument, output = notation.base(source), notation.base(node)

    def ring(accent: str, sup: str, part: int = 1) -> str:
        sub = ",".join(s for s in (argument.sub, str(part) if part > 1 else "") if s)
        return Symbol(rf"\{accent}{{{argument.head}}}", sub, sup, "mathring").latex()

    for v in variables:
        notation.symbols[f"dc{node}_{v}"] = ring("dot", notation(v))
        for w in variables:
            both = f"{notation(v)},{notation(w)}"
            for part in (1, 2, 3):
                suffix = "" if part == 1 else f"_{part}"
                notation.symbols[f"d2c{node}_{v}{w}{suffix}"] = ring("ddot", both, part)
    for label in ("params", "X"):
        notation.symbols[f"dc{node}_v{label}"] = ring("dot", "v")
        notation.symbols[f"dgc_{node}_v{label}"] = Symbol(
            rf"\dot{{\bar{{{output.head}}}}}", output.sub, "v", "mathring").latex()
    notation.symbols[f"gc_{node}"] = Symbol(rf"\bar{{{output.head}}}", output.sub, "",
                                            "mathring").latex()


NOTATION_TEXT = r"""
Matrices are vectorised row by row: $\operatorname{vec}_r(W)$ stacks the rows of $W$, so the
entry $W_{pq}$ of a $P \times Q$ matrix sits at position $pQ + q$. Derivatives use numerator
layout: $\partial N / \partial W := \partial \operatorname{vec}_r(N) / \partial
\operatorname{vec}_r(W)^{\top}$, and a second derivative $\partial^2 N / \partial W_i \partial
W_j$ is $\partial \operatorname{vec}_r(\partial N / \partial W_i) / \partial
\operatorname{vec}_r(W_j)^{\top}$, of shape $(n_N n_i) \times n_j$. $A \otimes B$ is the
Kronecker product, $K_{m,n}$ the commutation matrix ($K_{m,n} \operatorname{vec}(A) =
\operatorname{vec}(A^{\top})$ for $A \in \mathbb{R}^{m \times n}$), $A \circ B$ the
elementwise product, $\operatorname{diag}(u)$ the diagonal matrix of a vector,
$\mathbf{1}_n$ the all-ones vector and $I_n$ the identity. A scalar function written
of a matrix ($e^{T}$, $1/E$, $\theta(H)$) acts entry by entry.

\emph{Index form.} Every formula is first stated entry by entry, exactly as the engine
derived it: an index repeated on the right and absent on the left is summed (the sum is
written out), $\delta$ is the Kronecker delta. Row indices are $i, j, k, l$, the first
direction's $p, q$, the second direction's $r, t$, summed ones $a, b, c, e, f, g, h$.
\emph{Matrix form.} Where the engine recognises the structure (chains of matrix products,
Kronecker products with commutation matrices, products with a stored derivative) the same
formula follows in the paper's notation, as a matrix whose rows and columns are stated with
it; otherwise the index form stands alone, marked \emph{index form only}.

\emph{Derived symbols.} $\dot N^{W}$ is the engine's stored derivative of node $N$ along
$W$: its indices are $N$'s and $W$'s, except those a Kronecker delta or a broadcast
carries where it is used, so $\dot N^{W}$ is the Jacobian $\partial N / \partial W$ up to
such factors, which each formula shows. $\ddot N^{V,W}$ is the second derivative, $\bar N =
\partial \ell / \partial N$ the adjoint (the gradient of the per-sample loss),
$\dot N^{v}$ a directional derivative along $v$ (Hessian-vector products). A ring marks
a row centred by the softmax weights it feeds, $\mathring u = u - \langle A, u\rangle$
row by row (for $A = \operatorname{softmax}(T)$: $\dot A = A \circ \mathring{\dot T}$), the
form in which the softmax's derivatives are computed.
"""


def _symbol_table(der: Derivation, notation: Notation) -> list[tuple[str, ...]]:
    """Inputs, parameters, target, constants and the network's nodes, with their shapes
    (and, for a module's program, the name each has in the module or the program: what
    ``names=`` overrides)."""
    roles = {"input": "input", "param": "parameter", "target": "target",
             "constant": "constant", "node": "node"}
    network = {a.target.name for a in der.graph.assigns if a.group in ("forward", "loss")}
    program = der.config if isinstance(der.config, Program) else None
    sources = {p.name: p.source for p in program.params} if program else {}
    rows = []
    for tensor in der.graph.tensors.values():
        if tensor.name in network or tensor.role in ("input", "param", "target"):
            times = r" \times "
            shape = (f"${_size_text(tensor.shape, notation, times)}$" if tensor.shape
                     else "$1$ (a scalar)")
            row = (f"${notation(tensor.name)}$", shape, roles[tensor.role])
            if program:  # the key names= takes: the module's name, else the program's
                named = tensor.name in notation.bases and tensor.role != "input"
                code = sources.get(tensor.name) or tensor.name
                row += (rf"\texttt{{{tex_text(code)}}}" if named else "",)
            rows.append(row)
    return rows


def document_context(der: Derivation, backend: Backend,
                     attributes: Mapping[str, int] | None = None,
                     names: Mapping[str, str | int] | None = None, line: int = LINE) -> dict:
    """Everything the LaTeX template needs for ``der``: title, architecture, sections, each
    formula printed by ``backend``'s printer in lines of ``line`` characters. A program read
    from a module is written in its names (:mod:`.names`): ``attributes`` are the module's
    integer attributes (they name sizes), ``names`` the caller's own symbols."""
    notation = Notation()
    size_rows: list[tuple[str, int, str]] = []
    if isinstance(der.config, Program):
        bases, sizes = program_names(der.config, size_hints(attributes or {}), names or {})
        size_rows = size_table(der.config, sizes, attributes or {}, names or {})
        dims = der.config.dims()
        notation.bases.update(bases)
        for name, text in sizes.items():
            if text.isdigit():
                notation.values[dims[name]] = sp.Integer(int(text))
            else:
                notation.sizes[dims[name]] = text
    elif names:
        raise ValueError("names: a config's document is written in its own names; names= is "
                         f"for a module's, got {dict(names)!r}")
    _notation(der, notation)
    builder = builder_for(der, notation, backend.printer, line)
    # the statements first (the architecture, each Hessian block), then the appendix: the
    # derivatives they read, node by node
    statements = _loss_hessian(der, builder)
    statements.forms = "statement"
    sections = [_architecture(der, builder), statements]
    if (isinstance(der.config, Config) and der.config.kind == "block"
            and der.config.norm_position == "post"):
        sections.append(_paper_objects(der, notation, backend.printer))
    index_forms = Section("Loss Hessian in index form", "The blocks of the Loss Hessian "
                          "section entry by entry, as the engine contracts them.",
                          statements.blocks, forms="index")
    appendix = [index_forms, _first_derivatives(der, builder),
                _second_derivatives(der, builder), _gradient(der, builder),
                _hessian_vector_products(der, builder)]
    for section in appendix:
        section.appendix = True
    sections = [s for s in sections + appendix if s.blocks]
    title, description = describe(der.config)
    functions = _functions(notation.functions)
    program = isinstance(der.config, Program)
    return dict(
        name=der.config.name, heading=title if program else f"{der.config.name}: {title}",
        architecture=[] if program else description.split("\n"),
        notation=NOTATION_TEXT.strip(), symbols=_symbol_table(der, notation), sizes=size_rows,
        code_names=program, functions=functions,
        sections=sections, shares=[(s.title, *s.counts) for s in sections if s.forms != "index"],
        total=tuple(map(sum, zip(*(s.counts for s in sections)))))


def _architecture(der: Derivation, builder: Builder) -> Section:
    """The network's nodes and the loss's."""
    section = Section("Architecture", "The configured network and its loss, node by node "
                      "(per sample; the loss is averaged over the batch).")
    section.blocks = builder.blocks(der.graph.in_group("forward") + der.graph.in_group("loss"))
    return section


def _first_derivatives(der: Derivation, builder: Builder) -> Section:
    """Per variable: the tangents of the nodes, the output Jacobian, the loss tangents."""
    section = Section("First derivatives", r"For each variable $W$, the stored derivatives "
                      r"$\dot N^{W}$ of the nodes in forward order (the chain rule), then the "
                      r"output Jacobian $J_W = \partial Z / \partial W$ of shape "
                      r"$n_Z \times n_W$.")
    group = der.graph.in_group
    for v in (v.name for v in der.variables):
        block_list = builder.blocks(group(f"tangent_{v}"))
        block_list += builder.blocks(group(f"jacobian_{v}"),
                                     {f"jacobian_{v}": "Output Jacobian"})
        for block in block_list:
            block.key = (builder.notation(v),)
        loss = builder.blocks(group(f"loss_tangent_{v}"))
        for block in loss:  # the loss's tangents: not J_V's
            block.key = (builder.notation(v), r"\ell")
        for block in block_list + loss:
            block.title = f"${builder.notation(v)}$: {block.title}"
        section.blocks += block_list + loss
    return section


def _second_derivatives(der: Derivation, builder: Builder) -> Section:
    """Per pair of variables: the second derivatives of the nodes and the output Hessian."""
    section = Section("Second derivatives", r"For each pair $V \le W$ (in parameter order; "
                      r"the pair $W, V$ is the same tensor with its direction indices "
                      r"swapped), the stored second derivatives $\ddot N^{V,W}$ and the "
                      r"output's $\partial^2 Z / \partial V \partial W$ in the paper's layout "
                      r"$(L d\, n_V) \times n_W$.")
    variables = [v.name for v in der.variables]
    for n, v in enumerate(variables):
        for w in variables[n:]:
            block_list = builder.blocks(der.graph.in_group(f"second_{v}_{w}"),
                                        {f"output_hessian_{v}_{w}": "Output Hessian"})
            for block in block_list:
                block.title = (f"${builder.notation(v)}, {builder.notation(w)}$: "
                               f"{block.title}")
                block.key = (builder.notation(v), builder.notation(w))
            section.blocks += block_list
    return section


def _gradient(der: Derivation, builder: Builder) -> Section:
    """The adjoints of every node (reverse mode)."""
    section = Section("Gradient", r"Reverse mode: the adjoints $\bar N = \partial \ell / "
                      r"\partial N$ of the per-sample loss, from the loss back to the "
                      r"parameters and the input.")
    section.blocks = builder.blocks(der.graph.in_group("loss_adjoints")
                                    + der.graph.in_group("adjoints"))
    return section


def _loss_hessian(der: Derivation, builder: Builder) -> Section:
    """Each loss-Hessian block, as its Gauss–Newton and functional parts."""
    section = Section("Loss Hessian", r"Each block $H_{V,W} = H^{\mathrm{GN}}_{V,W} + "
                      r"H^{\mathrm{F}}_{V,W}$ of shape $n_V \times n_W$: the Gauss--Newton "
                      r"part $J_V^{\top} (\partial^2 \ell / \partial Z^2) J_W$ and the "
                      r"functional part $(\operatorname{vec}_r(\partial \ell / \partial "
                      r"Z)^{\top} \otimes I_{n_V}) \partial^2 Z / \partial V \partial W$, "
                      r"both contracted with the "
                      r"adjoints before expanding. Parameter blocks are averaged over the "
                      r"batch; the blocks in $X$ are per sample. The output Jacobians $J_V$ "
                      r"and second derivatives $\partial^2 Z / \partial V \partial W$ the "
                      r"statements read, and the stored derivatives $\dot N$, $\ddot N$ of "
                      r"their index forms, are derived node by node in the appendix.")
    if der.config.loss == "cross_entropy":
        section.text += (r" For the cross-entropy, $P$ is the rows' softmax and $w$ their "
                         r"weights (1, or 0 for a row whose target is ignored); its "
                         r"$\partial \ell / \partial Z$ and $\partial^2 \ell / \partial Z^2$ "
                         r"as stated hold for one-hot target rows, the targets curvgap takes.")
    for v, w in der.nodes("loss_hessian"):
        block = Block(f"${builder.notation(v)}, {builder.notation(w)}$",
                      key=(builder.notation(v), builder.notation(w)))
        for assign in der.graph.in_group(f"loss_hessian_{v}_{w}"):
            block.formulas.append(builder.formula(
                assign, note="per sample: the block is its mean over the batch"
                if assign.mean_over_batch else ""))
        section.blocks.append(block)
    return section


def _hessian_vector_products(der: Derivation, builder: Builder) -> Section:
    """Forward mode over the gradient, in the parameters and in the input."""
    section = Section("Hessian-vector products", r"Forward mode over the gradient: the "
                      r"directional derivatives $\dot N^{v}$ of every node and adjoint along "
                      r"the direction $v$, then $(Hv)_W = \dot{\bar W}^{v}$.")
    for label in ("params", "X"):
        section.blocks += builder.blocks(der.graph.in_group(f"hvp_{label}"))
    return section


def _paper_objects(der: Derivation, notation: Notation,
                   printer: type[LatexPrinter]) -> Section:
    """The named objects of Theorems 4-5 (post-LN block), with their derivations."""
    objects = BlockObjects(der.config)
    symbols = {"J_Z": "J_Z", "J_Y": "J_Y", "J_SY": "J_{SY}",
               **{f"G_{k}": f"G_{k}" for k in "QKV"}, **{f"B_{k}": f"B_{k}" for k in WEIGHTS},
               "H_Z": "H_Z"}
    section = Section(
        "The paper's named objects",
        r"Theorems 4--5 in the engine's terms: $J_Z = \partial Z / \partial S$, $H_Z = "
        r"\partial^2 Z / \partial S^2$, $J_Y = \partial Y / \partial (X + F)$, $J_{SY} = "
        r"\partial S / \partial Y$, $G_k = \partial F / \partial W_k$, $B_i = \partial S / "
        r"\partial W_i$ and $\xi_{ij} = \partial B_i / \partial W_j = \partial^2 S / "
        r"\partial W_i \partial W_j$, each derived by the same chain rule (the $\xi_{ij}$ "
        r"are the stored second derivatives $\ddot S^{W_i,W_j}$ of the second-derivatives "
        r"section). Theorem 5 assembles the output Hessian as $H_{\mathrm{tr}}^{(i,j)} = "
        r"(J_Z \otimes I_{n_i})\, \xi_{ij} + (I_{L d} \otimes B_i^{\top})\, H_Z\, B_j$; "
        r"the test suite checks this identity for every pair "
        r"(\texttt{tests/test\_paper\_block.py}).")
    directions: dict[str, tuple] = {}
    for name in symbols:
        obj = objects.get(name)
        wrt = obj.expr.free[len(objects.tensor(_of(name)).indices):]
        half = len(wrt) // 2 if name == "H_Z" else len(wrt)
        directions[f"object_{name}"] = (wrt[:half], wrt[half:])
        if name == "H_Z":
            directions["paper_S_S"] = directions["object_H_Z"]
        with objects.graph.group(f"object_{name}"):
            objects.graph.output(f"object_{name}", obj.expr)
        notation.symbols[f"object_{name}"] = symbols[name]
    for variable in ("S", "U", "Y", *WEIGHTS.values()):
        directions[f"paper_{variable}"] = (objects._first(variable).indices, ())
    for assign in objects.graph.assigns:
        node, group = assign.target.name, assign.group
        if group == "paper_S_S" and node.endswith("_paper_SS"):
            notation.derived(node, node[2:-len("_paper_SS")], "ddot", "S,S")
        elif group.startswith("paper_") and node.endswith(f"_{group}"):
            notation.derived(node, node[1:-len(group) - 1], "dot",
                             notation(group[len("paper_"):]))
    builder = Builder(objects.graph, notation, directions, printer)
    for name in symbols:
        block = Block(f"${symbols[name]}$")
        block.formulas = [builder.formula(a) for a in objects.graph.in_group(
            "paper_S_S" if name == "H_Z" else f"paper_{_wrt(name)}")]
        block.formulas += [builder.formula(a) for a in objects.graph.in_group(f"object_{name}")]
        section.blocks.append(block)
    return section


def _of(name: str) -> str:
    """The node a named object differentiates."""
    return {"J_Z": "Z", "H_Z": "Z", "J_Y": "Y", "J_SY": "S"}.get(name) or (
        "F" if name.startswith("G_") else "S")


def _wrt(name: str) -> str:
    """The variable a named object differentiates along."""
    return {"J_Z": "S", "H_Z": "S", "J_Y": "U", "J_SY": "Y"}.get(name) or WEIGHTS[name[2:]]
