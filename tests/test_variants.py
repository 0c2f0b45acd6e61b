"""Option combinations that are not shipped, generated inside the test run into a temporary
folder and checked against torch.func like the shipped ones; and every rejection path."""

from __future__ import annotations

import importlib.util

import pytest
import sympy as sp
import torch
from conftest import to_backend

from curvgap.cli.verification import verify_dims
from curvgap.codegen.backends import backend as backend_named
from curvgap.codegen.generate import generate, render
from curvgap.codegen.verify import check_module, random_case
from curvgap.derivations.config import ConfigError, load, validate
from curvgap.derivations.derivation import derive
from curvgap.derivations.losses import r, register_residual_loss

TOLERANCE = 1e-10
DIMS = {"L": 3, "d": 4, "d_k": 5, "d_ff": 7}

VARIANTS = {
    "ffn_gelu_bias": 'kind = "ffn"\nactivation = "gelu"\nffn_bias = true',
    "ffn_sigmoid": 'kind = "ffn"\nactivation = "sigmoid"',
    "ffn_softplus": 'kind = "ffn"\nactivation = "softplus"',
    "ffn_tanh_ce": 'kind = "ffn"\nactivation = "tanh"\nloss = "cross_entropy"',
    "ffn_identity": 'kind = "ffn"\nactivation = "identity"\nffn_bias = true',
    "attention_heads_causal": 'kind = "self_attention"\nheads = 2\ncausal = true\nout_proj = true',
    "attention_out_proj": 'kind = "self_attention"\nout_proj = true\nloss = "cross_entropy"',
    "rmsnorm_ce": 'kind = "layernorm"\nnorm = "rmsnorm"\nloss = "cross_entropy"',
    "post_rms_gelu_heads": ('kind = "block"\nnorm = "rmsnorm"\neps = 1e-6\naffine = true\n'
                            'heads = 2\nout_proj = true\nactivation = "gelu_tanh"'),
    "pre_ln_relu_causal": 'kind = "block"\nnorm_position = "pre"\ncausal = true',
    "ffn_log_cosh": 'kind = "ffn"\nactivation = "silu"\nloss = "log_cosh"',
    "attention_biases_heads": ('kind = "self_attention"\nheads = 2\ncausal = true\n'
                               'out_proj = true\nattention_bias = true'),
    "attention_bias_scale": 'kind = "self_attention"\nattention_bias = true\nattention_scale = 0.3',
    "post_ln_biases_no_beta": ('attention_bias = true\nout_proj = true\naffine = true\n'
                               'norm_bias = false\neps = 1e-5\nactivation = "gelu"\n'
                               'ffn_bias = true'),
    "pre_ln_encoder_layer": ('norm_position = "pre"\nheads = 2\nout_proj = true\n'
                             'attention_bias = true\naffine = true\neps = 1e-5\n'
                             'activation = "gelu"\nffn_bias = true'),
    "ffn_swiglu": 'kind = "ffn"\nactivation = "silu"\nffn_gate = true',
    "ffn_geglu_bias": 'kind = "ffn"\nactivation = "gelu"\nffn_gate = true\nffn_bias = true',
    "pre_rms_swiglu_block": ('norm = "rmsnorm"\nnorm_position = "pre"\naffine = true\n'
                             'eps = 1e-6\nheads = 2\ncausal = true\nout_proj = true\n'
                             'activation = "silu"\nffn_gate = true'),
    "layernorm_no_beta": 'kind = "layernorm"\naffine = true\nnorm_bias = false\neps = 1e-5',
    "pre_ln_linear_loss": 'norm_position = "pre"\nheads = 2\nout_proj = true\nloss = "linear"',
    "attention_rotary": 'kind = "self_attention"\nrotary = true\nrotary_base = 100.0',
    "attention_multi_query": ('kind = "self_attention"\nheads = 2\nkv_heads = 1\n'
                              'out_proj = true\ncausal = true'),
    "attention_gqa_rotary_bias": ('kind = "self_attention"\nheads = 4\nkv_heads = 2\n'
                                  'out_proj = true\nrotary = true\nattention_bias = true\n'
                                  'loss = "cross_entropy"'),
    "llama_block": ('norm = "rmsnorm"\nnorm_position = "pre"\naffine = true\neps = 1e-5\n'
                    'heads = 4\nkv_heads = 2\ncausal = true\nout_proj = true\nrotary = true\n'
                    'rotary_base = 500.0\nactivation = "silu"\nffn_gate = true'),
    # the terms of today's decoders and ViTs
    "neox_parallel_block": ('norm_position = "parallel"\naffine = true\neps = 1e-5\n'
                            'heads = 2\ncausal = true\nout_proj = true\nattention_bias = true\n'
                            'rotary = true\nactivation = "gelu"\nffn_bias = true'),
    "phi_parallel_shared_norm": ('norm_position = "parallel"\nshared_norm = true\n'
                                 'affine = true\neps = 1e-5\nheads = 2\nout_proj = true\n'
                                 'activation = "gelu_fast"\nffn_bias = true'),
    "gemma2_block": ('norm = "rmsnorm"\nnorm_offset = true\nnorm_position = "pre"\n'
                     'sandwich_norm = true\naffine = true\neps = 1e-6\nheads = 4\n'
                     'kv_heads = 2\ncausal = true\nout_proj = true\nrotary = true\n'
                     'logit_softcap = 0.7\nactivation = "gelu_tanh"\nffn_gate = true'),
    "sandwich_layer_scale": ('norm_position = "pre"\nsandwich_norm = true\nlayer_scale = true\n'
                             'affine = true\neps = 1e-5\nactivation = "gelu"'),
    "layer_scale_quick_gelu": ('norm_position = "pre"\nlayer_scale = true\naffine = true\n'
                               'eps = 1e-6\nheads = 2\nout_proj = true\n'
                               'activation = "quick_gelu"\nffn_bias = true'),
    "attention_softcap": 'kind = "self_attention"\nlogit_softcap = 0.5\ncausal = true',
    "ffn_quick_gelu": 'kind = "ffn"\nactivation = "quick_gelu"\nffn_bias = true',
    # biases set apart, partial and scaled rotary, heads of their own width
    "qwen2_biases_qkv": ('norm = "rmsnorm"\nnorm_position = "pre"\naffine = true\n'
                         'eps = 1e-6\nheads = 2\ncausal = true\nout_proj = true\n'
                         'attention_bias = "qkv"\nrotary = true\nactivation = "silu"\n'
                         'ffn_gate = true'),
    "attention_biases_qvo": ('kind = "self_attention"\nheads = 2\nout_proj = true\n'
                             'attention_bias = "qvo"'),
    "attention_bias_out_only": ('kind = "self_attention"\nout_proj = true\n'
                                'attention_bias = "o"\nloss = "cross_entropy"'),
    "neox_partial_rotary": ('norm_position = "parallel"\naffine = true\neps = 1e-5\n'
                            'heads = 2\ncausal = true\nout_proj = true\nattention_bias = true\n'
                            'rotary = true\nrotary_fraction = 0.5\nactivation = "gelu"\n'
                            'ffn_bias = true'),
    "phi_partial_rotary": ('kind = "self_attention"\nheads = 2\nout_proj = true\n'
                           'attention_bias = true\nrotary = true\nrotary_fraction = 0.4'),
    "rotary_linear": ('kind = "self_attention"\nrotary = true\nrotary_scaling = "linear"\n'
                      'rotary_factor = 2.5'),
    "rotary_dynamic_ntk": ('kind = "self_attention"\ncausal = true\nrotary = true\n'
                           'rotary_scaling = "dynamic"\nrotary_factor = 2.0\n'
                           'rotary_original_length = 3'),
    "rotary_llama3": ('kind = "self_attention"\nheads = 2\nkv_heads = 1\nout_proj = true\n'
                      'rotary = true\nrotary_base = 500000.0\nrotary_scaling = "llama3"\n'
                      'rotary_factor = 8.0\nrotary_original_length = 64'),
    "rotary_yarn": ('kind = "self_attention"\nrotary = true\nrotary_scaling = "yarn"\n'
                    'rotary_factor = 4.0\nrotary_original_length = 64'),
    "gemma_value_width": ('norm = "rmsnorm"\nnorm_offset = true\nnorm_position = "pre"\n'
                          'affine = true\neps = 1e-6\nheads = 2\ncausal = true\n'
                          'out_proj = true\nvalue_width = "d_k"\nrotary = true\n'
                          'activation = "gelu_tanh"\nffn_gate = true'),
    # T5's relative position bias: encoder (both directions), decoder (causal), grouped heads
    "t5_encoder_block": ('norm = "rmsnorm"\nnorm_position = "pre"\naffine = true\n'
                         'eps = 1e-6\nheads = 2\nout_proj = true\nvalue_width = "d_k"\n'
                         'attention_scale = 1.0\nrelative_bias = true\nrelative_buckets = 8\n'
                         'relative_max_distance = 6'),
    "attention_relative_causal": ('kind = "self_attention"\ncausal = true\n'
                                  'relative_bias = true\nrelative_buckets = 6\n'
                                  'relative_max_distance = 5'),
    "attention_relative_gqa": ('kind = "self_attention"\nheads = 4\nkv_heads = 2\n'
                               'out_proj = true\nrelative_bias = true\n'
                               'relative_buckets = 8\nrelative_max_distance = 4'),
    # heads after pooling: a norm of the pooled row (timm's fc_norm), BERT's pooler
    "head_pooled_norm": ('kind = "head"\npooling = "mean"\npooled_norm = true\naffine = true\n'
                         'eps = 1e-6\nloss = "cross_entropy"'),
    "bert_pooler_head": 'kind = "head"\npooling = "first"\npooler = true\nloss = "cross_entropy"',
    # cross-attention: keys and values from a second input M (L_m × d), one per sample
    "cross_attention": 'kind = "self_attention"\nheads = 2\nout_proj = true\ncross_attention = true',
    "cross_attention_gqa_bias": ('kind = "self_attention"\nheads = 4\nkv_heads = 2\n'
                                 'out_proj = true\ncross_attention = true\n'
                                 'attention_bias = "qvo"\nvalue_width = "d_k"'),
    # decoder blocks: self-attention, cross-attention on M (norm 3), FFN
    "decoder_block_post": ('kind = "block"\nheads = 2\nout_proj = true\ncausal = true\n'
                           'affine = true\nattention_bias = true\nffn_bias = true\n'
                           'cross_attention = true\neps = 1e-5'),
    "decoder_block_pre_rms": ('kind = "block"\nnorm_position = "pre"\nnorm = "rmsnorm"\n'
                              'heads = 2\nkv_heads = 1\nout_proj = true\nrotary = true\n'
                              'activation = "silu"\nffn_gate = true\ncross_attention = true'),
    "attention_value_width_gqa": ('kind = "self_attention"\nheads = 4\nkv_heads = 2\n'
                                  'out_proj = true\nvalue_width = "d_k"\n'
                                  'attention_bias = "qkv"'),
}
#: Sizes for the variants that need an even d_k (rotary) and d divisible by 4 heads.
ROTARY_DIMS = {"L": 3, "d": 8, "d_k": 6, "d_ff": 5}
DIMS_OF = {name: ROTARY_DIMS for name in ("attention_rotary", "attention_gqa_rotary_bias",
                                          "llama_block", "neox_parallel_block",
                                          "gemma2_block", "qwen2_biases_qkv",
                                          "rotary_linear", "rotary_yarn", "rotary_llama3",
                                          "gemma_value_width", "attention_value_width_gqa")}
