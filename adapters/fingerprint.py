"""What a module computes, apart from the values of its weights, as one digest: a curvature
object checks it at every call and reads the module again when it changed — a submodule
swapped (even for one of the same class), a forward replaced (on the class or the instance),
a function it calls replaced (a helper of its module, a method it calls on ``self``), an
activation or option changed, train/eval, a tensor attribute of another shape, parameters
added, removed, tied, untied, frozen or thawed. Its portable form, equal in every process,
names a module's reading on disk (:mod:`.readings`).

Values are not in it: weights, buffers and tensor attributes are read at every call."""

from __future__ import annotations

import contextlib
import enum
import functools
import hashlib
import re
import types

import torch

_PLAIN = (bool, int, float, str, type(None))


def _code(value: object, portable: bool, owner: type | None = None) -> str:
    """A function (a forward, a hook) as its code: its name and the code object's identity,
    or ``portable``, what it runs (equal in every process, :func:`_what_runs`; ``owner``: the
    class whose methods it may call on ``self``)."""
    name = f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}"
    if getattr(value, "__code__", None) is None:  # a builtin (torch.tanh): its name
        if portable and not isinstance(getattr(value, "__self__", None), torch.nn.Module):
            if name == ".":
                raise NotPortable(f"{type(value).__qualname__} callable")
            return name
        return f"{name}@{id(value)}"
    return f"{name}@{_what_runs(value, set(), owner, portable)}"


def _what_runs(function: object, visited: set[int], owner: type | None = None,
          portable: bool = False) -> str:
    """A digest of what ``function`` runs: its code (the code object's identity, or
    ``portable`` its text), and that of the functions it reads from its globals, its closure,
    the user's modules it names and its defaults, of the methods and properties of ``owner``
    it names, and the plain values among all those (so a helper, a default or a class
    constant changed counts)."""
    code = getattr(function, "__code__", None)
    if code is None or id(code) in visited:
        return ""
    visited.add(id(code))
    digest = hashlib.sha256((_code_text(code) if portable else str(id(code))).encode())
    names = set(code.co_names)
    for inner in code.co_consts:  # comprehensions, lambdas and nested functions
        if hasattr(inner, "co_names"):
            names |= set(inner.co_names)
    scope = getattr(function, "__globals__", {})
    cells = []
    for cell in getattr(function, "__closure__", None) or ():
        with contextlib.suppress(ValueError):  # an empty cell
            cells.append(cell.cell_contents)
    # what it names on its class: methods it calls on self, class attributes it reads
    held = [getattr(owner, n) for n in sorted(names) if owner is not None
            and n not in scope and hasattr(owner, n)]
    # what it names in a module of the user's it reads (helpers.squash(x))
    for n in sorted(names & set(scope)):
        if isinstance(scope[n], types.ModuleType) and not scope[n].__name__.startswith(
                ("torch", "numpy", "math", "transformers", "timm")):
            held += [getattr(scope[n], m) for m in sorted(names) if hasattr(scope[n], m)]
    defaults = [*(getattr(function, "__defaults__", None) or ()),
                *(getattr(function, "__kwdefaults__", None) or {}).values()]
    for value in [scope[n] for n in sorted(names) if n in scope] + cells + held + defaults:
        value = getattr(value, "fget", None) or getattr(value, "__wrapped__", None) or value
        if hasattr(value, "__code__"):
            digest.update(_what_runs(value, visited, owner, portable).encode())
        elif isinstance(value, (*_PLAIN, tuple, frozenset)):
            digest.update(_stable(value).encode())
    return digest.hexdigest()


def _code_text(code: types.CodeType) -> str:
    """A code object as text equal in every process (``marshal``'s bytes are not: they mark
    shared objects by how often they are referenced)."""
    constants = [_code_text(c) if isinstance(c, types.CodeType) else _stable(c)
                 for c in code.co_consts]
    return repr((code.co_code.hex(), constants, code.co_names, code.co_varnames,
                 code.co_freevars))


def _stable(value: object) -> str:
    """``repr(value)``, sets and frozensets in sorted order (their order changes with the
    process's string hashing)."""
    if isinstance(value, set | frozenset):
        return "{" + ", ".join(sorted(_stable(v) for v in value)) + "}"
    if isinstance(value, tuple | list):
        return repr(type(value)(_stable(v) for v in value))
    return repr(value)


