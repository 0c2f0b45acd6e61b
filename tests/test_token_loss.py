"""A token loss as torch computes it: ``loss="cross_entropy"`` ignores targets of ``-100``
and averages over the targets counted, and a dataset's batches of any size and length weigh
by the tokens they count, so the dataset's quantity is that of all its tokens as one batch."""

import pytest
import torch

import curvgap
from tests.reference import Reference, randomise, relative

DTYPE = torch.float64
VOCABULARY = 7


class TinyLM(torch.nn.Module):
    """Token ids to logits, position by position, with one attention-free mixing step."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(VOCABULARY, 6)
        self.hidden = torch.nn.Linear(6, 5)
        self.head = torch.nn.Linear(5, VOCABULARY)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.table(ids))))


def _batch(batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCABULARY, (batch, length), generator=generator)
    targets = torch.randint(0, VOCABULARY, (batch, length), generator=generator)
    ignored = torch.rand(batch, length, generator=generator) < 0.4
    return ids, targets.masked_fill(ignored, -100)


def test_ignored_targets_add_nothing_and_the_mean_is_over_those_counted():
    module = randomise(TinyLM().to(DTYPE))
    ids, T = _batch(3, 5, 0)
    T[2] = -100  # a sample with every target ignored
    ref = Reference(module, ids, T, "cross_entropy")
    c = curvgap.curvature(module, "cross_entropy")
    assert relative(c.loss(ids, T), ref.loss().detach()) <= 1e-10
    gradient = c.gradient(ids, T)
    assert relative(gradient, ref.gradient()) <= 1e-10
    v = torch.randn(gradient.numel(), generator=torch.Generator().manual_seed(1), dtype=DTYPE)
    assert relative(c.hvp(ids, T, v), ref.hvp(v)) <= 1e-10
    assert relative(c.gnvp(ids, T, v), ref.gnvp(v)) <= 1e-10
    assert relative(c.hessian_operator(ids, T) @ v, ref.hvp(v)) <= 1e-10
    assert relative(c.diagonal(ids, T), ref.diagonal()) <= 1e-10
    assert relative(c.hessian_trace(ids, T), ref.diagonal().sum()) <= 1e-10
    wrt = ["hidden.weight", "head.weight"]
    assert relative(c.loss_hessian(ids, T, wrt=wrt),
                    Reference(module, ids, T, "cross_entropy", wrt=wrt).hessian()) <= 1e-10


def test_per_sample_results_are_each_samples_own_mean():
    class Logits(torch.nn.Module):  # a float input, so there are derivatives in X
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, VOCABULARY)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(torch.tanh(x))

    module = randomise(Logits().to(DTYPE))
    generator = torch.Generator().manual_seed(2)
    X = torch.randn(2, 3, 4, generator=generator, dtype=DTYPE)
    T = torch.tensor([[1, -100, 4], [-100, -100, 6]])
    gradient = curvgap.curvature(module, "cross_entropy").gradient(X, T, wrt="X")
    for b in range(2):
        x = X[b:b + 1].clone().requires_grad_(True)
        loss = torch.nn.functional.cross_entropy(module(x).reshape(-1, VOCABULARY),
                                                 T[b].reshape(-1))
        (expected,) = torch.autograd.grad(loss, x)
        assert relative(gradient[b], expected.reshape(-1)) <= 1e-10


def test_a_datasets_batches_of_any_size_and_length_weigh_by_their_tokens():
    module = randomise(TinyLM().to(DTYPE))
    batches = [_batch(3, 5, 3), _batch(1, 2, 4), _batch(2, 7, 5)]
    c = curvgap.curvature(module, "cross_entropy")
    # the whole dataset as one batch: every token, padded where a sequence is shorter
    ids = torch.zeros(6, 7, dtype=torch.long)
    T = torch.full((6, 7), -100)
    row = 0
    for X, Y in batches:
        ids[row:row + len(X), :X.shape[1]], T[row:row + len(X), :X.shape[1]] = X, Y
        row += len(X)
    ref = Reference(module, ids, T, "cross_entropy")
    assert relative(c.loss(batches), ref.loss().detach()) <= 1e-10
    gradient = c.gradient(batches)
    assert relative(gradient, ref.gradient()) <= 1e-10
    v = torch.randn(gradient.numel(), generator=torch.Generator().manual_seed(6), dtype=DTYPE)
    assert relative(c.hvp(batches, v), ref.hvp(v)) <= 1e-10
    assert relative(c.hessian_operator(batches) @ v, ref.hvp(v)) <= 1e-10


def test_a_batch_whose_targets_are_all_ignored_is_refused_alone_and_skipped_in_a_dataset():
    module = randomise(TinyLM().to(DTYPE))
    c = curvgap.curvature(module, "cross_entropy")
    ids, T = _batch(2, 3, 7)
    with pytest.raises(ValueError, match="T: expected a target that is not -100"):
        c.loss(ids, torch.full_like(T, -100))
    alone = c.gradient(ids, T)
    assert torch.equal(c.gradient([(ids, T), (ids, torch.full_like(T, -100))]), alone)
    with pytest.raises(ValueError, match="got none .*one whose every target is ignored"):
        c.gradient([(ids, torch.full_like(T, -100))])
    with pytest.raises(ValueError, match="T: expected a target that is not -100"):
        c.hessian_operator(ids, torch.full_like(T, -100))


def test_a_target_outside_the_classes_is_refused_by_name():
    module = randomise(TinyLM().to(DTYPE))
    ids, T = _batch(2, 3, 8)
    T[0, 0] = -5
    with pytest.raises(ValueError, match=r"target: expected class indices in \[0, "
                                         r".*or -100 \(ignored\), got -5 at index \(0, 0\)"):
        curvgap.curvature(module, "cross_entropy").loss(ids, T)
