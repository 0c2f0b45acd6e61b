"""Fused execution of a generated torch module (``fused=True``): each group function of the
module (its forward, adjoint, tangent and second-order sweeps) runs through
``torch.compile(fullgraph=True)``, its elementwise chains fused into single kernels, compiled
on first use for each set of sizes and dtypes (seconds to a minute).

A group is called on a dict of just the entries it reads, found by one eager run on its first
call (the generated groups read ``ns["name"]`` and write ``ns["name"] = value``, nothing
else): its compiled code is guarded on those entries alone, so that what else a call's
namespace holds (the entries of other routes' groups) compiles nothing again. Past torch's
recompile limit for a group (``torch._dynamo.config.recompile_limit`` sets of sizes), that
group runs uncompiled at sizes it has not compiled for, said once; the compiled sizes keep
their code.

A guard of the generated code (a variance that must be positive) is an assertion inside the
compiled code, not a branch: when it fails, the group is rerun uncompiled, which raises the
guard's error with its words (sample and row).

Inductor's pattern passes are off: the one that folds ``x.add_(a @ b, alpha=c)`` into
``addmm`` drops ``c`` (pytorch/pytorch#167313 reports its kin), and the generated code
scales matrix products in place that way."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any


class _Reads(dict):
    """A copy of a namespace that keeps the names read from it before any write to them."""

    def __init__(self, ns: dict) -> None:
        super().__init__(ns)
        self.names: dict[str, None] = {}
        self.written: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        if key not in self.written:
            self.names[key] = None
        return super().__getitem__(key)

    def __setitem__(self, key: str, value: Any) -> None:
        self.written.add(key)
        super().__setitem__(key, value)


class _Fused:
    """One group function through ``torch.compile``, called on the entries it reads."""

    def __init__(self, group: str, function: Callable[[dict], None]) -> None:
        import torch

        self.group, self.function = group, function
        self.reads: tuple[str, ...] | None = None
        self.compiled = torch.compile(function, fullgraph=True, dynamic=False,
                                      options={"pattern_matcher": False})
        self.said = False  # whether the recompile limit has been reported

    def __call__(self, ns: dict) -> None:
        from torch._dynamo.exc import FailOnRecompileLimitHit

        if self.reads is None:
            recording = _Reads(ns)
            self.function(recording)
            self.reads = tuple(recording.names)
        local = {name: ns[name] for name in self.reads}
        try:
            self.compiled(local)
        except FailOnRecompileLimitHit:  # raised before the group runs: nothing half done
            if not self.said:
                self.said = True
                print(f"curvgap: fused: {self.group} has been compiled for as many sets of "
                      f"sizes as torch allows (torch._dynamo.config.recompile_limit); at "
                      f"other sizes it runs uncompiled", file=sys.stderr)
            self.function(ns)
            return
        except RuntimeError:  # a guard's assertion (or another failure) in the compiled code
            self.function(ns)  # uncompiled, it raises the guard's worded error
            raise
        ns.update(local)


def fuse(module: ModuleType) -> None:
    """``module``'s group functions replaced by their fused forms (see the module's doc)."""
    module._GROUPS = {group: (_Fused(group, function), requires)
                      for group, (function, requires) in module._GROUPS.items()}
