"""``curvgap.curvature`` on whole real models — GPT-2's ``GPT2Model`` (on ``inputs_embeds``,
with ``wpe`` and ``ln_f``) and a timm ViT classifier (patch embedding, class token, blocks,
final norm, head) — with random nonzero weights, float64, against reverse-over-reverse
autograd on the model itself (MATH attention kernel); and the refusals. (The
``TransformerEncoder`` is checked in ``test_models.py``.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import extra_module, import_timm
from torch.nn.attention import SDPBackend, sdpa_kernel

import curvgap
from curvgap.adapters import UnsupportedLayer

B = 2


def randomise(model: torch.nn.Module) -> torch.nn.Module:
    """Random nonzero weights and biases (vectors around 0.5, so norms' weights too)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.7 + (0.5 if p.ndim == 1 else 0.0))
    return model.eval()


def gpt2_model(layers: int = 2) -> torch.nn.Module:
    transformers = extra_module("transformers")
    config = transformers.GPT2Config(n_embd=4, n_head=2, n_inner=6, n_layer=layers,
                                     n_positions=5, vocab_size=7, layer_norm_epsilon=1e-5)
    config._attn_implementation = "sdpa"
    return randomise(transformers.GPT2Model(config).to(torch.float64))


def vit(**options) -> torch.nn.Module:
    import_timm()
    from timm.models.vision_transformer import VisionTransformer

    options = {"img_size": 4, "patch_size": 2, "in_chans": 2, "num_classes": 3,
               "embed_dim": 4, "depth": 2, "num_heads": 2, "mlp_ratio": 1.5,
               "qkv_bias": True, **options}
    return randomise(VisionTransformer(**options).to(torch.float64))


def reference(model, output, X, T, loss):
    """The loss, its gradient and its Hessian by reverse over reverse on the model."""
    params = list(model.parameters())
    with sdpa_kernel(SDPBackend.MATH):
        value = loss(output(model, X), T)
        grads = torch.autograd.grad(value, params, create_graph=True, allow_unused=True)
        flat = torch.cat([torch.zeros_like(p).reshape(-1) if g is None else g.reshape(-1)
                          for g, p in zip(grads, params)])
        rows = []
        for k in range(flat.numel()):
            if not flat[k].requires_grad:
                rows.append(torch.zeros_like(flat))
                continue
            row = torch.autograd.grad(flat[k], params, retain_graph=True, allow_unused=True)
            rows.append(torch.cat([torch.zeros_like(p).reshape(-1) if r is None else
                                   r.reshape(-1) for r, p in zip(row, params)]))
    return value.detach(), flat.detach(), torch.stack(rows)


def gpt2_output(model, X):
    return model(inputs_embeds=X).last_hidden_state


def vit_output(model, X):
    return model(X)


def relative(value, expected) -> float:
    expected = expected.detach()
    return float((value - expected).abs().max() / expected.abs().max())


CASES = {
    "gpt2": lambda: (gpt2_model(), gpt2_output, (B, 3, 4), "mse"),
    "vit-token": lambda: (vit(), vit_output, (B, 2, 4, 4), "cross_entropy"),
    "vit-avg-pre-norm": lambda: (vit(class_token=False, global_pool="avg", fc_norm=False,
                                     pre_norm=True), vit_output, (B, 2, 4, 4), "mse"),
}


#: The cases the default run checks; CI runs the rest with ``-m slow``.
QUICK = ("gpt2", "vit-token")


@pytest.fixture(scope="module", params=[
    name if name in QUICK else pytest.param(name, marks=pytest.mark.slow) for name in CASES])
def case(request):
    model, output, shape, loss = CASES[request.param]()
    generator = torch.Generator().manual_seed(1)
    X = torch.randn(*shape, generator=generator, dtype=torch.float64)
    with torch.no_grad():
        Z = output(model, X)
    if loss == "cross_entropy":
        T, fn = torch.randint(0, Z.shape[-1], (B,), generator=generator), F.cross_entropy
    else:
        T, fn = torch.randn(Z.shape, generator=generator, dtype=torch.float64), F.mse_loss
    return model, output, X, T, loss, reference(model, output, X, T, fn)


def test_forward_loss_and_gradient_equal_the_model(case):
    model, output, X, T, loss, (value, gradient, _) = case
    c = curvgap.curvature(model, loss=loss)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        assert relative(c.forward(X), output(model, X)) <= 1e-12
    assert relative(c.loss(X, T), value) <= 1e-12
    assert relative(c.gradient(X, T), gradient) <= 1e-12


def test_full_hessian_and_hvp_in_the_models_order_equal_autograd(case):
    model, _, X, T, loss, (_, _, H) = case
    c = curvgap.curvature(model, loss=loss)
    assert relative(c.loss_hessian(X, T), H) <= 1e-10
    v = torch.randn(H.shape[0], generator=torch.Generator().manual_seed(2),
                    dtype=torch.float64)
    assert relative(c.hvp(X, T, v), H @ v) <= 1e-10


def test_a_cross_layer_block_by_the_models_names(case):
    model, _, X, T, loss, (_, _, H) = case
    c = curvgap.curvature(model, loss=loss)
    names = [n for n, _ in model.named_parameters()]
    wrt = [names[1], names[-3], names[-1]]
    slices = c.layer_slices()
    index = torch.cat([torch.arange(slices[n].start, slices[n].stop) for n in wrt])
    assert relative(c.loss_hessian(X, T, wrt=wrt), H[index][:, index]) <= 1e-10
    assert relative(c.gradient(X, T, wrt=wrt[::-1]), c.gradient(X, T)[index]) == 0.0


def test_gpt2_unused_entries_are_exact_zeros():
    """On ``inputs_embeds`` the token embedding is unused, and so are the positions past
    the input's length: their rows are zero, and asking for them alone says so."""
    model = gpt2_model(layers=1)
    c = curvgap.curvature(model)
    X = torch.randn(B, 3, 4, dtype=torch.float64)
    g = c.gradient(X, X)
    slices = c.layer_slices()
    assert bool((g[slices["wte.weight"]] == 0).all())
    wpe = g[slices["wpe.weight"]].reshape(5, 4)
    assert bool((wpe[3:] == 0).all()) and bool((wpe[:3] != 0).all())
    with pytest.raises(ValueError, match=r"wrt: the loss does not depend on \['wte.weight'\]"):
        c.loss_hessian(X, X, wrt="wte.weight")
    with pytest.raises(ValueError, match=r"X: expected at most 5 positions \(the rows of the "
                                         r"model's positional table\), got 6"):
        c.loss(torch.randn(B, 6, 4, dtype=torch.float64), torch.randn(B, 6, 4))


@pytest.mark.parametrize("options, message", [
    ({"reg_tokens": 1}, "model.reg_token: expected the plain ViT's"),
    ({"global_pool": "avg", "fc_norm": False}, "model.global_pool: expected 'token' with a class token or 'avg' "
                             "without one, got 'avg' with class_token=True"),
    ({"class_token": False, "global_pool": "avg"}, "model.fc_norm: expected the plain ViT's"),
    ({"no_embed_class": True}, "model.no_embed_class: expected the plain ViT's"),
])
def test_what_curvgap_does_not_represent_in_a_vit_is_refused(options, message):
    with pytest.raises(UnsupportedLayer, match=message):
        curvgap.curvature(vit(**options))


def test_bad_images_are_refused_naming_their_shape():
    c = curvgap.curvature(vit(), loss="cross_entropy")
    with pytest.raises(ValueError, match=r"X: expected images of shape \(B, 2, 4, 4\), got "
                                         r"shape \(2, 2, 6, 6\)"):
        c.loss(torch.randn(B, 2, 6, 6, dtype=torch.float64), torch.zeros(B, dtype=torch.long))


@pytest.mark.slow
def test_gpt2_input_blocks_and_jacobians_equal_autograd():
    """On a model taking rows: the input's gradient, Hessian, HVP, the input–parameter
    block and Jacobians, per sample, against autograd on the model."""
    model = gpt2_model(layers=2)
    c = curvgap.curvature(model)
    generator = torch.Generator().manual_seed(3)
    X, T = (torch.randn(B, 3, 4, generator=generator, dtype=torch.float64) for _ in range(2))
    F_ = torch.autograd.functional
    weight = dict(model.named_parameters())["h.1.mlp.c_fc.weight"]

    def sample_loss(x, t):
        with sdpa_kernel(SDPBackend.MATH):
            return F.mse_loss(gpt2_output(model, x[None])[0], t)

    def per_sample(derivative):
        return torch.stack([derivative(x, t) for x, t in zip(X, T)])

    gradient = per_sample(lambda x, t: F_.jacobian(lambda y: sample_loss(y, t), x).reshape(-1))
    assert relative(c.gradient(X, T, wrt="X"), gradient) <= 1e-12
    H_XX = per_sample(lambda x, t: F_.hessian(lambda y: sample_loss(y, t), x)
                      .reshape(x.numel(), -1))
    assert relative(c.loss_hessian(X, T, wrt="X"), H_XX) <= 1e-10
    v = torch.randn(B, 12, generator=generator, dtype=torch.float64)
    assert relative(c.hvp(X, T, v, wrt="X"), torch.einsum("bij,bj->bi", H_XX, v)) <= 1e-10

    def output(w, x):
        return torch.func.functional_call(model, {"h.1.mlp.c_fc.weight": w}, (),
                                          {"inputs_embeds": x}).last_hidden_state

    def input_gradient(w, x, t):  # ∂ℓ/∂x of one sample, as a function of the weight
        return torch.func.grad(lambda y: F.mse_loss(output(w, y[None])[0], t))(x).reshape(-1)

    with sdpa_kernel(SDPBackend.MATH):  # reverse over reverse (jacrev of grad)
        mixed = per_sample(lambda x, t: torch.func.jacrev(input_gradient)(
            weight.detach(), x, t).reshape(x.numel(), -1))
        J = torch.func.jacrev(output)(weight.detach(), X).reshape(B, 12, -1)
    assert relative(c.loss_hessian_mixed(X, T, wrt="h.1.mlp.c_fc.weight"), mixed) <= 1e-10
    assert relative(c.jacobian(X, "h.1.mlp.c_fc.weight"), J) <= 1e-12
    every = c.loss_hessian_mixed(X, T)
    assert every.shape == (B, 12, sum(p.numel() for p in model.parameters()))
    assert bool((every[..., c.layer_slices()["wte.weight"]] == 0).all())


def test_a_vit_has_no_input_blocks():
    c = curvgap.curvature(vit(), loss="cross_entropy")
    images = torch.randn(B, 2, 4, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="wrt: 'X' is offered for models taking rows"):
        c.loss_hessian(images, torch.zeros(B, dtype=torch.long), wrt="X")


@pytest.mark.slow  # the quick run checks operators and diagonals in test_operators
def test_diagonal_and_operator_in_the_models_order_equal_autograd(case):
    model, _, X, T, loss, (_, _, H) = case
    c = curvgap.curvature(model, loss=loss)
    assert relative(c.diagonal(X, T), torch.diagonal(H)) <= 1e-10
    V = torch.randn(H.shape[0], 2, generator=torch.Generator().manual_seed(3),
                    dtype=torch.float64)
    assert relative(c.hessian_operator(X, T) @ V, H @ V) <= 1e-10
