"""The rules that lower single ATen operations into program operations, one small function
per operation (``read_<operation>(reader, node, *args)``: the operation's arguments as the
graph gives them, the :class:`~curvgap.adapters.builder.Builder` to write with), grouped by
kind: :mod:`.shapes` (views, selections, concatenations, pads), :mod:`.arithmetic`
(elementwise), :mod:`.reductions`, :mod:`.linear` (linear maps, einsums), :mod:`.attention`
(softmax, normalisation, ``scaled_dot_product_attention``) and :mod:`.tables` (lookups,
gathers, interpolation). A table of the program's own (a selection, a causal mask) is made at
call time by the maker its rule registers (:data:`MAKERS`)."""

from . import arithmetic, attention, linear, reductions, shapes, tables  # noqa: F401 - register
from .registry import MAKERS, RULES, make_table, makes, rule

__all__ = ["MAKERS", "RULES", "make_table", "makes", "rule"]
