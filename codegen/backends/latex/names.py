"""The symbols of a program read from a module: its parameters, sizes and intermediates by
what the module calls them and what they compute, as a researcher would write them.

* **Parameters** by the module's names: a linear map ``q_proj.weight`` is :math:`W_q` and its
  bias :math:`b_q`, a norm's weight and bias :math:`\\gamma` and :math:`\\beta`, an attribute
  ``lam`` :math:`\\lambda`, ``W_q`` :math:`W_q`, ``gate`` :math:`\\mathrm{gate}`.
* **Sizes** by what they are: ``L`` and ``d`` for the input's, then the module's own
  attributes (``num_heads`` → :math:`h`, ``head_dim`` or ``d_k`` → :math:`d_k`,
  ``intermediate_size`` → :math:`d_{ff}`; any short integer attribute by its name); a size
  no attribute names prints as its number.
* **Intermediates** by what they compute: a linear map's output :math:`Q` (of ``q``),
  a chunk of it :math:`Q_1`, the attention map :math:`A = \\operatorname{softmax}(S)`, a
  norm's mean :math:`\\mu`, centred input :math:`C`, variance, reciprocal root :math:`r`,
  normalised rows :math:`N` and output :math:`Y`, the output :math:`Z`; anything else takes
  the next free letter.

``names`` overrides any of them: a tensor by the module's name for it (``"q.weight"``) or
the program's (as the document's symbol table lists them), a size by its symbol and value
(``{"d_k": 3}``).
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from collections.abc import Iterator, Mapping

from ....derivations.program import Program
from .printer import Symbol, base_symbol, tex_text

#: The module attributes that name a size, by the symbol they print as.
SIZE_ATTRIBUTES = {
    "h": ("num_heads", "n_head", "n_heads", "num_attention_heads", "nhead", "heads"),
    "h_{kv}": ("num_key_value_heads", "n_kv_heads", "num_kv_heads"),
    "d_k": ("head_dim", "d_k", "d_head", "head_size", "attention_head_size", "dim_head"),
    "d_{ff}": ("intermediate_size", "n_inner", "d_ff", "dim_feedforward", "ffn_dim",
               "mlp_dim", "hidden_features"),
    "d": ("hidden_size", "embed_dim", "d_model", "n_embd", "embed_dim"),
    # not V: that is the attention's values
    r"n_{\mathrm{vocab}}": ("vocab_size", "num_embeddings"),
}
_SHORT_SIZE = re.compile(r"[A-Za-z](_[A-Za-z0-9]{1,3})?")
#: Operations that pick a slice of one tensor.
_SELECTIONS = {"chunk", "split", "split_with_sizes", "unbind", "getitem", "select", "slice",
               "narrow", "unsafe_split"}
_LINEAR = {"linear", "addmm", "mm", "conv1d", "conv2d"}
_NORM = re.compile(r"(layer_norm|rms_norm|group_norm|batch_norm|native_layer_norm)"
                   r"(?:_(mean|centred|var|ms|rsqrt|normalised))?(?:_\d+)?")
_NORM_PARTS = {"mean": r"\mu", "centred": "C", "var": r"\mathrm{var}", "ms": r"\mathrm{ms}",
               "rsqrt": "r", "normalised": "N", None: "Y"}
_SOFTMAX_PARTS = {"T_max": r"\max", "T_shift": r"\mathrm{shift}", "T_mask": r"\mathrm{mask}",
                  "T_masked": r"\mathrm{masked}", "E_sum": r"\mathrm{sum}"}
_CONSTANTS = {"select": "e", "causal": "M", "shift": "P", "border": "B"}
#: Letters free for intermediates no rule names (X, Z, T, D, L, I, H, J, K, A, S, E, Q, V,
#: W, Y, C, N and the like have meanings in the documents; a letter a rule also gives is
#: told apart by a subscript).
_FREE_LETTERS = "MPRBFGO"
#: Symbols the document gives to what is not the program's (the target, the loss's residual
#: and value, the Jacobians' letter, π); ``X`` and ``Z`` only the input and the output.
RESERVED = frozenset({"X", "Z", "T", "D", r"\ell", "J", r"\pi"})


def size_hints(attributes: Mapping[str, int]) -> dict[str, int]:
    """The size symbols a module's integer ``attributes`` (name → value) suggest: the
    conventional names of :data:`SIZE_ATTRIBUTES`, and any other short name (``d_k``, ``h``)
    as written."""
    hints = {}
    for attribute, value in attributes.items():
        symbol = next((s for s, names in SIZE_ATTRIBUTES.items() if attribute in names), None)
        if symbol is None and _SHORT_SIZE.fullmatch(attribute):
            head, _, sub = attribute.partition("_")
            symbol = f"{head}_{{{sub}}}" if len(sub) > 1 else attribute
        if symbol is not None:
            hints.setdefault(symbol, value)
    return hints


def size_symbols(program: Program, hints: Mapping[str, int],
                 chosen: Mapping[str, int] | None = None) -> dict[str, str]:
    """Each of the program's sizes as LaTeX: its own name for the input's (``L``, ``d``), the
    one symbol its value is ``chosen`` or hinted as, else its number. A symbol of the input's
    own (``d``) names no other size of another value."""
    sizes, chosen = dict(program.sizes), dict(chosen or {})
    by_value: dict[int, set[str]] = {}
    for symbol, value in hints.items():
        by_value.setdefault(value, set()).add(symbol)
    for value in set(chosen.values()):
        by_value[value] = {s for s, v in chosen.items() if v == value}
    own = {a for dim in program.X.shape for a in dim}
    own_values = {_size_name(n): sizes.get(n) for n in own}
    out = {}
    for name, value in program.sizes:
        if value is None or name in own or not re.fullmatch(r"n\d+(_\d+)?", name):
            out[name] = _size_name(name)
            continue
        candidates = {s for s in by_value.get(value, ()) if own_values.get(s, value) == value}
        if value not in chosen.values():
            candidates |= {_size_name(n) for n in own if sizes.get(n) == value}
        out[name] = candidates.pop() if len(candidates) == 1 else str(value)
    return out


def size_table(program: Program, symbols: Mapping[str, str], attributes: Mapping[str, int],
               names: Mapping[str, str | int]) -> list[tuple[str, int, str]]:
    """The sizes a document names by a symbol (``symbols``: size name → LaTeX, from
    :func:`size_symbols`), each as (symbol, value, where the name comes from: the input's
    shape, ``names=`` or the module's attributes of that value)."""
    own = {a for dim in program.X.shape for a in dim}
    chosen = {_as_symbol(k, "names").latex(): k for k, v in names.items() if isinstance(v, int)
              and not isinstance(v, bool)}
    rows = {}
    for name, value in program.sizes:
        symbol = symbols.get(name, "")
        if value is None or symbol.isdigit() or symbol in rows:
            continue
        if name in own or symbol in {_size_name(n) for n in own}:
            where = "the input's shape"
        elif _as_symbol(symbol, "size").latex() in chosen:
            where = r"\texttt{names=}"
        else:
            found = [a for a, v in attributes.items() if v == value and _as_symbol(
                symbol, "size").latex() in {_as_symbol(h, "size").latex()
                                            for h in size_hints({a: v})}]
            where = ", ".join(rf"\texttt{{{tex_text(a)}}}" for a in found)
        rows[symbol] = (f"${symbol}$", value, where)
    return list(rows.values())


def _size_name(name: str) -> str:
    """A size's own name as LaTeX (``d_k`` for ``dk`` or ``d_k``)."""
    return name if len(name) == 1 else f"{name[0]}_{{{name[1:].lstrip('_')}}}"


def _short(path: str) -> str:
    """A submodule's name as a subscript: its last part without ``c_`` and ``_proj``."""
    parts = [p for p in path.split(".") if p]
    if not parts:
        return ""
    if parts[-1].isdigit() and len(parts) > 1:  # a place in a Sequential: f.0 → f0
        return _short(".".join(parts[:-1])) + parts[-1]
    short = re.sub(r"^c_|_proj$|^proj_", "", parts[-1])
    return short if short else parts[-1]


def _subscript(text: str) -> str:
    """A name as a subscript: one letter or a number as it is, a word upright; only its
    letters and digits (a ``ModuleDict`` key may hold anything)."""
    text = re.sub(r"[^A-Za-z0-9]", "", text)
    return text if len(text) <= 1 or text.isdigit() else rf"\mathrm{{{text}}}"


def tensor_symbols(program: Program) -> dict[str, Symbol]:
    """Each parameter, constant and operation output of ``program`` as a :class:`Symbol`
    (see the module docstring)."""
    symbols: dict[str, Symbol] = {program.X.name: Symbol("X")}
    readers: dict[str, str] = {}
    for op in program.ops:
        for term in op.terms:
            for operand in term.operands:
                readers.setdefault(operand.name, op.what)
    for param in program.params:
        symbols[param.name] = _parameter(param.source or param.name, readers.get(param.name, ""))
    symbols = _distinct(symbols, program)
    symbols.update(_operations(program, symbols))
    return _distinct(symbols, program)


def _parameter(source: str, what: str) -> Symbol:
    """A parameter by its name in the module and what reads it."""
    path, _, attribute = source.rpartition(".")
    norm = _NORM.fullmatch(what) is not None
    for kind, letters in (("weight", ("W", r"\gamma")), ("bias", ("b", r"\beta"))):
        if attribute == kind or attribute.endswith(f"_{kind}"):
            owner = path if attribute == kind else f"{path}.{attribute[:-len(kind) - 1]}"
            return Symbol(letters[norm], _subscript(_short(owner)))
    return base_symbol(attribute)


def _operations(program: Program, symbols: dict[str, Symbol]) -> dict[str, Symbol]:
    """The operations' outputs, in order (see the module docstring)."""
    out: dict[str, Symbol] = {}
    softmaxes = [op for op in program.ops if op.kind == "softmax"]
    norms = list(dict.fromkeys(op.path for op in program.ops if _NORM.fullmatch(op.out)))
    selections: dict[str, int] = {}
    free = _free_symbols()
    for op in program.ops:
        operands = [o.name for t in op.terms for o in t.operands]
        if op.out == program.output.name:
            out[op.out] = Symbol("Z")
        elif op.kind == "softmax":
            k = softmaxes.index(op) + 1
            sub = str(k) if len(softmaxes) > 1 else ""
            out[op.out] = Symbol("A", sub)
            if op.source.name not in symbols:  # a computed argument, not X or a parameter
                out[op.source.name] = Symbol("S", sub)
            out[f"{op.out}_E"] = Symbol("E", sub)
            for part, text in _SOFTMAX_PARTS.items():
                head = "E" if part.startswith("E") else "S"
                out[f"{op.out}_{part}"] = Symbol(head, ",".join(s for s in (sub, text) if s))
        elif op.out in out:  # a softmax's argument, named with it
            continue
        elif (match := _NORM.fullmatch(op.out)) and op.path in norms:
            sup = f"({norms.index(op.path) + 1})" if len(norms) > 1 else ""
            out[op.out] = Symbol(_NORM_PARTS[match.group(2)], "", sup)
        elif op.what in _LINEAR and any(_is_param(program, n) for n in operands):
            weight = symbols[next(n for n in operands if _is_param(program, n))]
            out[op.out] = (Symbol(weight.sub.upper()) if len(weight.sub) == 1
                           and weight.sub.isalpha() else Symbol("Y", weight.sub))
        elif op.what in _SELECTIONS and op.kind == "einsum" and len(op.terms) == 1:
            source = next((n for n in operands if n in out), None)
            selector = next((n for n in operands if n.startswith("c_select")), None)
            if source is None or selector is None:
                out[op.out] = next(free)
                continue
            selections[source] = selections.get(source, 0) + 1
            m = selections[source]
            base = out[source]
            out[op.out] = Symbol(base.head, ",".join(s for s in (base.sub, str(m)) if s),
                                 base.sup)
            out[selector] = Symbol("e", str(m))
        else:
            out[op.out] = next(free)
    _qkv(program, out)
    for constant in program.constants:
        if constant.name not in out:
            kind = re.sub(r"^c_|_\d+$", "", constant.name)
            out[constant.name] = (Symbol(_CONSTANTS[kind]) if kind in _CONSTANTS
                                  else base_symbol(kind))
    return out


def _is_param(program: Program, name: str) -> bool:
    """Whether ``name`` is one of the program's parameters."""
    return any(p.name == name for p in program.params)


def _free_symbols() -> Iterator[Symbol]:
    """The symbols of intermediates no rule names: the free letters, then ``U_1``, ``U_2``…"""
    yield from (Symbol(letter) for letter in _FREE_LETTERS)
    yield from (Symbol("U", str(k)) for k in itertools.count(1))


def _qkv(program: Program, out: dict[str, Symbol]) -> None:
    """A fused projection split in three (``c_attn``, ``qkv``, ``in_proj``): its parts are
    ``Q``, ``K`` and ``V``."""
    fused = {op.out for op in program.ops
             if op.what in _LINEAR and re.search(r"attn|qkv|in_proj|query_key_value",
                                                 op.path + op.out)}
    for name in fused:
        parts = [op.out for op in program.ops if op.what in _SELECTIONS
                 and name in [o.name for t in op.terms for o in t.operands]]
        if len(parts) == 3:
            for part, letter in zip(parts, "QKV", strict=True):
                out[part] = Symbol(letter)


def _distinct(symbols: dict[str, Symbol], program: Program) -> dict[str, Symbol]:
    """Tensors that would print alike, or as a symbol of :data:`RESERVED`, told apart by their
    submodule or else a number, until every symbol is one tensor's; selections of equal size
    may share theirs (``e_1`` is ``e_1``)."""
    paths = {op.out: op.path for op in program.ops}
    paths |= {p.name: p.source.rpartition(".")[0] for p in program.params}
    own = {program.X.name, program.output.name}
    counts = Counter(symbol.latex() for name, symbol in symbols.items()
                     if not name.startswith("c_select"))
    used = set(RESERVED) | {symbol.latex() for name, symbol in symbols.items()
                            if counts[symbol.latex()] == 1 and symbol.latex() not in RESERVED}
    out = dict(symbols)
    for name, symbol in symbols.items():
        latex = symbol.latex()
        if name.startswith("c_select") or name in own or (
                counts[latex] == 1 and latex not in RESERVED):
            continue
        parent = _subscript(_short(paths.get(name, "").rpartition(".")[0]))
        extras = ([parent] if parent else []) + [str(k) for k in range(1, len(symbols) + 2)]
        for extra in extras:
            candidate = Symbol(symbol.head, ",".join(s for s in (extra, symbol.sub) if s),
                               symbol.sup, symbol.accent)
            if candidate.latex() not in used:
                out[name] = candidate
                used.add(candidate.latex())
                break
    return out


def program_names(program: Program, hints: Mapping[str, int],
                  names: Mapping[str, str | int]) -> tuple[dict[str, Symbol], dict[str, str]]:
    """The program's tensor symbols and size symbols (LaTeX), with ``names`` applied: a
    string for a tensor (by the module's name or the program's), an integer for a size
    (``{"d_k": 3}``: the size 3 prints as ``d_k``). Two tensors never share a symbol."""
    sources = {p.source: p.name for p in program.params if p.source}
    symbols = tensor_symbols(program)
    sizes: dict[str, int] = {}
    chosen: dict[str, str] = {}
    for key, value in names.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"names: expected names as strings, got {key!r}")
        if isinstance(value, int) and not isinstance(value, bool):
            if value < 1 or value not in dict(program.sizes).values():
                raise ValueError(
                    f"names: the size {key!r} = {value}: expected one of the module's sizes "
                    f"{sorted({v for _, v in program.sizes if v is not None})}")
            sizes[_as_symbol(key, "names").latex()] = value
        elif isinstance(value, str):
            tensor = sources.get(key, key)
            if tensor not in symbols or tensor == program.X.name:
                known = sorted(sources) + sorted(n for n in symbols if n not in sources.values()
                                                 and n != program.X.name)
                raise ValueError(f"names: {key!r} names no tensor of this module; expected "
                                 f"one of {known[:12]}{' ...' if len(known) > 12 else ''} "
                                 "(the symbol table lists them), or a size as name=int")
            symbols[tensor] = _as_symbol(value, f"names[{key!r}]")
            chosen[symbols[tensor].latex()] = key
        else:
            raise ValueError(f"names[{key!r}]: expected a LaTeX symbol (str) or a size (int), "
                             f"got {type(value).__name__}")
    taken = Counter(symbol.latex() for name, symbol in symbols.items()
                    if not name.startswith("c_select"))
    for latex, key in chosen.items():
        if taken[latex] > 1 or latex in RESERVED:
            raise ValueError(f"names[{key!r}]: {latex!r} is the symbol of another tensor of "
                             "the document; choose one no other tensor has")
    return symbols, size_symbols(program, hints, sizes)


