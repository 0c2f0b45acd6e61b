"""The layers and models users study, built from their libraries' config classes with random
nonzero weights (float64, eval mode), at sizes where ``L``, ``d``, ``d_k`` and ``d_ff`` all
differ: ``L = 5``, ``d = 8``, two heads (``d_k = 4``), ``d_ff = 12``, a batch of 2.

Each :class:`Case` says how to call the module (``X``, keyword inputs such as masks), its
loss and target, and whether the library computes in float32 inside a float64 module (then
the reference is the module's float64 twin, :func:`reference.float64_twin`, and the module
itself agrees to 1e-5)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from conftest import extra_module, import_timm
from reference import randomise

B, L, D, HEADS, D_FF = 2, 5, 8, 2, 12
DTYPE = torch.float64


@dataclass
class Case:
    module: torch.nn.Module
    X: torch.Tensor | None
    T: torch.Tensor
    inputs: dict[str, Any] = field(default_factory=dict)
    loss: str = "mse"
    float32_inside: bool = False

    @property
    def reference_X(self) -> torch.Tensor | None:
        return self.X


def _rows(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(B, L, D, generator=generator, dtype=DTYPE),
            torch.randn(B, L, D, generator=generator, dtype=DTYPE))


def _padding() -> torch.Tensor:
    """A padding mask (1 keep, 0 pad): the first sample's last two positions padded."""
    mask = torch.ones(B, L, dtype=torch.long)
    mask[0, -2:] = 0
    return mask


def encoder_layer(norm_first: bool = False, activation: str = "relu",
                  batch_first: bool = True, mask: str = "") -> Case:
    torch.manual_seed(0)
    layer = randomise(torch.nn.TransformerEncoderLayer(
        D, HEADS, D_FF, activation=activation, norm_first=norm_first, batch_first=batch_first,
        dtype=DTYPE))
    X, T = _rows()
    inputs: dict[str, Any] = {}
    if mask == "causal":
        inputs = {"src_mask": torch.nn.Transformer.generate_square_subsequent_mask(
            L, dtype=DTYPE), "is_causal": True}
    elif mask == "padding":
        inputs = {"src_key_padding_mask": _padding() == 0}
    if not batch_first:
        X, T = X.transpose(0, 1).contiguous(), T.transpose(0, 1).contiguous()
    return Case(layer, X, T, inputs)


def encoder(mask: bool = False) -> Case:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(D, HEADS, D_FF, batch_first=True, dtype=DTYPE)
    model = randomise(torch.nn.TransformerEncoder(
        layer, 2, norm=torch.nn.LayerNorm(D, dtype=DTYPE), enable_nested_tensor=False))
    X, T = _rows()
    inputs = ({"mask": torch.nn.Transformer.generate_square_subsequent_mask(L, dtype=DTYPE)}
              if mask else {})
    return Case(model, X, T, inputs)


