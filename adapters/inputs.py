"""The inputs of a call on a real module, checked before any work: ``X`` and the keyword
inputs (no meta tensors, token ids of shape ``(B, L)``, masks of ``X``'s batch and length,
indices inside their tables; a batch given as a dict), ``wrt`` (names or parameters), a
direction ``v``, a target's ignored entries, and the sizes of each part for this ``X``."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import torch

from ..data import NothingCounted
from ..runtime.torch_arrays import _all_finite
from .trace import Trace


def batch_first(module: torch.nn.Module) -> bool:
    """Whether the module takes its batch first: torch's ``batch_first=False`` (on the module
    or on the attention inside it) says otherwise."""
    for sub in module.modules():
        if isinstance(getattr(sub, "batch_first", None), bool):
            return sub.batch_first
    return True


def without_cache(module: torch.nn.Module, inputs: dict) -> dict:
    """``inputs`` with ``use_cache=False`` where the module's forward takes ``use_cache`` and
    the call does not give it: a Hugging Face decoder called as it is returns a key-value
    cache besides its output, which the loss does not read and no trace can return."""
    if "use_cache" in inputs:
        return inputs
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return inputs
    return {**inputs, "use_cache": False} if "use_cache" in parameters else inputs


def direction(v: Any, like: torch.Tensor) -> torch.Tensor:
    """``v`` (a tensor or numpy array of any floating dtype), checked finite, as a tensor of
    ``like``'s dtype and device (the module's: the result has its dtype)."""
    if isinstance(v, np.ndarray):
        if v.dtype.kind != "f" or v.dtype.itemsize > 8:
            raise TypeError(f"v: expected floating-point values (float16, float32 or "
                            f"float64), got dtype {v.dtype}")
        v = torch.from_numpy(np.require(v, v.dtype.newbyteorder("="), ["W"]))
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"v: expected a torch.Tensor or a numpy array, got "
                        f"{type(v).__name__}")
    if not v.is_floating_point():
        raise TypeError(f"v: expected floating-point values, got dtype {v.dtype}")
    _finite("v", v)
    v = v.detach().to(dtype=like.dtype, device=like.device)
    if not _all_finite(v):
        raise ValueError(f"v: expected values that fit the module's dtype {like.dtype}, got "
                         f"some beyond its range ({torch.finfo(like.dtype).max:.4g})")
    return v


def _finite(name: str, value: torch.Tensor) -> None:
    """ValueError naming the first entry of ``value`` that is NaN or inf."""
    if value.is_floating_point() and not _all_finite(value):
        at = tuple(int(i) for i in (~torch.isfinite(value)).nonzero()[0])
        what = "NaN" if bool(torch.isnan(value[at])) else "inf"
        raise ValueError(f"{name}: expected finite values, got {what} at index "
                         f"{at[0] if len(at) == 1 else at}")


#: a cross-entropy target that adds nothing (torch's ``ignore_index``)
IGNORE_INDEX = -100


def ignored_scale(T: Any, loss: str, per_sample: bool = False) -> float | torch.Tensor | None:
    """Where a cross-entropy target ``T`` (class indices, batch first) ignores entries
    (``-100``), the factor from the generated code's mean over every row (an ignored row adds
    zero) to torch's mean over the rows counted: ``rows / counted`` over the batch, or with
    ``per_sample`` each sample's own (``(B,)``; 0 for a sample with none counted); None where
    nothing is ignored."""
    if loss != "cross_entropy" or not isinstance(T, torch.Tensor) or T.is_floating_point():
        return None
    counted = T != IGNORE_INDEX
    if bool(counted.all()):
        return None
    if per_sample:
        rows = counted[0].numel()
        per = counted.reshape(len(T), -1).sum(1)
        return torch.where(per > 0, rows / per.clamp(min=1), 0.0)
    total = int(counted.sum())
    if total == 0:
        raise NothingCounted("T: expected a target that is not -100 (ignored), got only "
                             "ignored ones: the mean over the counted targets is 0/0")
    return T.numel() / total


#: keyword inputs with one entry per sample and position of X, ``(B, L)``
_PER_POSITION = ("attention_mask", "src_key_padding_mask", "key_padding_mask",
                 "tgt_key_padding_mask", "token_type_ids", "position_ids")


def _meta(name: str, value: Any) -> None:
    if isinstance(value, torch.Tensor) and value.device.type == "meta":
        raise ValueError(f"{name}: expected a tensor with data (cpu or cuda), got a meta "
                         f"tensor")


def _plain(value: Any) -> Any:
    """A tensor detached (the derivatives do not depend on its autograd state), and copied
    out of inference mode (made under ``torch.inference_mode()``, it cannot be traced)."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.clone() if value.is_inference() else value.detach()


