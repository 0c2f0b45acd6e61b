"""What a module computes, apart from the values of its weights, as one digest: a curvature
object checks it at every call and reads the module again when it changed — a submodule
swapped (even for one of the same class), a forward replaced (on the class or the instance),
an activation or option changed, train/eval, a tensor attribute of another shape, parameters
added, removed, tied, untied, frozen or thawed.

Values are not in it: weights, buffers and tensor attributes are read at every call."""

from __future__ import annotations

import hashlib

import torch

_PLAIN = (bool, int, float, str, type(None))


def _plain(value: object, seen: set[int]) -> object:
    """``value`` as something with a stable ``repr``, or ``None`` when it is not part of the
    computation curvgap reads (tensors are weights or buffers, covered by their shapes)."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, tuple | list) and all(isinstance(v, _PLAIN) for v in value):
        return tuple(value)
    if isinstance(value, torch.dtype | torch.device):
        return str(value)
    if isinstance(value, torch.Tensor):  # a tensor attribute: read at call time, its layout
        return f"tensor{tuple(value.shape)}{value.dtype}{value.device}{value.requires_grad}"
    if callable(value) and not isinstance(value, torch.nn.Module):
        code = getattr(value, "__code__", None)  # a function object is its code and its id
        return (f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}"
                f"@{id(code) if code is not None else id(value)}")
    if hasattr(value, "to_dict") and id(value) not in seen:  # a transformers config
        seen.add(id(value))
        try:
            return repr(sorted((str(k), repr(v)) for k, v in value.to_dict().items()))
        except Exception:  # noqa: BLE001 - a config that cannot list itself adds nothing
            return None
    return None


def _tensors(kind: str, items: list[tuple[str, torch.Tensor]]) -> str:
    """Each tensor's name, layout and ``requires_grad``, and the first name of the tensor it
    is (a tie)."""
    first: dict[int, str] = {}
    return "".join(f"{kind}{name}{tuple(t.shape)}{t.dtype}{t.device}{t.requires_grad}"
                   f"={first.setdefault(id(t), name)};" for name, t in items)


def fingerprint(module: torch.nn.Module) -> str:
    """A digest of ``module``'s structure: each submodule's path, identity, class, mode, the
    code of its ``forward``, its forward hooks and its plain and tensor attributes; the
    names, shapes, dtypes, devices, ``requires_grad`` and ties of its parameters and
    buffers."""
    digest = hashlib.blake2b(digest_size=16)
    seen: set[int] = set()
    for name, sub in module.named_modules(remove_duplicate=False):
        forward = _plain(type(sub).forward, seen)
        hooks = [id(hook) for table in (sub._forward_pre_hooks, sub._forward_hooks)
                 for hook in table.values()]  # what a hook adds is traced with the forward
        digest.update(f"{name}|{id(sub)}|{type(sub).__module__}.{type(sub).__qualname__}|"
                      f"{sub.training}|{forward}|{hooks}".encode())
        for key, value in sorted(vars(sub).items()):
            if key in ("_parameters", "_buffers", "_modules", "training") or \
                    key.endswith("_hooks") or key.startswith("_forward") or \
                    key.startswith("_backward") or key.startswith("_state_dict"):
                continue
            plain = _plain(value, seen)
            if plain is not None:
                digest.update(f"{key}={plain!r}".encode())
    digest.update(_tensors("p", list(module.named_parameters(remove_duplicate=False))).encode())
    digest.update(_tensors("b", list(module.named_buffers(remove_duplicate=False))).encode())
    return digest.hexdigest()
