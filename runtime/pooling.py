"""Pooled rows: the weights of the rows a pooling keeps (their mean, the first, or all but
the first), passed to a module for each call. Copied into a module whose dimensions include
``n_1`` (the one row a pooling keeps)."""

# -- stand-ins: the generated module defines these (not copied) --
# the backend's primitives: numpy_arrays.py stands for torch_arrays.py (the same names)
from .numpy_arrays import _floats

# -- end stand-ins --


def _row_weights(ns, length, kind):
    """``(1, length)`` row weights: ``1/length`` each (mean), ``e_0`` (first), ``1 - e_0``."""
    if kind == "mean":
        return _floats([[1 / length] * length], ns["X"])
    first = [1.0] + [0.0] * (length - 1)
    return _floats([first if kind == "first" else [1.0 - w for w in first]], ns["X"])
