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


class OwnForward:
    """The last batch the module's own forward was found finite on, with the parameters it
    was found finite for (by identity and version of each tensor, so that a batch or a
    parameter changed in place is checked again)."""

    def __init__(self) -> None:
        self._vouched: list[tuple[torch.Tensor, int]] | None = None

    def check(self, module: torch.nn.Module, call: Call, X: torch.Tensor, inputs: dict,
              output_batch_dim: int, how: tuple[str, str]) -> None:
        """ValueError naming the samples the module's own forward gives NaN or inf for,
        where it computes ``how`` (a :func:`narrowing`); its output holds the batch along
        ``output_batch_dim`` (other outputs where they have a dimension of the batch's
        size)."""
        tensors = [v for v in pytree.tree_leaves((X, inputs)) if isinstance(v, torch.Tensor)]
        tensors += [*module.parameters(), *module.buffers()]  # (an optimizer's step, in place)
        if self._vouched is not None and len(self._vouched) == len(tensors) and all(
                a is b and a._version == version
                for a, (b, version) in zip(tensors, self._vouched)):
            return
        args, kwargs = call.arguments(X, inputs)
        with torch.enable_grad():  # as the trace reads it (no inference-only fast path)
            output = module(*args, **kwargs)
        batch = X.shape[call.batch_dim]
        bad: set[int] = set()
        kinds: set[str] = set()
        for value in pytree.tree_leaves(output):
            if not (isinstance(value, torch.Tensor) and value.is_floating_point()
                    and value.ndim > 0):
                continue
            value = value.detach()
            finite = torch.isfinite(value)
            if bool(finite.all()):
                continue
            kinds.add("NaN" if bool(torch.isnan(value).any()) else "inf")
            dims = [output_batch_dim] + list(range(value.ndim))
            at = next((d for d in dims if d < value.ndim and value.shape[d] == batch), 0)
            bad.update(int(k) for k in (~finite).movedim(at, 0).flatten(1).any(1)
                       .nonzero().flatten())
        if bad:
            samples = sorted(bad)
            shown = ", ".join(map(str, samples[:10])) + (", ..." if len(samples) > 10 else "")
            what = call.keyword or "X"
            raise ValueError(
                f"{what}: {type(module).__name__}'s own forward gives "
                f"{' and '.join(sorted(kinds))} for sample{'s' if len(samples) > 1 else ''} "
                f"{shown} of {batch}: it computes in {how[0]}, and those numbers overflow; "
                f"curvgap computes in {how[1]} and would return finite numbers the module "
                f"does not give. A common cause: a row of attention whose every key "
                f"is masked (a sample of padding only, or left padding under a causal mask) "
                f"is -inf once narrowed, and its softmax NaN. Leave those samples out, or "
                f"give every query a key it may attend to")
        self._vouched = [(v, v._version) for v in tensors]
