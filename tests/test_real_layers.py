"""``curvgap.curvature`` on real PyTorch layers with random nonzero weights and biases,
float64, against reverse-over-reverse autograd on the layer itself (MATH attention kernel),
backed by finite differences of the gradient; and the refusals."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import extra_module, import_timm
from torch.nn.attention import SDPBackend, sdpa_kernel

import curvgap
from curvgap.adapters import UnsupportedLayer

L, D, HEADS, D_FF, B = 3, 4, 2, 6, 2  # d_k = 2: L, d, d_k, d_ff all differ


def randomise(layer: torch.nn.Module) -> torch.nn.Module:
    """Random nonzero weights and biases (vectors around 0.5, so norms' weights too)."""
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.7 + (0.5 if p.ndim == 1 else 0.0))
    return layer.eval()


def encoder_layer(norm_first: bool, activation: str, bias: bool, heads: int = HEADS,
                  batch_first: bool = True, seed: int = 0) -> torch.nn.TransformerEncoderLayer:
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(D, heads, D_FF, dropout=0.1, activation=activation,
                                             layer_norm_eps=1e-5, batch_first=batch_first,
                                             norm_first=norm_first, bias=bias,
                                             dtype=torch.float64)
    return randomise(layer)


def gpt2_block(activation: str = "gelu_new", seed: int = 0) -> torch.nn.Module:
    transformers = extra_module("transformers")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_embd=D, n_head=HEADS, n_inner=D_FF,
                                     activation_function=activation, layer_norm_epsilon=1e-5)
    config._attn_implementation = "sdpa"  # causal without a mask, as in GPT2Model
    return randomise(GPT2Block(config).to(torch.float64))


def llama_layer(heads: int, kv_heads: int, bias: bool, seed: int = 0) -> torch.nn.Module:
    transformers = extra_module("transformers")
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=2 * D, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, intermediate_size=D_FF,
                                      rms_norm_eps=1e-5, rope_theta=500.0,
                                      attention_bias=bias, mlp_bias=bias)
    config._attn_implementation = "sdpa"  # causal without a mask, as in LlamaModel
    return randomise(LlamaDecoderLayer(config, layer_idx=0).to(torch.float64))


def vit_block(**options) -> torch.nn.Module:
    import_timm()
    from timm.models.vision_transformer import Block

    torch.manual_seed(0)
    options = {"qkv_bias": True, **options}
    return randomise(Block(D, HEADS, mlp_ratio=D_FF / D, **options).to(torch.float64))


def rope_tables(length: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's default ``(cos, sin)`` for positions ``0..length-1`` in float64, ``(1, L,
    head_dim)``: angle ``i · theta^(-2m/head_dim)``, repeated over the two halves."""
    frequencies = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(length, dtype=torch.float64)[:, None] * frequencies
    angles = torch.cat([angles, angles], dim=-1)[None]
    return angles.cos(), angles.sin()


def llama_twin(layer: torch.nn.Module) -> torch.nn.Module:
    """``layer`` in float64 throughout, sharing its parameters (same names, same order).
    ``LlamaRMSNorm`` computes in float32 even for float64 inputs, and the model hands its
    layers cos/sin made in float32: the twin has ``torch.nn.RMSNorm`` with the same weight
    and eps, and gets the tables in float64."""
    twin = copy.deepcopy(layer)
    for name in ("input_layernorm", "post_attention_layernorm"):
        setattr(twin, name, torch.nn.RMSNorm(layer.hidden_size, dtype=torch.float64,
                                             eps=getattr(layer, name).variance_epsilon))
    for name, parameter in layer.named_parameters():
        owner, _, leaf = name.rpartition(".")
        setattr(twin.get_submodule(owner), leaf, parameter)
    theta = layer.self_attn.config.rope_parameters["rope_theta"]

    def tables(module, args, kwargs):
        length = (args[0] if args else kwargs["hidden_states"]).shape[-2]
        return args, {**kwargs, "position_embeddings": rope_tables(
            length, layer.self_attn.head_dim, theta)}

    twin.register_forward_pre_hook(tables, with_kwargs=True)
    return twin


def output(layer, X):
    """The layer's own output for batch-first ``X`` (MATH kernel: it has second derivatives)."""
    with sdpa_kernel(SDPBackend.MATH):
        if isinstance(layer, torch.nn.TransformerEncoderLayer) and not layer.self_attn.batch_first:
            return layer(X.transpose(0, 1)).transpose(0, 1)
        return layer(X)


