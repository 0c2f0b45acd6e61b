"""Whole models composed of generated modules: :class:`Chain` (parts one after another),
:class:`Stack` (``N`` blocks of one config), :class:`Model` (a model config: embedding,
blocks, final norm, head)."""

from .chain import Chain, Stack
from .model import Model
from .model_config import ModelConfig, load_model, validate_model

__all__ = ["Chain", "Model", "ModelConfig", "Stack", "load_model", "validate_model"]
