"""The generated modules a :class:`~curvgap.models.chain.Chain` composes, requested by its
caller: each part's module from its config or program, generated once and cached on disk."""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any

from ..codegen.cache import module_for
from ..derivations.config import Config
from ..derivations.program import Program


def check_parts(parts: list, backend: Any, what: str) -> None:
    """ValueError for no ``parts`` (of ``(prefix, what)``) or an unknown ``backend``."""
    if not parts:
        raise ValueError(f"parts: expected at least one (prefix, {what}), got none")
    if backend not in ("torch", "numpy"):
        raise ValueError(f"backend: expected 'torch' or 'numpy', got {backend!r}")


def generated(parts: list[tuple[str, Config | Program]], backend: str = "torch",
              fused: bool = False) -> list[tuple[str, ModuleType]]:
    """Each part's generated module (:func:`~curvgap.codegen.cache.module_for`: generated
    once, cached on disk) as a :class:`Chain` takes it: every part but the last with the
    ``linear`` loss (its second derivatives against the cotangent from above), the last with
    its own loss. ``fused=True`` (torch): compiled by ``torch.compile(fullgraph=True)``."""
    check_parts(parts, backend, "config")
    return [(prefix, module_for(config if k == len(parts) - 1 else
                                dataclasses.replace(config, loss="linear"), backend, fused))
            for k, (prefix, config) in enumerate(parts)]
