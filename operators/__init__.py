"""Curvature as linear operators and structured (Kronecker) blocks, on generated modules,
real layers and models."""

from .hessian import CurvatureOperator, hessian_operator

__all__ = ["CurvatureOperator", "hessian_operator"]
