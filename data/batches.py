"""Functions of a batch ``(X, T)`` over a whole dataset: the mean over its samples.

A function ``f`` that averages over its batch (``loss``, ``gradient``, ``loss_hessian``,
``hvp``, …) gives over batches ``(X_1, T_1), …, (X_m, T_m)`` that it averages over ``n_1, …,
n_m`` terms (their samples ``B_i``; for a loss over entries or tokens, the entries or the
tokens counted)

    f(dataset) = Σ_i n_i f(X_i, T_i) / Σ_i n_i,

the mean over every term, whatever the batching: the dataset's quantity as one batch.
Batches are taken one at a time from any iterable of pairs (a
``torch.utils.data.DataLoader`` over a dataset of ``(X, T)``), so memory is one batch's and
one running sum. With a ``torch.distributed`` process group initialised, every rank passes
its own shard and the sums and counts are added over the ranks (:mod:`curvgap.data.ranks`):
every rank gets the mean over the union of the shards, which may be uneven or empty. Long
passes show a ``tqdm`` bar on rank 0 (on a terminal, after a second; ``TQDM_DISABLE=1``
turns it off).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from .ranks import Contribution, RankError, current, device, gather, sum_over_ranks

Array = Any  # a torch tensor or a numpy array


def is_batches(X: Any) -> bool:
    """Whether ``X`` is a dataset's batches (an iterable that is not an array)."""
    return not isinstance(X, torch.Tensor | np.ndarray | str | bytes | dict) and \
        isinstance(X, Iterable)


def _parts(batch: Any, index: int) -> tuple[Any, Array, dict]:
    """A loader's batch as ``(X, T, keyword inputs)``: from ``(X, T)``, ``(X, T, kwargs)``
    or a dict of the forward's keyword inputs (``X`` the dict, its target among them)."""
    if isinstance(batch, dict):
        return batch, None, {}
    if not isinstance(batch, tuple | list) or len(batch) not in (2, 3) or (
            len(batch) == 3 and not isinstance(batch[2], dict)):
        kind = (f"a {type(batch).__name__} of length {len(batch)}"
                if isinstance(batch, tuple | list) else f"a {type(batch).__name__}")
        raise ValueError(f"X: expected batches (X, T), (X, T, keyword inputs) or dicts of "
                         f"the forward's keyword inputs from the loader (such as "
                         f"DataLoader(TensorDataset(X, T)) or [(X, T)]), got {kind} as batch "
                         f"{index}")
    X, T, inputs = (*batch, {}) if len(batch) == 2 else batch
    if not isinstance(X, torch.Tensor | np.ndarray) or X.ndim < 2:
        shape = tuple(X.shape) if hasattr(X, "shape") else type(X).__name__
        raise ValueError(f"X: expected each batch's X to be an array of samples along its "
                         f"first axis, got {shape} in batch {index}")
    return X, T, inputs


def _samples(X: Any, batch_dim: int) -> int:
    """The samples of a batch's ``X`` (of a dict: of its first tensor, batch first)."""
    if isinstance(X, dict):
        first = next((v for v in X.values() if isinstance(v, torch.Tensor | np.ndarray)
                      and v.ndim), None)
        return 0 if first is None else int(first.shape[0])
    return int(X.shape[batch_dim])


def _fingerprint(value: Any) -> str:
    """A digest of ``value`` (arrays by their bytes, modules by their state) that is equal
    on every rank exactly when the value is."""
    digest = hashlib.blake2b(digest_size=16)

    def feed(item: Any) -> None:
        if isinstance(item, torch.nn.Module):
            feed(item.state_dict())
        elif isinstance(item, torch.Tensor):
            item = item.detach().cpu().contiguous()
            digest.update(f"{item.dtype}{tuple(item.shape)}".encode())
            digest.update(item.reshape(-1).view(torch.uint8).numpy().data)
        elif isinstance(item, np.ndarray):
            digest.update(f"{item.dtype}{item.shape}".encode())
            digest.update(np.ascontiguousarray(item).view(np.uint8).data)
        elif isinstance(item, dict):
            for key in item:
                feed(repr(key))
                feed(item[key])
        elif isinstance(item, tuple | list):
            for element in item:
                feed(element)
        else:
            digest.update(repr(item).encode())

    feed(value)
    return digest.hexdigest()


