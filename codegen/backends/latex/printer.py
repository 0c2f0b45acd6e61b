"""The LaTeX backend's printer: index-form expressions and matrix expressions as LaTeX.

One ``_print_<Node>`` per node type, as in SymPy's printers. Tensor names print through a
:class:`Notation` (``T_att`` as :math:`T_{\\mathrm{att}}`, the tangent ``dF_W_V`` as
:math:`\\dot F^{W_V}`, the adjoint ``g_A`` as :math:`\\bar A`); index names are chosen per
equation (rows ``i j k l``, first direction ``p q``, second direction ``r t``, summed
``a b c e f g h``). :meth:`LatexPrinter.chunks` splits an expression where a line may
break, for documents that must not overflow the page.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache

import sympy as sp
from sympy.printing.latex import LatexPrinter as SympyLatexPrinter
from sympy.printing.precedence import PRECEDENCE

from ....derivations import matrixform as mf
from ....derivations.functions import ScalarFn
from ....derivations.functions import x as fn_variable
from ....derivations.indexform import Apply, Delta, Expr, Index, Ref, Term

GREEK = {name: "\\" + name for name in (
    "alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
    "lambda", "mu", "nu", "xi", "pi", "rho", "sigma", "tau", "phi", "chi", "psi", "omega",
    "ell", "Gamma", "Delta", "Theta", "Lambda", "Xi", "Pi", "Sigma", "Phi", "Psi", "Omega")}
GREEK |= {"lam": r"\lambda", "eps": r"\epsilon"}
LETTERS = {"rows": "ijklmn", "first": "pqu", "second": "rtv", "summed": "abcefgh"}


@dataclass(frozen=True)
class Symbol:
    """A tensor's symbol: a head letter with a subscript, a superscript and a decoration
    (``dot``, ``ddot``, ``bar``) on the head."""

    head: str
    sub: str = ""
    sup: str = ""
    accent: str = ""

    def latex(self, extra_sub: str = "") -> str:
        head = f"\\{self.accent}{{{self.head}}}" if self.accent else self.head
        sub = ",".join(s for s in (self.sub, extra_sub) if s)
        return head + (f"_{{{sub}}}" if sub else "") + (f"^{{{self.sup}}}" if self.sup else "")


def base_symbol(name: str) -> Symbol:
    """``W_Q`` → ``W_Q``; ``T_att`` → ``T_{att}``; ``ln1_mu`` → ``μ^{(1)}``; ``gamma_1``
    → ``γ_1``."""
    sup = ""
    match = re.fullmatch(r"ln(\d)_(.*)", name)
    if match:
        sup, name = f"({match.group(1)})", match.group(2)
    head, _, sub = name.partition("_")
    head = GREEK.get(head, head if len(head) == 1 else rf"\mathrm{{{head}}}")
    if len(sub) > 1 and not sub.isdigit():
        sub = sub.replace("_", "")
        sub = r"\max" if sub == "max" else rf"\mathrm{{{sub}}}"
    return Symbol(head, sub, sup)


_TEXT_SPECIALS = {"\\": r"\textbackslash{}", "{": r"\{", "}": r"\}", "$": r"\$", "&": r"\&",
                  "#": r"\#", "^": r"\^{}", "_": r"\_", "%": r"\%", "~": r"\~{}"}


def tex_text(text: str) -> str:
    """``text`` (a module path, a name from the code) as LaTeX text, its special characters
    escaped."""
    return "".join(_TEXT_SPECIALS.get(char, char) for char in text)


#: Elementwise functions printed wider than this are named, and defined apart.
LONG_FUNCTION = 18


@dataclass
class Notation:
    """Display symbols for every tensor of a derivation (fallback: :func:`base_symbol`),
    and the elementwise functions too long to print inline (name → definition)."""

    symbols: dict[str, str] = field(default_factory=dict)
    functions: dict[str, sp.Expr] = field(default_factory=dict)
    #: base symbols chosen for tensors (a module's names), where :func:`base_symbol` would not do
    bases: dict[str, Symbol] = field(default_factory=dict)
    #: size symbols printed otherwise than their names (``n3`` as ``d_k``)
    sizes: dict[sp.Symbol, str] = field(default_factory=dict)
    #: size symbols printed as their numbers (``n2`` as ``2``: ``2 d d_k``, not ``d 2 d_k``)
    values: dict[sp.Symbol, sp.Integer] = field(default_factory=dict)

    def base(self, name: str) -> Symbol:
        """The base symbol of the tensor ``name``."""
        return self.bases.get(name) or base_symbol(name)

    def function(self, fn: ScalarFn) -> str | None:
        """The name under which ``fn`` prints, when its formula is too long to inline."""
        if _printed_width(fn.expr) <= LONG_FUNCTION:
            return None
        stem = fn.label.rstrip("'")
        base = rf"\operatorname{{{stem.replace('_', '-')}}}" + "'" * (len(fn.label) - len(stem))
        name, n = base, 1
        while self.functions.get(name, fn.expr) != fn.expr:
            n += 1
            name = f"{base}_{{{n}}}"
        self.functions[name] = fn.expr
        return name

    def __call__(self, name: str) -> str:
        return self.symbols.get(name) or self.base(name).latex()

    def derived(self, name: str, node: str, accent: str, sup: str) -> None:
        symbol = self.base(node)
        sup = ",".join(s for s in (symbol.sup, sup) if s)
        self.symbols[name] = Symbol(symbol.head, symbol.sub, sup, accent).latex()


@lru_cache(maxsize=512)
def _printed_width(expr: sp.Expr) -> int:
    """The printed width of a scalar function's formula (a document asks for each use)."""
    return width(sp.latex(expr))


