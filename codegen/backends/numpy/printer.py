"""The numpy backend's printer."""

from __future__ import annotations

import sympy as sp

from ... import ir
from ..array_printer import ArrayPrinter


class NumpyPrinter(ArrayPrinter):
    module = "np"

    def _print_Max(self, expr: sp.Max) -> str:
        return f"np.maximum({', '.join(self._print(a) for a in expr.args)})"

    def _print_erf(self, expr: sp.Function) -> str:
        return f"_erf({self._print(expr.args[0])})"

    def _print_Heaviside(self, expr: sp.Heaviside) -> str:
        # the indicator of x > 0: the almost-everywhere derivative of max(x, 0)
        arg = self._print(expr.args[0])
        return f"({arg} > 0).astype({arg}.dtype)"

    axis_keyword = "axis"

    def einsum(self, spec: str, operands: tuple[str, ...]) -> str:
        # optimize=True lets numpy hand a pairwise contraction to BLAS (tensordot)
        optimize = ", optimize=True" if len(operands) > 1 else ""
        return f'np.einsum("{spec}", {", ".join(operands)}{optimize})'

    def transposed(self, name: str) -> str:
        return f"np.swapaxes({name}, -1, -2)"

    def permuted(self, name: str, axes: tuple[int, ...], copy: bool) -> str:
        view = f"{name}.transpose{axes}"
        return self.row_major(view) if copy else view

    def row_major(self, value: str) -> str:
        return f"np.ascontiguousarray({value})"

    def _print_RowMax(self, node: ir.RowMax) -> str:
        return f"{node.result} = {node.source}.max(axis=-1)"

    def tied(self, target: str, spec: str) -> str:
        # numpy's einsum returns a writeable view for a pure diagonal selection
        return f'np.einsum("{spec}", {target})'
