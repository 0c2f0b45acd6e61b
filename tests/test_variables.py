"""The variables are autograd's: vectors cover the parameters that require a gradient, in
the module's order; ``wrt`` takes names, a tied weight's aliases or the ``Parameter`` objects,
in any order, and results follow the order given; ``v`` may be of any floating dtype, torch
or numpy, and results have the module's dtype."""

import numpy as np
import pytest
import torch

import curvgap
from tests.reference import Reference, randomise, relative

DTYPE = torch.float64


class Frozen(torch.nn.Module):
    """Two linear maps, the first one's bias frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(5, 4), torch.nn.Linear(4, 3)
        self.a.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _case(seed: int = 0) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    module = randomise(Frozen().to(DTYPE), seed)
    X = torch.randn(3, 2, 5, generator=generator, dtype=DTYPE)
    T = torch.randn(3, 2, 3, generator=generator, dtype=DTYPE)
    return module, X, T


def test_vectors_cover_the_parameters_that_require_a_gradient():
    module, X, T = _case()
    trained = [n for n, p in module.named_parameters() if p.requires_grad]
    assert "a.bias" not in trained
    ref = Reference(module, X, T, wrt=trained)
    c = curvgap.curvature(module)
    gradient = c.gradient(X, T)
    assert gradient.shape == (sum(module.get_parameter(n).numel() for n in trained),)
    assert relative(gradient, ref.gradient()) <= 1e-10
    assert relative(c.loss_hessian(X, T), ref.hessian()) <= 1e-10
    assert relative(c.diagonal(X, T), ref.diagonal()) <= 1e-10
    v = torch.randn_like(gradient)
    assert relative(c.hvp(X, T, v), ref.hvp(v)) <= 1e-10
    assert relative(c.gnvp(X, T, v), ref.gnvp(v)) <= 1e-10
    assert c.hessian_operator(X, T).shape == (gradient.numel(), gradient.numel())
    assert list(c.layer_slices()) == trained
    # a frozen parameter is a constant to autograd: naming it is refused, as autograd does
    with pytest.raises(ValueError, match="got 'a.bias', which is frozen; thaw it"):
        c.gradient(X, T, wrt=["a.bias", "b.weight"])


def test_wrt_takes_parameters_in_any_order_and_results_follow_it():
    module, X, T = _case(1)
    order = [module.b.weight, module.a.weight, module.b.bias]  # not the module's order
    names = ["b.weight", "a.weight", "b.bias"]
    ref = Reference(module, X, T, wrt=names)
    c = curvgap.curvature(module)
    gradient = c.gradient(X, T, wrt=order)
    assert relative(gradient, ref.gradient()) <= 1e-10
    assert torch.equal(gradient, c.gradient(X, T, wrt=names))
    assert relative(c.loss_hessian(X, T, wrt=order), ref.hessian()) <= 1e-10
    assert relative(c.diagonal(X, T, wrt=order), ref.diagonal()) <= 1e-10
    v = torch.randn_like(gradient)
    assert relative(c.hvp(X, T, v, wrt=order), ref.hvp(v)) <= 1e-10
    assert relative(c.hessian_operator(X, T, wrt=order) @ v, ref.hvp(v)) <= 1e-10
    slices = c.layer_slices(order)
    assert list(slices) == names and slices["b.weight"].start == 0
    one = c.gradient(X, T, wrt=module.a.weight)
    assert relative(one, Reference(module, X, T, wrt=["a.weight"]).gradient()) <= 1e-10


def test_a_tied_weight_is_named_by_any_of_its_names():
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
            self.b.weight = self.a.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.tanh(self.a(x)))

    module = randomise(Tied().to(DTYPE))
    generator = torch.Generator().manual_seed(2)
    X, T = (torch.randn(2, 3, 4, generator=generator, dtype=DTYPE) for _ in range(2))
    c = curvgap.curvature(module)
    ref = Reference(module, X, T, wrt=["a.weight"]).gradient()
    assert relative(c.gradient(X, T, wrt=["b.weight"]), ref) <= 1e-10
    assert relative(c.gradient(X, T, wrt=[module.b.weight]), ref) <= 1e-10
    with pytest.raises(ValueError, match="wrt: expected each parameter once, got 'a.weight' "
                                         "and 'b.weight', which are one tied weight"):
        c.gradient(X, T, wrt=["a.weight", "b.weight"])
    with pytest.raises(ValueError, match="wrt: expected distinct names"):
        c.gradient(X, T, wrt=[module.a.weight, module.a.weight])


def test_v_of_any_floating_dtype_torch_or_numpy():
    module, X, T = _case(3)
    c = curvgap.curvature(module)
    v = torch.randn(c.gradient(X, T).numel(), dtype=torch.float32)
    expected = c.hvp(X, T, v.to(DTYPE))
    for given in (v, v.numpy(), v.numpy().astype(">f4"), v.to(torch.float16).to(torch.float32)):
        value = c.hvp(X, T, given)
        assert value.dtype == DTYPE
    assert torch.equal(c.hvp(X, T, v.numpy()), expected)
    V = torch.stack([v, -v], 1)
    assert torch.equal(c.gnvp(X, T, V.numpy()), c.gnvp(X, T, V.to(DTYPE)))
    X_v = np.ones((3, 10), dtype=np.float32)
    assert c.hvp(X, T, X_v, wrt="X").dtype == DTYPE


@pytest.mark.parametrize("wrt, error, words", [
    (torch.nn.Parameter(torch.zeros(4, 5)), ValueError,
     r"wrt: expected the module's parameters or their names, got a tensor of shape \(4, 5\)"),
    ([torch.zeros(3)], ValueError, "that is not a parameter of Frozen"),
    (3, TypeError, "wrt: expected 'X', a parameter name or a list of names, got an int"),
])
def test_wrt_that_is_not_the_modules_is_refused_by_name(wrt, error, words):
    module, X, T = _case()
    with pytest.raises(error, match=words):
        curvgap.curvature(module).gradient(X, T, wrt=wrt)


def test_v_that_is_not_floating_or_does_not_fit_is_refused():
    module, X, T = _case()
    c = curvgap.curvature(module)
    n = c.gradient(X, T).numel()
    with pytest.raises(TypeError, match=r"v: expected floating-point values \(float16, "
                                        r"float32 or float64\), got dtype int64"):
        c.hvp(X, T, np.ones(n, dtype=np.int64))
    with pytest.raises(TypeError, match="got dtype float128"):
        c.hvp(X, T, np.ones(n, dtype=np.longdouble))
    with pytest.raises(TypeError, match="v: expected a torch.Tensor or a numpy array, got list"):
        c.hvp(X, T, [1.0] * n)
    half = curvgap.curvature(_case()[0].to(torch.float16))
    with pytest.raises(ValueError, match="v: expected values that fit the module's dtype "
                                         "torch.float16"):
        half.hvp(X.half(), T.half(), torch.full((n,), 1e6))


def test_a_module_with_every_parameter_frozen_is_refused_by_name():
    module, X, T = _case()
    module.requires_grad_(False)
    with pytest.raises(ValueError, match="Frozen's output reads none that does; thaw some"):
        curvgap.curvature(module).gradient(X, T)