class SelfAttention(torch.nn.Module):
    """``nn.MultiheadAttention`` used as self-attention, its output only."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(D, HEADS, batch_first=True, dtype=DTYPE)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.attn(x, x, x, attn_mask=attn_mask, need_weights=False)[0]


def multihead_attention(mask: bool = False) -> Case:
    torch.manual_seed(0)
    X, T = _rows()
    inputs = ({"attn_mask": torch.nn.Transformer.generate_square_subsequent_mask(
        L, dtype=DTYPE)} if mask else {})
    return Case(randomise(SelfAttention()), X, T, inputs)


def _hf(module_path: str, cls: str, config: str, **options: Any) -> tuple[Any, Any]:
    """A transformers class and a config with ``options``."""
    transformers = extra_module("transformers")
    module = __import__(f"transformers.models.{module_path}", fromlist=[cls])
    return getattr(module, cls), getattr(transformers, config)(**options)


def bert_layer() -> Case:
    cls, config = _hf("bert.modeling_bert", "BertLayer", "BertConfig", hidden_size=D,
                      num_attention_heads=HEADS, intermediate_size=D_FF)
    return Case(randomise(cls(config).to(DTYPE)), *_rows())


def roberta_layer() -> Case:
    cls, config = _hf("roberta.modeling_roberta", "RobertaLayer", "RobertaConfig",
                      hidden_size=D, num_attention_heads=HEADS, intermediate_size=D_FF)
    return Case(randomise(cls(config).to(DTYPE)), *_rows())


def bert_model(mask: bool = True) -> Case:
    cls, config = _hf("bert.modeling_bert", "BertModel", "BertConfig", hidden_size=D,
                      num_attention_heads=HEADS, intermediate_size=D_FF, num_hidden_layers=2,
                      vocab_size=30, max_position_embeddings=16)
    model = randomise(cls(config, add_pooling_layer=False).to(DTYPE))
    X, T = _rows()
    inputs: dict[str, Any] = {"inputs_embeds": X}
    if mask:
        inputs["attention_mask"] = _padding()
    return Case(model, None, T, inputs)


def distilbert_block() -> Case:
    cls, config = _hf("distilbert.modeling_distilbert", "TransformerBlock", "DistilBertConfig",
                      dim=D, n_heads=HEADS, hidden_dim=D_FF)
    return Case(randomise(cls(config).to(DTYPE)), *_rows())


def vit_layer() -> Case:
    cls, config = _hf("vit.modeling_vit", "ViTLayer", "ViTConfig", hidden_size=D,
                      num_attention_heads=HEADS, intermediate_size=D_FF)
    return Case(randomise(cls(config).to(DTYPE)), *_rows(), float32_inside=True)


def vit_model() -> Case:
    cls, config = _hf("vit.modeling_vit", "ViTModel", "ViTConfig", hidden_size=D,
                      num_attention_heads=HEADS, intermediate_size=D_FF, image_size=8,
                      patch_size=4, num_channels=3, num_hidden_layers=2)
    config._attn_implementation = "sdpa"
    model = randomise(cls(config, add_pooling_layer=False).to(DTYPE))
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(B, 3, 8, 8, generator=generator, dtype=DTYPE)
    return Case(model, images, torch.randn(B, 5, D, generator=generator, dtype=DTYPE))


def clip_layer() -> Case:
    cls, config = _hf("clip.modeling_clip", "CLIPEncoderLayer", "CLIPVisionConfig",
                      hidden_size=D, num_attention_heads=HEADS, intermediate_size=D_FF)
    return Case(randomise(cls(config).to(DTYPE)), *_rows(),
                {"attention_mask": None, "causal_attention_mask": None}, float32_inside=True)


def opt_layer() -> Case:
    cls, config = _hf("opt.modeling_opt", "OPTDecoderLayer", "OPTConfig", hidden_size=D,
                      num_attention_heads=HEADS, ffn_dim=D_FF, word_embed_proj_dim=D)
    return Case(randomise(cls(config).to(DTYPE)), *_rows(), float32_inside=True)


def gpt2_block() -> Case:
    cls, config = _hf("gpt2.modeling_gpt2", "GPT2Block", "GPT2Config", n_embd=D, n_head=HEADS,
                      n_inner=D_FF)
    return Case(randomise(cls(config).to(DTYPE)), *_rows())


def gpt2_model(mask: bool = True) -> Case:
    cls, config = _hf("gpt2.modeling_gpt2", "GPT2Model", "GPT2Config", n_embd=D, n_head=HEADS,
                      n_inner=D_FF, n_layer=2, n_positions=16, vocab_size=30,
                      bos_token_id=0, eos_token_id=0)
    model = randomise(cls(config).to(DTYPE))
    X, T = _rows()
    inputs: dict[str, Any] = {"inputs_embeds": X, "use_cache": False}
    if mask:
        left = torch.ones(B, L, dtype=torch.long)
        left[0, :2] = 0  # left padding
        inputs["attention_mask"] = left
    return Case(model, None, T, inputs)


def _rotary(cls_path: str, cls: str, config: Any, X: torch.Tensor) -> tuple:
    module = __import__(f"transformers.models.{cls_path}", fromlist=[cls])
    rotary = getattr(module, cls)(config).to(DTYPE)
    cos, sin = rotary(X, torch.arange(L)[None].expand(B, L))
    return cos.to(DTYPE), sin.to(DTYPE)


def llama_layer() -> Case:
    cls, config = _hf("llama.modeling_llama", "LlamaDecoderLayer", "LlamaConfig",
                      hidden_size=D, num_attention_heads=2 * HEADS, num_key_value_heads=HEADS,
                      intermediate_size=D_FF, rope_theta=500.0, attention_bias=True)
    X, T = _rows()
    tables = _rotary("llama.modeling_llama", "LlamaRotaryEmbedding", config, X)
    return Case(randomise(cls(config, layer_idx=0).to(DTYPE)), X, T,
                {"position_embeddings": tables}, float32_inside=True)


def llama_model(mask: bool = True) -> Case:
    cls, config = _hf("llama.modeling_llama", "LlamaModel", "LlamaConfig", hidden_size=D,
                      num_attention_heads=2 * HEADS, num_key_value_heads=HEADS,
                      intermediate_size=D_FF, num_hidden_layers=2, vocab_size=30,
                      rope_theta=500.0)
    X, T = _rows()
    inputs: dict[str, Any] = {"inputs_embeds": X, "use_cache": False}
    if mask:
        inputs["attention_mask"] = _padding()
    return Case(randomise(cls(config).to(DTYPE)), None, T, inputs, float32_inside=True)


def mistral_layer() -> Case:
    cls, config = _hf("mistral.modeling_mistral", "MistralDecoderLayer", "MistralConfig",
                      hidden_size=D, num_attention_heads=2 * HEADS, num_key_value_heads=HEADS,
                      intermediate_size=D_FF, head_dim=4)
    X, T = _rows()
    tables = _rotary("mistral.modeling_mistral", "MistralRotaryEmbedding", config, X)
    return Case(randomise(cls(config, layer_idx=0).to(DTYPE)), X, T,
                {"position_embeddings": tables}, float32_inside=True)


def timm_block() -> Case:
    import_timm()
    from timm.models.vision_transformer import Block

    torch.manual_seed(0)
    block = Block(D, HEADS, mlp_ratio=D_FF / D, qkv_bias=True).to(DTYPE)
    return Case(randomise(block), *_rows())


def timm_vit() -> Case:
    import_timm()
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    vit = VisionTransformer(img_size=8, patch_size=4, in_chans=3, num_classes=5, embed_dim=D,
                            depth=2, num_heads=HEADS, mlp_ratio=D_FF / D).to(DTYPE)
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(B, 3, 8, 8, generator=generator, dtype=DTYPE)
    labels = torch.randint(0, 5, (B,), generator=generator)
    return Case(randomise(vit), images, labels, loss="cross_entropy")


# -- the architecture terms of today's common models ------------------------------------------
def _decoder_layer(path: str, cls: str, config: str, rotary: str, **options: Any) -> Case:
    """A Hugging Face decoder layer with its rotary tables (float32 inside)."""
    layer_cls, cfg = _hf(path, cls, config, hidden_size=D, intermediate_size=D_FF, **options)
    X, T = _rows()
    tables = _rotary(path, rotary, cfg, X)
    return Case(randomise(layer_cls(cfg, layer_idx=0).to(DTYPE)), X, T,
                {"position_embeddings": tables}, float32_inside=True)


#: ``rope_parameters`` of each scaled rotary type
ROPE = {"linear": {"rope_type": "linear", "factor": 2.0},
        "dynamic": {"rope_type": "dynamic", "factor": 2.0},
        "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
        "yarn": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8}}


def llama_rope(kind: str) -> Case:
    return _decoder_layer("llama.modeling_llama", "LlamaDecoderLayer", "LlamaConfig",
                          "LlamaRotaryEmbedding", num_attention_heads=2 * HEADS,
                          num_key_value_heads=HEADS, head_dim=4, attention_bias=True,
                          max_position_embeddings=16,
                          rope_parameters={**ROPE[kind], "rope_theta": 500.0})


def falcon_layer(new_architecture: bool = False) -> Case:
    """Falcon's parallel attention and MLP on one norm (``new_decoder_architecture``: two
    norms, grouped queries), eager attention with a causal mask (its softmax in float32
    inside in recent transformers releases)."""
    heads = dict(num_attention_heads=2 * HEADS, num_kv_heads=HEADS) if new_architecture \
        else dict(num_attention_heads=HEADS)
    cls, config = _hf("falcon.modeling_falcon", "FalconDecoderLayer", "FalconConfig",
                      hidden_size=D, ffn_hidden_size=D_FF, parallel_attn=True, alibi=False,
                      bias=True, new_decoder_architecture=new_architecture, **heads)
    config._attn_implementation = "eager"
    X, T = _rows()
    causal = torch.nn.Transformer.generate_square_subsequent_mask(L, dtype=DTYPE)
    inputs = {"alibi": None, "attention_mask": causal.expand(B, 1, L, L).contiguous(),
              "position_embeddings": _rotary("falcon.modeling_falcon", "FalconRotaryEmbedding",
                                             config, X)}
    return Case(randomise(cls(config, layer_idx=0).to(DTYPE)), X, T, inputs,
                float32_inside=True)


def t5_block(decoder: bool = False) -> Case:
    """A T5 block with its relative position bias; the decoder's with cross-attention to
    encoder states one longer than ``X``."""
    cls, config = _hf("t5.modeling_t5", "T5Block", "T5Config", d_model=D, d_kv=D // HEADS,
                      num_heads=HEADS, d_ff=D_FF, relative_attention_num_buckets=8,
                      relative_attention_max_distance=16, is_decoder=decoder)
    X, T = _rows()
    inputs = {}
    if decoder:
        generator = torch.Generator().manual_seed(7)
        inputs["encoder_hidden_states"] = torch.randn(B, L + 1, D, generator=generator,
                                                      dtype=DTYPE)
    block = cls(config, has_relative_attention_bias=True, layer_idx=0).to(DTYPE)
    return Case(randomise(block), X, T, inputs, float32_inside=True)


def _tokens(classes: int = 30, per_token: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 30, (B, L), generator=generator)
    return ids, torch.randint(0, classes, (B, L) if per_token else (B,), generator=generator)


def gpt2_lm() -> Case:
    """GPT-2 with its language-model head tied to the token embedding, on token ids."""
    cls, config = _hf("gpt2.modeling_gpt2", "GPT2LMHeadModel", "GPT2Config", n_embd=D,
                      n_head=HEADS, n_inner=D_FF, n_layer=2, n_positions=16, vocab_size=30,
                      bos_token_id=0, eos_token_id=0)
    return Case(randomise(cls(config).to(DTYPE)), *_tokens(), {"use_cache": False},
                "cross_entropy")


def llama_lm() -> Case:
    cls, config = _hf("llama.modeling_llama", "LlamaForCausalLM", "LlamaConfig", hidden_size=D,
                      num_attention_heads=2 * HEADS, num_key_value_heads=HEADS,
                      intermediate_size=D_FF, num_hidden_layers=2, vocab_size=30,
                      rope_theta=500.0)
    return Case(randomise(cls(config).to(DTYPE)), *_tokens(), {"use_cache": False},
                "cross_entropy", float32_inside=True)


def bert_classifier() -> Case:
    cls, config = _hf("bert.modeling_bert", "BertForSequenceClassification", "BertConfig",
                      hidden_size=D, num_attention_heads=HEADS, intermediate_size=D_FF,
                      num_hidden_layers=2, vocab_size=30, max_position_embeddings=16,
                      num_labels=3)
    return Case(randomise(cls(config).to(DTYPE)), *_tokens(3, per_token=False),
                {"attention_mask": _padding()}, "cross_entropy")


def clip_quick_gelu() -> Case:
    cls, config = _hf("clip.modeling_clip", "CLIPEncoderLayer", "CLIPVisionConfig",
                      hidden_size=D, num_attention_heads=HEADS, intermediate_size=D_FF,
                      hidden_act="quick_gelu")
    return Case(randomise(cls(config).to(DTYPE)), *_rows(),
                {"attention_mask": None, "causal_attention_mask": None}, float32_inside=True)


#: the timm module of each model class :func:`_timm` builds
TIMM_MODULES = {"Eva": "eva", "Cait": "cait"}


def _timm(cls: str, **options: Any) -> Case:
    import_timm()
    module = __import__(f"timm.models.{TIMM_MODULES.get(cls, 'vision_transformer')}",
                        fromlist=[cls])
    torch.manual_seed(0)
    model = getattr(module, cls)(img_size=8, patch_size=4, in_chans=3, num_classes=5,
                                 embed_dim=D, depth=2, num_heads=HEADS, mlp_ratio=D_FF / D,
                                 **options).to(DTYPE)
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(B, 3, 8, 8, generator=generator, dtype=DTYPE)
    labels = torch.randint(0, 5, (B,), generator=generator)
    return Case(randomise(model), images, labels, loss="cross_entropy")


def decoder_layer(causal: bool = False) -> Case:
    """``nn.TransformerDecoderLayer`` on ``X`` with a memory one longer than ``X``."""
    torch.manual_seed(0)
    layer = randomise(torch.nn.TransformerDecoderLayer(D, HEADS, D_FF, batch_first=True,
                                                       dtype=DTYPE))
    X, T = _rows()
    generator = torch.Generator().manual_seed(7)
    inputs: dict[str, Any] = {"memory": torch.randn(B, L + 1, D, generator=generator,
                                                    dtype=DTYPE)}
    if causal:
        inputs.update(tgt_mask=torch.nn.Transformer.generate_square_subsequent_mask(
            L, dtype=DTYPE), tgt_is_causal=True)
    return Case(layer, X, T, inputs)


#: Every family, by name: ``name -> builder``.
FAMILIES: dict[str, Callable[[], Case]] = {
    "TransformerEncoderLayer post-LN ReLU": lambda: encoder_layer(),
    "TransformerEncoderLayer pre-LN GELU": lambda: encoder_layer(True, "gelu"),
    "TransformerEncoderLayer batch_first=False": lambda: encoder_layer(batch_first=False),
    "TransformerEncoderLayer causal mask": lambda: encoder_layer(mask="causal"),
    "TransformerEncoderLayer padding mask": lambda: encoder_layer(mask="padding"),
    "TransformerEncoder": lambda: encoder(),
    "TransformerEncoder mask": lambda: encoder(mask=True),
    "MultiheadAttention": lambda: multihead_attention(),
    "MultiheadAttention attn_mask": lambda: multihead_attention(mask=True),
    "BertLayer": bert_layer,
    "BertModel attention_mask": bert_model,
    "RobertaLayer": roberta_layer,
    "DistilBERT TransformerBlock": distilbert_block,
    "ViTLayer": vit_layer,
    "ViTModel": vit_model,
    "CLIPEncoderLayer": clip_layer,
    "OPTDecoderLayer": opt_layer,
    "GPT2Block": gpt2_block,
    "GPT2Model attention_mask": gpt2_model,
    "LlamaDecoderLayer": llama_layer,
    "LlamaModel attention_mask": llama_model,
    "MistralDecoderLayer": mistral_layer,
    "timm Block": timm_block,
    "timm VisionTransformer": timm_vit,
    "Qwen2DecoderLayer": lambda: _decoder_layer(
        "qwen2.modeling_qwen2", "Qwen2DecoderLayer", "Qwen2Config", "Qwen2RotaryEmbedding",
        num_attention_heads=2 * HEADS, num_key_value_heads=HEADS),
    "GPTNeoXLayer partial rotary": lambda: _decoder_layer(
        "gpt_neox.modeling_gpt_neox", "GPTNeoXLayer", "GPTNeoXConfig", "GPTNeoXRotaryEmbedding",
        num_attention_heads=HEADS, use_parallel_residual=True, rotary_pct=0.5),
    "PhiDecoderLayer partial rotary": lambda: _decoder_layer(
        "phi.modeling_phi", "PhiDecoderLayer", "PhiConfig", "PhiRotaryEmbedding",
        num_attention_heads=HEADS, partial_rotary_factor=0.5),
    "FalconDecoderLayer parallel": falcon_layer,
    "FalconDecoderLayer new architecture": lambda: falcon_layer(new_architecture=True),
    **{f"LlamaDecoderLayer rope {kind}": (lambda kind=kind: llama_rope(kind)) for kind in ROPE},
    "GemmaDecoderLayer": lambda: _decoder_layer(
        "gemma.modeling_gemma", "GemmaDecoderLayer", "GemmaConfig", "GemmaRotaryEmbedding",
        num_attention_heads=2 * HEADS, num_key_value_heads=HEADS, head_dim=6),
    "Gemma2DecoderLayer": lambda: _decoder_layer(
        "gemma2.modeling_gemma2", "Gemma2DecoderLayer", "Gemma2Config",
        "Gemma2RotaryEmbedding", num_attention_heads=2 * HEADS, num_key_value_heads=HEADS,
        head_dim=6, query_pre_attn_scalar=6, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, sliding_window=16),
    "T5Block encoder": t5_block,
    "T5Block decoder": lambda: t5_block(decoder=True),
    "GPT2LMHeadModel input_ids": gpt2_lm,
    "LlamaForCausalLM input_ids": llama_lm,
    "BertForSequenceClassification input_ids": bert_classifier,
    "CLIPEncoderLayer quick_gelu": clip_quick_gelu,
    "timm ViT LayerScale": lambda: _timm("VisionTransformer", init_values=0.1),
    "timm ViT qkv_bias=False": lambda: _timm("VisionTransformer", qkv_bias=False),
    "timm ViT global_pool=avg": lambda: _timm("VisionTransformer", global_pool="avg"),
    # the mean over every token, a flattened grid of patches (n2*n2_2) with no class token
    "timm ViT class_token=False global_pool=avg": lambda: _timm(
        "VisionTransformer", class_token=False, global_pool="avg"),
    # CaiT: talking-heads self-attention, then class attention (only the class token queries)
    "timm CaiT class attention": lambda: _timm(
        "Cait", depth_token_only=1, mlp_ratio_token_only=D_FF / D, init_values=0.1),
    "timm Eva": lambda: _timm("Eva", use_rot_pos_emb=True, swiglu_mlp=True,
                              ref_feat_shape=(2, 2)),
    "nn.TransformerDecoderLayer": decoder_layer,
    "nn.TransformerDecoderLayer causal": lambda: decoder_layer(causal=True),
}


# -- blocks no library ships, written as a user would ------------------------------------------
class DifferentialAttention(torch.nn.Module):
    """``(softmax(Q₁K₁ᵀ/√d_k) − λ softmax(Q₂K₂ᵀ/√d_k)) V``: one head of differential
    attention, written as a user would."""

    def __init__(self, d: int, d_k: int) -> None:
        super().__init__()
        self.q = torch.nn.Linear(d, 2 * d_k, bias=False)
        self.k = torch.nn.Linear(d, 2 * d_k, bias=False)
        self.v = torch.nn.Linear(d, d, bias=False)
        self.lam = torch.nn.Parameter(torch.tensor(0.5))
        self.d_k = d_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q1, q2 = self.q(x).chunk(2, dim=-1)
        k1, k2 = self.k(x).chunk(2, dim=-1)
        a1 = torch.softmax(q1 @ k1.transpose(-1, -2) / self.d_k ** 0.5, dim=-1)
        a2 = torch.softmax(q2 @ k2.transpose(-1, -2) / self.d_k ** 0.5, dim=-1)
        return (a1 - self.lam * a2) @ self.v(x)


class GatedResidual(torch.nn.Module):
    """``x + σ(x W_g + b_g) ∘ f(x)`` with ``f`` a ReLU MLP."""

    def __init__(self, d: int, d_ff: int) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(d, d)
        self.f = torch.nn.Sequential(torch.nn.Linear(d, d_ff), torch.nn.ReLU(),
                                     torch.nn.Linear(d_ff, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.sigmoid(self.gate(x)) * self.f(x)


class PreNormBlock(torch.nn.Module):
    """``x + σ(y G) ∘ (softmax(y W_q (y W_k)ᵀ / τ) y W_v W_o)`` with ``y = LN(x)``: a pre-norm
    block whose weights are plain parameters named as in a paper."""

    def __init__(self, d: int, d_k: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.W_q, self.W_k, self.W_v = (torch.nn.Parameter(torch.randn(d, d_k)) for _ in "qkv")
        self.W_o = torch.nn.Parameter(torch.randn(d_k, d))
        self.gate = torch.nn.Parameter(torch.randn(d, d))
        self.tau = torch.nn.Parameter(torch.tensor(2.0))
        self.d_k = d_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        a = torch.softmax(y @ self.W_q @ (y @ self.W_k).transpose(-1, -2) / self.tau, dim=-1)
        return x + torch.sigmoid(y @ self.gate) * (a @ y @ self.W_v @ self.W_o)
