"""The configuration schema: parsed from TOML as data, validated in full.

A config is never evaluated; every value that reaches generated code is checked here
against a closed set of choices (or, for ``name``, against the rules of a Python
identifier).
"""

from __future__ import annotations

import keyword
import math
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

CHOICES = {
    "kind": ("block", "self_attention", "layernorm", "ffn", "embedding", "head"),
    "norm": ("layernorm", "rmsnorm"),
    "norm_position": ("post", "pre", "parallel"),
    "activation": ("relu", "gelu", "gelu_tanh", "gelu_fast", "quick_gelu", "silu", "tanh",
                   "sigmoid", "softplus", "identity"),
    "loss": ("mse", "cross_entropy", "linear"),
    "pooling": ("none", "mean", "first"),
    "value_width": ("d/h", "d_k"),
    "rotary_scaling": ("none", "linear", "dynamic", "llama3", "yarn"),
}
#: The projections ``attention_bias`` may name, in the order they are written.
BIASED_PROJECTIONS = "qkvo"
#: The options of each rotary scaling (HF's ``rope_scaling`` keys), beside ``rotary_factor``.
ROTARY_SCALING_OPTIONS = {
    "none": (), "linear": (), "dynamic": ("rotary_original_length",),
    "llama3": ("rotary_original_length", "rotary_low_freq_factor", "rotary_high_freq_factor"),
    "yarn": ("rotary_original_length", "rotary_beta_fast", "rotary_beta_slow",
             "rotary_attention_factor"),
}

#: Options that mean something for each kind; the others must keep their defaults.
APPLIES_TO = {
    "norm": ("block", "layernorm", "head"),
    "norm_position": ("block",),
    "eps": ("block", "layernorm", "head"),
    "affine": ("block", "layernorm", "head"),
    "heads": ("block", "self_attention"),
    "causal": ("block", "self_attention"),
    "out_proj": ("block", "self_attention"),
    "attention_bias": ("block", "self_attention"),
    "attention_scale": ("block", "self_attention"),
    "kv_heads": ("block", "self_attention"),
    "rotary": ("block", "self_attention"),
    "rotary_base": ("block", "self_attention"),
    "rotary_fraction": ("block", "self_attention"),
    "rotary_scaling": ("block", "self_attention"),
    "rotary_factor": ("block", "self_attention"),
    "rotary_original_length": ("block", "self_attention"),
    "rotary_low_freq_factor": ("block", "self_attention"),
    "rotary_high_freq_factor": ("block", "self_attention"),
    "rotary_beta_fast": ("block", "self_attention"),
    "rotary_beta_slow": ("block", "self_attention"),
    "rotary_attention_factor": ("block", "self_attention"),
    "value_width": ("block", "self_attention"),
    "relative_bias": ("block", "self_attention"),
    "cross_attention": ("block", "self_attention"),
    "relative_buckets": ("block", "self_attention"),
    "relative_max_distance": ("block", "self_attention"),
    "norm_bias": ("block", "layernorm", "head"),
    "norm_offset": ("block", "layernorm", "head"),
    "shared_norm": ("block",),
    "layer_scale": ("block",),
    "sandwich_norm": ("block",),
    "logit_softcap": ("block", "self_attention"),
    "activation": ("block", "ffn"),
    "ffn_bias": ("block", "ffn"),
    "ffn_gate": ("block", "ffn"),
    "projection": ("embedding",),
    "embedding_bias": ("embedding",),
    "positional": ("embedding",),
    "class_token": ("embedding",),
    "pooling": ("head",),
    "head_bias": ("head",),
    "pooled_norm": ("head",),
    "pooler": ("head",),
}


#: The longest config name (it names the generated files).
MAX_NAME = 64
#: The largest config file read, in bytes (a config is a few lines).
MAX_BYTES = 1 << 20


class ConfigError(ValueError):
    """A config entry that is unknown, mistyped or out of range."""


