"""``curvgap.curvature(model, loss="model")``: the loss the model computes itself when given
its labels, read from its trace — a Hugging Face language model's shift by one position,
``-100`` ignored and the mean over the tokens counted; a sequence classifier's loss — against
autograd on ``model(**inputs).loss`` (its float64 twin: the loss's float32 upcast kept in
float64)."""

import pytest
import torch

import curvgap
from tests.reference import Reference, randomise, relative

transformers = pytest.importorskip("transformers")

DTYPE = torch.float64


def _lm() -> torch.nn.Module:
    config = transformers.GPT2Config(n_embd=16, n_head=2, n_layer=2, n_positions=32,
                                     vocab_size=40, bos_token_id=0, eos_token_id=0)
    return randomise(transformers.GPT2LMHeadModel(config).to(DTYPE).eval())


def _padded(batch: int = 3, length: int = 6, seed: int = 0) -> dict:
    """Token ids, a mask with right padding, and labels of ``-100`` where padded."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 40, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, 4:], mask[1, 2:] = 0, 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _own(model: torch.nn.Module, labels: torch.Tensor):
    """The model's own loss of its logits (what its forward computes from them)."""
    return lambda logits, _: model.loss_function(logits, labels, model.config.vocab_size)


def test_a_language_models_own_loss_shifts_ignores_and_averages_over_the_tokens():
    model, batch = _lm(), _padded()
    ids, inputs = batch["input_ids"], {k: v for k, v in batch.items() if k != "input_ids"}
    c = curvgap.curvature(model, loss="model")
    assert relative(c.loss(ids, None, **inputs), model(**batch).loss.detach()) <= 1e-6
    ref = Reference(model, ids, None, _own(model, batch["labels"]), twin=True, **inputs)
    assert relative(c.loss(ids, None, **inputs), ref.loss().detach()) <= 1e-10
    gradient = c.gradient(ids, None, **inputs)
    assert relative(gradient, ref.gradient()) <= 1e-10
    v = torch.randn(gradient.numel(), generator=torch.Generator().manual_seed(1), dtype=DTYPE)
    assert relative(c.hvp(ids, None, v, **inputs), ref.hvp(v)) <= 1e-10
    assert relative(c.gnvp(ids, None, v, **inputs), ref.gnvp(v)) <= 1e-10
    # the model's loss is not curvgap's cross_entropy of the same labels (unshifted)
    plain = curvgap.curvature(model, "cross_entropy")
    mask = batch["attention_mask"]
    assert relative(plain.loss(ids, batch["labels"], attention_mask=mask),
                    c.loss(ids, None, **inputs)) > 1e-3


def test_a_sequence_classifiers_own_loss():
    config = transformers.BertConfig(hidden_size=8, num_attention_heads=2, intermediate_size=12,
                                     num_hidden_layers=1, vocab_size=30,
                                     max_position_embeddings=16, num_labels=3)
    model = randomise(transformers.BertForSequenceClassification(config).to(DTYPE).eval())
    ids = torch.tensor([[5, 9, 23, 0, 0], [9, 7, 13, 7, 3]])
    inputs = {"attention_mask": (ids != 0).long(), "labels": torch.tensor([2, 0])}
    c = curvgap.curvature(model, loss="model")
    ref = Reference(model, ids, inputs["labels"], "cross_entropy",
                    attention_mask=inputs["attention_mask"])
    assert relative(c.loss(ids, None, **inputs), ref.loss().detach()) <= 1e-10
    gradient = c.gradient(ids, None, **inputs)
    assert relative(gradient, ref.gradient()) <= 1e-10
    v = torch.randn(gradient.numel(), generator=torch.Generator().manual_seed(2), dtype=DTYPE)
    assert relative(c.hvp(ids, None, v, **inputs), ref.hvp(v)) <= 1e-10


def test_labels_with_another_loss_or_a_target_with_the_models_are_refused_by_name():
    model, batch = _lm(), _padded()
    ids, inputs = batch["input_ids"], {k: v for k, v in batch.items() if k != "input_ids"}
    with pytest.raises(ValueError, match="its first output is its own loss .* pass "
                                         "loss='model' to take that loss"):
        curvgap.curvature(model, "cross_entropy").loss(ids, batch["labels"], **inputs)
    with pytest.raises(TypeError, match="T: expected None with loss='model'"):
        curvgap.curvature(model, "model").loss(ids, batch["labels"], **inputs)
    with pytest.raises(ValueError, match="loss='model': GPT2LMHeadModel's loss is "
                                         "F.cross_entropy of its logits then div.*leave "
                                         "num_items_in_batch out"):
        curvgap.curvature(model, "model").loss(ids, None, num_items_in_batch=torch.tensor(5),
                                               **inputs)


def test_a_model_without_its_own_loss_is_refused_by_name():
    model = torch.nn.Linear(4, 3).to(DTYPE)
    with pytest.raises(ValueError, match="loss='model': expected Linear's first output to be "
                                         "its loss"):
        curvgap.curvature(model, "model").loss(torch.randn(2, 5, 4, dtype=DTYPE), None)


def _loader(seed: int) -> list[dict]:
    """Padded batches of several sizes and lengths, as a data collator yields them."""
    return [_padded(3, 6, seed), _padded(2, 4, seed + 1), _padded(4, 7, seed + 2)]