def reference_hessian(layer, X, T, loss=F.mse_loss) -> torch.Tensor:
    """Reverse over reverse on the layer: each row the gradient of one gradient entry."""
    params = list(layer.parameters())
    with sdpa_kernel(SDPBackend.MATH):
        gradient = torch.autograd.grad(loss(output(layer, X), T), params,
                                       create_graph=True)
        flat = torch.cat([g.reshape(-1) for g in gradient])
        rows = [torch.cat([r.reshape(-1) for r in torch.autograd.grad(
            flat[k], params, retain_graph=True)]) for k in range(flat.numel())]
    return torch.stack(rows)


def gradient(layer, X, T) -> torch.Tensor:
    with sdpa_kernel(SDPBackend.MATH):
        grads = torch.autograd.grad(F.mse_loss(output(layer, X), T), list(layer.parameters()))
    return torch.cat([g.reshape(-1) for g in grads])


def relative(value, reference) -> float:
    return float((value - reference).abs().max() / reference.abs().max())


#: The layers checked, by id: how to build each, the name of its attention weight (packed
#: or not) and of a feed-forward weight.
LAYERS = {
    "encoder-post-relu-bias": (lambda: encoder_layer(False, "relu", True),
                               "self_attn.in_proj_weight", "linear1.weight"),
    "encoder-pre-gelu-bias": (lambda: encoder_layer(True, "gelu", True),
                              "self_attn.in_proj_weight", "linear1.weight"),
    "encoder-post-gelu-nobias": (lambda: encoder_layer(False, "gelu", False),
                                 "self_attn.in_proj_weight", "linear1.weight"),
    "encoder-pre-relu-nobias": (lambda: encoder_layer(True, "relu", False),
                                "self_attn.in_proj_weight", "linear1.weight"),
    "gpt2": (gpt2_block, "attn.c_attn.weight", "mlp.c_fc.weight"),
    "timm-vit": (vit_block, "attn.qkv.weight", "mlp.fc2.weight"),
    # grouped-query attention with biases (d_k = 2); multi-query without (d_k = 4)
    "llama-gqa-bias": (lambda: llama_layer(4, 2, True), "self_attn.k_proj.weight",
                       "mlp.up_proj.weight"),
    "llama-mqa": (lambda: llama_layer(2, 1, False), "self_attn.q_proj.weight",
                  "mlp.gate_proj.weight"),
}


#: Layers checked with ``-m slow`` (CI): the quick run keeps one of each library.
SLOW = {"encoder-pre-gelu-bias", "encoder-post-gelu-nobias", "encoder-pre-relu-nobias",
        "llama-mqa"}


@pytest.fixture(scope="module", params=[pytest.param(name, marks=pytest.mark.slow)
                                        if name in SLOW else name for name in LAYERS])
def case(request):
    """The layer's reference (itself, or its float64 twin sharing its parameters), curvgap
    on the layer itself, inputs, targets and the reverse-over-reverse Hessian."""
    make, attention_weight, ffn_weight = LAYERS[request.param]
    layer = make()
    reference = llama_twin(layer) if request.param.startswith("llama") else layer
    reference.attention_weight, reference.ffn_weight = attention_weight, ffn_weight
    width = layer.self_attn.config.hidden_size if reference is not layer else D
    generator = torch.Generator().manual_seed(1)
    X = torch.randn(B, L, width, generator=generator, dtype=torch.float64)
    T = torch.randn(B, L, width, generator=generator, dtype=torch.float64)
    return (reference, curvgap.curvature(layer), X, T,
            reference_hessian(reference, X, T))


def test_forward_and_loss_equal_the_layer(case):
    layer, c, X, T, _ = case
    with torch.no_grad():
        assert relative(c.forward(X), output(layer, X)) <= 1e-12
        assert relative(c.loss(X, T), F.mse_loss(output(layer, X), T)) <= 1e-12


def test_loss_hessian_in_the_layers_order_equals_autograd(case):
    layer, c, X, T, H = case
    n = sum(p.numel() for p in layer.parameters())
    mine = c.loss_hessian(X, T)
    assert mine.shape == (n, n)
    assert relative(mine, H) <= 1e-10


