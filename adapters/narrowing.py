"""Where a module computes in a narrower float than curvgap does: its own numbers checked.

curvgap computes a module in the dtype of its input (float16 and bfloat16 in float32), also
where the module casts down inside (a float64 model whose softmax runs in float32). Where the
narrower numbers overflow — a row of attention whose every key is masked with float64's
``finfo.min`` is ``-inf`` in float32, its softmax NaN — the module gives NaN or inf where the
program would give finite numbers that the module never computes. For such modules the
module's own forward is run once per batch (as the trace read it, with autograd on) and a
sample it does not give finite numbers for is refused by name.
"""

from __future__ import annotations

import weakref

import torch
import torch.utils._pytree as pytree

from .trace import Call

_HALF = (torch.float16, torch.bfloat16)


def narrowing(module: torch.nn.Module, X: torch.Tensor, readings: list
              ) -> tuple[str, str] | None:
    """Where the module computes narrower than curvgap does, and the dtype curvgap computes
    in (``("float32 (cast from float64 before softmax)", "float64")``); None where nowhere."""
    dtype = X.dtype if X.is_floating_point() else next(module.parameters()).dtype
    if dtype in _HALF:
        return str(dtype).removeprefix("torch."), "float32"
    inside = next((r.narrowing for r in readings if r.narrowing), "")
    return (inside, str(dtype).removeprefix("torch.")) if inside else None


def _state(tensor: torch.Tensor) -> tuple:
    """What identifies a tensor's values between calls: itself (weakly), its storage and its
    version (an in-place change bumps it; ``.data`` swapped moves the storage); ``None``
    for an inference tensor, which keeps no version (checked every call)."""
    if tensor.is_inference():
        return None
    return weakref.ref(tensor), tensor.data_ptr(), tensor._version


def _same(states: list, tensors: list[torch.Tensor]) -> bool:
    return len(states) == len(tensors) and all(
        state is not None and state[0]() is t and state[1:] == (t.data_ptr(), t._version)
        for state, t in zip(states, tensors))


class OwnForward:
    """The last batch the module's own forward was found finite on, with the parameters it
    was found finite for: by each tensor's identity, storage and version (a batch or a
    parameter changed in place is checked again) and the other inputs' values. The module
    runs with autograd on, as the trace read it (torch's inference-only fast paths, such as
    ``nn.MultiheadAttention``'s, give NaN where the traced path gives 0); its forward hooks
    run too."""

    def __init__(self) -> None:
        self._vouched: tuple[list, str] | None = None

    def check(self, module: torch.nn.Module, call: Call, X: torch.Tensor, inputs: dict,
              output_batch_dim: int, how: tuple[str, str]) -> None:
        """ValueError naming the samples the module's own forward gives NaN or inf for in its
        main output (the first tensor it returns, the batch along ``output_batch_dim``),
        where it computes ``how`` (a :func:`narrowing`)."""
        leaves = pytree.tree_leaves((X, inputs))
        tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
        tensors += [*module.parameters(), *module.buffers()]  # (an optimizer's step, in place)
        others = repr([v for v in leaves if not isinstance(v, torch.Tensor)])
        if self._vouched is not None and self._vouched[1] == others and _same(
                self._vouched[0], tensors):
            return
        args, kwargs = call.arguments(X, inputs)
        with torch.enable_grad():
            output = module(*args, **kwargs)
        main = next((v for v in pytree.tree_leaves(output) if isinstance(v, torch.Tensor)),
                    None)
        if main is not None and main.is_floating_point():
            _refuse_non_finite(module, call, X, main.detach(), output_batch_dim, how)
        self._vouched = ([_state(t) for t in tensors], others)


def _refuse_non_finite(module: torch.nn.Module, call: Call, X: torch.Tensor,
                       output: torch.Tensor, batch_dim: int, how: tuple[str, str]) -> None:
    """ValueError naming the samples of ``output`` (batch along ``batch_dim``) that are not
    finite (every sample where the output holds no such dimension)."""
    finite = torch.isfinite(output)
    if bool(finite.all()):
        return
    what = call.keyword or "X"
    kind = "NaN" if bool(torch.isnan(output).any()) else "inf"
    batch = X.shape[call.batch_dim]
    if output.ndim > batch_dim and output.shape[batch_dim] == batch:
        rows = (~finite).movedim(batch_dim, 0).reshape(batch, -1).any(1)
        samples = [int(k) for k in rows.nonzero().flatten()]
        shown = ", ".join(map(str, samples[:10])) + (", ..." if len(samples) > 10 else "")
        where = f"for sample{'s' if len(samples) > 1 else ''} {shown} of {batch}"
    else:
        where = "for this batch"
    raise ValueError(
        f"{what}: {type(module).__name__}'s own forward gives {kind} {where}: it computes "
        f"in {how[0]}, and those numbers overflow; curvgap computes in {how[1]} and would "
        f"return finite numbers the module does not give. A common cause: a row of attention "
        f"whose every key is masked (a sample of padding only, or left padding under a causal "
        f"mask) is -inf once narrowed, and its softmax NaN. Leave those samples out, or give "
        f"every query a key it may attend to")