def _progress(batches: Iterable, what: str) -> Iterable:
    here = current()
    try:
        length = len(batches)
    except TypeError:  # an iterable without a length (an IterableDataset's loader)
        length = None
    return tqdm(batches, desc=f"curvgap {what}", unit="batch", leave=False, delay=1.0,
                total=length, disable=True if here is not None and here[0] != 0 else None)


#: the terms the mean of the batch just computed is over: ``count(X, T)``
Count = Callable[[Array, Array], int]


class NothingCounted(ValueError):
    """A batch whose mean is over no term (every target ignored): alone it has no value; in a
    dataset it adds nothing."""


def _sum(batches: Iterable, compute: Callable[[Array, Array, dict], Array], what: str,
         batch_dim: int = 0, count_of: Count | None = None) -> tuple[Array | None, int]:
    """``Σ_i n_i compute(X_i, T_i, inputs_i)`` over the batches (``None`` if none has a term) and
    ``Σ_i n_i`` (``n_i``: ``count_of(X_i, T_i)`` after the batch is computed, by default
    the size of ``X_i`` along ``batch_dim``; a batch that counts nothing is skipped)."""
    total, count = None, 0
    for index, batch in enumerate(_progress(batches, what)):
        X, T, inputs = _parts(batch, index)
        if _samples(X, batch_dim) == 0:
            continue
        try:
            value = compute(X, T, inputs)
        except NothingCounted:
            continue
        size = _samples(X, batch_dim) if count_of is None else int(count_of(X, T))
        if total is None:
            total = value * size
        elif isinstance(total, torch.Tensor):
            total.add_(value, alpha=size)
        else:
            total += size * value
        count += size
    return total, count


def _nothing(what: str, where: str = "") -> ValueError:
    """The error of a dataset whose batches add no term to the mean."""
    return ValueError(f"X: expected batches with at least one sample in all{where} (and a "
                      f"target that is not -100, for a loss over targets), got none ({what} "
                      f"over an empty dataset, or one whose every target is ignored)")


def mean(batches: Iterable, compute: Callable[[Array, Array, dict], Array], what: str,
         arguments: Any = (), batch_dim: int = 0, count_of: Count | None = None) -> Array:
    """``Σ_i n_i compute(X_i, T_i, inputs_i) / Σ_i n_i`` over ``batches`` (keyword inputs
    ``inputs_i``, see :func:`_parts`) (and over every rank's
    shard when a process group is initialised; then ``arguments``, the call's other
    inputs, must be equal on every rank; ``batch_dim``: the samples' axis of ``X``;
    ``count_of``: the terms ``n_i`` of a batch, by default its samples). ``what`` names the
    function in errors."""
    here = current()
    if here is None:
        total, count = _sum(batches, compute, what, batch_dim, count_of)
        if count == 0:
            raise _nothing(what)
        return total / count
    total, count, failure = None, 0, None
    try:
        total, count = _sum(batches, compute, what, batch_dim, count_of)
    except Exception as error:  # reaches the collective, so the other ranks learn of it
        failure = error
    layout = None if total is None else (tuple(total.shape), str(total.dtype))
    everyone = gather(Contribution(
        count, layout, _fingerprint(arguments),
        None if failure is None else f"{type(failure).__name__}: {failure}"), what)
    if failure is not None:
        raise failure
    return _reduced(total, everyone, what)


