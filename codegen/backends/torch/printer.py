"""The PyTorch backend's printer."""

from __future__ import annotations

import sympy as sp

from ... import ir
from ..array_printer import ArrayPrinter


class TorchPrinter(ArrayPrinter):
    module = "torch"
    axis_keyword = "dim"

    def transposed(self, name: str) -> str:
        return f"{name}.mT"

    def permuted(self, name: str, axes: tuple[int, ...], copy: bool) -> str:
        view = f"{name}.permute{axes}"
        return self.row_major(view) if copy else view

    def row_major(self, value: str) -> str:
        simple = " " not in value or value.startswith("torch.einsum(")
        return f"{value}.contiguous()" if simple else f"({value}).contiguous()"

    def add_scaled(self, target: str, tie: str | None, value: str | None,
                   coeff: sp.Expr) -> str:
        if value is None or coeff == 1:
            return super().add_scaled(target, tie, value, coeff)
        # one fused kernel instead of a scaled temporary and an addition
        return f"{target}.add_({value}, alpha={self.coefficient(coeff)})"

    def _print_Max(self, expr: sp.Max) -> str:
        arg, floor = (a for a in expr.args if a != 0), 0
        return f"torch.clamp({self._print(next(arg))}, min={floor})"

    def _print_Heaviside(self, expr: sp.Heaviside) -> str:
        arg = self._print(expr.args[0])
        return f"({arg} > 0).to({arg}.dtype)"

    def _print_RowMax(self, node: ir.RowMax) -> str:
        return f"{node.result} = {node.source}.amax(dim=-1)"

    def tied(self, target: str, spec: str) -> str:
        return f'_tied({target}, "{spec}")'