@dataclass(frozen=True)
class Config:
    name: str = "paper_block"
    kind: str = "block"
    norm: str = "layernorm"
    norm_position: str = "post"
    eps: float = 0.0
    affine: bool = False
    heads: int = 1
    causal: bool = False
    out_proj: bool = False
    attention_bias: str = ""  # the biased projections, letters of "qkvo" (true: all of them)
    attention_scale: float = 0.0  # 0: 1/sqrt(d_k)
    kv_heads: int = 0  # key/value heads (grouped-query attention); 0: as many as heads
    rotary: bool = False  # rotary position embeddings on Q and K (rotate-half convention)
    rotary_base: float = 10000.0
    rotary_fraction: float = 1.0  # the share of a head's entries that turn, 2/n (GPT-NeoX, Phi)
    rotary_scaling: str = "none"  # the angle table's scaling (HF's rope_scaling "rope_type")
    rotary_factor: float = 1.0  # the scaling's factor
    rotary_original_length: int = 0  # the length trained on (original_max_position_embeddings)
    rotary_low_freq_factor: float = 1.0  # llama3
    rotary_high_freq_factor: float = 4.0  # llama3
    rotary_beta_fast: float = 32.0  # yarn
    rotary_beta_slow: float = 1.0  # yarn
    rotary_attention_factor: float = 0.0  # yarn: the amplitude of cos, sin; 0: 0.1 ln(f) + 1
    relative_bias: bool = False  # T5's learned bias per head and offset bucket on the scores
    relative_buckets: int = 32  # T5's relative_attention_num_buckets
    relative_max_distance: int = 128  # T5's relative_attention_max_distance
    value_width: str = "d/h"  # a head's value width: d/h, or d_k as queries' (Gemma, T5)
    cross_attention: bool = False  # keys and values from a second input M (encoder states);
    # in a block, a cross-attention sublayer (W_Q_c, ...; its norm gamma_3) after self-attention
    norm_bias: bool = True
    norm_offset: bool = False  # RMSNorm scaled by (1 + gamma), as Gemma's
    shared_norm: bool = False  # a parallel block's two branches read one norm (Phi, Falcon)
    layer_scale: bool = False  # a learned per-channel scale on each branch (LayerScale)
    sandwich_norm: bool = False  # each branch's output normalised too (Gemma 2), pre-norm
    logit_softcap: float = 0.0  # attention scores cap * tanh(scores / cap) (Gemma 2); 0: none
    activation: str = "relu"
    ffn_bias: bool = False
    ffn_gate: bool = False
    projection: bool = True  # X W_E; without it X is already embedded (L×d)
    embedding_bias: bool = True
    positional: bool = True  # a learned positional embedding (L×d)
    class_token: bool = False  # the first row is a learned token (a ViT's class token)
    pooling: str = "none"  # of the rows before a head: none, mean or first
    head_bias: bool = True
    pooled_norm: bool = False  # the pooled row normalised before the head (timm's fc_norm)
    pooler: bool = False  # the pooled row through tanh(U W_P + b_P) first (BERT's pooler)
    loss: str = "mse"


def _check_type(key: str, value: object, default: object, source: str) -> None:
    expected = type(default)
    ok = isinstance(value, expected) and not (expected is int and isinstance(value, bool))
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise ConfigError(f"{source}: '{key}' must be a {expected.__name__}, "
                          f"got {value!r} ({type(value).__name__})")


def check_name(name: str, source: str) -> None:
    """:class:`ConfigError` unless ``name`` can name generated files: a Python identifier
    (ASCII, not a keyword), at most :data:`MAX_NAME` characters, not starting with ``__``."""
    if not name.isidentifier() or keyword.iskeyword(name) or not name.isascii():
        raise ConfigError(f"{source}: 'name' must be a Python identifier (letters, digits, "
                          f"underscores, not starting with a digit, not a keyword), "
                          f"got {name!r}")
    if len(name) > MAX_NAME:
        raise ConfigError(f"{source}: 'name' must have at most {MAX_NAME} characters (it "
                          f"names files), got {len(name)} characters")
    if name.startswith("__"):
        raise ConfigError(f"{source}: 'name' must not start with '__' (names such as "
                          f"__init__ are Python's own module files), got {name!r}")