def _decimal(r: sp.Expr) -> bool:
    """Whether ``r`` is a rational best written as a decimal: a denominator of 1000 or more
    whose expansion ends within eight digits (GELU's ``0.044715``, not ``1/1024``)."""
    return bool(r.is_Rational and r.q >= 1000 and (r * 10 ** 8).is_Integer)


def _decimal_text(r: sp.Rational) -> str:
    """A rational with a finite decimal expansion, written out (``0.044715``; a power of ten
    as one, ``10^{-5}``)."""
    if abs(r.p) == 1 and sp.log(r.q, 10).is_Integer:
        return f"{'-' if r < 0 else ''}10^{{-{sp.log(r.q, 10)}}}"
    digits = 0
    while (r * 10 ** digits).q != 1:
        digits += 1
    whole = abs(r.p) * 10 ** digits // r.q
    text = f"{whole // 10 ** digits}.{whole % 10 ** digits:0{digits}d}"
    return ("-" if r < 0 else "") + text


class ScalarPrinter(SympyLatexPrinter):
    """SymPy's LaTeX printer, with numbers as written: a float as its shortest decimal
    (``0.044715``) and so a rational that is a short decimal (``8943/200000``); a power of
    ten as one (``10^{-5}``, not ``1.0 \\cdot 10^{-5}``); a number that is an integer over a
    square root as such (``\\frac{1}{\\sqrt{3}}``, the scale of attention scores, not SymPy's
    rationalised ``\\frac{\\sqrt{3}}{3}``)."""

    def _print_Rational(self, expr: sp.Rational) -> str:
        return _decimal_text(expr) if _decimal(expr) else super()._print_Rational(expr)

    def _print_Mul(self, expr: sp.Expr) -> str:
        rational, rest = expr.as_coeff_Mul()
        if _decimal(rational):  # 0.044715 x^3, not \frac{8943 x^{3}}{200000}
            return f"{_decimal_text(rational)} {self.parenthesize(rest, PRECEDENCE['Mul'])}"
        if (expr.is_number and rational.is_Rational and rational.q > 1 and rest.is_Pow
                and rest.base.is_Integer and rest.exp == sp.S.Half
                and (rational * rest.base).is_Integer):
            numerator = rational * rest.base  # r √n = (r n) / √n
            sign = "-" if numerator < 0 else ""
            return rf"{sign}\frac{{{abs(numerator)}}}{{\sqrt{{{rest.base}}}}}"
        return super()._print_Mul(expr)

    def _print_Float(self, expr: sp.Float) -> str:
        text = repr(float(expr))
        mantissa, _, exponent = text.partition("e")
        if not exponent:
            return text
        mantissa = mantissa.removesuffix(".0")
        power = f"10^{{{int(exponent)}}}"
        return power if mantissa == "1" else (
            f"-{power}" if mantissa == "-1" else rf"{mantissa} \cdot {power}")


