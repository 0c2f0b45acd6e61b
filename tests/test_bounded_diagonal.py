"""The whole-model diagonal in bounded memory (``max_memory``, ``chunk``): per sample the columns
of the identity at each part's input go through that part's second derivative and down the parts
below it in chunks, each part's own diagonal a few rows at a time. Checked against
reverse-over-reverse autograd on the module itself (unit vectors, double backward, MATH
attention kernel) on sampled entries, and against the dense route on every entry, with chunks
forced small so that several chunks, samples and row slices are taken; and the engine's pieces
(each sample's own gradients, a diagonal on rows) against the generated module's own."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import SHIPPED, generated_module, to_backend
from reference import Reference, randomise, relative

import curvgap
from curvgap.models import Chain
from curvgap.models.diagonal import most_that_fit

DTYPE = torch.float64


def _gpt2() -> tuple[torch.nn.Module, dict, torch.Tensor]:
    import transformers

    config = transformers.GPT2Config(n_layer=2, n_embd=8, n_head=2, n_inner=12, n_positions=5,
                                     vocab_size=10, bos_token_id=0, eos_token_id=0)
    model = randomise(transformers.GPT2Model(config).to(DTYPE))
    generator = torch.Generator().manual_seed(2)
    X, T = (torch.randn(2, 5, 8, generator=generator, dtype=DTYPE) for _ in range(2))
    return model, {"inputs_embeds": X, "use_cache": False}, T


def _encoder() -> tuple[torch.nn.Module, dict, torch.Tensor]:
    layer = torch.nn.TransformerEncoderLayer(6, 2, 10, dropout=0.0, activation="gelu",
                                             batch_first=True, norm_first=True, dtype=DTYPE)
    norm = torch.nn.LayerNorm(6, eps=1e-6, dtype=DTYPE)
    model = randomise(torch.nn.TransformerEncoder(layer, 2, norm=norm,
                                                  enable_nested_tensor=False))
    generator = torch.Generator().manual_seed(3)
    X, T = (torch.randn(2, 4, 6, generator=generator, dtype=DTYPE) for _ in range(2))
    return model, {"X": X}, T


MODELS = {"GPT2Model": _gpt2, "TransformerEncoder": _encoder}


def _call(c, method, inputs, T, **options):
    inputs = dict(inputs)
    X = inputs.pop("X", None)
    return getattr(c, method)(X, T, **options, **inputs)


def _autograd_entries(model, inputs, T, entries):
    """The loss Hessian's diagonal at ``entries`` (of the flat parameters, the module's
    order): each the gradient of one gradient entry, double backward on the module itself."""
    inputs = dict(inputs)
    X = inputs.pop("X", None)
    ref = Reference(model, X, T, "mse", **inputs)
    n = sum(p.numel() for p in model.parameters())
    return torch.stack([ref.hvp(torch.nn.functional.one_hot(i, n).to(DTYPE))[i]
                        for i in entries])


@pytest.mark.parametrize("name", [pytest.param("GPT2Model", marks=pytest.mark.slow),
                                  "TransformerEncoder"])
def test_chunks_agree_with_autograd_and_the_dense_route(name):
    model, inputs, T = MODELS[name]()
    c = curvgap.curvature(model)
    dense = _call(c, "diagonal", inputs, T)
    assert c.diagonal_cost.route == "dense"
    chunked = _call(c, "diagonal", inputs, T, chunk=3)
    cost = c.diagonal_cost
    assert (cost.route, cost.width, cost.samples) == ("chunked", 3, 2)
    assert cost.chunks > 2 * cost.samples and cost.slices > 0
    assert cost.backward_equivalents > 0
    assert relative(chunked, dense) <= 1e-10
    used = torch.nonzero(dense).reshape(-1)  # the parameters the output reads
    entries = used[torch.randperm(used.numel(), generator=torch.Generator().manual_seed(4))[:12]]
    assert relative(chunked[entries], _autograd_entries(model, inputs, T, entries)) <= 1e-10


@pytest.mark.parametrize("part", ["gauss_newton", "functional"])
def test_parts_and_the_input_in_chunks_agree_with_the_dense_route(part):
    model, inputs, T = _encoder()
    c = curvgap.curvature(model)
    assert relative(_call(c, "diagonal", inputs, T, part=part, chunk=2),
                    _call(c, "diagonal", inputs, T, part=part)) <= 1e-10
    assert relative(_call(c, "diagonal", inputs, T, wrt="X", part=part, chunk=4),
                    _call(c, "diagonal", inputs, T, wrt="X", part=part)) <= 1e-10
    wrt = ["layers.1.linear1.weight", "norm.bias"]
    assert relative(_call(c, "diagonal", inputs, T, wrt=wrt, part=part, chunk=5),
                    _call(c, "diagonal", inputs, T, wrt=wrt, part=part)) <= 1e-10


@pytest.mark.slow  # 28 s
def test_a_budget_picks_the_chunks_and_a_single_layer_takes_rows():
    model, inputs, T = _encoder()
    c = curvgap.curvature(model)
    dense = _call(c, "diagonal", inputs, T)
    fits = c.diagonal_cost.dense_bytes  # what the dense route holds: it fits the default
    assert c.diagonal_cost.route == "dense" and fits > 0
    tight = _call(c, "diagonal", inputs, T, max_memory=fits - 1)
    cost = c.diagonal_cost
    assert cost.route == "chunked" and cost.width >= 1
    assert relative(tight, dense) <= 1e-10
    with pytest.raises(ValueError, match=r"max_memory: expected at least \d+ bytes") as refused:
        _call(c, "diagonal", inputs, T, max_memory=1)
    least = int(str(refused.value).split("at least ")[1].split()[0])
    assert least < fits  # one column's work is less than the dense route's
    assert relative(_call(c, "diagonal", inputs, T, max_memory=least), dense) <= 1e-10
    assert c.diagonal_cost.width == 1
    layer = curvgap.curvature(model.layers[0])
    X = inputs["X"]
    whole = layer.diagonal(X, T)
    assert layer.diagonal_cost is None
    assert relative(layer.diagonal(X, T, chunk=2), whole) <= 1e-10
    assert layer.diagonal_cost.route == "chunked"


@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_the_peak_counts_what_is_held_at_once(backend):
    """``peak_bytes``, by which the chunks are sized: two 8 MB arrays live together at most
    (one freed before the third is made), a view adding nothing, what existed before the call
    not counted."""
    from curvgap.models.memory import peak_bytes

    def zeros(shape: tuple[int, ...]):
        return (torch.zeros(shape, dtype=torch.float64) if backend == "torch"
                else np.zeros(shape))

    before = zeros((1000, 1000))

    def call() -> None:
        a = zeros((1000, 1000))
        b = (a + 1).reshape(-1)
        del a
        c = b * 2
        del b, c

    assert 2 * 8 * 10**6 <= peak_bytes(call, backend) <= 2 * 8 * 10**6 + 10**5
    assert before.sum() == 0


@pytest.mark.parametrize("work", [
    lambda units: 100 + 10 * units,
    # a cheaper phase holds the most at few units, the steeper one past five: a line through
    # the measures at one and two units would take 425 units, whose work is 5200
    lambda units: max(150 + 2 * units, 100 + 12 * units)])
@pytest.mark.parametrize("budget", [1000, 10**5])
def test_the_units_chosen_are_the_most_that_fit_and_no_measure_passes_the_budget(work, budget):
    measured = []

    def held(units: int) -> int:
        measured.append(units)
        return work(units)

    most = 5000
    units = most_that_fit(held, work(1), most, budget)
    assert max(work(u) for u in measured) <= budget
    assert work(units) <= budget
    assert units == most or work(units + 1) > budget
    assert len(measured) <= 13  # doubling: a few measures, not a search over every count


@pytest.mark.slow
def test_the_work_held_at_once_stays_within_the_budget():
    """At a width where the work dominates (one row of the attention projection's own diagonal
    holds ~100 MB of tangents), the most bytes the diagonal holds at once, counted by a
    dispatch mode over every tensor it creates, stay within ``max_memory`` beyond the
    forward values and adjoints a gradient holds."""
    import transformers

    from curvgap.models.memory import peak_bytes

    config = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=2, n_positions=16,
                                     vocab_size=10, bos_token_id=0, eos_token_id=0)
    model = randomise(transformers.GPT2Model(config).to(DTYPE))
    generator = torch.Generator().manual_seed(5)
    X, T = (torch.randn(1, 16, 128, generator=generator, dtype=DTYPE) for _ in range(2))
    inputs = {"inputs_embeds": X, "use_cache": False}
    c = curvgap.curvature(model)
    _call(c, "gradient", inputs, T)  # the module is read on its first call
    forward = peak_bytes(lambda: _call(c, "gradient", inputs, T), "torch")
    budget = 128 * 10**6
    held = peak_bytes(lambda: _call(c, "diagonal", inputs, T, max_memory=budget), "torch")
    assert c.diagonal_cost.route == "chunked"
    assert held <= budget + forward


def test_bad_budgets_are_refused_by_name():
    model, inputs, T = _encoder()
    c = curvgap.curvature(model)
    for bad in (0, -5, 0.5, float("nan"), float("inf"), "2GB", True):
        with pytest.raises(ValueError, match=r"max_memory: expected a finite number of bytes "
                                             r">= 1 \(such as 2\*\*31\) or None"):
            _call(c, "diagonal", inputs, T, max_memory=bad)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=r"chunk: expected a positive int \(columns per "
                                             r"chunk\) or None"):
            _call(c, "diagonal", inputs, T, chunk=bad)
    with pytest.raises(ValueError, match=r"max_memory: expected at least \d+ bytes \(one "
                                         r"column's work in the chunked diagonal at these "
                                         r"sizes\), got 1$"):
        _call(c, "diagonal", inputs, T, max_memory=1)


@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_rows_and_per_sample_gradients_agree_with_the_module(backend):
    module = generated_module("rmsnorm_block", backend)
    chain = Chain.generate([("", SHIPPED["rmsnorm_block"])], backend)
    generator = torch.Generator().manual_seed(5)
    shapes = chain.parameter_shapes({"L": 3, "d": 4, "d_k": 2, "d_ff": 5})
    params = {name: torch.randn(shape, generator=generator, dtype=DTYPE) * 0.7
              + (0.5 if len(shape) == 1 else 0.0) for name, shape in shapes.items()}
    X, T, G = (torch.randn(2, 3, 4, generator=generator, dtype=DTYPE) for _ in range(3))
    params, X, T, G = (to_backend(backend, v) for v in (params, X, T, G))
    whole = torch.as_tensor(module.diagonal(params, X, T))
    offset = 0
    for name, _ in module.PARAMS:
        rows, per_row, held = module.diagonal_row_layout(params, X, name)
        assert rows * per_row == int(np.prod(params[name].shape))
        assert held >= 0
        parts = [torch.as_tensor(module.diagonal_rows(params, X, T, name, start,
                                                      min(rows, start + 2)))
                 for start in range(0, rows, 2)]
        assert relative(torch.cat(parts), whole[offset:offset + rows * per_row]) <= 1e-10
        offset += rows * per_row
    with pytest.raises(ValueError, match=r"start, stop: expected ints with 0 <= start < stop"):
        module.diagonal_rows(params, X, T, module.PARAMS[0][0], 2, 1)
    _, saved = module.forward_saved(params, X)
    mean, in_X = module.vjp_saved(saved, G)
    mean = {k: torch.as_tensor(v).clone() for k, v in mean.items()}
    in_X = torch.as_tensor(in_X).clone()
    each, each_X = module.vjp_per_sample_saved(saved, G)
    assert relative(torch.as_tensor(each_X), in_X) <= 1e-12
    for name, value in mean.items():
        assert relative(torch.as_tensor(each[name]).mean(0), value) <= 1e-12
    # each sample's own HVP in the parameters: the HVP of that sample alone
    v = {name: to_backend(backend, torch.randn(tuple(value.shape), generator=generator,
                                               dtype=DTYPE)) for name, value in params.items()}
    v_X = to_backend(backend, torch.randn(2, 3, 4, generator=generator, dtype=DTYPE))
    for kind in ("hvp", "gnvp"):  # and each sample's own Gauss–Newton product
        module.jvp_saved(saved, v, v_X)
        each, _ = getattr(module, f"{kind}_per_sample_saved")(saved, T)
        each = {name: torch.as_tensor(value).clone() for name, value in each.items()}
        for b in range(2):
            _, alone = module.forward_saved(params, X[b:b + 1])
            module.jvp_saved(alone, v, v_X[b:b + 1])
            for name, value in getattr(module, f"{kind}_saved")(alone, T[b:b + 1])[0].items():
                assert relative(each[name][b], torch.as_tensor(value)) <= 1e-12


@pytest.mark.parametrize("backend", ["torch", pytest.param("numpy", marks=pytest.mark.slow)])
def test_a_stack_in_chunks_agrees_with_the_dense_route(backend):
    stack = Chain.generate([(str(k), SHIPPED["rmsnorm_block"]) for k in range(3)], backend)
    generator = torch.Generator().manual_seed(6)
    shapes = stack.parameter_shapes({"L": 3, "d": 4, "d_k": 2, "d_ff": 5})
    params = {name: torch.randn(shape, generator=generator, dtype=DTYPE) * 0.7
              + (0.5 if len(shape) == 1 else 0.0) for name, shape in shapes.items()}
    X, T = (torch.randn(2, 3, 4, generator=generator, dtype=DTYPE) for _ in range(2))
    params, X, T = (to_backend(backend, v) for v in (params, X, T))
    for wrt in (None, "X", ["1.W_1", "2.gamma_1"]):
        dense = torch.as_tensor(stack.diagonal(params, X, T, wrt=wrt))
        assert stack.diagonal_cost.route == "dense"
        chunked = torch.as_tensor(stack.diagonal(params, X, T, wrt=wrt, chunk=2))
        assert stack.diagonal_cost.route == "chunked"
        assert relative(chunked, dense) <= 1e-10


def _stack() -> tuple:
    stack = Chain.generate([(str(k), SHIPPED["rmsnorm_block"]) for k in range(3)], "torch")
    generator = torch.Generator().manual_seed(7)
    shapes = stack.parameter_shapes({"L": 3, "d": 4, "d_k": 2, "d_ff": 5})
    params = {name: torch.randn(shape, generator=generator, dtype=DTYPE) * 0.7
              + (0.5 if len(shape) == 1 else 0.0) for name, shape in shapes.items()}
    X, T = (torch.randn(2, 3, 4, generator=generator, dtype=DTYPE) for _ in range(2))
    return stack, params, X, T


def test_a_time_limit_stops_after_the_first_chunks_with_the_estimate_and_cheaper_routes():
    stack, params, X, T = _stack()
    wrt = ["1.W_1", "2.gamma_1"]
    whole = stack.diagonal(params, X, T, wrt=wrt, chunk=2)
    cost = stack.diagonal_cost
    assert cost.estimated_seconds > 0 and cost.seconds > 0 and cost.estimated_bytes >= 0
    # a limit the estimate stays within changes nothing
    assert relative(stack.diagonal(params, X, T, wrt=wrt, chunk=2, max_seconds=1e6), whole) == 0
    with pytest.raises(TimeoutError, match=(
            r"^max_seconds: expected the diagonal within 1e-09 s, got an estimate over it: "
            r"the exact diagonal of \d+ entries takes about .+ here \(chunked route: 48 "
            r"columns over 2 sample\(s\) in chunks of 4.*nothing more was done\. Cheaper: "
            r"part='gauss_newton' \(.+\); wrt= the parameters of 1 and the parts above it "
            r"only \(about .+\); Hutchinson's estimate")):
        stack.diagonal(params, X, T, chunk=2, max_seconds=1e-9)
    # one chunk per source part (the parts above the lowest) and the first slices, no more
    assert stack.diagonal_cost.chunks == 2 and stack.diagonal_cost.slices == 0
    with pytest.raises(TimeoutError, match=r"\(dense route over 2 sample\(s\), estimated from "
                                           r"its top part's step\)"):
        stack.diagonal(params, X, T, max_seconds=1e-9)


def test_a_budget_below_one_row_of_a_parameter_is_refused_before_any_chunk():
    stack, params, X, T = _stack()
    with pytest.raises(ValueError, match=r"max_memory: expected at least \d+ bytes \(the work "
                                         r"of one row of 0\.W_Q for its own diagonal\), got 1$"):
        stack.diagonal(params, X, T, chunk=1, max_memory=1)
    assert stack.diagonal_cost.chunks == 0


def test_bad_time_limits_are_refused_by_name():
    stack, params, X, T = _stack()
    for bad in (0, -1, float("nan"), float("inf"), "10", True):
        with pytest.raises(ValueError, match=r"max_seconds: expected a finite number of "
                                             r"seconds > 0 \(such as 600\) or None"):
            stack.diagonal(params, X, T, max_seconds=bad)


def test_a_modules_diagonal_and_trace_take_a_time_limit():
    model, inputs, T = _encoder()
    c = curvgap.curvature(model)
    for method in ("diagonal", "hessian_trace"):
        with pytest.raises(TimeoutError, match=r"^max_seconds: expected the diagonal within "
                                               r"1e-09 s, got an estimate over it"):
            _call(c, method, inputs, T, chunk=2, max_seconds=1e-9)
    layer = curvgap.curvature(model.layers[0])  # a single layer: its own diagonal in rows
    with pytest.raises(TimeoutError, match=r"first slice of each parameter"):
        layer.diagonal(inputs["X"], T, max_seconds=1e-9)
    with pytest.raises(ValueError, match=r"max_seconds: expected a finite number of seconds"):
        layer.diagonal(inputs["X"], T, max_seconds=-1)


@pytest.mark.parametrize("places", [["0.W_1", "1.W_1"], ["0.W_1", "1.W_1", "2.W_1"]],
                         ids=["both below the top", "three places, one at the top"])
def test_a_weight_read_in_several_parts_sums_every_block_between_its_places(places):
    """One weight read by several parts (``shared``): the sum of its places' entries is
    ``Σ_{p,q} diag(H_pq)`` over those places, read off the loss Hessian (block
    backpropagation, the dense route) with the weight's value at each place; the
    Gauss–Newton part's alike."""
    stack, params, X, T = _stack()
    for place in places[1:]:
        params[place] = params[places[0]].clone()
    wrt = sorted([*places, "2.gamma_1"], key=list(params).index)
    H = stack.loss_hessian(params, X, T, wrt=wrt)
    n, starts = params[places[0]].numel(), {}
    for name in wrt:
        starts[name] = sum(params[w].numel() for w in wrt[:wrt.index(name)])
    expected = sum(H[starts[p]:starts[p] + n, starts[q]:starts[q] + n].diagonal()
                   for p in places for q in places)
    for chunk in (None, 1):
        got = stack.diagonal(params, X, T, wrt=wrt, shared=[places], chunk=chunk)
        assert stack.diagonal_cost.route == "chunked"
        assert relative(sum(got[starts[p]:starts[p] + n] for p in places), expected) <= 1e-10
        gamma = slice(starts["2.gamma_1"], starts["2.gamma_1"] + 4)
        assert relative(got[gamma], H.diagonal()[gamma]) <= 1e-10
    for bad in ([places, places[:2]], [places[:1]]):  # a name in two groups; a group of one
        with pytest.raises(ValueError, match=r"^shared: expected groups of two or more names "
                                             r"of parameters asked for, each in one group"):
            stack.diagonal(params, X, T, wrt=wrt, shared=bad)
    H = stack.loss_hessian(params, X, T, wrt=wrt, part="gauss_newton")
    got = stack.diagonal(params, X, T, wrt=wrt, shared=[places], part="gauss_newton")
    assert relative(sum(got[starts[p]:starts[p] + n] for p in places),
                    sum(H[starts[p]:starts[p] + n, starts[q]:starts[q] + n].diagonal()
                        for p in places for q in places)) <= 1e-10