def validate(data: dict, source: str = "config") -> Config:
    """A :class:`Config` from a TOML table, or :class:`ConfigError` naming the entry."""
    known = {f.name: f.default for f in fields(Config)}
    for key in data:
        if key not in known:
            raise ConfigError(f"{source}: unknown key '{key}'; allowed keys: "
                              + ", ".join(known))
    if "name" not in data:
        raise ConfigError(f"{source}: 'name' is required (a Python identifier, "
                          "the module name under generated/)")
    if "attention_bias" in data:
        data = {**data, "attention_bias": _biases(data, source)}
    for key, value in data.items():
        _check_type(key, value, known[key], source)
    check_name(data["name"], source)
    from .losses import names as loss_names

    for key, allowed in {**CHOICES, "loss": loss_names()}.items():
        if key in data and data[key] not in allowed:
            raise ConfigError(f"{source}: '{key}' must be one of {', '.join(allowed)}; "
                              f"got {data[key]!r}")
    eps = float(data.get("eps", 0.0))
    if not math.isfinite(eps) or eps < 0:
        raise ConfigError(f"{source}: 'eps' must be a finite number >= 0, got {eps!r}")
    scale = float(data.get("attention_scale", 0.0))
    if not math.isfinite(scale) or scale < 0:
        raise ConfigError(f"{source}: 'attention_scale' must be a finite number > 0 (or 0 for "
                          f"1/sqrt(d_k)), got {data['attention_scale']!r}")
    if data.get("heads", 1) < 1:
        raise ConfigError(f"{source}: 'heads' must be >= 1, got {data['heads']!r}")
    heads, kv_heads = data.get("heads", 1), data.get("kv_heads", 0)
    if kv_heads < 0 or (kv_heads and heads % kv_heads):
        raise ConfigError(f"{source}: 'kv_heads' must divide heads = {heads} (or be 0 for as "
                          f"many as heads), got {kv_heads!r}")
    cap = float(data.get("logit_softcap", 0.0))
    if not math.isfinite(cap) or cap < 0:
        raise ConfigError(f"{source}: 'logit_softcap' must be a finite number > 0 (or 0 for "
                          f"none), got {data['logit_softcap']!r}")
    _check_rotary(data, source)
    _check_relative(data, source)
    if data.get("cross_attention", False):
        _check_cross(data, source)
    floats = {key: float(data[key]) for key in data
              if key.startswith("rotary_") and isinstance(Config.__dataclass_fields__[key]
                                                         .default, float)}
    config = Config(**{**data, **floats, "eps": eps, "attention_scale": scale,
                       "logit_softcap": cap, "kv_heads": 0 if kv_heads == heads else kv_heads})
    for key, kinds in APPLIES_TO.items():
        if config.kind not in kinds and getattr(config, key) != known[key]:
            raise ConfigError(f"{source}: '{key}' applies to kind {' or '.join(kinds)}, "
                              f"not to kind '{config.kind}'; remove it")
    norm_keys = [key for key in ("norm", "eps", "affine", "norm_bias", "norm_offset")
                 if key in data]
    if config.kind == "head" and norm_keys and not config.pooled_norm:
        raise ConfigError(f"{source}: '{norm_keys[0]}' sets the norm of a head's pooled row; "
                          "it needs pooled_norm = true")
    if (config.pooled_norm or config.pooler) and config.pooling == "none":
        key = "pooled_norm" if config.pooled_norm else "pooler"
        raise ConfigError(f"{source}: '{key}' acts on the pooled row; it needs pooling = "
                          "\"mean\" or \"first\" (a norm of every row is a model's [norm])")
    if not config.norm_bias and not (config.norm == "layernorm" and config.affine):
        raise ConfigError(f"{source}: 'norm_bias' = false drops the beta of an affine "
                          "LayerNorm; it needs norm = \"layernorm\" and affine = true")
    if config.norm_offset and not (config.norm == "rmsnorm" and config.affine):
        raise ConfigError(f"{source}: 'norm_offset' scales by (1 + gamma); it needs "
                          "norm = \"rmsnorm\" and affine = true")
    if config.shared_norm and config.norm_position != "parallel":
        raise ConfigError(f"{source}: 'shared_norm' shares one norm between the branches of a "
                          "parallel block; it needs norm_position = \"parallel\"")
    if config.layer_scale and config.norm_position == "post":
        raise ConfigError(f"{source}: 'layer_scale' scales a residual branch before it is "
                          "added; it needs norm_position = \"pre\" or \"parallel\"")
    if config.sandwich_norm and config.norm_position != "pre":
        raise ConfigError(f"{source}: 'sandwich_norm' normalises each branch's output before "
                          "it is added; it needs norm_position = \"pre\"")
    if "o" in config.attention_bias and not config.out_proj:
        raise ConfigError(f"{source}: 'attention_bias' names b_O (\"o\"), which needs "
                          "out_proj = true")
    if config.value_width == "d_k" and not config.out_proj:
        raise ConfigError(f"{source}: 'value_width' = \"d_k\" gives heads of width d_k, which "
                          "W_O maps back to d; it needs out_proj = true")
    if config.heads > 1 and not config.out_proj:
        raise ConfigError(f"{source}: heads = {config.heads} needs out_proj = true: "
                          "concatenating heads without W_O is not derived yet")
    return config


