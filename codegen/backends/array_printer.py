"""What the array backends' printers share: a SymPy ``Printer``, one ``_print_<Node>`` per
node type.

Scalar expressions (elementwise functions, coefficients in the sizes) print through
SymPy's Python code printer with the array module's functions; the statements of
:mod:`codegen.ir` print as one line of array code each. A backend's printer names its array
module and spells its axis arguments, permutations and transposes.
"""

from __future__ import annotations

import functools

import sympy as sp
from sympy.printing.pycode import PythonCodePrinter

from ...derivations.functions import PRINTABLE
from .. import calls, ir

#: Placeholders of an elementwise statement's names (no generated name contains them).
_RESULT, _ARGUMENT = "RESULTxPLACEHOLDER", "ARGUMENTxPLACEHOLDER"


class ArrayPrinter(PythonCodePrinter):
    """What numpy and torch code share; subclasses name the array module and spell its
    axis arguments, permutations and transposes."""

    module = ""
    axis_keyword = ""
    #: ``one_hot_input``: ``X`` holds the one-hot rows of token ids, so that its products
    #: print as gathers and scatters of rows (:meth:`_one_hot_product`)
    _default_settings = {**PythonCodePrinter._default_settings, "one_hot_input": False}

    # -- scalar expressions ---------------------------------------------------------
    def _call(self, function: str, expr: sp.Function) -> str:
        return f"{self.module}.{function}({', '.join(self._print(a) for a in expr.args)})"

    def _unsupported(self, expr: sp.Function) -> str:
        # SymPy's Python printer would fall back to the math module, which takes no arrays
        raise ValueError(f"no {self.module} code for the function {type(expr).__name__}; "
                         "the array functions printed are: "
                         + ", ".join(f.__name__ for f in PRINTABLE))

    def _constant(self, expr: sp.Expr) -> str:
        return repr(float(expr))

    def _print_Abs(self, expr: sp.Function) -> str:
        return self._call("abs", expr)

    def _print_Pow(self, expr: sp.Pow, rational: bool = False) -> str:
        if all(s.is_integer for s in expr.free_symbols):  # a coefficient in the sizes (ints)
            return f"{self.parenthesize(expr.base, 100)}**({self._print(expr.exp)})"
        return self._hprint_Pow(expr, rational=rational, sqrt=f"{self.module}.sqrt")

    def _print_erf(self, expr: sp.Function) -> str:
        return self._call("erf", expr)

    def _helper(self, expr: sp.Function) -> str:
        """A call of the module's own overflow-free helper ``_<name>``."""
        return f"_{type(expr).__name__}({self._print(expr.args[0])})"

    _print_sech = _print_sigmoid = _print_softplus = _helper

    def _print_Rational(self, expr: sp.Rational) -> str:
        return f"{expr.p}/{expr.q}"

    def _print_Float(self, expr: sp.Float) -> str:
        """A float read from a module (``0.044715``, ``finfo.min``) as the float it is."""
        return repr(float(expr))

    def _print_Half(self, expr: sp.Rational) -> str:
        return self._print_Rational(expr)

    # -- statements -----------------------------------------------------------------
    def statement(self, node: object) -> str:
        """One line of code for a statement of :mod:`codegen.ir`."""
        return self._print(node)

    def _print_Elementwise(self, node: ir.Elementwise) -> str:
        """``result = fn(argument)``, its repeated subexpressions (a ``tanh`` that a GELU's
        derivatives read four times) computed once (SymPy's ``cse``) and freed after."""
        text = self._elementwise_text(node.fn, node.variable)
        return text.replace(_RESULT, node.result).replace(_ARGUMENT, node.argument)

    @functools.cache  # noqa: B019 - one printer per module; its functions recur
    def _elementwise_text(self, fn: sp.Expr, variable: sp.Symbol) -> str:
        """The lines of an elementwise function, for the placeholder names below."""
        shared, (reduced,) = sp.cse(fn.subs(variable, sp.Symbol(_ARGUMENT)),
                                    symbols=sp.numbered_symbols(f"{_RESULT}_"))
        lines = [f"{s} = {self._print(e)}" for s, e in shared]
        lines.append(f"{_RESULT} = {self._print(reduced)}")
        if shared:
            lines.append(f"del {', '.join(str(s) for s, _ in shared)}")
        return "\n".join(lines)

    def _print_Contract(self, node: ir.Contract) -> str:
        gathered = self._one_hot_product(node)
        if gathered is not None:
            return f"{node.result} = {gathered}"
        call = calls.classify(node.spec)
        if node.row_major and call is None and len(node.operands) == 2:
            # the module's helper: a large result in slices, never held twice
            return (f'{node.result} = _row_major_einsum("{node.spec}", '
                    f'{", ".join(node.operands)})')
        value = self.contraction(call, node.spec, node.operands,
                                 node.result if node.into else None)
        if node.row_major and not isinstance(call, (calls.Matmul, calls.MergedMatmul)):
            value = self.row_major(value)  # a matmul's result is row-major already
        return f"{node.result} = {value}"

    def _one_hot_product(self, node: ir.Contract) -> str | None:
        """The product of ``X``, the one-hot rows of token ids ``(B, ..., V)``, with another
        operand, where the module's input is such rows: a gather of the operand's rows at the
        ids (``V`` summed, ``out = X's rows, the operand's other axes``) or a scatter of its
        rows into theirs (``V`` kept, the operand ``(X's rows, N...)``, ``out = (leading
        rows, V, N...)``); None for any other contraction (printed as it is)."""
        if (not self._settings["one_hot_input"] or len(node.operands) != 2
                or node.operands.count("X") != 1):
            return None
        specs, out = node.spec.split("->")
        k = node.operands.index("X")
        x, spec = specs.split(",")[k], specs.split(",")[1 - k]
        other, rows, v = node.operands[1 - k], x[:-1], x[-1]
        if v not in out and v in spec and not set(rows) & set(spec):
            rest = spec.replace(v, "")
            if out != rows + rest:
                return None
            if spec[0] != v:  # the rows of the operand along its vocabulary axis
                axes = (spec.index(v), *(a for a, c in enumerate(spec) if c != v))
                other = self.permuted(other, axes, copy=False)
            return f"_gather_rows(ns, {other})"
        if v in out and v not in spec:
            lead, rest = out[:out.index(v)], out[out.index(v) + 1:]
            if not rows.startswith(lead) or spec != rows + rest:
                return None
            into = f', "{node.result}"' if node.into else ""
            return f"_scatter_rows(ns, {other}, {len(lead)}{into})"
        return None

    def contraction(self, call: calls.Call | None, spec: str, x: tuple[str, ...],
                    into: str | None = None) -> str:
        """The einsum ``spec`` of ``x`` as ``call``, the direct call of :mod:`codegen.calls`
        that computes it, or (None) as an einsum; a matrix product of the result ``into``
        writes into the caller's array for it (``_matmul_into``), when the call has one."""
        if isinstance(call, calls.Sum):
            value = f"{x[0]}.sum({self.axis_keyword}={call.axes})"
        elif isinstance(call, calls.Permute):
            value = self.permuted(x[0], call.axes, copy=True)
        elif isinstance(call, calls.Product):
            value = " * ".join(name if index is None else self.broadcast(name, index)
                               for name, index in zip(x, call.indexes))
        elif isinstance(call, calls.ProductSum):
            value = f"({x[0]} * {x[1]}).sum({self.axis_keyword}={call.axes})"
        elif isinstance(call, calls.Matmul):
            left, right = x[call.left], x[call.right]
            value = self.product(self.transposed(left) if call.transpose_left else left,
                                 self.transposed(right) if call.transpose_right else right,
                                 into)
        elif isinstance(call, calls.MergedMatmul):
            value = self.merged_matmul(call, x, into)
        else:
            value = self.einsum(spec, x)
        return value

    @staticmethod
    def product(left: str, right: str, into: str | None) -> str:
        """``left @ right``; for the result ``into``, written into the caller's array."""
        if into is None:
            return f"{left} @ {right}"
        return f'_matmul_into(ns, "{into}", {left}, {right})'

    def merged_matmul(self, call: calls.MergedMatmul, x: tuple[str, ...],
                      into: str | None = None) -> str:
        """``call``'s operands reshaped to matrices (views of row-major arrays), their
        product, and that reshaped to the output's axes."""
        left, right = x[call.left], x[call.right]
        # the free run of each operand: its axes [start, stop), the other run its remaining ones
        m_axes = (call.k, call.k + call.m) if call.transpose_left else (0, call.m)
        n_axes = (0, call.n) if call.transpose_right else (call.k, call.k + call.n)
        matrices = []
        for name, (start, stop), transpose in ((left, m_axes, call.transpose_left),
                                               (right, n_axes, call.transpose_right)):
            size = " * ".join(f"{name}.shape[{i}]" for i in range(start, stop))
            shape = f"-1, {size}" if start else f"{size}, -1"
            matrix = f"{name}.reshape({shape})"
            matrices.append(self.transposed(matrix) if transpose else matrix)
        value = self.product(*matrices, into)
        if call.m == 1 and call.n == 1:
            return value
        return (f"({value}).reshape({left}.shape[{m_axes[0]}:{m_axes[1]}] + "
                f"{right}.shape[{n_axes[0]}:{n_axes[1]}])")

    def einsum(self, spec: str, operands: tuple[str, ...]) -> str:
        return f'{self.module}.einsum("{spec}", {", ".join(operands)})'

    @staticmethod
    def broadcast(name: str, keep: tuple[bool, ...]) -> str:
        """``name`` indexed with a new axis (None) wherever ``keep`` is False."""
        return f"{name}[{', '.join(':' if k else 'None' for k in keep)}]"

    def transposed(self, name: str) -> str:
        """``name`` with its last two axes swapped (a view)."""
        raise NotImplementedError

    def permuted(self, name: str, axes: tuple[int, ...], copy: bool) -> str:
        """``name`` with its axes in the order ``axes``: a row-major copy, or a view."""
        raise NotImplementedError

    def row_major(self, value: str) -> str:
        """``value`` laid out row-major (itself when it is already)."""
        raise NotImplementedError

    def _print_Zeros(self, node: ir.Zeros) -> str:
        shape = ", ".join(self._print(s) for s in node.shape)
        return f"{node.result} = _zeros(ns, ({shape}{',' if len(node.shape) == 1 else ''}))"

    def coefficient(self, coeff: sp.Expr) -> str:
        """``coeff`` as code; a negative one as the negation of its magnitude, so that
        ``a·x − a·y`` scales both sides by the same float (``-1/sqrt(d_k)`` and
        ``d_k**(-1/2)`` may differ in the last bit, which leaves ``x == y`` a residue)."""
        if coeff.could_extract_minus_sign():
            return f"-({self._print(-coeff)})"
        return self._print(coeff)

    def _scaled(self, value: str | None, coeff: sp.Expr) -> str:
        if value is None:
            return self.coefficient(coeff)
        if coeff == 1:
            return value
        if coeff == -1:
            return f"-{value}"
        return f"({self.coefficient(coeff)}) * {value}"

    def _print_Combine(self, node: ir.Combine) -> str:
        terms = []
        for part in node.parts:
            value = part.value
            if part.permute is not None:  # a view: the sum is a fresh array anyway
                value = self.permuted(value, calls.classify(part.permute).axes, copy=False)
            if part.broadcast is not None:
                value = self.broadcast(value, part.broadcast)
            terms.append(self._scaled(value, part.coeff))
        value = " + ".join(terms).replace("+ -", "- ")
        return f"{node.result} = {self.row_major(value) if node.row_major else value}"

    def _print_Free(self, node: ir.Free) -> str:
        return f"del {', '.join(node.names)}"

    def _print_Assign(self, node: ir.Assign) -> str:
        value = self._scaled(node.value, node.coeff)
        return f"{node.result} = {self.row_major(value) if node.row_major else value}"

    def _print_Scale(self, node: ir.Scale) -> str:
        return f"{node.target} *= {self.coefficient(node.coeff)}"

    def _print_Accumulate(self, node: ir.Accumulate) -> str:
        value = node.value
        if value is not None and node.broadcast is not None:
            value = self.broadcast(value, node.broadcast)
        target = node.target if node.tie is None else self.tied(node.target, node.tie)
        if value is not None and node.coeff == -1:
            return f"{self.in_place(target, node.tie)} -= {value}"
        return self.add_scaled(target, node.tie, value, node.coeff)

    def in_place(self, target: str, tie: str | None) -> str:
        """``target`` as the left side of an in-place operator (a tied view needs ``[...]``)."""
        return target if tie is None else f"{target}[...]"

    def add_scaled(self, target: str, tie: str | None, value: str | None,
                   coeff: sp.Expr) -> str:
        """``target += coeff * value`` in place."""
        return f"{self.in_place(target, tie)} += {self._scaled(value, coeff)}"

    def _print_CausalBias(self, node: ir.CausalBias) -> str:
        return f"{node.result} = _causal_bias(ns, {self._print(node.size)})"

    def _print_Rotary(self, node: ir.Rotary) -> str:
        return (f"{node.result} = _rotary(ns, {self._print(node.length)}, "
                f"{self._print(node.chunks)}, {self._print(node.half)}, {node.base!r}, "
                f"{node.scaling!r})")

    def _print_RelativeBuckets(self, node: ir.RelativeBuckets) -> str:
        return (f"{node.result} = _relative_buckets(ns, {self._print(node.length)}, "
                f"{self._print(node.buckets)}, {node.max_distance!r}, {node.bidirectional!r})")

    def _print_RowWeights(self, node: ir.RowWeights) -> str:
        return f"{node.result} = _row_weights(ns, {self._print(node.length)}, {node.kind!r})"

    def _print_Guard(self, node: ir.Guard) -> str:
        return (f"_guard(ns, {node.tensor}, {node.scale}, {node.argument!r}, "
                f"{node.message!r})")

    def tied(self, target: str, spec: str) -> str:
        raise NotImplementedError


#: Functions with the same name in numpy and torch, printed as ``module.name(...)``.
ARRAY_FUNCTIONS = ("exp", "log", "tanh", "cosh", "sinh", "cos", "sin", "tan", "sign")
# SymPy's Python printer maps known functions and constants to the math module; here the
# array functions go to the array module, constants become numbers, the rest is refused.
for _name in PythonCodePrinter._kf:
    if _name not in ("erf", "Abs"):  # printed by ArrayPrinter's own methods
        setattr(ArrayPrinter, f"_print_{_name}", ArrayPrinter._unsupported)
for _name in PythonCodePrinter._kc:
    setattr(ArrayPrinter, f"_print_{_name}", ArrayPrinter._constant)
for _name in ARRAY_FUNCTIONS:
    setattr(ArrayPrinter, f"_print_{_name}",
            lambda self, expr, _name=_name: self._call(_name, expr))
