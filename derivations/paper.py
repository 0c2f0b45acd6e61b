"""The paper's named objects of the post-LN block (Theorems 4-5), derived by the engine.

With ``S = ReLU(Y W_1) W_2 + Y``, ``Z = LN_2(S)``, ``Y = LN_1(X + F(X))``:

=========  =====================================  ===========================
name       meaning                                paper layout (rows × cols)
=========  =====================================  ===========================
``J_Z``    ``∂Z/∂S``                               ``(L·d) × (L·d)``
``H_Z``    ``∂²Z/∂S²``                             ``(L·d·L·d) × (L·d)``
``J_Y``    ``∂Y/∂U``, ``U = X + F``                  ``(L·d) × (L·d)``
``H_Y``    ``∂²Y/∂U²``                             ``(L·d·L·d) × (L·d)``
``J_SY``   ``∂S/∂Y``                               ``(L·d) × (L·d)``
``G_k``    ``∂F/∂W_k``, ``k ∈ {Q, K, V}``            ``(L·d) × n_k``
``Phi_kl`` ``∂G_k/∂W_l = ∂²F/∂W_k∂W_l``              ``(L·d·n_k) × n_l``
``B_i``    ``∂S/∂W_i``                             ``(L·d) × n_i``
``xi_ij``  ``∂B_i/∂W_j = ∂²S/∂W_i∂W_j``              ``(L·d·n_i) × n_j``
``H_tr_ij`` ``∂²Z/∂W_i∂W_j``                        ``(L·d·n_i) × n_j``
=========  =====================================  ===========================

Theorem 5 assembles ``H_tr_ij = (J_Z ⊗ I_{n_i}) xi_ij + (I_{L·d} ⊗ B_i^T) H_Z B_j``; each
object here is an index-form expression (row-major reshape gives the paper's layout), so
that identity can be checked term by term (tests/test_paper_block.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from . import calculus
from .config import Config
from .graph import Graph, Tensor
from .indexform import Expr
from .network import build_network

#: The paper's short names of the block's weights, and their parameters.
WEIGHTS = {"Q": "W_Q", "K": "W_K", "V": "W_V", "1": "W_1", "2": "W_2"}


@dataclass
class NamedObject:
    """A paper object: its index-form expression and its shape in the paper's layout."""

    name: str
    expr: Expr
    rows: sp.Expr
    cols: sp.Expr


class BlockObjects:
    """The named objects of a post-LN block config, derived on demand."""

    def __init__(self, config: Config) -> None:
        if config.kind != "block" or config.norm_position != "post":
            raise ValueError(f"config: the paper's named objects belong to the post-LN block; "
                             f"got kind {config.kind!r}, norm_position {config.norm_position!r}")
        self.graph = Graph()
        self.X, self.Z, self.params, _ = build_network(self.graph, config)
        self.forward = list(self.graph.assigns)
        self._tangents: dict[str, calculus.Tangents] = {}
        self._seconds: dict[tuple[str, str], calculus.Tangents] = {}
        self._objects: dict[str, NamedObject] = {}

    def tensor(self, name: str) -> Tensor:
        return self.graph.tensors[name]

    def _first(self, variable: str) -> calculus.Tangents:
        if variable not in self._tangents:
            with self.graph.group(f"paper_{variable}"):
                self._tangents[variable] = calculus.propagate(
                    self.graph, self.forward, calculus.seed(self.graph, self.tensor(variable)),
                    f"paper_{variable}")
        return self._tangents[variable]

    def _size(self, name: str) -> sp.Expr:
        return sp.Mul(*self.tensor(name).shape)

    def _jacobian(self, name: str, of: str, wrt: str) -> NamedObject:
        tangents = self._first(wrt)
        return NamedObject(name, tangents.of(self.tensor(of)), self._size(of),
                           self._size(wrt))

    def _second(self, name: str, of: str, first: str, second: str) -> NamedObject:
        if (first, second) not in self._seconds:
            a, b = self._first(first), self._first(second)
            renamed = {i: self.graph.index(i.dim, "q") for i in b.indices}
            with self.graph.group(f"paper_{first}_{second}"):
                self._seconds[first, second] = calculus.propagate_second(
                    self.graph, self.forward, a, b, renamed, f"paper_{first}{second}")
        both = self._seconds[first, second]
        return NamedObject(name, both.of(self.tensor(of)),
                           self._size(of) * self._size(first), self._size(second))

    def get(self, name: str) -> NamedObject:
        """``J_Z``, ``H_Z``, ``J_Y``, ``H_Y``, ``J_SY``, ``G_k``, ``Phi_kl``, ``B_i``,
        ``xi_ij`` or ``H_tr_ij`` (``i, j`` among ``Q K V 1 2``; ``k, l`` among ``Q K V``)."""
        if name not in self._objects:
            self._objects[name] = self._derive(name)
        return self._objects[name]

    def _derive(self, name: str) -> NamedObject:
        head, _, tail = name.partition("_")
        if name == "J_Z":
            return self._jacobian(name, "Z", "S")
        if name == "H_Z":
            return self._second(name, "Z", "S", "S")
        if name == "J_Y":
            return self._jacobian(name, "Y", "U")
        if name == "H_Y":
            return self._second(name, "Y", "U", "U")
        if name == "J_SY":
            return self._jacobian(name, "S", "Y")
        if head == "G" and tail in ("Q", "K", "V"):
            return self._jacobian(name, "F", WEIGHTS[tail])
        if head == "Phi" and len(tail) == 2 and set(tail) <= set("QKV"):
            return self._second(name, "F", WEIGHTS[tail[0]], WEIGHTS[tail[1]])
        if head == "B" and tail in WEIGHTS:
            return self._jacobian(name, "S", WEIGHTS[tail])
        if head == "xi" and len(tail) == 2 and set(tail) <= set(WEIGHTS):
            return self._second(name, "S", WEIGHTS[tail[0]], WEIGHTS[tail[1]])
        if name.startswith("H_tr_") and len(name) == 7 and set(name[5:]) <= set(WEIGHTS):
            return self._second(name, "Z", WEIGHTS[name[5]], WEIGHTS[name[6]])
        raise ValueError(f"name: expected J_Z, H_Z, J_Y, H_Y, J_SY, G_k, Phi_kl, B_i, xi_ij "
                         f"or H_tr_ij with i, j in Q K V 1 2 (k, l in Q K V), got {name!r}")

