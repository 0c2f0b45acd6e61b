"""What a module computes, apart from its weights, as one digest: a curvature object checks it
at every call and reads the module again when it changed (a submodule swapped, an activation
or option changed, train/eval, parameters of other shapes)."""

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
    if callable(value) and not isinstance(value, torch.nn.Module):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}"
    if hasattr(value, "to_dict") and id(value) not in seen:  # a transformers config
        seen.add(id(value))
        try:
            return repr(sorted((str(k), repr(v)) for k, v in value.to_dict().items()))
        except Exception:  # noqa: BLE001 - a config that cannot list itself adds nothing
            return None
    return None


def fingerprint(module: torch.nn.Module) -> str:
    """A digest of ``module``'s structure: each submodule's class, mode and plain attributes,
    and the names, shapes, dtypes, devices and ``requires_grad`` of its parameters and
    buffers (a frozen parameter is read as a constant)."""
    digest = hashlib.blake2b(digest_size=16)
    seen: set[int] = set()
    for name, sub in module.named_modules():
        digest.update(f"{name}|{type(sub).__module__}.{type(sub).__qualname__}|"
                      f"{sub.training}".encode())
        for key, value in sorted(vars(sub).items()):
            if key in ("_parameters", "_buffers", "_modules", "training") or \
                    key.endswith("_hooks") or key.startswith("_forward") or \
                    key.startswith("_backward") or key.startswith("_state_dict"):
                continue
            plain = _plain(value, seen)
            if plain is not None:
                digest.update(f"{key}={plain!r}".encode())
    for kind, items in (("p", module.named_parameters()), ("b", module.named_buffers())):
        for name, tensor in items:
            digest.update(f"{kind}{name}{tuple(tensor.shape)}{tensor.dtype}"
                          f"{tensor.device}{tensor.requires_grad}".encode())
    return digest.hexdigest()
