"""Whole models composed of generated modules: :class:`Chain` (parts one after another),
:class:`Stack` (``N`` blocks of one config)."""

from .chain import Chain, Stack

__all__ = ["Chain", "Stack"]
