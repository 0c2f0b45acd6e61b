"""Curvature as linear operators and structured (Kronecker) blocks, on generated modules,
real layers and models."""

from .hessian import CurvatureOperator, hessian_operator
from .kronecker import KroneckerSum, kronecker_block

__all__ = ["CurvatureOperator", "KroneckerSum", "hessian_operator", "kronecker_block"]