def _reduced(total: Array | None, everyone: list[Contribution], what: str) -> Array:
    """The mean over ranks of the sums ``total`` whose contributions are ``everyone``."""
    rank, size = current()
    failed = [(r, c.failure) for r, c in enumerate(everyone) if c.failure is not None]
    if failed:
        r, said = failed[0]
        raise RankError(f"{what} over the dataset, rank {rank} of {size}: rank {r} "
                              f"raised {said}")
    differing = [r for r, c in enumerate(everyone) if c.arguments != everyone[0].arguments]
    if differing:
        raise ValueError(f"{what}: expected the same arguments and weights on every rank (the "
                         f"result is one mean over every rank's shard), got others on rank"
                         f"{'s' if len(differing) > 1 else ''} "
                         f"{', '.join(map(str, differing))} than on rank 0")
    layouts = {c.layout for c in everyone if c.layout is not None}
    if not layouts:
        raise _nothing(what, f" over the {size} ranks")
    if len(layouts) > 1:
        raise ValueError(f"{what}: expected results of one shape and dtype on every rank, got "
                         f"{sorted(layouts)}")
    shape, dtype = layouts.pop()
    if total is None:  # an empty shard adds zeros
        total = (np.zeros(shape, dtype=np.dtype(dtype)) if not dtype.startswith("torch.")
                 else torch.zeros(shape, dtype=getattr(torch, dtype[6:]),
                                  device=device()))
    sum_over_ranks(torch.from_numpy(total) if isinstance(total, np.ndarray) else total,
                         what)
    return total / sum(c.count for c in everyone)


def _rebound(signature: inspect.Signature, args: tuple, kwargs: dict
             ) -> tuple[Any, inspect.BoundArguments, str] | None:
    """For a call whose ``X`` is a dataset's batches, ``(batches, arguments bound with X
    and the target left None, the target's name)``; ``None`` for a call on one batch."""
    names = list(signature.parameters)
    at = names.index("X")
    target = names[at + 1]
    X = args[at] if len(args) > at else kwargs.get("X")
    if not is_batches(X):
        return None
    if isinstance(X, list | tuple) and X and not isinstance(X[0], dict) and not (
            isinstance(X[0], tuple | list) and len(X[0]) in (2, 3)
            and isinstance(X[0][0], torch.Tensor | np.ndarray)):
        raise TypeError(f"X: expected a tensor (the module's input) or a dataset's batches of "
                        f"(X, T) pairs of tensors, got a {type(X).__name__} of "
                        f"{type(X[0]).__name__} (nested lists of numbers? convert them with "
                        "torch.tensor)")
    if target in kwargs:
        raise TypeError(f"{target}: expected none with a loader of (X, T) batches (each "
                        f"batch carries its own), got one")
    if len(args) > at:
        head, rest = args[:at], args[at + 1:]
    else:
        kwargs = {k: v for k, v in kwargs.items() if k != "X"}
        head, rest = args, ()
    bound = signature.bind(*head, None, None, *rest, **kwargs)
    bound.apply_defaults()
    for name in ("wrt", "part"):
        if isinstance(bound.arguments.get(name), torch.Tensor | np.ndarray):
            raise TypeError(f"{name}: expected {'parameter names' if name == 'wrt' else 'a part'}"
                            f", got an array (with a loader of (X, T) batches give no "
                            f"{target}: each batch carries its own)")
    if isinstance(bound.arguments.get("wrt"), str) and bound.arguments["wrt"] == "X":
        raise ValueError("wrt: expected parameters over a dataset ('X' gives one result per "
                         "sample: call it on each batch), got 'X'")
    return X, bound, target