def checked(module: torch.nn.Module, X: torch.Tensor, T: Any, inputs: dict, batch_dim: int,
             keyword: str | None) -> tuple[torch.Tensor, Any, dict]:
    """The call's inputs checked before any work (no meta tensors, token ids of shape
    ``(B, L)``, a batch of sequences, keyword inputs of X's batch and length) and detached
    (and out of inference mode: :func:`_plain`); token ids as int64."""
    name = keyword or "X"
    _meta(name, X)  # (a meta target is refused by the loss, with its own words)
    for key, value in inputs.items():
        _meta(key, value)
    meta = next((n for n, p in module.named_parameters() if p.device.type == "meta"), None)
    if meta is not None:
        raise ValueError(f"module: expected parameters with data (cpu or cuda), got a meta "
                         f"tensor for {meta!r} (materialise it: module.to_empty(device=...) "
                         f"and load its weights)")
    X, T = _plain(X), _plain(T)
    inputs = {k: _plain(v) for k, v in inputs.items()}
    if not X.is_floating_point():
        if X.ndim > 2 and X.shape[-1] == 1:  # (B, L, 1)
            raise ValueError(f"{name}: expected token ids of shape (B, L), got shape "
                             f"{tuple(X.shape)}")
        X = X.long()
        batch, length = X.shape if X.ndim == 2 else (None, None)
    elif X.ndim == 3:
        batch, length = X.shape[batch_dim], X.shape[1 - batch_dim]
    else:
        batch = length = None
        if X.ndim == 2 and any(isinstance(m, torch.nn.MultiheadAttention)
                               for m in module.modules()):
            layout, one = ("(B, L, d)", "unsqueeze(0)") if batch_dim == 0 else (
                "(L, B, d)", "unsqueeze(1)")
            raise ValueError(f"{name}: expected shape {layout} (a batch of sequences; "
                             f"{type(module).__name__} reads a 2-D input as one sequence "
                             f"without a batch), got shape {tuple(X.shape)}; for one "
                             f"sequence pass {name}.{one}")
    if batch is not None and inputs.get("past_key_values") is None:
        for key in _PER_POSITION:
            value = inputs.get(key)
            if not isinstance(value, torch.Tensor) or value.ndim != 2:
                continue
            ones = key == "position_ids" and value.shape[0] == 1
            if value.shape[1] != length or (value.shape[0] != batch and not ones):
                also = f" or (1, {length})" if key == "position_ids" else ""
                raise ValueError(f"{key}: expected shape ({batch}, {length}){also} to match "
                                 f"{name}'s batch and sequence, got {tuple(value.shape)}")
    return X, T, inputs


def check_indices(traced: Trace, inputs: dict) -> None:
    """ValueError naming a keyword input of indices into a table (``position_ids``) that
    has one outside the table."""
    for reading in traced.readings:
        for constant in reading.constants:
            kind, _, arg = constant.transform.partition(":")
            value = inputs.get(constant.node) if isinstance(constant.node, str) else None
            if kind not in ("one_hot", "index") or not isinstance(value, torch.Tensor) \
                    or not value.numel():
                continue
            rows = int(arg.partition(":")[0])
            low = -rows if kind == "index" else 0
            outside = (value < low) | (value >= rows)
            if bool(outside.any()):
                at = tuple(int(i) for i in outside.nonzero()[0])
                raise ValueError(f"{constant.node}: expected indices in [{low}, {rows}) (the "
                                 f"module's table has {rows} rows), got {int(value[at])} at "
                                 f"index {at[0] if len(at) == 1 else at}")


