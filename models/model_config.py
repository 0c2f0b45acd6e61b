"""Model configs: ``depth`` blocks of one kind between an optional input embedding and an
optional final norm and output head, the loss on the last part's output. A model config is
TOML data, validated in full (each part as a sublayer config) and never evaluated::

    name = "digits_vit"
    depth = 2
    loss = "cross_entropy"
    [embedding]          # optional: Z = X W_E + b_E + P_E (options of kind "embedding")
    [block]              # the options of kind "block"
    norm_position = "pre"
    [norm]               # optional final norm (options of kind "layernorm")
    affine = true
    [head]               # optional: pooling and W_H, b_H (options of kind "head")
    pooling = "mean"

``tie_embeddings = true`` reads the head's ``W_H`` as the embedding's ``W_E`` transposed (a
language-model head tied to its token table, Hugging Face's ``tie_word_embeddings``): it needs
an ``[embedding]`` with its projection and a ``[head]`` over every row (``pooling = "none"``),
and its vocabulary is then both the embedding's ``p`` and the head's ``c``.
``share_relative_bias = true`` gives every block the first block's relative-position table
``E_rel`` (T5, whose later blocks reuse the first one's bias); it needs ``relative_bias`` in
``[block]``.

Parameters are named in the style of a ``state_dict``: ``embedding.W_E``, ``blocks.3.W_Q``,
``norm.gamma``, ``head.W_H``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ..derivations.config import Config, ConfigError, check_name, read_table, validate

#: The optional and required sections, with the kind of sublayer each holds.
SECTIONS = {"embedding": "embedding", "block": "block", "norm": "layernorm", "head": "head"}
#: The deepest model a config may ask for.
MAX_DEPTH = 256


@dataclass(frozen=True)
class ModelConfig:
    name: str
    depth: int
    loss: str
    block: Config
    embedding: Config | None = None
    norm: Config | None = None
    head: Config | None = None
    tie_embeddings: bool = False
    share_relative_bias: bool = False

    def ties(self) -> dict[str, str]:
        """The tied parameters, as :class:`~curvgap.models.Chain` takes them."""
        ties = {"head.W_H": "embedding.W_E.T"} if self.tie_embeddings else {}
        if self.share_relative_bias:
            ties.update({f"blocks.{k}.E_rel": "blocks.0.E_rel" for k in range(1, self.depth)})
        return ties

    def parts(self) -> list[tuple[str, Config]]:
        """The parts in order with their prefixes (``"embedding"``, ``"blocks.0"``, …,
        ``"norm"``, ``"head"``); the last carries the model's loss."""
        parts = [("embedding", self.embedding)] if self.embedding else []
        parts += [(f"blocks.{k}", self.block) for k in range(self.depth)]
        parts += [(prefix, part) for prefix, part in (("norm", self.norm), ("head", self.head))
                  if part]
        last_prefix, last = parts[-1]
        return parts[:-1] + [(last_prefix, replace(last, loss=self.loss))]

    def sublayers(self) -> list[Config]:
        """The distinct sublayer configs of the parts (``<name>_embedding``,
        ``<name>_block``, …), each generated as a module of its own; the last one with the
        model's loss."""
        distinct = {part.name: part for _, part in self.parts()}
        return list(distinct.values())


def is_model_table(data: dict) -> bool:
    """Whether a config file's table is a model config (it has ``depth``)."""
    return "depth" in data


def validate_model(data: dict, source: str = "model config") -> ModelConfig:
    """A :class:`ModelConfig` from a TOML table, or :class:`ConfigError` naming the entry."""
    allowed = ("name", "depth", "loss", "tie_embeddings", "share_relative_bias", *SECTIONS)
    unknown = [key for key in data if key not in allowed]
    if unknown:
        raise ConfigError(f"{source}: unknown key '{unknown[0]}'; allowed keys: "
                          + ", ".join(allowed))
    name = data.get("name")
    if not isinstance(name, str):
        raise ConfigError(f"{source}: 'name' is required (a Python identifier), got "
                          f"{name!r}")
    check_name(name, source)
    depth = data.get("depth")
    if not isinstance(depth, int) or isinstance(depth, bool) or not 1 <= depth <= MAX_DEPTH:
        raise ConfigError(f"{source}: 'depth' must be an int from 1 to {MAX_DEPTH} (the number "
                          f"of blocks), got {depth!r}")
    if "block" not in data:
        raise ConfigError(f"{source}: a [block] table is required (the options of the blocks; "
                          f"it may be empty)")
    parts = {}
    for section, kind in SECTIONS.items():
        if section not in data:
            continue
        table = data[section]
        where = f"{source} [{section}]"
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: expected a table of options, got {table!r}")
        for key in ("name", "kind", "loss"):
            if key in table:
                raise ConfigError(f"{where}: '{key}' is set by the model config, not by a "
                                  f"section; remove it")
        parts[section] = validate({**table, "name": f"{name}_{section}", "kind": kind}, where)
    loss = data.get("loss", "mse")
    validate({"name": name, "loss": loss}, source)  # a loss name, checked as for a sublayer
    tie, share = data.get("tie_embeddings", False), data.get("share_relative_bias", False)
    for key, value in (("tie_embeddings", tie), ("share_relative_bias", share)):
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: '{key}' must be true or false, got {value!r}")
    if share and not parts["block"].relative_bias:
        raise ConfigError(f"{source}: 'share_relative_bias' shares the blocks' E_rel: it needs "
                          f"relative_bias = true in [block]")
    if tie:
        embedding, head = parts.get("embedding"), parts.get("head")
        if embedding is None or not embedding.projection or head is None \
                or head.pooling != "none":
            raise ConfigError(f"{source}: 'tie_embeddings' reads the head's W_H as the "
                              f"embedding's W_E transposed: it needs an [embedding] with "
                              f"projection = true and a [head] with pooling = \"none\"")
    return ModelConfig(name, depth, loss, **parts, tie_embeddings=tie,
                       share_relative_bias=share)


def load_model(path: str | Path) -> ModelConfig:
    """Parse and validate one TOML model config file."""
    return validate_model(read_table(path), str(path))