def _joined(batches: list[dict]) -> dict:
    """The batches as one, padded to the longest (right padding, labels -100)."""
    length = max(b["input_ids"].shape[1] for b in batches)

    def pad(key: str, value: int) -> torch.Tensor:
        return torch.cat([torch.nn.functional.pad(b[key], (0, length - b[key].shape[1]),
                                                  value=value) for b in batches])

    return {"input_ids": pad("input_ids", 1), "attention_mask": pad("attention_mask", 0),
            "labels": pad("labels", -100)}


def test_batches_as_the_model_takes_them_one_dict_or_a_loader_of_any_sizes():
    model = _lm()
    c = curvgap.curvature(model, loss="model")
    batch = _padded()
    ids, inputs = batch["input_ids"], {k: v for k, v in batch.items() if k != "input_ids"}
    v = torch.randn(sum(p.numel() for p in model.parameters()),
                    generator=torch.Generator().manual_seed(3), dtype=DTYPE)
    assert torch.equal(c.loss(batch), c.loss(ids, None, **inputs))
    assert torch.equal(c.gradient(batch), c.gradient(ids, None, **inputs))
    assert torch.equal(c.hvp(batch, v), c.hvp(ids, None, v, **inputs))
    assert torch.equal(c.gnvp(batch, v), c.gnvp(ids, None, v, **inputs))
    assert torch.equal(c.hessian_operator(batch) @ v, c.hvp(ids, None, v, **inputs))
    # a loader of dicts: the whole dataset as one batch (every token counted once)
    batches = _loader(4)
    whole = _joined(batches)
    ids, inputs = whole["input_ids"], {k: v for k, v in whole.items() if k != "input_ids"}
    ref = Reference(model, ids, None, _own(model, whole["labels"]), twin=True, **inputs)
    assert relative(c.loss(batches), ref.loss().detach()) <= 1e-10
    assert relative(c.gradient(batches), ref.gradient()) <= 1e-10
    assert relative(c.hvp(batches, v), ref.hvp(v)) <= 1e-10
    assert relative(c.hessian_operator(batches) @ v, ref.hvp(v)) <= 1e-10


def test_a_loader_of_triples_with_keyword_inputs():
    model = _lm()
    batches = _loader(5)
    triples = [(b["input_ids"], b["labels"], {"attention_mask": b["attention_mask"]})
               for b in batches]
    c = curvgap.curvature(model, "cross_entropy")
    whole = _joined(batches)
    ref = Reference(model, whole["input_ids"], whole["labels"], "cross_entropy",
                    attention_mask=whole["attention_mask"])
    assert relative(c.loss(triples), ref.loss().detach()) <= 1e-10
    assert relative(c.gradient(triples), ref.gradient()) <= 1e-10
    # dicts with loss="cross_entropy": labels are the target, as given (not shifted)
    assert relative(c.gradient(batches), ref.gradient()) <= 1e-10


def test_a_batch_dict_without_its_input_or_target_is_refused_by_name():
    model, batch = _lm(), _padded()
    with pytest.raises(ValueError, match="X: expected the batch to hold 'input_ids'"):
        curvgap.curvature(model, "model").loss({"attention_mask": batch["attention_mask"]})
    with pytest.raises(ValueError, match="X: expected the batch to hold its target as 'labels' "
                                         "for loss='cross_entropy'"):
        curvgap.curvature(model, "cross_entropy").loss(
            {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]})
    with pytest.raises(TypeError, match="attention_mask: expected it once"):
        curvgap.curvature(model, "model").loss(batch, attention_mask=batch["attention_mask"])
    with pytest.raises(TypeError, match="T: expected none with a batch dict"):
        curvgap.curvature(model, "model").loss(batch, batch["labels"])
    # a call without a target takes a batch without one
    plain = curvgap.curvature(model, "cross_entropy")
    logits = plain.forward({"input_ids": batch["input_ids"],
                            "attention_mask": batch["attention_mask"]})
    assert logits.shape == (*batch["input_ids"].shape, 40)


def test_a_models_own_mean_squared_error():
    class Regressor(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 3)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> tuple:
            out = self.a(torch.tanh(x))
            return torch.nn.functional.mse_loss(out, labels), out

    module = randomise(Regressor().to(DTYPE))
    generator = torch.Generator().manual_seed(6)
    X = torch.randn(2, 5, 4, generator=generator, dtype=DTYPE)
    labels = torch.randn(2, 5, 3, generator=generator, dtype=DTYPE)
    c = curvgap.curvature(module, "model")
    loss = module(X, labels)[0]
    expected = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, module.parameters())])
    assert relative(c.loss(X, None, labels=labels), loss.detach()) <= 1e-10
    assert relative(c.gradient(X, None, labels=labels), expected) <= 1e-10
    config = transformers.BertConfig(hidden_size=8, num_attention_heads=2, intermediate_size=12,
                                     num_hidden_layers=1, vocab_size=30,
                                     max_position_embeddings=16, num_labels=1)
    bert = randomise(transformers.BertForSequenceClassification(config).to(DTYPE).eval())
    ids = torch.tensor([[5, 9, 23, 4], [9, 7, 13, 7]])
    target = torch.tensor([0.5, -1.0], dtype=DTYPE)
    own = curvgap.curvature(bert, "model")
    assert relative(own.loss(ids, None, labels=target), bert(ids, labels=target).loss.detach()
                    ) <= 1e-10