def _one_batch(signature: inspect.Signature, args: tuple, kwargs: dict
               ) -> tuple[tuple, dict]:
    """The call's arguments, where its ``X`` is one batch given as a dict of the forward's
    keyword inputs passed alone, with the target ``None`` (``c.hvp(batch, v)``: ``v`` is
    ``v``)."""
    names = list(signature.parameters)
    at = names.index("X")
    target = names[at + 1] if at + 1 < len(names) else None
    X = args[at] if len(args) > at else kwargs.get("X")
    if not isinstance(X, dict) or target in (None, "wrt") or len(args) <= at:
        return args, kwargs
    positional = [p for p in signature.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if target in kwargs or len(args) + 1 > len(positional):
        raise TypeError(f"{target}: expected none with a batch dict (it holds its target, or "
                        f"the model makes it), got one")
    return (*args[:at + 1], None, *args[at + 1:]), kwargs


def one_batch(method: Callable) -> Callable:
    """Let a method ``f(…, X, T, …)`` take one batch as a dict of the forward's keyword inputs
    in place of ``X, T`` (``f(…, batch, …)``)."""
    signature = inspect.signature(method)

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return method(*_one_batch(signature, args, kwargs)[0], **kwargs)

    return wrapper


def _dispatching(method: Callable, over: Callable[[Any, inspect.BoundArguments, str, tuple],
                                                   Any]) -> Callable:
    """``method`` as it is on one batch (a dict of keyword inputs too, :func:`one_batch`),
    and ``over(batches, bound, target, args)`` when its ``X`` is a dataset's batches
    (``bound``: the call's arguments, ``X`` and the target ``None``)."""
    signature = inspect.signature(method)

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        rebound = _rebound(signature, args, kwargs)
        if rebound is None:
            return method(*_one_batch(signature, args, kwargs)[0], **kwargs)
        return over(*rebound, args)

    return wrapper


def over_batches(state: Callable[[Any], Any] | None = None,
                 count_of: Callable[[Any, Array, Array], int] | None = None) -> Callable:
    """Let a method ``f(…, X, T, …)`` that averages over its batch also take, in place of
    ``X, T``, a dataset's batches (``f(…, loader, …)``): then it returns :func:`mean` of
    ``f`` over them. ``state(self)`` is what else must agree on every rank (the weights);
    ``count_of(self, X, T)`` the terms a batch's mean is over (default: its samples)."""

    def decorate(method: Callable) -> Callable:
        def over(batches: Any, bound: inspect.BoundArguments, target: str, args: tuple) -> Any:
            others = {k: v for k, v in bound.arguments.items()
                      if k not in ("self", "X", target)}

            def compute(X: Array, T: Array, inputs: dict) -> Array:
                bound.arguments["X"], bound.arguments[target] = X, T
                given = bound.kwargs
                twice = sorted(set(inputs) & set(given))
                if twice:
                    raise TypeError(f"{twice[0]}: expected it once, got it in a batch and in "
                                    f"the call")
                return method(*bound.args, **given, **inputs)

            agreed = (others, state(args[0])) if state is not None else others
            # (a module that takes its batch second, X of shape (L, B, d), says so)
            counted = None if count_of is None else functools.partial(count_of, args[0])
            return mean(batches, compute, method.__name__, agreed,
                        getattr(args[0], "batch_dim", 0), counted)

        return _dispatching(method, over)

    return decorate


def check_reiterable(batches: Any, what: str) -> None:
    """``ValueError`` if ``batches`` can be iterated only once (an iterator, such as a
    generator), where ``what`` passes over them several times."""
    if isinstance(batches, Iterator):  # its iter() is itself: a second pass finds it spent
        raise ValueError(f"X: expected batches that can be iterated several times (a "
                         f"DataLoader, or a list of (X, T)), got a {type(batches).__name__}, "
                         f"which can be iterated once: {what} passes over the dataset at "
                         f"every product; pass list(...) of it, or a DataLoader")


def takes_batches(method: Callable) -> Callable:
    """Let a method ``f(…, X, T, …)`` take a dataset's batches in place of ``X, T``
    (``f(…, loader, …)``), passed on as ``X`` with the target ``None``; batches that can
    be iterated only once are refused (the method keeps them for several passes)."""

    def over(batches: Any, bound: inspect.BoundArguments, target: str, args: tuple) -> Any:
        check_reiterable(batches, method.__name__)
        bound.arguments["X"] = batches
        return method(*bound.args, **bound.kwargs)

    return _dispatching(method, over)
