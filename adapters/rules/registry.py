"""Where each operation's rule and each table kind's maker are registered (one each)."""

from __future__ import annotations

from collections.abc import Callable

import torch

#: each operation's rule, by ATen overload (or overload packet)
RULES: dict[object, Callable] = {}

#: each table kind's maker: ``(args, sizes, options) -> tensor`` of shape ``sizes``
MAKERS: dict[str, Callable[[tuple, list[int], dict], torch.Tensor]] = {}


def rule(*targets: object) -> Callable:
    """Register the decorated function as the rule of ``targets`` (one rule each)."""
    def register(function: Callable) -> Callable:
        for target in targets:
            if target in RULES:
                old = RULES[target]
                raise RuntimeError(f"two rules for {target}: {old.__module__}."
                                   f"{old.__name__} and {function.__module__}."
                                   f"{function.__name__}")
            RULES[target] = function
        return function
    return register


def makes(*kinds: str) -> Callable:
    """Register the decorated function as the maker of the tables ``kinds``."""
    def register(function: Callable) -> Callable:
        for kind in kinds:
            if kind in MAKERS:
                raise RuntimeError(f"two makers for the table {kind!r}")
            MAKERS[kind] = function
        return function
    return register


def make_table(kind: str, args: tuple, sizes: list[int], X: torch.Tensor) -> torch.Tensor:
    """The table ``kind`` of ``sizes`` (one axis per dimension), in X's dtype and device."""
    if kind not in MAKERS:
        raise ValueError(f"constant: unknown table {kind!r}")
    return MAKERS[kind](args, sizes, dict(dtype=X.dtype, device=X.device)).reshape(sizes)

