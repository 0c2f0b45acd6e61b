"""Operations real Transformer modules use beyond linear maps, softmax and norms — each read
with its exact rule and checked against reverse-over-reverse autograd on a small module that
uses it (float64, ``L = 5``, ``d = 8``, ``d_k = 3``, ``d_ff = 12``, a batch of 2); variants
outside the rule refused naming the operation and the module path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from families import DTYPE
from reference import Reference, randomise, relative

import curvgap
from curvgap.adapters import UnsupportedOperation

B, L, D, D_K, D_FF = 2, 5, 8, 3, 12


def rows(seed: int = 0, width: int = D) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(B, L, D, generator=generator, dtype=DTYPE),
            torch.randn(B, L, width, generator=generator, dtype=DTYPE))


def exact(module: torch.nn.Module, X: torch.Tensor | None = None, T: torch.Tensor | None = None,
          twin: bool = False, **inputs) -> tuple[float, float]:
    """curvgap's gradient and Hessian-vector product against autograd's (both within 1e-10);
    the relative errors."""
    module = randomise(module.to(DTYPE))
    if X is None and "inputs_embeds" not in inputs:
        X, T = rows()
    c = curvgap.curvature(module)
    reference = Reference(module, X, T, twin=twin, **inputs)
    gradient = c.gradient(X, T, **inputs)
    v = torch.randn(gradient.shape, generator=torch.Generator().manual_seed(1), dtype=DTYPE)
    errors = (relative(gradient, reference.gradient()),
              relative(c.hvp(X, T, v, **inputs), reference.hvp(v)))
    assert max(errors) <= 1e-10, errors
    return errors


def refused(module: torch.nn.Module, *parts: str) -> None:
    module = randomise(module.to(DTYPE))
    X, T = rows()
    with pytest.raises(UnsupportedOperation) as error:
        curvgap.curvature(module).gradient(X, T)
    for part in parts:
        assert part in str(error.value)


class Inside(torch.nn.Module):
    """``inner`` at the path ``block`` (refusals name it)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.block = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


# -- repeat ------------------------------------------------------------------------------------
class Tiled(torch.nn.Module):
    """A learned row repeated over the batch and appended to the sequence (as
    ``MultiheadAttention``'s ``bias_k``), then the features tiled twice."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(D, D_K)
        self.extra = torch.nn.Parameter(torch.randn(1, 1, D_K))
        self.out = torch.nn.Linear(2 * D_K, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.proj(x), self.extra.repeat(x.shape[0], 1, 1)], 1)  # (B, L + 1, d_k)
        return x + torch.tanh(self.out(h.repeat(1, 1, 2))).mean(1, keepdim=True)


class MultiheadSelfAttention(torch.nn.Module):
    def __init__(self, **options) -> None:
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(D, 2, batch_first=True, **options)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention(x, x, x)[0]


def test_repeat_tiles_a_parameter_over_the_batch_and_the_features():
    exact(Tiled())


@pytest.mark.parametrize("options", [dict(add_bias_kv=True), dict(add_zero_attn=True),
                                     dict(add_bias_kv=True, add_zero_attn=True)],
                         ids=["bias_kv", "zero_attn", "both"])
def test_multihead_attention_with_bias_kv_and_zero_attention(options):
    """``bias_k``, ``bias_v`` repeated over the batch and appended to the keys and values (a
    piece placed after the sequence: counted from the end); a zero key and value appended
    (constant zeros: only their place is read)."""
    exact(MultiheadSelfAttention(**options))


# -- constant pad ------------------------------------------------------------------------------
class Padded(torch.nn.Module):
    """Features padded by one before and two after with 0.5, then the sequence cut by one at
    its start and padded with zeros by one at its end."""

    def __init__(self, mode: str = "constant") -> None:
        super().__init__()
        self.proj = torch.nn.Linear(D, D_K)
        self.out = torch.nn.Linear(D_K + 3, D)
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode != "constant":
            return self.out(F.pad(self.proj(x), (1, 2), mode=self.mode))
        h = F.pad(self.proj(x), (1, 2), value=0.5)
        return torch.tanh(self.out(F.pad(h.transpose(1, 2), (-1, 1)).transpose(1, 2)))


def test_constant_pad_places_the_tensor_and_fills_the_rest():
    exact(Padded())


def test_a_pad_that_is_not_constant_is_refused_naming_its_mode_and_path():
    refused(Inside(Padded("reflect")), "block", "pad", "constant mode", "'reflect'")


# -- baddbmm -----------------------------------------------------------------------------------
class AlibiScores(torch.nn.Module):
    """BLOOM's scores: ``β bias + α Q Kᵀ`` by ``baddbmm``, the bias learned here."""

    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(D, D_K)
        self.k = torch.nn.Linear(D, D_K)
        self.v = torch.nn.Linear(D, D_FF)
        self.out = torch.nn.Linear(D_FF, D)
        self.slope = torch.nn.Parameter(torch.randn(1, 1, L))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.slope.expand(x.shape[0], L, L)
        scores = torch.baddbmm(bias, self.q(x), self.k(x).transpose(1, 2), beta=0.7,
                               alpha=D_K ** -0.5)
        return self.out(torch.softmax(scores, -1) @ self.v(x))


