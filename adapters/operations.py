"""Readers of further operations real Transformer modules use, each with its exact rule (the
same signature as :class:`~.reader.Reader`'s ``_read_<operation>`` methods, registered into
:data:`~.reader.READERS`):

* ``repeat``: a tiling, read as a broadcast (each repeated dimension factored into
  ``(copies, entries)``, the copies an axis the tensor lacks);
* ``pad`` / ``constant_pad_nd`` (constant mode): a placement ``S[out, in]`` along each padded
  dimension plus the fill value on the entries it adds;
* ``baddbmm``: ``β input + α batch1 @ batch2``;
* ``einsum``: its contraction, one einsum of the program;
* ``linalg_vector_norm`` (order 2): ``sqrt(Σ x²)``, an elementwise function of a sum of
  squares;
* ``gather``, ``index_select`` by constant indices (the one-hot rows of the indices, as an
  embedding), and ``topk``'s values (``gather(x, indices)``, the indices a constant: autograd
  treats them so too);
* interpolation (``upsample_*``, ``_upsample_*_aa``) along fixed sizes: a linear map with
  constant coefficients, its matrix made at call time by the operation itself on an identity
  basis.
"""

from __future__ import annotations

import operator

import sympy as sp
import torch

from ..derivations.functions import x
from .axes import Axis, align
from .reader import READERS, TOKENS, Value, _extent, _number, _path, reads

aten = torch.ops.aten


def _own(self, value: Value, what: str) -> Value:
    """``value``, refused where it is not a tensor the program computes (token ids)."""
    if value.constant is not None:
        raise self.refuse(f"{what} of a tensor computed from X or the parameters "
                          "(not of token ids)")
    return value


def _extent_of(self, dim: list[Axis]) -> int | sp.Expr:
    return sp.Mul(*[a.extent for a in dim]) if dim else 1


# -- repeat ------------------------------------------------------------------------------------
@reads(aten.repeat.default)
def _read_repeat(self, node, source, repeats) -> Value:
    """``source.repeat(r…)``: dimension ``k`` of the result is ``(r_k, n_k)`` row-major, its
    entry independent of the copy: the copies a broadcast axis (leading new dimensions
    too)."""
    value = _own(self, self.value(source), "a repeat")
    out = self.shape_of(node)
    before = self.shape_of(source)
    extra = len(out) - len(before)
    dims = [[] for _ in range(extra)] + [list(d) for d in value.dims]
    leaves = [[] for _ in range(extra)] + self.leaf_dims(value)
    for k, extent in enumerate(out):
        given = before[k - extra] if k >= extra else 1
        copies = sp.simplify(sp.sympify(extent) / given)
        if copies == 1:
            continue
        if any(self.is_batch(a) for a in leaves[k]):
            raise self.refuse("a repeat along the features, not along the batch")
        if dims[k] and not copies.is_Integer:
            raise self.refuse("a repeat along a dimension of more than one entry by a count "
                              "fixed when the module is read (this one is bound at call "
                              f"time: {copies})")
        dims[k] = [Axis(self.size((node.name, "copies", k), copies))] + dims[k]
    return self._with_dims(value, dims)