class LatexPrinter(ScalarPrinter):
    """SymPy's LaTeX printer extended with the engine's index-form and matrix nodes."""

    def __init__(self, notation: Notation | None = None,
                 letters: dict[Index, str] | None = None) -> None:
        self.notation = notation or Notation()
        super().__init__({"mul_symbol": None, "symbol_names": self.notation.sizes})
        self.letters = dict(letters or {})

    def doprint(self, expr: object) -> str:
        """``expr`` printed, the sizes known by number replaced by their numbers first."""
        if isinstance(expr, sp.Basic) and self.notation.values:
            expr = expr.xreplace(self.notation.values)
        return super().doprint(expr)

    # -- indices -------------------------------------------------------------------
    def name_indices(self, expr: Expr, rows: tuple[Index, ...] = (),
                     first: tuple[Index, ...] = (), second: tuple[Index, ...] = ()) -> None:
        """Choose letters for ``expr``'s free indices by role and for its summed ones."""
        self.letters = {}
        roles = (("second", second), ("first", first), ("rows", rows))
        used: set[str] = set()
        for index in expr.free or ():
            role = next((r for r, group in roles if index in group), "rows")
            self.letters[index] = self._letter(role, used)
        summed = dict.fromkeys(i for t in expr.terms for i in t.indices()
                               if i not in self.letters)
        for index in summed:
            self.letters[index] = self._letter("summed", used)

    @staticmethod
    def _letter(role: str, used: set[str]) -> str:
        for n in range(100):
            for letter in LETTERS[role]:
                name = letter if n == 0 else f"{letter}_{{{n}}}"
                if name not in used:
                    used.add(name)
                    return name
        raise AssertionError("ran out of index letters")

    def index_name(self, index: Index) -> str:
        return self.letters.get(index, index.name.lstrip("_"))

    def _indices(self, indices: tuple[Index, ...]) -> str:
        names = [self.index_name(i) for i in indices]
        return "".join(names) if all(len(n) == 1 for n in names) else ",".join(names)

    # -- index form ------------------------------------------------------------------
    def _print_Ref(self, factor: Ref) -> str:
        symbol = self.notation(factor.name)
        if not factor.indices:
            return symbol
        indices = self._indices(factor.indices)
        if "_" not in _outer(symbol):  # a letter, perhaps with a superscript
            return f"{symbol}_{{{indices}}}"
        if r"\frac" in symbol:
            return rf"\left[{symbol}\right]_{{{indices}}}"
        return f"[{symbol}]_{{{indices}}}"

    def _print_Apply(self, factor: Apply) -> str:
        return self._applied(factor.fn, self._print_Ref(Ref(factor.name, factor.indices)))

    def _applied(self, fn: ScalarFn, argument: str) -> str:
        """``fn`` of the printed ``argument``: inline, or by name when long."""
        name = self.notation.function(fn)
        if name is not None:
            return rf"{name}\left({argument}\right)"
        symbol = sp.Symbol("ARG")
        body = fn.expr.subs(fn_variable, symbol)
        text = ScalarPrinter({"symbol_names": {symbol: argument}}).doprint(body)
        # a factor of a product: a sum or a leading minus sign would read as a new term
        if body.is_Add or body.could_extract_minus_sign():
            return rf"\left({text}\right)"
        return text

    def _print_Delta(self, factor: Delta) -> str:
        return rf"\delta_{{{self._indices(factor.indices)}}}"

    def _coefficient(self, coeff: sp.Expr, first: bool) -> str:
        """The sign and coefficient that lead a term (``""`` for 1)."""
        sign = "-" if coeff.could_extract_minus_sign() else "+"
        magnitude = -coeff if sign == "-" else coeff
        text = "" if magnitude == 1 else self.doprint(magnitude) + " "
        if first:
            return ("-" if sign == "-" else "") + text
        return f"{sign} {text}"

    def term_chunks(self, term: Term, free: tuple[Index, ...], first: bool) -> list[str]:
        """A term as pieces between which a line may break: the sign, coefficient and sum,
        then one piece per factor."""
        summed = [i for i in term.indices() if i not in free]
        head = self._coefficient(term.coeff, first)
        if summed:
            head += rf"\sum_{{{self._indices(tuple(summed))}}} "
        factors = [self._print(f) for f in term.factors] or ["1"]
        return [head + factors[0], *factors[1:]]

    def chunks(self, expr: Expr | mf.MatExpr) -> list[list[str]]:
        """``expr`` as terms, each a list of pieces that may be split across lines."""
        if isinstance(expr, Expr):
            if expr.is_zero:
                return [["0"]]
            return [self.term_chunks(t, expr.free, n == 0) for n, t in enumerate(expr.terms)]
        terms = expr.args if isinstance(expr, mf.MatSum) else (expr,)
        out = []
        for n, term in enumerate(terms):
            coeff, body = ((term.coeff, term.arg) if isinstance(term, mf.MatScaled)
                           else (sp.Integer(1), term))
            pieces = self._factors(body)
            out.append([self._coefficient(coeff, n == 0) + pieces[0], *pieces[1:]])
        return out

    def _factors(self, body: mf.MatExpr) -> list[str]:
        """A matrix term as pieces: the factors of a product, the operands of ``∘``."""
        if isinstance(body, mf.MatProduct):
            return [self._wrap(a, body) for a in body.args]
        if isinstance(body, mf.MatHadamard):
            pieces = [self._wrap(a, body) for a in body.args]
            return [p + r" \circ" for p in pieces[:-1]] + pieces[-1:]
        return [self._print(body)]

    def _print_Expr(self, expr) -> str:
        if not isinstance(expr, Expr):
            return super()._print_Basic(expr)
        return " ".join(piece for term in self.chunks(expr) for piece in term)

    # -- matrix form --------------------------------------------------------------------
    def _wrap(self, arg: mf.MatExpr, parent: mf.MatExpr) -> str:
        text = self._print(arg)
        loose = (mf.MatSum, mf.MatScaled, mf.MatKron, mf.MatHadamard)
        tight = isinstance(parent, (mf.MatTranspose, mf.MatKron, mf.MatHadamard))
        if isinstance(arg, loose) or (tight and isinstance(arg, mf.MatProduct)):
            return rf"\left({text}\right)"
        return text

    def _print_MatLeaf(self, node: mf.MatLeaf) -> str:
        symbol = self.notation(node.factor.name)
        if isinstance(node.factor, Apply):
            return self._applied(node.factor.fn, symbol)
        return symbol

    def _print_MatIdentity(self, node: mf.MatIdentity) -> str:
        return rf"I_{{{self.doprint(node.dim)}}}"

    def _print_MatOnes(self, node: mf.MatOnes) -> str:
        return rf"\mathbf{{1}}_{{{self.doprint(node.dim)}}}"

    def _print_MatZero(self, node: mf.MatZero) -> str:
        return "0"

    def _print_MatCommutation(self, node: mf.MatCommutation) -> str:
        return rf"K_{{{self.doprint(node.m)},{self.doprint(node.n)}}}"

    def _print_MatTranspose(self, node: mf.MatTranspose) -> str:
        inner = self._wrap(node.arg, node)
        if "^" in inner and not inner.startswith(r"\left("):
            inner = rf"\left({inner}\right)"
        return rf"{inner}^{{\top}}"

    def _print_MatDiag(self, node: mf.MatDiag) -> str:
        return rf"\operatorname{{diag}}\left({_unwrapped(self._print(node.arg))}\right)"

    def _print_MatVec(self, node: mf.MatVec) -> str:
        text = rf"\operatorname{{vec}}_r\left({self._print(node.arg)}\right)"
        return text + r"^{\top}" if node.row else text

    def _print_MatProduct(self, node: mf.MatProduct) -> str:
        return " ".join(self._wrap(a, node) for a in node.args)

    def _print_MatHadamard(self, node: mf.MatHadamard) -> str:
        return r" \circ ".join(self._wrap(a, node) for a in node.args)

    def _print_MatKron(self, node: mf.MatKron) -> str:
        scalars = [a for a in node.args if a.shape() == (1, 1)]
        rest = [a for a in node.args if a.shape() != (1, 1)]
        text = r" \otimes ".join(self._wrap(a, node) for a in rest)
        if scalars:
            text = " ".join(rf"\left({self._print(a)}\right)" for a in scalars) + (
                rf" \left({text}\right)" if len(rest) > 1 else f" {text}")
        return text

    def _print_MatScaled(self, node: mf.MatScaled) -> str:
        return " ".join(" ".join(t) for t in self.chunks(node))

    def _print_MatSum(self, node: mf.MatSum) -> str:
        return " ".join(piece for term in self.chunks(node) for piece in term)