#: a symbol ``names=`` may give: a letter or a command (``\lambda``, ``\mathrm{gate}``), with
#: a subscript and a superscript of letters, digits and commas
_SYMBOL = re.compile(r"(?P<head>[A-Za-z]|\\[A-Za-z]+(?:\{[A-Za-z0-9]+\})?)"
                     r"(?:_(?:\{(?P<sub>[A-Za-z0-9,\\ ]+)\}|(?P<sub1>[A-Za-z0-9])))?"
                     r"(?:\^(?:\{(?P<sup>[A-Za-z0-9,()\\ ]+)\}|(?P<sup1>[A-Za-z0-9])))?")
#: TeX commands that read or write files or change TeX itself: never a symbol
_UNSAFE = re.compile(r"\\(input|include|openin|openout|read|write|immediate|def|let|catcode|"
                     r"csname|end|begin|special|usepackage|newcommand|renewcommand)\b")


def _as_symbol(text: str, where: str) -> Symbol:
    """``text`` (``W_{q}``, ``W_q``, ``\\lambda_1``) as a head, a subscript and a superscript
    (derived symbols decorate the head); a clear error for anything else."""
    match = _SYMBOL.fullmatch(text.strip())
    if match is None or _UNSAFE.search(text):
        raise ValueError(f"{where}: expected a LaTeX symbol such as 'W_q', 'W_{{q,1}}' or "
                         f"r'\\lambda_1' (a letter or command, a subscript and superscript "
                         f"of letters and digits), got {text!r}")
    return Symbol(match["head"], match["sub"] or match["sub1"] or "",
                  match["sup"] or match["sup1"] or "")