def test_baddbmm_is_a_scaled_sum_of_its_input_and_a_product():
    exact(AlibiScores())


# -- einsum ------------------------------------------------------------------------------------
class EinsumAttention(torch.nn.Module):
    """Heads projected, scored and mixed by ``torch.einsum`` (an ellipsis too)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(D, D_K, 2))
        self.out = torch.nn.Parameter(torch.randn(D_K, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.einsum("bld,dkh->blhk", x, self.w)
        scores = torch.einsum("...lhk,...mhk->...hlm", h, h)
        mixed = torch.einsum("bhlm,bmhk->blk", torch.softmax(scores, -1), h)
        return torch.einsum("blk,kd", mixed, self.out).transpose(1, 2)  # implicit: "bdl"


def test_einsum_is_read_as_its_contraction():
    exact(EinsumAttention())


# -- vector norm -------------------------------------------------------------------------------
class Normalised(torch.nn.Module):
    """Rows scaled to unit length by ``Tensor.norm`` (cosine attention, QK-norm)."""

    def __init__(self, order: float = 2) -> None:
        super().__init__()
        self.up = torch.nn.Linear(D, D_FF)
        self.down = torch.nn.Linear(D_FF, D)
        self.order = order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        return self.down(h / h.norm(p=self.order, dim=-1, keepdim=True)) * x.norm(dim=(1, 2))[
            :, None, None]


def test_vector_norm_is_the_square_root_of_a_sum_of_squares():
    exact(Normalised())


def test_a_norm_of_another_order_is_refused():
    refused(Inside(Normalised(1)), "block", "linalg_vector_norm", "order 2")


# -- attention with a learned bias ---------------------------------------------------------------
class BiasedAttention(torch.nn.Module):
    """``scaled_dot_product_attention`` with an additive mask computed from a parameter table
    (a relative-position bias, as T5's): the mask is differentiable."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(D, 3 * 2 * D_K)
        self.out = torch.nn.Linear(2 * D_K, D)
        self.table = torch.nn.Parameter(torch.randn(2 * L - 1, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, 2, D_K).permute(2, 0, 3, 1, 4)
        distance = torch.arange(n)[None, :] - torch.arange(n)[:, None] + L - 1
        bias = self.table[distance].permute(2, 0, 1)[None]  # (1, h, L, L)
        mixed = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.out(mixed.transpose(1, 2).reshape(b, n, 2 * D_K))


def test_attention_with_a_mask_computed_from_parameters():
    exact(BiasedAttention())


def test_t5_attention_under_sdpa_reads_its_position_bias_as_a_term_of_the_scores():
    from families import _hf, _rows
    cls, config = _hf("t5.modeling_t5", "T5Block", "T5Config", d_model=D, d_kv=D_K,
                      num_heads=2, d_ff=D_FF, relative_attention_num_buckets=8,
                      relative_attention_max_distance=16)
    config._attn_implementation = "sdpa"
    block = cls(config, has_relative_attention_bias=True, layer_idx=0)
    X, T = _rows()
    exported = torch.export.export(block.to(DTYPE), (X,), strict=False)
    assert any(n.target is torch.ops.aten.scaled_dot_product_attention.default
               for n in exported.graph.nodes)
    exact(block, X, T, twin=True)


# -- interpolation -------------------------------------------------------------------------------
class Resized(torch.nn.Module):
    """A learned (3, 4) grid of position embeddings resized to (2, 5) (as ViTs do for
    another image size), its first L positions added."""

    def __init__(self, **options) -> None:
        super().__init__()
        self.grid = torch.nn.Parameter(torch.randn(1, D, 3, 4))
        self.options = options

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = F.interpolate(self.grid, size=(2, 5), **self.options)
        return torch.tanh(x + table.flatten(2).transpose(1, 2)[:, :L])


@pytest.mark.parametrize("options", [
    dict(mode="bilinear"), dict(mode="bilinear", align_corners=True),
    dict(mode="bicubic", antialias=True), dict(mode="bicubic"), dict(mode="nearest")],
    ids=["bilinear", "bilinear-corners", "bicubic-antialias", "bicubic", "nearest"])
def test_interpolation_of_a_learned_table_is_a_linear_map(options):
    exact(Resized(**options))


# -- selection by data-dependent indices ----------------------------------------------------------
class Routed(torch.nn.Module):
    """Mixture-of-experts routing: the top two of a softmax of router logits (their values
    differentiable, their indices constants), the logits gathered by those indices, experts
    chosen by ``index_select`` and ``index`` with indices from ``topk`` and ``argmax``."""

    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(D, 4)
        self.experts = torch.nn.Parameter(torch.randn(4, D, D_K))
        self.out = torch.nn.Linear(D_K, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        weights, chosen = torch.topk(torch.softmax(logits, -1), 2, dim=-1)  # (B, L, 2)
        gathered = torch.gather(logits, -1, chosen)
        favourite = self.router.weight.sum(1).topk(2).indices  # (2,): one per slot
        experts = self.experts.index_select(0, favourite)  # (2, d, d_k)
        first = self.experts[self.router.bias.argmax(-1, keepdim=True)][0]  # (d, d_k)
        h = torch.einsum("bld,kde->blke", x, experts) + (x @ first)[:, :, None]
        return self.out((h * (weights + gathered)[..., None]).sum(2))


def test_routing_by_topk_reads_its_values_and_selects_by_its_indices():
    exact(Routed())


def test_an_expert_loop_over_the_chosen_experts_is_refused_naming_the_operation_and_path():
    """Hugging Face's mixture of experts loops over the experts the router chose: a shape
    that depends on tensor values, which torch.export cannot trace; the refusal says where."""
    from families import _hf, _rows
    cls, config = _hf("mixtral.modeling_mixtral", "MixtralSparseMoeBlock", "MixtralConfig",
                      hidden_size=D, intermediate_size=D_FF, num_local_experts=4,
                      num_experts_per_tok=2, num_attention_heads=2, num_key_value_heads=2)
    block = randomise(cls(config).to(DTYPE))
    X, T = _rows()
    with pytest.raises(UnsupportedOperation) as error:
        curvgap.curvature(block).gradient(X, T)
    message = str(error.value)
    assert message.startswith("experts (")  # the submodule's path, then its class
    assert "operation unbind" in message and "nonzero" in message
    assert "depend on tensor values" in message and "GuardOnDataDependent" not in message


# -- Hugging Face decoders called as they are ------------------------------------------------------
@pytest.mark.parametrize("family", ["gpt2_model", "llama_model"])
def test_a_decoder_called_with_its_defaults_ignores_its_cache(family):
    """Without ``use_cache=False`` a decoder returns a key-value cache beside its output (no
    trace can return one): the call is read with ``use_cache=False``, the loss reading the
    output only; the default attention (sdpa) is read as it is."""
    import families
    case = getattr(families, family)()
    inputs = {k: v for k, v in case.inputs.items() if k != "use_cache"}
    assert case.module.config._attn_implementation == "sdpa"
    out = case.module(**inputs)
    assert getattr(out, "past_key_values", None) is not None  # a cache, by default
    exact(case.module, None, case.T, twin=case.float32_inside, **inputs)