def gauss_newton_reference(layer, X, T) -> torch.Tensor:
    """``J^T (∂²ℓ/∂Z²) J`` with every factor from autograd on the layer."""
    params = dict(layer.named_parameters())
    names = list(params)

    def out(*values):
        return torch.func.functional_call(layer, dict(zip(names, values)), (X,)).reshape(-1)

    with sdpa_kernel(SDPBackend.MATH):
        J = torch.cat([j.reshape(X.numel(), -1) for j in torch.autograd.functional.jacobian(
            out, tuple(params.values()))], dim=1)
        Z = out(*(p.detach() for p in params.values()))
    Hz = torch.autograd.functional.hessian(lambda z: F.mse_loss(z.reshape(T.shape), T), Z)
    return J.T @ Hz @ J


def test_gauss_newton_part_equals_autograd(case):
    layer, c, X, T, _ = case
    assert relative(c.loss_hessian(X, T, part="gauss_newton"),
                    gauss_newton_reference(layer, X, T)) <= 1e-10


@pytest.mark.slow  # the quick run checks operators and diagonals in test_operators
def test_diagonals_products_and_operator_in_the_layers_order_equal_autograd(case):
    layer, c, X, T, H = case
    GN = gauss_newton_reference(layer, X, T)
    assert relative(c.diagonal(X, T), torch.diagonal(H)) <= 1e-10
    assert relative(c.diagonal(X, T, part="gauss_newton"), torch.diagonal(GN)) <= 1e-10
    V = torch.randn(H.shape[0], 3, generator=torch.Generator().manual_seed(5),
                    dtype=torch.float64)
    assert relative(c.gnvp(X, T, V), GN @ V) <= 1e-10
    for part, dense in (("full", H), ("gauss_newton", GN), ("functional", H - GN)):
        operator = c.hessian_operator(X, T, part=part)
        assert operator.shape == H.shape
        assert float((operator @ V - dense @ V).abs().max() / (H @ V).abs().max()) <= 1e-10
    # the largest eigenvalues by scipy's Lanczos on the operator, the trace from the diagonal
    eigsh = extra_module("scipy.sparse.linalg").eigsh
    top = eigsh(c.hessian_operator(X, T).to_scipy(), k=2, which="LA", tol=1e-13)[0]
    expected = torch.linalg.eigvalsh(H)[-2:]
    assert float(abs(torch.as_tensor(sorted(top)) - expected).max()
                 / expected.abs().max()) <= 1e-10
    trace = torch.trace(H)
    assert abs(float(c.diagonal(X, T).sum() - trace)) <= 1e-10 * float(torch.diagonal(H).abs().sum())


def test_gradient_in_the_layers_order_equals_autograd(case):
    layer, c, X, T, _ = case
    assert relative(c.gradient(X, T), gradient(layer, X, T)) <= 1e-12


def test_input_parameter_block_equals_autograd(case):
    layer, c, X, T, _ = case

    def input_gradient(*values):
        names = [n for n, _ in layer.named_parameters()]
        x = X.detach().requires_grad_()
        with sdpa_kernel(SDPBackend.MATH):
            out = torch.func.functional_call(layer, dict(zip(names, values)), (x,))
            return torch.autograd.grad(F.mse_loss(out, T), x, create_graph=True)[0]

    values = tuple(p.detach() for p in layer.parameters())
    blocks = torch.autograd.functional.jacobian(input_gradient, values)
    # d(mean over samples)/dX_b is the sample's own gradient over B
    expected = torch.cat([j.reshape(B, X[0].numel(), -1) for j in blocks], dim=-1) * B
    assert relative(c.loss_hessian_mixed(X, T), expected) <= 1e-10