class NotPortable(ValueError):
    """A module holds a value whose meaning no process-independent text captures (its
    ``repr`` is an address): its reading is not kept on disk."""


def _plain(value: object, seen: set[int], portable: bool = False) -> object:
    """``value`` as something with a stable ``repr``, or ``None`` when it is not part of the
    computation curvgap reads (submodules are read as such; tensors are weights or buffers,
    covered by their shapes). ``portable``: a value of another kind is its ``repr``, or
    :class:`NotPortable` where that is an address."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, enum.Enum):
        return repr(value)
    if isinstance(value, tuple | list):
        return tuple(_plain(v, seen, portable) for v in value)
    if isinstance(value, dict):  # options such as an interpolation's mode
        return tuple(sorted((repr(k), repr(_plain(v, seen, portable)))
                            for k, v in value.items()))
    if isinstance(value, set | frozenset):
        return tuple(sorted(repr(_plain(v, seen, portable)) for v in value))
    if isinstance(value, torch.dtype | torch.device):
        return str(value)
    if isinstance(value, torch.Tensor):  # a tensor attribute: read at call time, its layout
        return f"tensor{tuple(value.shape)}{value.dtype}{value.device}{value.requires_grad}"
    if isinstance(value, torch.nn.Module):
        return None
    if isinstance(value, functools.partial):
        return (_plain(value.func, seen, portable), _plain(value.args, seen, portable),
                _plain(value.keywords, seen, portable))
    if callable(value):
        return _code(value, portable)
    if hasattr(value, "to_dict") and id(value) not in seen:  # a transformers config
        seen.add(id(value))
        try:
            return repr(sorted((str(k), _stable(v)) for k, v in value.to_dict().items()))
        except Exception:  # noqa: BLE001 - a config that cannot list itself adds nothing
            return None
    if not portable:
        return None
    text = repr(value)
    if re.search(r"0x[0-9a-fA-F]{6,}", text):
        raise NotPortable(f"{type(value).__qualname__} attribute")
    return text


def _tensors(kind: str, items: list[tuple[str, torch.Tensor]]) -> str:
    """Each tensor's name, layout and ``requires_grad``, and the first name of the tensor it
    is (a tie)."""
    first: dict[int, str] = {}
    return "".join(f"{kind}{name}{tuple(t.shape)}{t.dtype}{t.device}{t.requires_grad}"
                   f"={first.setdefault(id(t), name)};" for name, t in items)


def fingerprint(module: torch.nn.Module, portable: bool = False) -> str:
    """A digest of ``module``'s structure: each submodule's path, identity, class, mode, the
    code of its ``forward``, its forward hooks and its plain and tensor attributes; the
    names, shapes, dtypes, devices, ``requires_grad`` and ties of its parameters and
    buffers. ``portable``: equal in every process for equal modules (identities as the
    first path of each submodule, functions as their code), for a cache on disk."""
    digest = hashlib.blake2b(digest_size=16)
    seen: set[int] = set()
    first: dict[int, str] = {}
    forwards: dict[type, str] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        cls = type(sub)
        if cls not in forwards:  # each class's forward walked once
            forwards[cls] = _code(cls.forward, portable, cls)
        forward = forwards[cls]
        hooks = [_code(hook, portable) for table in (sub._forward_pre_hooks, sub._forward_hooks)
                 for hook in table.values()]  # what a hook adds is traced with the forward
        identity = first.setdefault(id(sub), name) if portable else id(sub)
        digest.update(f"{name}|{identity}|{type(sub).__module__}.{type(sub).__qualname__}|"
                      f"{sub.training}|{forward}|{hooks}".encode())
        for key, value in sorted(vars(sub).items()):
            if key in ("_parameters", "_buffers", "_modules", "training") or \
                    key.endswith("_hooks") or key.startswith("_forward") or \
                    key.startswith("_backward") or key.startswith("_state_dict"):
                continue
            plain = _plain(value, seen, portable)
            if plain is not None:
                digest.update(f"{key}={plain!r}".encode())
    digest.update(_tensors("p", list(module.named_parameters(remove_duplicate=False))).encode())
    digest.update(_tensors("b", list(module.named_buffers(remove_duplicate=False))).encode())
    return digest.hexdigest()