def part_dims(traced: Trace, X: torch.Tensor) -> list[dict[str, int]]:
    """Each part's sizes for this ``X``: the fixed ones and those bound at call time (the
    trace's symbols, valued from ``X``'s shape)."""
    values = {extent: int(size) for extent, size in zip(traced.entry.X_shape, X.shape)
              if not isinstance(extent, int)}
    out = []
    for reading in traced.readings:
        dims = {name: size for name, size in reading.program.sizes if size is not None}
        for name, symbol in reading.symbols.items():
            dims[name] = int(symbol.xreplace(values))
        out.append(dims)
    return out


def by_name(module: torch.nn.Module, wrt: Any) -> Any:
    """``wrt`` with each ``Parameter`` (or the alias of a tied weight) as the module's name of
    it; ValueError for a tensor that is not one of the module's, or two names of one tied
    weight."""
    named = {id(p): n for n, p in module.named_parameters()}
    aliases = {alias: named[id(p)] for alias, p in module.named_parameters(remove_duplicate=False)}
    given = [wrt] if isinstance(wrt, torch.Tensor | str) else wrt
    if isinstance(given, list | tuple):  # two names of one tied weight: said so
        seen: dict[str, Any] = {}
        for item in given:
            canonical = (named.get(id(item)) if isinstance(item, torch.Tensor)
                         else aliases.get(item))
            if canonical is not None and canonical in seen and seen[canonical] is not item \
                    and not (isinstance(item, str) and seen[canonical] == item):
                raise ValueError(f"wrt: expected each parameter once, got {seen[canonical]!r} "
                                 f"and {item!r}, which are one tied weight")
            if canonical is not None:
                seen[canonical] = item

    def name(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            if id(item) not in named:
                raise ValueError(f"wrt: expected the module's parameters or their names, got a "
                                 f"tensor of shape {tuple(item.shape)} that is not a parameter "
                                 f"of {type(module).__name__}")
            return named[id(item)]
        return aliases.get(item, item) if isinstance(item, str) and item != "X" else item

    if isinstance(wrt, torch.Tensor | str):
        return name(wrt)
    return [name(item) for item in wrt] if isinstance(wrt, list | tuple) else wrt


def unpacked(module: torch.nn.Module, batch: dict, T: Any, inputs: dict, loss: str,
             needs_target: bool = True) -> tuple[Any, Any, dict]:
    """A batch given as a dict of the forward's keyword inputs, as ``X`` (its first input, or
    ``None`` beside ``inputs_embeds``), the target (its ``labels``; ``None`` with
    ``loss="model"``, whose model reads them itself; not needed where the call does not
    ``needs_target``) and the other keyword inputs."""
    twice = sorted(set(batch) & set(inputs))
    if twice:
        raise TypeError(f"{twice[0]}: expected it once, got it in the batch and in the call")
    inputs = {**batch, **inputs}
    try:
        first = next(iter(inspect.signature(module.forward).parameters))
    except (StopIteration, TypeError, ValueError):
        first = None
    if "inputs_embeds" in inputs and inputs.get(first) is None:
        X = None
        inputs.pop(first, None)
    elif first in inputs:
        X = inputs.pop(first)
    else:
        raise ValueError(f"X: expected the batch to hold {first!r}, the first input of "
                         f"{type(module).__name__}'s forward (or inputs_embeds), got keys "
                         f"{sorted(batch)}")
    if loss != "model":
        if "labels" not in inputs and not needs_target:
            return X, T, inputs
        if "labels" not in inputs:
            raise ValueError(f"X: expected the batch to hold its target as 'labels' for "
                             f"loss={loss!r} (or loss='model' for the model's own), got keys "
                             f"{sorted(batch)}")
        T = inputs.pop("labels")
    return X, T, inputs
