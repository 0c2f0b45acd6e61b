"""Whole models composed of generated blocks: :class:`Stack`, ``N`` blocks of one config."""

from .stack import Stack

__all__ = ["Stack"]
