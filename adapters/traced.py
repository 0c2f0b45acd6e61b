"""A module traced for one kind of inputs, and what computes its derivatives: the generated
module of its one part, or the chain of its parts' modules, generated on first use."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from types import ModuleType

from ..codegen.cache import module_for
from ..models import Chain
from .trace import Trace


@dataclass
class Traced:
    """A module traced for one kind of inputs: its trace, the module's name of each of the
    runners' parameters (in their order), each part's prefix in a chain, and the runners made
    so far by scope (:meth:`runner`)."""

    trace: Trace
    names: dict[str, str]
    prefixes: list[str]
    fused: bool = False
    #: read from disk and not yet checked against the module (:mod:`.readings`)
    from_disk: bool = False
    runners: dict[str, ModuleType | Chain] = field(default_factory=dict)

    @property
    def chained(self) -> bool:
        return len(self.trace.programs) > 1

    def runner(self, scope: str = "products", chained: bool = False) -> ModuleType | Chain:
        """What computes this module's derivatives, derived for ``scope``, generated on first
        use: for ``"products"`` (loss, gradient, HVP and GN products) the chain of its parts'
        modules (one part or several); for ``"blocks"`` (Hessian blocks, Jacobians,
        diagonals too) the generated module of its one part, or the chain of its parts (of
        one part too when ``chained``: a diagonal in bounded memory)."""
        key = f"{scope} chained" if chained else scope
        if key not in self.runners:
            programs = [dataclasses.replace(p, scope=scope) for p in self.trace.programs]
            # the blocks' generated code takes views (as_strided at a storage offset) that
            # torch.compile cannot trace: they run unfused
            fused = self.fused and scope == "products"
            if self.fused and not fused:
                warnings.warn("fused=True: Hessian blocks, Jacobians and diagonals "
                              "(loss_hessian, diagonal, jacobian, kronecker_block) run unfused "
                              "(torch.compile cannot trace their generated code); the loss, "
                              "gradient and products stay fused", stacklevel=4)
            if len(programs) == 1 and scope != "products" and not chained:
                self.runners[key] = module_for(programs[0], fused=fused)
            else:
                self.runners[key] = Chain.generate([(prefix[:-1], program) for prefix, program
                                                    in zip(self.prefixes, programs)], fused=fused)
        return self.runners[key]