#: Cross-attention: M's rows L_m differ from every other size. Partial rotary: a head's width in
#: 2/fraction chunks (4 for GPT-NeoX's 1/2, 5 for Phi's 0.4), a sequence longer than the
#: trained length (dynamic NTK grows its base).
DIMS_OF.update(cross_attention={**DIMS, "L_m": 6}, decoder_block_post={**DIMS, "L_m": 6},
               decoder_block_pre_rms={"L": 3, "d": 4, "d_k": 2, "d_ff": 5, "L_m": 6},
               cross_attention_gqa_bias={"L": 3, "d": 8, "d_k": 6, "d_ff": 5, "L_m": 4},
               neox_partial_rotary={"L": 3, "d": 8, "d_k": 12, "d_ff": 5},
               phi_partial_rotary={"L": 3, "d": 8, "d_k": 10, "d_ff": 5},
               rotary_dynamic_ntk={"L": 5, "d": 4, "d_k": 6, "d_ff": 7},
               t5_encoder_block={"L": 7, "d": 4, "d_k": 5, "d_ff": 3},
               attention_relative_causal={"L": 7, "d": 4, "d_k": 5, "d_ff": 3},
               attention_relative_gqa={"L": 7, "d": 8, "d_k": 6, "d_ff": 3},
               head_pooled_norm={**DIMS, "c": 6}, bert_pooler_head={**DIMS, "c": 6})