def _outer(text: str) -> str:
    """``text`` without what its braces enclose."""
    depth, out = 0, []
    for char in text:
        depth += (char == "{") - (char == "}")
        if depth == 0 and char != "}":
            out.append(char)
    return "".join(out)


def latex(expr: Expr | mf.MatExpr | Term, notation: Notation | None = None) -> str:
    """LaTeX for an index-form expression (free indices named by position) or a matrix
    expression."""
    printer = LatexPrinter(notation)
    if isinstance(expr, Term):
        expr = Expr([expr], tuple(dict.fromkeys(expr.indices())))
    if isinstance(expr, Expr):
        printer.name_indices(expr)
    return printer.doprint(expr)


def _unwrapped(text: str) -> str:
    """``text`` without one pair of ``\\left( … \\right)`` around all of it (the
    parentheses a negative factor gets, redundant inside ``diag(…)``)."""
    if not (text.startswith(r"\left(") and text.endswith(r"\right)")):
        return text
    depth = 0
    for match in re.finditer(r"\\left|\\right", text[:-len(r"\right)")]):
        depth += 1 if match.group() == r"\left" else -1
        if depth == 0:  # the first \left( closes before the end
            return text
    return text[len(r"\left("):-len(r"\right)")]


def width(text: str) -> float:
    """A rough printed width of a LaTeX snippet, in characters of normal size."""
    text = re.sub(r"\\(left|right|operatorname|mathrm|mathbf|top)\b", "", text)
    text = re.sub(r"\\[a-zA-Z]+", "x", text)
    scripts = sum(len(m) for m in re.findall(r"[_^]\{([^{}]*)\}", text))
    plain = len(re.sub(r"[{}_^\s]", "", text))
    return plain - 0.4 * scripts