def _biases(data: dict, source: str) -> str:
    """``attention_bias`` as the letters of its biased projections in ``"qkvo"`` order:
    ``true`` is every projection there is (``b_O`` only with ``out_proj``)."""
    value = data["attention_bias"]
    if isinstance(value, bool):
        return ("qkvo" if data.get("out_proj", False) else "qkv") if value else ""
    letters = set(value) if isinstance(value, str) else None
    if not letters or not letters <= set(BIASED_PROJECTIONS) or len(letters) != len(value):
        raise ConfigError(f"{source}: 'attention_bias' must be true, false or the biased "
                          f"projections as distinct letters of \"qkvo\" (\"qkv\": Qwen2, \"qvo\": "
                          f"EVA), got {value!r}")
    return "".join(p for p in BIASED_PROJECTIONS if p in letters)


def _check_rotary(data: dict, source: str) -> None:
    """:class:`ConfigError` unless the rotary options are in range and go together."""
    rotary_keys = [key for key in data if key.startswith("rotary_")]
    if rotary_keys and not data.get("rotary", False):
        raise ConfigError(f"{source}: '{rotary_keys[0]}' needs rotary = true")
    base = float(data.get("rotary_base", 10000.0))
    if not math.isfinite(base) or base <= 1:
        raise ConfigError(f"{source}: 'rotary_base' must be a finite number > 1, got "
                          f"{data['rotary_base']!r}")
    fraction = float(data.get("rotary_fraction", 1.0))
    chunks = 2 / fraction if math.isfinite(fraction) and fraction > 0 else 0.0
    if not (chunks >= 2 and chunks == round(chunks)):
        raise ConfigError(f"{source}: 'rotary_fraction' must be 2/n for an integer n >= 2 "
                          f"(1, 2/3, 1/2, 0.4, 1/3, 0.25, ...: a head's width splits into n "
                          f"equal chunks, the first two turn), got {data['rotary_fraction']!r}")
    scaling = data.get("rotary_scaling", "none")
    allowed = ROTARY_SCALING_OPTIONS.get(scaling, ())
    for key in rotary_keys:
        if key in ("rotary_base", "rotary_fraction", "rotary_scaling"):
            continue
        if key == "rotary_factor" and scaling != "none":
            continue
        if key not in allowed:
            raise ConfigError(f"{source}: '{key}' does not apply to rotary_scaling = "
                              f"{scaling!r}; remove it")
    for key in ("rotary_factor", "rotary_low_freq_factor", "rotary_high_freq_factor",
                "rotary_beta_fast", "rotary_beta_slow"):
        value = float(data.get(key, 1.0))
        if not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{source}: '{key}' must be a finite number > 0, got "
                              f"{data[key]!r}")
    if scaling != "none" and float(data.get("rotary_factor", 1.0)) < 1:
        raise ConfigError(f"{source}: 'rotary_factor' must be >= 1 (a context stretched "
                          f"that many times), got {data['rotary_factor']!r}")
    amplitude = float(data.get("rotary_attention_factor", 0.0))
    if not math.isfinite(amplitude) or amplitude < 0:
        raise ConfigError(f"{source}: 'rotary_attention_factor' must be a finite number > 0 "
                          f"(or 0 for 0.1 ln(factor) + 1), got {data['rotary_attention_factor']!r}")
    if scaling in ("dynamic", "llama3", "yarn") and data.get("rotary_original_length", 0) < 1:
        raise ConfigError(f"{source}: rotary_scaling = {scaling!r} needs "
                          "'rotary_original_length' >= 1 (the length trained on, HF's "
                          "original_max_position_embeddings)")
    if scaling == "llama3" and (float(data.get("rotary_high_freq_factor", 4.0))
                                <= float(data.get("rotary_low_freq_factor", 1.0))):
        raise ConfigError(f"{source}: 'rotary_high_freq_factor' must be larger than "
                          "'rotary_low_freq_factor'")