#: Variants whose check runs with ``-m slow`` (CI): the quick run keeps one of each option.
SLOW = {"llama_block", "decoder_block_post", "attention_gqa_rotary_bias", "pre_ln_encoder_layer",
        "post_ln_biases_no_beta", "post_rms_gelu_heads", "pre_rms_swiglu_block",
        "pre_ln_relu_causal", "pre_ln_linear_loss", "neox_parallel_block", "gemma2_block",
        "layer_scale_quick_gelu", "qwen2_biases_qkv", "gemma_value_width", "rotary_llama3",
        "sandwich_layer_scale", "decoder_block_pre_rms", "neox_partial_rotary",
        "attention_relative_gqa"}


def _load_module(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    """``variant(name, backend)``: the config and generated module of a variant, derived on
    first use (module backends only: LaTeX of every variant is
    :func:`test_every_variant_renders_as_latex`)."""
    register_residual_loss("log_cosh", sp.log(sp.cosh(r)))
    folder = tmp_path_factory.mktemp("variants")
    derived = {}

    def get(name, backend):
        if name not in derived:
            path = folder / f"{name}.toml"
            path.write_text(f'name = "{name}"\n{VARIANTS[name]}\n')
            derived[name] = load(path), derive(load(path))
        config, der = derived[name]
        file = folder / backend / f"{name}.py"
        if not file.exists():
            file.parent.mkdir(exist_ok=True)
            file.write_text(render(der, backend_named(backend)))
        return config, _load_module(file, f"variant_{name}_{backend}")

    return get


@pytest.mark.parametrize("backend", ["torch", pytest.param("numpy", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW
                                  else name for name in sorted(VARIANTS)])
def test_variant_matches_torch_func(variant, name, backend):  # numpy's in the slow run
    config, module = variant(name, backend)
    errors = check_module(config, module, backend, DIMS_OF.get(name, DIMS), batch=2, seed=3)
    bad = {k: v for k, v in errors.items() if not v <= TOLERANCE}
    assert not bad, bad
    # the sizes `curvgap generate --config` checks it at are sizes the module takes
    params, X, _ = random_case(module, verify_dims(config), batch=2)
    module.forward(to_backend(backend, params), to_backend(backend, X))


#: The new terms where they are strained (the stability matrix's scales, run with -m stability):
#: soft-capped scores of large queries and keys, large inputs, rows of large mean; the
#: cross-attentions with their per-sample M (a decoder block's W_Q_c, W_K_c scaled too). A
#: cross-attention sublayer reads X in its queries alone: at X × 100 its scores saturate and
#: its X-Hessian falls to 1e-28 of the parameters' (finite differences), where both autograd
#: routes and curvgap differ by their rounding of nothing, so its strained row is X × 10.
STRAINED = [("gemma2_block", "W_QK", 1e3), ("neox_parallel_block", "shift", 1e5),
            ("layer_scale_quick_gelu", "X", 1e3), ("attention_softcap", "W_QK", 1e3),
            ("rotary_yarn", "W_QK", 1e3), ("neox_partial_rotary", "X", 1e3),
            ("gemma_value_width", "shift", 1e5), ("cross_attention", "W_QK", 1e3),
            ("cross_attention_gqa_bias", "X", 10.0), ("decoder_block_post", "W_QK", 1e3),
            ("decoder_block_pre_rms", "shift", 1e5)]


@pytest.mark.stability
@pytest.mark.parametrize("name, scaled, scale", STRAINED)
def test_new_terms_are_as_stable_as_autograd(variant, name, scaled, scale):
    from stability import DIMS, measure

    config, _ = variant(name, "torch")
    modules = {b: variant(name, b)[1] for b in ("numpy", "torch")}
    dims = {**DIMS, **DIMS_OF.get(name, {})}
    rows = measure(name, config, scaled, scale, modules=modules, dims=dims)
    bad = [f"{r.function} {str(r.dtype)[6:]}: curvgap {r.curvgap}, autograd {r.autograd:.2e}"
           for r in rows if not r.ok]
    assert not bad, f"{len(bad)} functions above 10× autograd's error: " + "; ".join(bad[:5])
    assert max(r.autograd for r in rows) <= 0.1


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_variant_renders_as_latex(name, tmp_path):
    """Through ``generate``, as users run it: every backend, LaTeX included (one variant per
    test, so that the run's workers share them)."""
    register_residual_loss("log_cosh", sp.log(sp.cosh(r)))
    path = tmp_path / f"{name}.toml"
    path.write_text(f'name = "{name}"\n{VARIANTS[name]}\n')
    written = generate([path], tmp_path / "out", report=lambda line: None)
    assert [p.stem for p in written if p.suffix == ".tex"] == [name]


def test_custom_loss_module_names_its_loss(variant):
    assert variant("ffn_log_cosh", "numpy")[1].LOSS == "log_cosh"


@pytest.mark.parametrize("data, message", [
    ({"kind": "block", "heads": 2}, "heads = 2 needs out_proj = true"),
    ({"kind": "layernorm", "causal": True}, "'causal' applies to kind block or self_attention"),
    ({"kind": "ffn", "norm": "rmsnorm"}, "'norm' applies to kind block or layernorm"),
    ({"kind": "self_attention", "activation": "gelu"}, "'activation' applies to kind block or ffn"),
    ({"kind": "block", "heads": 0}, "'heads' must be >= 1, got 0"),
    ({"kind": "block", "loss": "huber"}, "'loss' must be one of mse, cross_entropy"),
    ({"kind": "block", "norm_bias": False}, "'norm_bias' = false drops the beta of an affine "
                                            "LayerNorm; it needs norm"),
    ({"kind": "ffn", "attention_bias": True}, "'attention_bias' applies to kind block or "
                                              "self_attention"),
    ({"kind": "block", "attention_scale": -1.0}, "'attention_scale' must be a finite number > 0"),
    ({"kind": "block", "heads": 4, "kv_heads": 3, "out_proj": True},
     "'kv_heads' must divide heads = 4 .*, got 3"),
    ({"kind": "block", "rotary_base": 500.0}, "'rotary_base' needs rotary = true"),
    ({"kind": "block", "rotary": True, "rotary_base": 1.0}, "'rotary_base' must be a finite "
                                                            "number > 1, got 1.0"),
    ({"kind": "ffn", "rotary": True}, "'rotary' applies to kind block or self_attention"),
    ({"kind": "block", "norm_offset": True, "affine": True},
     "'norm_offset' scales by \\(1 \\+ gamma\\); it needs norm = \"rmsnorm\""),
    ({"kind": "block", "shared_norm": True, "norm_position": "pre"},
     "'shared_norm' .* needs norm_position = \"parallel\""),
    ({"kind": "block", "layer_scale": True}, "'layer_scale' .* needs norm_position = \"pre\" "
                                              "or \"parallel\""),
    ({"kind": "block", "logit_softcap": -2.0}, "'logit_softcap' must be a finite number > 0"),
    ({"kind": "block", "sandwich_norm": True}, "'sandwich_norm' .* needs norm_position = "
                                               "\"pre\""),
    ({"kind": "ffn", "layer_scale": True}, "'layer_scale' applies to kind block"),
    ({"kind": "block", "attention_bias": "qq"}, "'attention_bias' must be true, false or the "
                                                 "biased projections as distinct letters"),
    ({"kind": "block", "attention_bias": "qx"}, "'attention_bias' must be true, false"),
    ({"kind": "block", "attention_bias": "o"}, "'attention_bias' names b_O .* needs out_proj"),
    ({"kind": "block", "value_width": "d_k"}, "'value_width' = \"d_k\" .* needs out_proj"),
    ({"kind": "block", "value_width": "d"}, "'value_width' must be one of d/h, d_k"),
    ({"kind": "block", "rotary_fraction": 0.5}, "'rotary_fraction' needs rotary = true"),
    ({"kind": "block", "rotary": True, "rotary_fraction": 0.3},
     "'rotary_fraction' must be 2/n for an integer n >= 2 .* got 0.3"),
    ({"kind": "block", "rotary": True, "rotary_factor": 2.0},
     "'rotary_factor' does not apply to rotary_scaling = 'none'"),
    ({"kind": "block", "rotary": True, "rotary_scaling": "yarn", "rotary_factor": 2.0},
     "rotary_scaling = 'yarn' needs 'rotary_original_length' >= 1"),
    ({"kind": "block", "rotary": True, "rotary_scaling": "linear",
      "rotary_original_length": 8}, "'rotary_original_length' does not apply to "
                                    "rotary_scaling = 'linear'"),
    ({"kind": "block", "rotary": True, "rotary_scaling": "linear", "rotary_factor": 0.5},
     "'rotary_factor' must be >= 1"),
    ({"kind": "block", "rotary": True, "rotary_scaling": "llama3", "rotary_factor": 8.0,
      "rotary_original_length": 8, "rotary_low_freq_factor": 4.0,
      "rotary_high_freq_factor": 2.0}, "'rotary_high_freq_factor' must be larger"),
    ({"kind": "head", "pooling": "mean", "affine": True},
     "'affine' sets the norm of a head's pooled row; it needs pooled_norm = true"),
    ({"kind": "head", "pooler": True}, "'pooler' acts on the pooled row; it needs pooling"),
    ({"kind": "block", "pooled_norm": True}, "'pooled_norm' applies to kind head"),
    ({"kind": "block", "relative_buckets": 8}, "'relative_buckets' needs relative_bias = true"),
    ({"kind": "block", "relative_bias": True, "relative_buckets": 7},
     "'relative_buckets' must be an even number >= 4"),
    ({"kind": "block", "relative_bias": True, "relative_buckets": 8,
      "relative_max_distance": 2}, "'relative_max_distance' must exceed the 2 exact offsets"),
    ({"kind": "self_attention", "cross_attention": True, "causal": True},
     "'cross_attention' attends to the rows of a second input M, .* cannot go with causal"),
    ({"kind": "self_attention", "cross_attention": True, "rotary": True},
     "cannot go with rotary = true"),
    ({"kind": "block", "cross_attention": True, "norm_position": "parallel"},
     "'cross_attention' adds a third sublayer .* not \"parallel\""),
    ({"kind": "block", "cross_attention": True, "norm_position": "pre", "layer_scale": True},
     "'cross_attention' in a block does not go with layer_scale = true"),
    ({"kind": "ffn", "cross_attention": True}, "'cross_attention' applies to kind block or "
                                               "self_attention"),
    ({"kind": "block", "rotary": True, "rotary_scaling": "ntk"},
     "'rotary_scaling' must be one of none, linear, dynamic, llama3, yarn"),
])
def test_rejected_combinations(data, message):
    with pytest.raises(ConfigError, match=message):
        validate({"name": "v", **data})


def test_width_not_divisible_by_heads(backend):
    from conftest import generated_module

    module = generated_module("gpt2_block", backend)
    params, X, target = random_case(module, {"L": 3, "d": 4, "d_k": 5, "d_ff": 7}, batch=2)
    with pytest.raises(ValueError, match=r"X: expected a width d divisible by the number of heads h = 2, got d = 5"):
        module.forward(to_backend(backend, params),
                       to_backend(backend, torch.randn(2, 3, 5, dtype=torch.float64)))


def test_cross_entropy_targets_are_checked(backend):
    from conftest import generated_module

    module = generated_module("gpt2_block", backend)
    params, X, target = random_case(module, {"L": 3, "d": 4, "d_k": 5, "d_ff": 7}, batch=2)
    P, Xb = to_backend(backend, params), to_backend(backend, X)
    with pytest.raises(ValueError, match=r"target: expected class indices in \[0, d\) = \[0, 4\) or -100 \(ignored\), got 4 at index \(0, 2\)"):
        module.loss(P, Xb, to_backend(backend, torch.tensor([[0, 1, 4], [1, 2, 3]])))
    with pytest.raises(TypeError, match="target: expected integer class indices"):
        module.loss(P, Xb, to_backend(backend, torch.zeros(2, 3, dtype=torch.float64)))
    with pytest.raises(ValueError, match=r"target: expected class indices of shape \(B, L\) = \(2, 3\), got shape \(2, 3, 4\)"):
        module.loss(P, Xb, to_backend(backend, torch.zeros(2, 3, 4, dtype=torch.int64)))


def test_an_ignored_cross_entropy_target_adds_nothing(backend):
    """A target of -100 (torch's ignore_index): its row adds nothing, and the mean stays over
    every row, as the module's conventions say."""
    from conftest import generated_module

    module = generated_module("gpt2_block", backend)
    params, X, _ = random_case(module, {"L": 3, "d": 4, "d_k": 5, "d_ff": 7}, batch=2)
    target = torch.tensor([[0, -100, 3], [-100, -100, 2]])
    P, Xb = to_backend(backend, params), to_backend(backend, X)
    Z = torch.as_tensor(module.forward(P, Xb))
    expected = torch.nn.functional.cross_entropy(Z.reshape(-1, 4), target.reshape(-1),
                                                 reduction="sum") / 6
    value = torch.as_tensor(module.loss(P, Xb, to_backend(backend, target)))
    assert abs(float(value) - float(expected)) <= 1e-12 * abs(float(expected))


def test_rotary_needs_an_even_head_width(variant, backend):
    module = variant("attention_rotary", backend)[1]
    params, X, _ = random_case(module, ROTARY_DIMS, batch=2)
    params = {"W_Q": params["W_Q"][:, :5], "W_K": params["W_K"][:, :5], "W_V": params["W_V"]}
    with pytest.raises(ValueError, match=r"params\['W_Q'\]: expected a head width d_k divisible "
                                         r"by 2 \(rotary embeddings turn pairs .*\), got d_k = 5"):
        module.forward(to_backend(backend, params), to_backend(backend, X))


ROPE_CASES = [  # (config's rotary options, Hugging Face's rope_parameters), head_dim 20, L 100
    # partial rotary: HF's unscaled table of the first 0.4 of a head, as linear with factor 1
    ({"rotary_fraction": 0.4}, {"rope_type": "linear", "factor": 1.0,
                                "partial_rotary_factor": 0.4}),
    ({"rotary_scaling": "linear", "rotary_factor": 2.5}, {"rope_type": "linear", "factor": 2.5}),
    ({"rotary_scaling": "dynamic", "rotary_factor": 2.0, "rotary_original_length": 64},
     {"rope_type": "dynamic", "factor": 2.0}),
    ({"rotary_scaling": "llama3", "rotary_factor": 8.0, "rotary_original_length": 64,
      "rotary_low_freq_factor": 1.0, "rotary_high_freq_factor": 4.0},
     {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64,
      "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
    ({"rotary_scaling": "yarn", "rotary_factor": 4.0, "rotary_original_length": 64},
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    ({"rotary_scaling": "yarn", "rotary_factor": 4.0, "rotary_original_length": 64,
      "rotary_beta_fast": 16.0, "rotary_attention_factor": 1.5},
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
      "beta_fast": 16.0, "attention_factor": 1.5}),
]


@pytest.mark.parametrize("options, rope", ROPE_CASES, ids=["partial", "linear", "dynamic", "llama3", "yarn", "yarn_options"])
def test_rotary_tables_match_hugging_face(tmp_path, options, rope):
    """The generated table's frequencies and amplitude, and the reference's, are Hugging
    Face's rope initialisers' (computed in float32 there)."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from curvgap.derivations.attention import _frequencies, rotary_scaling

    head_dim, length = 20, 100
    config = validate({"name": "v", "kind": "self_attention", "rotary": True,
                       "rotary_base": 500.0, **options})
    hf = transformers.LlamaConfig(hidden_size=40, num_attention_heads=2, head_dim=head_dim,
                                  max_position_embeddings=64,
                                  rope_parameters={"rope_theta": 500.0, **rope})
    expected, amplitude = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu", seq_len=length)
    half = round(head_dim * config.rotary_fraction) // 2
    path = tmp_path / "v.toml"
    path.write_text('name = "v"\nkind = "self_attention"\nrotary = true\nrotary_base = 500.0\n'
                    + "".join(f"{k} = {v!r}\n".replace("'", '"') for k, v in options.items()))
    module = _load_module_from(render(derive(load(path)), backend_named("torch")), tmp_path)
    generated, generated_amplitude = module._rotary_frequencies(half, length, 500.0,
                                                                rotary_scaling(config))
    reference, reference_amplitude = _frequencies(config, half, length, torch.float64)
    for omega, a in ((torch.tensor(generated, dtype=torch.float64), generated_amplitude),
                     (reference, reference_amplitude)):
        assert torch.allclose(omega, expected.double(), rtol=1e-6, atol=0)
        assert a == pytest.approx(amplitude, rel=1e-12)


def _load_module_from(source: str, folder):
    file = folder / "rotary_module.py"
    file.write_text(source)
    return _load_module(file, f"rotary_module_{folder.name}")


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
def test_relative_buckets_are_t5s(tmp_path, causal):
    """The generated bucket table and the reference's are T5's own
    ``_relative_position_bucket``, at offsets past the exact ones and past the largest."""
    pytest.importorskip("transformers")
    from transformers.models.t5.modeling_t5 import T5Attention

    from curvgap.derivations.attention import _buckets

    L, buckets, distance = 40, 12, 20
    body = (f'kind = "self_attention"\ncausal = {str(causal).lower()}\nrelative_bias = true\n'
            f'relative_buckets = {buckets}\nrelative_max_distance = {distance}\n')
    path = tmp_path / "v.toml"
    path.write_text('name = "v"\n' + body)
    config = load(path)
    module = _load_module_from(render(derive(config), backend_named("torch")), tmp_path)
    offset = torch.arange(L)[None, :] - torch.arange(L)[:, None]
    expected = T5Attention._relative_position_bucket(offset, bidirectional=not causal,
                                                     num_buckets=buckets, max_distance=distance)
    ns = {"X": torch.zeros(1, dtype=torch.float64)}
    table = module._relative_buckets(ns, L, buckets, distance, not causal)
    assert torch.equal(table.argmax(-1), expected) and torch.equal(table.sum(-1), torch.ones(L, L, dtype=torch.float64))
    assert torch.equal(_buckets(config, L), expected)


@pytest.mark.slow
def test_the_decoder_block_config_is_torchs_decoder_layer(variant):
    """``decoder_block_post`` is ``nn.TransformerDecoderLayer`` (post-LN, ReLU, biases, a
    causal self-attention, cross-attention on ``memory``): its generated module's forward,
    gradient and HVP equal autograd (double backward, MATH kernel) on the torch layer with
    the same weights (our ``Norm_3`` is torch's ``norm2``, our ``Norm_2`` its ``norm3``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    config, module = variant("decoder_block_post", "torch")
    d, heads, d_ff, L, L_m = 4, 2, 6, 3, 5
    torch.manual_seed(0)
    layer = torch.nn.TransformerDecoderLayer(d, heads, d_ff, dropout=0.0, batch_first=True,
                                             dtype=torch.float64)
    X, M = torch.randn(2, L, d, dtype=torch.float64), torch.randn(2, L_m, d, dtype=torch.float64)
    T = torch.randn(2, L, d, dtype=torch.float64)
    names = [name for name, _ in module.PARAMS]

    def torch_weights(ours: dict) -> dict:
        """The layer's state for our parameters (``W`` is ``weight^T``)."""
        weights = {}
        for prefix, tag in (("self_attn", ""), ("multihead_attn", "_c")):
            weights[f"{prefix}.in_proj_weight"] = torch.cat(
                [ours[f"W_{p}{tag}"].T for p in "QKV"])
            weights[f"{prefix}.in_proj_bias"] = torch.cat([ours[f"b_{p}{tag}"] for p in "QKV"])
            weights[f"{prefix}.out_proj.weight"] = ours[f"W_O{tag}"].T
            weights[f"{prefix}.out_proj.bias"] = ours[f"b_O{tag}"]
        for k in (1, 2):
            weights[f"linear{k}.weight"] = ours[f"W_{k}"].T
            weights[f"linear{k}.bias"] = ours[f"b_{k}"]
        for torch_norm, our_norm in ((1, 1), (2, 3), (3, 2)):
            weights[f"norm{torch_norm}.weight"] = ours[f"gamma_{our_norm}"]
            weights[f"norm{torch_norm}.bias"] = ours[f"beta_{our_norm}"]
        return weights

    state = dict(layer.named_parameters())
    ours = {}
    for prefix, tag in (("self_attn", ""), ("multihead_attn", "_c")):
        w = state[f"{prefix}.in_proj_weight"].detach()
        for k, p in enumerate("QKV"):
            ours[f"W_{p}{tag}"] = w[k * d:(k + 1) * d].T.contiguous()
            ours[f"b_{p}{tag}"] = torch.randn(d, dtype=torch.float64) * 0.3  # (zeros in torch)
        ours[f"W_O{tag}"] = state[f"{prefix}.out_proj.weight"].detach().T.contiguous()
        ours[f"b_O{tag}"] = torch.randn(d, dtype=torch.float64) * 0.3
    for k in (1, 2):
        ours[f"W_{k}"] = state[f"linear{k}.weight"].detach().T.contiguous()
        ours[f"b_{k}"] = state[f"linear{k}.bias"].detach()
    for n in (1, 2, 3):
        ours[f"gamma_{n}"] = 1 + 0.3 * torch.randn(d, dtype=torch.float64)
        ours[f"beta_{n}"] = 0.3 * torch.randn(d, dtype=torch.float64)
    assert set(ours) == set(names)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(L, dtype=torch.float64)

    def torch_loss(flat):
        values = dict(zip(names, torch.split(flat, [ours[n].numel() for n in names])))
        values = {n: v.reshape(ours[n].shape) for n, v in values.items()}
        with sdpa_kernel(SDPBackend.MATH):
            Z = torch.func.functional_call(layer, torch_weights(values), (X, M),
                                           {"tgt_mask": mask, "tgt_is_causal": True})
        return ((Z - T) ** 2).sum((1, 2)).mean() / (L * d), Z

    flat = torch.cat([ours[n].reshape(-1) for n in names]).requires_grad_()
    loss, Z = torch_loss(flat)
    (gradient,) = torch.autograd.grad(loss, flat, create_graph=True)
    v = torch.randn(flat.numel(), dtype=torch.float64)
    (hv,) = torch.autograd.grad(gradient @ v, flat)
    params = {**ours, "M": M}

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max())

    assert rel(module.forward(params, X), Z.detach()) <= 1e-12
    assert rel(module.gradient(params, X, T), gradient.detach()) <= 1e-12
    assert rel(module.hvp(params, X, T, v), hv) <= 1e-10
