"""Models from a model config (``curvgap.models.Model``): embedding with a class token, three
blocks, a final norm and a first-token head with cross-entropy — the loss, gradient, full
loss Hessian (cross-layer blocks included), its Gauss–Newton and functional parts and the
matrix-free HVP, on both backends, against reverse-over-reverse autograd on the plain-PyTorch
reference of the same model (float64); and the config's validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from curvgap.codegen.verify import random_case, reference_loss, reference_output
from curvgap.derivations.config import ConfigError
from curvgap.models import Chain, Model, validate_model

#: one worker runs this file: its module-scoped fixtures are computed once
pytestmark = pytest.mark.xdist_group("model_config")

B = 2
DIMS = {"L": 3, "d": 4, "d_k": 2, "d_ff": 5, "p": 6, "c": 7}  # every size differs
TABLE = {"name": "tiny_vit", "depth": 3, "loss": "cross_entropy",
         "embedding": {"class_token": True},
         "block": {"norm_position": "pre", "heads": 2, "out_proj": True, "affine": True,
                   "eps": 1e-5, "attention_bias": True, "activation": "gelu",
                   "ffn_bias": True},
         "norm": {"affine": True, "eps": 1e-5},
         "head": {"pooling": "first"}}


@pytest.fixture(scope="module")
def case():
    model = Model(validate_model(TABLE))
    params = {}
    for k, ((prefix, _), module) in enumerate(zip(model.config.parts(), model.modules)):
        values, _, _ = random_case(module, DIMS, B, seed=k)  # gamma near 1
        params.update({f"{prefix}.{name}": 0.7 * v + (0.3 if v.ndim == 1 else 0.0)
                       for name, v in values.items()})
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(B, DIMS["L"], DIMS["p"], generator=gen, dtype=torch.float64)
    T = torch.randint(0, DIMS["c"], (B, 1), generator=gen)
    return model, params, X, T


def logits(model, params, flat, X):
    """The model's output per sample, in plain PyTorch, as a function of all its
    parameters concatenated."""
    sizes = [params[name].numel() for name in model.PARAMS]
    values = {name: part.reshape(params[name].shape) for name, part in
              zip(model.PARAMS, torch.split(flat, sizes))}
    outputs = []
    for x in X:
        for (prefix, config), names in zip(model.config.parts(), model.part_params):
            x = reference_output(config, {n: values[f"{prefix}.{n}"] for n in names}, x)
        outputs.append(x)
    return torch.stack(outputs)


@pytest.fixture(scope="module")
def expected(case):
    """The loss, gradient, Hessian and Gauss–Newton matrix by autograd."""
    model, params, X, T = case
    top = model.config.parts()[-1][1]
    flat = torch.cat([params[name].reshape(-1) for name in model.PARAMS])

    def loss(vector):
        Z = logits(model, params, vector, X)
        return sum(reference_loss(top, z, t) for z, t in zip(Z, T)) / B

    H = torch.autograd.functional.hessian(loss, flat, vectorize=True)
    J = torch.autograd.functional.jacobian(lambda v: logits(model, params, v, X), flat,
                                           vectorize=True).reshape(B, -1, flat.numel())
    Z = logits(model, params, flat, X)
    curvature = torch.stack([torch.autograd.functional.hessian(
        lambda z, t=t: reference_loss(top, z, t), z).reshape(J.shape[1], J.shape[1])
        for z, t in zip(Z, T)])
    gauss_newton = torch.einsum("bri,brs,bsj->ij", J, curvature, J) / B
    return flat, loss(flat), torch.autograd.functional.jacobian(loss, flat), H, gauss_newton


def relative(value, reference) -> float:
    value = torch.as_tensor(value)
    return float((value - reference).abs().max() / reference.abs().max())


@pytest.mark.parametrize("backend", ["torch", pytest.param("numpy", marks=pytest.mark.slow)])
def test_every_function_equals_autograd(case, expected, backend):
    model, params, X, T = case
    flat, loss, gradient, H, gauss_newton = expected
    if backend == "numpy":
        model = Model(model.config, backend="numpy")
        params, X, T = {k: v.numpy() for k, v in params.items()}, X.numpy(), T.numpy()
    assert relative(model.loss(params, X, T), loss) <= 1e-12
    assert relative(model.gradient(params, X, T), gradient) <= 1e-12
    assert relative(model.loss_hessian(params, X, T), H) <= 1e-10
    assert relative(model.loss_hessian(params, X, T, part="gauss_newton"), gauss_newton) <= 1e-10
    assert relative(model.loss_hessian(params, X, T, part="functional"), H - gauss_newton,
                    ) <= 1e-10 * float(H.abs().max() / (H - gauss_newton).abs().max())
    v = torch.randn(flat.numel(), generator=torch.Generator().manual_seed(2),
                    dtype=torch.float64)
    direction = v if backend == "torch" else v.numpy()
    assert relative(model.hvp(params, X, T, direction), H @ v) <= 1e-10


def test_cross_layer_subsets_and_layer_slices(case, expected):
    model, params, X, T = case
    flat, _, _, H, _ = expected
    wrt = ["embedding.c_E", "blocks.0.W_V", "blocks.2.W_1", "head.W_H"]
    starts = {name: sum(params[n].numel() for n in model.PARAMS[:model.PARAMS.index(name)])
              for name in wrt}
    index = torch.cat([torch.arange(starts[n], starts[n] + params[n].numel()) for n in wrt])
    block = H[index][:, index]
    assert relative(model.loss_hessian(params, X, T, wrt=wrt), block) <= 1e-10
    v = torch.randn(index.numel(), generator=torch.Generator().manual_seed(3),
                    dtype=torch.float64)
    assert relative(model.hvp(params, X, T, v, wrt=wrt), block @ v) <= 1e-10
    slices = model.part_slices(params)
    assert list(slices) == ["embedding", "blocks.0", "blocks.1", "blocks.2", "norm", "head"]
    assert slices["head"].stop == flat.numel()
    assert list(model.part_slices(params, wrt)) == ["embedding", "blocks.0", "blocks.2", "head"]


def test_the_class_token_placeholder_row_is_not_read(case):
    model, params, X, T = case
    moved = X.clone()
    moved[:, 0] = 1e3
    assert torch.equal(model.forward(params, moved), model.forward(params, X))


@pytest.mark.parametrize("change, message", [
    ({"depth": 0}, r"'depth' must be an int from 1 to 256 \(the number of blocks\), got 0"),
    ({"depth": True}, r"'depth' must be an int from 1 to 256"),
    ({"block": None}, r"\[block\]: expected a table of options, got None"),
    ({"head": {"pooling": "max"}}, r"\[head\]: 'pooling' must be one of none, mean, first; "
                                   r"got 'max'"),
    ({"head": {"loss": "mse"}}, r"\[head\]: 'loss' is set by the model config"),
    ({"norm": {"heads": 2}}, r"\[norm\]: 'heads' applies to kind block or self_attention"),
    ({"loss": "hinge"}, r"'loss' must be one of"),
    ({"name": "../x"}, r"'name' must be a Python identifier"),
    ({"blocks": {}}, r"unknown key 'blocks'; allowed keys: name, depth, loss, "
                     r"tie_embeddings, share_relative_bias, embedding, block, norm, head"),
    ({"tie_embeddings": 1}, r"'tie_embeddings' must be true or false, got 1"),
    ({"tie_embeddings": True}, r"'tie_embeddings' reads the head's W_H as the embedding's W_E "
                               r"transposed: it needs .* pooling = \"none\""),
])
def test_bad_model_configs_are_refused(change, message):
    with pytest.raises(ConfigError, match=message):
        validate_model({**TABLE, **change})


@pytest.mark.slow
def test_input_derivatives_and_jacobians_equal_autograd(case):
    """With ``wrt="X"`` and across input and parameters: per sample, against autograd on
    the reference model."""
    model, params, X, T = case
    top = model.config.parts()[-1][1]
    flat = torch.cat([params[name].reshape(-1) for name in model.PARAMS])

    def sample_loss(x, t, vector=flat):
        return reference_loss(top, logits(model, params, vector, x[None])[0], t)

    F = torch.autograd.functional

    def per_sample(derivative):
        return torch.stack([derivative(x, t) for x, t in zip(X, T)])

    gradient = per_sample(lambda x, t: F.jacobian(lambda y: sample_loss(y, t), x).reshape(-1))
    assert relative(model.gradient(params, X, T, wrt="X"), gradient) <= 1e-12
    H_XX = per_sample(lambda x, t: F.hessian(lambda y: sample_loss(y, t), x)
                      .reshape(x.numel(), -1))
    assert relative(model.loss_hessian(params, X, T, wrt="X"), H_XX) <= 1e-10
    v = torch.randn(B, X[0].numel(), generator=torch.Generator().manual_seed(4),
                    dtype=torch.float64)
    assert relative(model.hvp(params, X, T, v, wrt="X"),
                    torch.einsum("bij,bj->bi", H_XX, v)) <= 1e-10
    H_Xt = per_sample(lambda x, t: F.jacobian(lambda w: F.jacobian(
        lambda y: sample_loss(y, t, w), x, create_graph=True).reshape(-1), flat))
    assert relative(model.loss_hessian_mixed(params, X, T), H_Xt) <= 1e-10
    J = F.jacobian(lambda w: logits(model, params, w, X), flat).reshape(B, -1, flat.numel())
    start = sum(params[n].numel() for n in model.PARAMS[:model.PARAMS.index("blocks.1.W_V")])
    W_V = J[:, :, start:start + params["blocks.1.W_V"].numel()]
    assert relative(model.jacobian(params, X, "blocks.1.W_V"), W_V) <= 1e-12
    J_X = F.jacobian(lambda x: logits(model, params, flat, x), X)  # (B, 1, c, B, L, p)
    J_X = torch.stack([J_X[b, ..., b, :, :].reshape(J.shape[1], -1) for b in range(B)])
    assert relative(model.jacobian(params, X, "X"), J_X) <= 1e-12


@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_low_rank_curvature_behind_a_two_class_head_equals_autograd(backend):
    """Behind a two-class cross-entropy head the curvature at the blocks' output has rank 1
    per sample, and the chain multiplies through its factor: the Hessian and its
    Gauss–Newton part still equal autograd."""
    table = {"name": "two_class", "depth": 2, "loss": "cross_entropy",
             "block": {"norm_position": "pre", "affine": True, "eps": 1e-5,
                       "activation": "gelu"},
             "head": {"pooling": "mean"}}
    model = Model(validate_model(table), backend=backend)
    dims = {"L": 4, "d": 3, "d_k": 2, "d_ff": 5, "c": 2}
    gen = torch.Generator().manual_seed(5)
    params = {name: 0.8 * torch.randn(shape, generator=gen, dtype=torch.float64)
              + (1.0 if ".gamma" in name else 0.0)
              for name, shape in model.parameter_shapes(dims).items()}
    X = torch.randn(B, 4, 3, generator=gen, dtype=torch.float64)
    T = torch.randint(0, 2, (B, 1), generator=gen)
    top = model.config.parts()[-1][1]
    flat = torch.cat([params[name].reshape(-1) for name in model.PARAMS])

    def loss(vector):
        Z = logits(model, params, vector, X)
        return sum(reference_loss(top, z, t) for z, t in zip(Z, T)) / B

    H = torch.autograd.functional.hessian(loss, flat)
    J = torch.autograd.functional.jacobian(lambda v: logits(model, params, v, X),
                                           flat).reshape(B, 2, -1)
    Z = logits(model, params, flat, X)
    curvature = torch.stack([torch.autograd.functional.hessian(
        lambda z, t=t: reference_loss(top, z, t), z).reshape(2, 2) for z, t in zip(Z, T)])
    gauss_newton = torch.einsum("bri,brs,bsj->ij", J, curvature, J) / B
    ranks = []  # the rank of each factor the chain used (the route under test)
    low_rank = model._low_rank

    def recorded(M):
        factor = low_rank(M)
        ranks.append(None if factor is None else factor[1].shape[-1])
        return factor

    model._low_rank = recorded
    P, Xb, Tb = convert(backend, params, X, T)
    assert relative(model.loss_hessian(P, Xb, Tb), H) <= 1e-10
    assert relative(model.loss_hessian(P, Xb, Tb, part="gauss_newton"), gauss_newton) <= 1e-10
    assert 1 in ranks


def convert(backend, params, X, T):
    if backend == "torch":
        return params, X, T
    return {k: v.numpy() for k, v in params.items()}, X.numpy(), T.numpy()


@pytest.mark.parametrize("backend", ["torch", pytest.param("numpy", marks=pytest.mark.slow)])
def test_diagonals_and_gauss_newton_products_equal_autograd(case, expected, backend):
    model, params, X, T = case
    flat, _, _, H, gauss_newton = expected
    V = torch.randn(flat.numel(), 3, generator=torch.Generator().manual_seed(4),
                    dtype=torch.float64)
    if backend == "numpy":
        model = Model(model.config, backend="numpy")
        params, X, T, V = {k: v.numpy() for k, v in params.items()}, X.numpy(), T.numpy(), V.numpy()
    V_ = torch.as_tensor(V)
    full, gn = torch.diagonal(H), torch.diagonal(gauss_newton)
    assert relative(model.diagonal(params, X, T), full) <= 1e-10
    assert relative(model.diagonal(params, X, T, part="gauss_newton"), gn) <= 1e-10
    assert float((torch.as_tensor(model.diagonal(params, X, T, part="functional"))
                  - (full - gn)).abs().max() / full.abs().max()) <= 1e-10
    assert relative(model.gnvp(params, X, T, V[:, 0]), gauss_newton @ V_[:, 0]) <= 1e-10
    assert relative(model.gnvp(params, X, T, V), gauss_newton @ V_) <= 1e-10
    assert relative(model.hvp(params, X, T, V), H @ V_) <= 1e-10
    wrt = ["blocks.1.W_Q", "head.b_H"]
    sizes = [int(np.prod(params[m].shape)) for m in model.PARAMS]
    index = torch.cat([torch.arange(sum(sizes[:model.PARAMS.index(n)]),
                                    sum(sizes[:model.PARAMS.index(n) + 1])) for n in wrt])
    assert relative(model.diagonal(params, X, T, wrt=wrt), full[index]) <= 1e-10


def test_a_gauss_newton_product_keeps_no_inner_tangents_below_the_top_part(case, expected):
    """Between products at one point, the parts below the top keep their forward values and
    adjoints but not the tangents of their inner nodes (a Gauss–Newton product's sweep down
    reads none of them); an HVP at the same point still finds them, and both are exact."""
    model, params, X, T = case
    flat, _, _, H, gauss_newton = expected
    v = torch.randn(flat.numel(), generator=torch.Generator().manual_seed(5),
                    dtype=torch.float64)
    sizes = [params[name].numel() for name in model.PARAMS]
    direction = {name: part.reshape(params[name].shape)
                 for name, part in zip(model.PARAMS, torch.split(v, sizes))}

    def product(kind: str, keep: dict) -> torch.Tensor:
        (pieces,) = model.product_pieces(kind, params, X, T, [direction], keep)
        return torch.cat([pieces[name].reshape(-1) for name in model.PARAMS])

    keep: dict = {}
    for _ in range(2):
        assert relative(product("gnvp", keep), gauss_newton @ v) <= 1e-10
        *below, top = keep["saved"]
        assert not any("jvp" in saved["_done"] for saved in below)
        assert "jvp" in top["_done"]
    assert relative(product("hvp", keep), H @ v) <= 1e-10
    assert all("jvp" in saved["_done"] for saved in keep["saved"])


#: A causal language model on one-hot token rows, its head tied to the token table; and a
#: T5-style stack whose blocks share the first one's relative-position table.
TIED = {"name": "tiny_lm", "depth": 2, "loss": "cross_entropy", "tie_embeddings": True,
        "embedding": {"positional": True},
        "block": {"norm_position": "pre", "heads": 2, "out_proj": True, "affine": True,
                  "eps": 1e-5, "causal": True, "activation": "gelu_tanh"},
        "norm": {"affine": True, "eps": 1e-5},
        "head": {"pooling": "none"}}
SHARED = {"name": "tiny_t5", "depth": 3, "loss": "mse", "share_relative_bias": True,
          "block": {"norm_position": "pre", "norm": "rmsnorm", "heads": 2, "out_proj": True,
                    "relative_bias": True, "relative_buckets": 8, "relative_max_distance": 4,
                    "eps": 1e-6}}
TIED_CASES = {  # the config, its sizes (c = p: the vocabulary), the tied source, a second wrt
    "tie_embeddings": (TIED, {"L": 3, "d": 4, "d_k": 2, "d_ff": 5, "p": 6, "c": 6},
                       "embedding.W_E", "blocks.1.W_Q"),
    "share_relative_bias": (SHARED, {"L": 7, "d": 4, "d_k": 3, "d_ff": 5},
                            "blocks.0.E_rel", "blocks.2.W_V")}


def _tied_case(name: str, backend: str):
    table, dims, source, other = TIED_CASES[name]
    model = Model(validate_model(table), backend=backend)
    gen = torch.Generator().manual_seed(6)
    params = {n: 0.6 * torch.randn(shape, generator=gen, dtype=torch.float64)
              + (1.0 if "gamma" in n else 0.0) for n, shape in model.parameter_shapes(dims).items()}
    if "p" in dims:
        X = torch.nn.functional.one_hot(torch.randint(0, dims["p"], (B, dims["L"]),
                                                      generator=gen), dims["p"]).double()
        T = torch.randint(0, dims["p"], (B, dims["L"]), generator=gen)
    else:
        X = torch.randn(B, dims["L"], dims["d"], generator=gen, dtype=torch.float64)
        T = torch.randn(B, dims["L"], dims["d"], generator=gen, dtype=torch.float64)
    return model, params, X, T, source, other


@pytest.mark.parametrize("backend", ["torch", pytest.param("numpy", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", list(TIED_CASES))
def test_tied_parameters_equal_autograd(name, backend):
    """``tie_embeddings`` (``head.W_H`` is ``embedding.W_E`` transposed) and
    ``share_relative_bias`` (every block reads ``blocks.0.E_rel``): one parameter whose
    gradient, Hessian (with its cross blocks), Gauss–Newton part, products and Jacobian sum
    its places, and whose diagonal holds the blocks between them; against autograd on the
    plain-PyTorch model that reads it in each place."""
    model, params, X, T, source, other = _tied_case(name, backend)
    assert source in model.PARAMS and not set(model.ties) & set(model.PARAMS)
    flat = torch.cat([params[n].reshape(-1) for n in model.PARAMS])
    sizes = [params[n].numel() for n in model.PARAMS]
    parts = model.config.parts()

    def outputs(vector, X=X):
        values = {n: part.reshape(params[n].shape)
                  for n, part in zip(model.PARAMS, torch.split(vector, sizes))}
        for tied, tied_source in model.ties.items():  # each place reads the one parameter
            values[tied] = values[tied_source].T if tied in model.transposed \
                else values[tied_source]
        result = []
        for x in X:
            for (prefix, config), names in zip(parts, model.part_params):
                x = reference_output(config, {n: values[f"{prefix}.{n}"] for n in names}, x)
            result.append(x)
        return torch.stack(result)

    def loss(vector):
        return sum(reference_loss(parts[-1][1], z, t) for z, t in zip(outputs(vector), T)) / B

    F = torch.autograd.functional
    H = F.hessian(loss, flat, vectorize=True)
    J = F.jacobian(outputs, flat, vectorize=True).reshape(B, -1, flat.numel())
    curvature = torch.stack([F.hessian(lambda z, t=t: reference_loss(parts[-1][1], z, t), z)
                             .reshape(J.shape[1], J.shape[1]) for z, t in zip(outputs(flat), T)])
    gauss_newton = torch.einsum("bri,brs,bsj->ij", J, curvature, J) / B
    V = torch.randn(flat.numel(), 2, generator=torch.Generator().manual_seed(7),
                    dtype=torch.float64)
    P, Xb, Tb = convert(backend, params, X, T)
    Vb = V if backend == "torch" else V.numpy()
    assert relative(model.loss(P, Xb, Tb), loss(flat)) <= 1e-12
    assert relative(model.gradient(P, Xb, Tb), F.jacobian(loss, flat)) <= 1e-12
    assert relative(model.loss_hessian(P, Xb, Tb), H) <= 1e-10
    assert relative(model.loss_hessian(P, Xb, Tb, part="gauss_newton"), gauss_newton) <= 1e-10
    assert relative(model.hvp(P, Xb, Tb, Vb), H @ V) <= 1e-10
    assert relative(model.gnvp(P, Xb, Tb, Vb[:, 0]), gauss_newton @ V[:, 0]) <= 1e-10
    # a subset holding the tied parameter: its block sums the blocks between its places
    wrt = [n for n in model.PARAMS if n in (source, other)]
    index = torch.cat([torch.arange(sum(sizes[:model.PARAMS.index(n)]),
                                    sum(sizes[:model.PARAMS.index(n) + 1])) for n in wrt])
    assert relative(model.loss_hessian(P, Xb, Tb, wrt=wrt), H[index][:, index]) <= 1e-10
    assert relative(model.hvp(P, Xb, Tb, Vb[index.numpy(), 0], wrt=wrt),
                    H[index][:, index] @ V[index, 0]) <= 1e-10
    start = sum(sizes[:model.PARAMS.index(source)])
    columns = slice(start, start + params[source].numel())
    assert relative(model.jacobian(P, Xb, source), J[:, :, columns]) <= 1e-12
    H_Xt = torch.stack([F.jacobian(lambda w, x=x, t=t: F.jacobian(
        lambda y: reference_loss(parts[-1][1], outputs(w, y[None])[0], t), x,
        create_graph=True).reshape(-1), flat) for x, t in zip(X, T)])
    assert relative(model.loss_hessian_mixed(P, Xb, Tb), H_Xt) <= 1e-10
    # the tied weight's diagonal: its places' blocks between them included
    assert relative(model.diagonal(P, Xb, Tb), torch.diagonal(H)) <= 1e-10
    assert relative(model.diagonal(P, Xb, Tb, part="gauss_newton"),
                    torch.diagonal(gauss_newton)) <= 1e-10
    with pytest.raises(ValueError, match=r"^shared: expected names outside the ties"):
        model.diagonal(P, Xb, Tb, shared=[[source, other]])
    rest = [n for n in model.PARAMS if n != source]
    kept = torch.cat([torch.arange(sum(sizes[:model.PARAMS.index(n)]),
                                   sum(sizes[:model.PARAMS.index(n) + 1])) for n in rest])
    assert relative(model.diagonal(P, Xb, Tb, wrt=rest), torch.diagonal(H)[kept]) <= 1e-10


def test_tied_sizes_and_ties_are_checked():
    model = Model(validate_model(TIED))
    with pytest.raises(ValueError, match=r"sizes: head.W_H is embedding.W_E transposed, so its "
                                         r"shape must be \(4, 6\); these sizes give \(4, 7\)"):
        model.parameter_shapes({**TIED_CASES["tie_embeddings"][1], "c": 7})
    parts = model.config.parts()
    with pytest.raises(ValueError, match=r"ties: expected names of the parts' parameters"):
        Chain.generate(parts, ties={"head.W_X": "embedding.W_E.T"})
    with pytest.raises(ValueError, match=r"tied to an untied parameter"):
        Chain.generate(parts, ties={"head.W_H": "embedding.W_E.T", "embedding.W_E": "head.b_H"})
    with pytest.raises(ConfigError, match=r"'share_relative_bias' shares the blocks' E_rel: "
                                          r"it needs relative_bias = true"):
        validate_model({**TABLE, "share_relative_bias": True})


@pytest.mark.slow  # the tied model's derivatives are checked in the quick run too (above)
@pytest.mark.parametrize("table", [TIED, SHARED], ids=["tie_embeddings", "share_relative_bias"])
def test_generate_writes_and_verifies_a_model_config(table, tmp_path, capsys, monkeypatch):
    """``curvgap generate --config model.toml``: the model's sublayer modules are written and
    verified, and the model itself, as the chain of its parts with its ties, is checked
    against autograd on its plain-PyTorch twin, one row per backend."""
    from curvgap.cli import main

    monkeypatch.setenv("CURVGAP_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "model.toml"
    path.write_text(_toml(table))
    assert main(["generate", "--config", str(path), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    parts = {f"{table['name']}_{section}" for section in ("embedding", "block", "norm", "head")
             if section in table}
    assert {p.stem for p in (tmp_path / "out" / "torch").glob("*.py")} >= parts
    rows = [line.split() for line in out.splitlines()
            if line.startswith(f"  {table['name']} ") and "(model," in line]
    assert [row[1] for row in rows] == ["numpy", "torch"]
    assert all(float(row[3]) <= 1e-10 for row in rows), rows


def test_the_model_check_sees_a_tie_left_out(monkeypatch):
    """The model check fails when the chain drops a tied place's share (its reference reads
    the tied parameter in every place)."""
    from curvgap.models import model_checks
    from curvgap.models.ties import Ties

    monkeypatch.setattr(Ties, "folded", lambda self, pieces, out=None: {
        k: v for k, v in pieces.items() if k not in self})
    errors = model_checks.check_model(validate_model(TIED), "torch", TIED_CASES["tie_embeddings"][1])
    assert errors["gradient"] > 1e-3 and errors["hvp"] > 1e-3


def _toml(table: dict) -> str:
    """``table`` (one level of sub-tables) as TOML."""
    def value(v):
        return str(v).lower() if isinstance(v, bool) else repr(v).replace("'", '"')
    lines = [f"{k} = {value(v)}" for k, v in table.items() if not isinstance(v, dict)]
    for section, options in table.items():
        if isinstance(options, dict):
            lines += [f"[{section}]", *(f"{k} = {value(v)}" for k, v in options.items())]
    return "\n".join(lines) + "\n"