def _check_cross(data: dict, source: str) -> None:
    """:class:`ConfigError` for terms a cross-attention cannot take: in its own sublayer,
    position terms (``M``'s rows have no order relative to ``X``'s; in a block they are the
    self-attention's); in a block, the layouts whose third sublayer is not defined."""
    if data.get("kind") == "self_attention":
        crossed = [key for key in ("causal", "rotary", "relative_bias") if data.get(key)]
        if crossed:
            raise ConfigError(f"{source}: 'cross_attention' attends to the rows of a second "
                              f"input M, which have no order relative to X's rows: it cannot "
                              f"go with {crossed[0]} = true")
        return
    if data.get("norm_position", "post") == "parallel":
        raise ConfigError(f"{source}: 'cross_attention' adds a third sublayer between "
                          f"self-attention and the FFN: it needs norm_position = \"post\" or "
                          f"\"pre\", not \"parallel\"")
    for key in ("sandwich_norm", "layer_scale"):
        if data.get(key):
            raise ConfigError(f"{source}: 'cross_attention' in a block does not go with "
                              f"{key} = true (their norms and scales are for two branches)")


def _check_relative(data: dict, source: str) -> None:
    """:class:`ConfigError` unless the relative-position options are in range and go with
    ``relative_bias``."""
    keys = [key for key in ("relative_buckets", "relative_max_distance") if key in data]
    if keys and not data.get("relative_bias", False):
        raise ConfigError(f"{source}: '{keys[0]}' needs relative_bias = true")
    buckets = data.get("relative_buckets", 32)
    least = 4 if not data.get("causal", False) else 2
    if buckets < least or buckets % 2:
        raise ConfigError(f"{source}: 'relative_buckets' must be an even number >= {least} "
                          f"(half of each direction's exact offsets), got {buckets!r}")
    exact = buckets // (4 if least == 4 else 2)
    distance = data.get("relative_max_distance", 128)
    if distance <= exact:
        raise ConfigError(f"{source}: 'relative_max_distance' must exceed the {exact} exact "
                          f"offsets, got {distance!r}")


def load(path: str | Path) -> Config:
    """Parse and validate one TOML config file (UTF-8, at most :data:`MAX_BYTES`)."""
    return validate(read_table(path), str(path))


def read_table(path: str | Path) -> dict:
    """The TOML table of one config file (UTF-8, at most :data:`MAX_BYTES`), parsed as data,
    or :class:`ConfigError` naming what is wrong with the file."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"--config: expected a TOML file, got the folder {str(path)!r}")
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"--config: no such file {str(path)!r}") from None
    except OSError as error:
        raise ConfigError(f"--config: cannot read {str(path)!r}: {error.strerror}") from None
    if len(data) > MAX_BYTES:
        raise ConfigError(f"{path}: expected a config of at most {MAX_BYTES} bytes, got a "
                          "larger file (a config is a few lines of TOML)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: expected UTF-8 text (TOML is UTF-8), got byte "
                          f"0x{data[error.start]:02x} at position {error.start}") from None
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML: {error}") from None
    return table