def test_hvp_and_a_block_by_name(case):
    layer, c, X, T, H = case
    v = torch.randn(H.shape[0], generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    assert relative(c.hvp(X, T, v), H @ v) <= 1e-10
    names = [n for n, _ in layer.named_parameters()]
    sizes = [p.numel() for p in layer.parameters()]
    start = sum(sizes[:names.index(layer.attention_weight)])
    stop = start + sizes[names.index(layer.attention_weight)]
    block = c.loss_hessian(X, T, wrt=layer.attention_weight)
    assert relative(block, H[start:stop, start:stop]) <= 1e-10


def test_jacobian_in_the_layout_of_the_layers_parameter(case):
    layer, c, X, _, _ = case
    weight = layer.get_parameter(layer.ffn_weight)

    def out(w):
        return torch.func.functional_call(layer, {layer.ffn_weight: w}, (X,))

    with sdpa_kernel(SDPBackend.MATH):
        J = torch.autograd.functional.jacobian(out, weight.detach())
    J = J.reshape(B, X[0].numel(), -1)
    assert relative(c.jacobian(X, layer.ffn_weight), J) <= 1e-10


def test_hessian_columns_equal_finite_differences_of_the_gradient(case):
    layer, c, X, T, _ = case
    H = c.loss_hessian(X, T)
    flat = torch.nn.utils.parameters_to_vector(layer.parameters()).detach()
    for k in (0, flat.numel() // 2, flat.numel() - 1):
        step = 1e-6 * max(1.0, float(flat[k].abs()))
        columns = []
        for sign in (1, -1):
            shifted = flat.clone()
            shifted[k] += sign * step
            torch.nn.utils.vector_to_parameters(shifted, layer.parameters())
            columns.append(gradient(layer, X, T))
        torch.nn.utils.vector_to_parameters(flat, layer.parameters())
        fd = (columns[0] - columns[1]) / (2 * step)
        assert relative(H[:, k], fd) <= 1e-6


def test_weights_are_read_at_call_time():
    layer = encoder_layer(False, "relu", True)
    c = curvgap.curvature(layer)
    X = torch.randn(B, L, D, dtype=torch.float64)
    with torch.no_grad():
        layer.linear2.bias.add_(1.0)
        assert relative(c.forward(X), output(layer, X)) <= 1e-12


def test_sequence_first_layers_take_batch_first_inputs():
    layer = encoder_layer(False, "relu", True, batch_first=False)
    X = torch.randn(B, L, D, dtype=torch.float64)
    with torch.no_grad():
        assert relative(curvgap.curvature(layer).forward(X), output(layer, X)) <= 1e-12


@pytest.mark.parametrize("change, message", [
    (lambda layer: layer.train(), "layer.dropout: the layer is in training mode with dropout"),
    (lambda layer: setattr(layer, "activation", torch.nn.Hardswish()),
     "layer.activation: expected one of ReLU, GELU .*, got Hardswish"),
    (lambda layer: setattr(layer.norm2, "eps", 1e-3), "layer.norm2.eps: expected the eps"),
])
def test_what_curvgap_does_not_represent_is_refused(change, message):
    layer = encoder_layer(False, "relu", True)
    change(layer)
    with pytest.raises(UnsupportedLayer, match=message):
        curvgap.curvature(layer)


def test_unknown_layers_and_parameter_names_are_refused():
    with pytest.raises(UnsupportedLayer, match="layer: expected a layer curvgap recognises"):
        curvgap.curvature(torch.nn.Linear(3, 3))
    c = curvgap.curvature(encoder_layer(False, "relu", True))
    X = torch.randn(B, L, D, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"wrt: expected 'X' or names of the layer's "
                                         r"parameters \[.*\], got \['W_Q'\]"):
        c.loss_hessian(X, X, wrt="W_Q")


def test_gpt2_block_is_the_causal_block_gpt2_model_runs():
    layer = gpt2_block()
    layer.attn.config._attn_implementation = "eager"  # the mask then comes from the caller
    X = torch.randn(B, L, D, dtype=torch.float64)
    mask = torch.zeros(L, L, dtype=torch.float64).masked_fill(
        torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    with torch.no_grad():
        assert relative(curvgap.curvature(layer).forward(X),
                        layer(X, attention_mask=mask[None, None])) <= 1e-12


@pytest.mark.parametrize("change, message", [
    (lambda layer: layer.train(), "layer.attn.attn_dropout: the layer is in training mode"),
    (lambda layer: setattr(layer.ln_2, "eps", 1e-3), "layer.ln_2.eps: expected the eps"),
    (lambda layer: setattr(layer, "crossattention", torch.nn.Identity()),
     "layer.crossattention: cross-attention"),
])
def test_what_curvgap_does_not_represent_in_gpt2_is_refused(change, message):
    layer = gpt2_block()
    change(layer)
    with pytest.raises(UnsupportedLayer, match=message):
        curvgap.curvature(layer)


def test_an_approximate_gelu_is_refused_not_approximated():
    with pytest.raises(UnsupportedLayer, match="layer.mlp.act: expected one of .*, got "
                                               "QuickGELUActivation"):
        curvgap.curvature(gpt2_block("quick_gelu"))


def test_llama_as_it_runs_agrees_to_its_float32_internals():
    """The unchanged layer, with the model's own rotary tables: equal to float32 rounding
    (its norms and tables are float32), and the tables equal the float64 ones to it."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    layer = llama_layer(4, 2, True)
    X = torch.randn(B, L, 2 * D, dtype=torch.float64)
    cos, sin = LlamaRotaryEmbedding(layer.self_attn.config)(X, torch.arange(L)[None])
    exact = rope_tables(L, layer.self_attn.head_dim, 500.0)
    assert relative(cos, exact[0]) <= 1e-6 and relative(sin, exact[1]) <= 1e-6
    with sdpa_kernel(SDPBackend.MATH), torch.no_grad():
        assert relative(curvgap.curvature(layer).forward(X),
                        layer(X, position_embeddings=(cos, sin))) <= 1e-5


@pytest.mark.parametrize("change, message", [
    (lambda layer: layer.train(), "layer.self_attn.attention_dropout: the layer is in "
                                  "training mode"),
    (lambda layer: setattr(layer.self_attn.config, "rope_parameters",
                           {"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0}),
     "rope_parameters: expected the default RoPE, got rope_type 'linear'"),
    (lambda layer: setattr(layer.post_attention_layernorm, "variance_epsilon", 1e-6),
     "layer.post_attention_layernorm.variance_epsilon: expected the eps"),
    (lambda layer: setattr(layer.mlp, "act_fn", torch.nn.Mish()),
     "layer.mlp.act_fn: expected one of .*, got Mish"),
])
def test_what_curvgap_does_not_represent_in_llama_is_refused(change, message):
    layer = llama_layer(4, 2, True)
    layer.self_attn.config.attention_dropout = 0.1
    layer.self_attn.attention_dropout = 0.1
    change(layer)
    with pytest.raises(UnsupportedLayer, match=message):
        curvgap.curvature(layer)


@pytest.mark.parametrize("options, message", [
    ({"init_values": 1e-5}, "layer.ls1: expected Identity, got LayerScale"),
    ({"qk_norm": True}, "layer.attn.q_norm: expected Identity, got LayerNorm"),
    ({"qkv_bias": False}, "layer.attn.proj.bias: expected biases everywhere or nowhere"),
    ({"act_layer": torch.nn.Mish}, "layer.mlp.act: expected one of .*, got Mish"),
])
def test_what_curvgap_does_not_represent_in_timm_is_refused(options, message):
    with pytest.raises(UnsupportedLayer, match=message):
        curvgap.curvature(vit_block(**options))


def test_timm_stochastic_depth_in_training_is_refused():
    layer = vit_block(drop_path=0.1).train()
    with pytest.raises(UnsupportedLayer, match="layer.drop_path1: the layer is in training"):
        curvgap.curvature(layer)


@pytest.mark.slow
def test_cross_entropy_over_each_rows_outputs_equals_autograd():
    """``loss="cross_entropy"``: ``F.cross_entropy`` of each row's ``d`` outputs against a
    class index per row, averaged over rows and samples."""
    layer = gpt2_block()
    generator = torch.Generator().manual_seed(3)
    X = torch.randn(B, L, D, generator=generator, dtype=torch.float64)
    T = torch.randint(0, D, (B, L), generator=generator)

    def cross_entropy(Z, T):
        return F.cross_entropy(Z.reshape(-1, D), T.reshape(-1))

    with torch.no_grad():
        loss = cross_entropy(output(layer, X), T)
    H = reference_hessian(layer, X, T, cross_entropy)
    c = curvgap.curvature(layer, loss="cross_entropy")
    assert relative(c.loss(X, T), loss) <= 1e-12
    assert relative(c.loss_hessian(X, T), H) <= 1e-10
