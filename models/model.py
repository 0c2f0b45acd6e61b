"""A model from its config (:mod:`.config`): the chain of its parts' generated modules."""

from __future__ import annotations

from pathlib import Path

from ..codegen.resources import MODEL_CONFIGS
from .chain import Chain
from .generation import generated
from .model_config import ModelConfig, load_model


class Model(Chain):
    """The parts of ``config`` (a :class:`ModelConfig`, the path of its TOML file, or the name
    of a model config shipped in ``configs/models/``, such as ``"digits_vit"``) as a
    :class:`Chain`: parameters named ``"embedding.W_E"``, ``"blocks.0.W_Q"``, …,
    ``"norm.gamma"``, ``"head.W_H"`` (not with ``tie_embeddings``: ``W_H`` is then
    ``embedding.W_E`` transposed); the loss on the last part's output. One module per
    distinct part is derived (cached), whatever the depth."""

    def __init__(self, config: ModelConfig | str | Path, backend: str = "torch") -> None:
        if isinstance(config, str) and config.isidentifier():
            config = MODEL_CONFIGS / f"{config}.toml"
        if not isinstance(config, ModelConfig):
            config = load_model(config)
        self.config = config
        super().__init__(generated(config.parts(), backend), backend, config.ties())
