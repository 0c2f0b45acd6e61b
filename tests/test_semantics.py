"""What PyTorch computes is what curvgap derives: masking constants (``finfo.min``,
``-finfo.max``, ``-inf``, ``-1e4``) as masks, floats as the numbers they are, an embedding's
padding row, frozen parameters, ``detach`` and ``torch.no_grad()`` regions as autograd has
them — each against reverse-over-reverse autograd on a module that uses it — and the
conventions curvgap cannot follow refused by name."""

from __future__ import annotations

import math
import re

import pytest
import sympy as sp
import torch
from families import DTYPE
from reference import Reference, randomise, relative

import curvgap
from curvgap.adapters import UnsupportedLayer
from curvgap.adapters.records import _number
from curvgap.codegen.backends.torch.printer import TorchPrinter

D = 5
F64 = torch.finfo(torch.float64)


def _rows(L: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, L, D, generator=generator, dtype=DTYPE) for _ in range(2))


def _agrees(module: torch.nn.Module, X: torch.Tensor, T: torch.Tensor, loss: str = "mse",
            twin: bool = False, **inputs) -> None:
    """Forward, gradient, HVP and GN product of ``module`` against autograd (the parameters
    that require a gradient), within 1e-10."""
    c = curvgap.curvature(module, loss)
    wrt = [n for n, p in module.named_parameters() if p.requires_grad]
    ref = Reference(module, X, T, loss, wrt=wrt, twin=twin, **inputs)
    assert relative(c.forward(X, **inputs), ref.output().detach()) <= 1e-10
    gradient = ref.gradient()
    assert relative(c.gradient(X, T, wrt=wrt, **inputs), gradient) <= 1e-10
    v = torch.randn(gradient.numel(), generator=torch.Generator().manual_seed(1), dtype=DTYPE)
    assert relative(c.hvp(X, T, v, wrt=wrt, **inputs), ref.hvp(v)) <= 1e-10
    assert relative(c.gnvp(X, T, v, wrt=wrt, **inputs), ref.gnvp(v)) <= 1e-10


# -- masking constants -------------------------------------------------------------------------
class Causal(torch.nn.Module):
    """One head's attention over ``x`` whose future positions are masked by ``how`` with
    ``fill`` (the idioms of Hugging Face's eager attentions)."""

    def __init__(self, how: str, fill: float) -> None:
        super().__init__()
        self.q = torch.nn.Linear(D, D, bias=False)
        self.how, self.fill = how, fill

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.q(x) @ x.transpose(-1, -2)
        L = x.shape[1]
        kept = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
        if self.how == "where tensor":  # the module: a 0-d tensor of finfo.min
            s = torch.where(kept, s, torch.tensor(self.fill, dtype=s.dtype))
        elif self.how == "where number":
            s = torch.where(kept, s, self.fill)
        elif self.how == "where full_like":
            s = torch.where(kept, s, torch.full_like(s, self.fill))
        elif self.how == "masked_fill":
            s = s.masked_fill(~kept, self.fill)
        return s.softmax(-1) @ x


FILLS = {"finfo.min": F64.min, "-finfo.max": -F64.max, "-inf": -math.inf, "-1e4": -1e4}


def _masks():
    """Every idiom with ``finfo.min`` and ``masked_fill`` with every fill by default; the rest
    in the slow run."""
    return [pytest.param(how, fill, id=f"{how}-{fill}", marks=() if fill == "finfo.min" or
                         how == "masked_fill" else pytest.mark.slow)
            for how in ("where tensor", "where number", "where full_like", "masked_fill")
            for fill in FILLS]


@pytest.mark.parametrize("how, fill", _masks())
def test_a_masking_constant_is_the_mask_it_stands_for(how, fill):
    """``finfo.min`` beside a score used to swallow it (``s + c - c`` is not ``s``): the
    forward was off by 0.2, the HVP by 7× its size."""
    module = randomise(Causal(how, FILLS[fill]).to(DTYPE))
    _agrees(module, *_rows())


def test_both_branches_of_where_are_derived_each_under_its_own_mask():
    class Both(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(D, D), torch.nn.Linear(D, D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.where(x > 0, torch.tanh(self.a(x)), 1e3 * self.b(x))

    _agrees(randomise(Both().to(DTYPE)), *_rows())


@pytest.mark.parametrize("layer", [0, pytest.param(1, marks=pytest.mark.slow)],
                         ids=["global", "local"])
def test_gpt_neo_as_shipped_masks_with_finfo_min_and_is_exact(layer):
    """GPT-Neo's eager attention: ``torch.where(causal, scores, tensor(finfo.min))``, global
    and local (windowed) layers; it computes attention in float32 inside, so the reference is
    its float64 twin."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_neo.modeling_gpt_neo import GPTNeoBlock

    config = transformers.GPTNeoConfig(hidden_size=8, num_heads=2, intermediate_size=12,
                                       num_layers=2, attention_types=[[["global", "local"], 1]],
                                       window_size=3, max_position_embeddings=16)
    config._attn_implementation = "eager"
    generator = torch.Generator().manual_seed(0)
    X, T = (torch.randn(2, 5, 8, generator=generator, dtype=DTYPE) for _ in range(2))
    _agrees(randomise(GPTNeoBlock(config, layer).to(DTYPE)), X, T, twin=True)


# -- constants as they are ---------------------------------------------------------------------
@pytest.mark.parametrize("value, expected", [
    (0.5, sp.Rational(1, 2)), (1 / 3, sp.Rational(1, 3)), (1 / math.sqrt(3), sp.sqrt(3) / 3),
    (-1e4, sp.Integer(-10000)), (2.0, sp.Integer(2)), (1 / math.sqrt(64), sp.Rational(1, 8)),
    (math.sqrt(2 / math.pi), sp.sqrt(2) / sp.sqrt(sp.pi)),  # GELU's, written out by GPT-2
])
def test_a_float_is_the_simple_number_it_visibly_is(value, expected):
    assert _number(value) == expected


@pytest.mark.parametrize("value", [0.044715, 1e-12, F64.min, F64.max, 0.7978845608028, 5e-324])
def test_any_other_float_is_the_float_it_is_and_prints_so(value):
    number = _number(value)
    assert isinstance(number, sp.Float) and float(number) == value
    assert TorchPrinter().doprint(number) == repr(value)


def test_no_constant_prints_as_a_long_integer_or_a_rational_of_a_floats_bits():
    """``1/sqrt(3)`` printed as ``\\frac{2251799813685248}{3900231685776981}`` and
    ``-finfo.max`` as a 309-digit integer (which crashed the generated code)."""

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k = torch.nn.Linear(4, 3, bias=False), torch.nn.Linear(4, 3, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            s = self.q(x) @ self.k(x).transpose(-1, -2) / math.sqrt(3)
            L = x.shape[1]
            s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), -F64.max)
            return torch.nn.functional.gelu(s.softmax(-1) @ x, approximate="tanh")

    module = randomise(Scaled().to(DTYPE))
    generator = torch.Generator().manual_seed(0)
    X, T = (torch.randn(2, 3, 4, generator=generator, dtype=DTYPE) for _ in range(2))
    _agrees(module, X, T)
    tex = curvgap.curvature(module).latex(X)
    assert not re.search(r"\d{20}", tex)
    assert not re.search(r"\\frac\{\d{7,}\}\{\d{7,}\}", tex)
    assert r"\frac{1}{\sqrt{3}}" in tex and r"\frac{\sqrt{3}}{3}" not in tex


# -- PyTorch's conventions ---------------------------------------------------------------------
class TokenTable(torch.nn.Module):
    """Token ids → an embedding with a padding row → a layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(7, D, padding_idx=2)
        self.out = torch.nn.Linear(D, 6)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.embedding(ids)))


class PositionTable(torch.nn.Module):
    """``x`` plus an embedding of constant ids (keyword input) with a padding row."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(6, D, padding_idx=0)
        self.out = torch.nn.Linear(D, D)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(x + self.embedding(positions)))


def test_the_padding_row_of_an_embedding_of_token_ids_has_no_derivative():
    """Autograd never differentiates the row ``padding_idx`` (its gradient, its Hessian row
    and column are zero) though the forward reads it: curvgap used to differentiate it."""
    module = randomise(TokenTable().to(DTYPE))
    ids = torch.tensor([[1, 2, 3, 2], [2, 0, 6, 5]])
    T = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(0), dtype=DTYPE)
    _agrees(module, ids, T)
    c, ref = curvgap.curvature(module), Reference(module, ids, T)
    H = c.loss_hessian(ids, T)
    assert relative(H, ref.hessian()) <= 1e-10
    row = slice(2 * D, 3 * D)  # the padding row of the table (first in parameter order)
    assert H[row].abs().max() == 0 and H[:, row].abs().max() == 0
    assert H[:2 * D, :2 * D].abs().max() > 0


def test_the_padding_row_of_an_embedding_of_constant_ids_has_no_derivative():
    module = randomise(PositionTable().to(DTYPE))
    X, T = _rows()
    _agrees(module, X, T, positions=torch.tensor([[0, 1, 2, 0], [3, 0, 4, 5]]))


def test_bert_classifies_padded_token_ids_as_autograd_does():
    """BERT's token table pads with id 0 (``pad_token_id``), the id its padded positions
    hold."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(hidden_size=8, num_attention_heads=2, intermediate_size=12,
                                     num_hidden_layers=1, vocab_size=30,
                                     max_position_embeddings=16, num_labels=3)
    model = randomise(transformers.BertForSequenceClassification(config).to(DTYPE))
    ids = torch.tensor([[5, 9, 23, 0, 0], [9, 7, 13, 7, 3]])
    mask = (ids != 0).long()
    _agrees(model, ids, torch.tensor([2, 0]), "cross_entropy", attention_mask=mask)


def test_a_frozen_parameter_is_a_constant():
    """A parameter with ``requires_grad=False`` (a sinusoidal table, a frozen bias) is read at
    call time as it is and never differentiated."""

    class Frozen(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(D, D), torch.nn.Linear(D, D)
            self.table = torch.nn.Parameter(torch.randn(8, D), requires_grad=False)
            self.b.bias.requires_grad_(False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.tanh(self.a(x) + self.table[: x.shape[1]]))

    module = Frozen().to(DTYPE).eval()
    X, T = _rows()
    _agrees(module, X, T)
    c = curvgap.curvature(module)
    trained = [n for n, p in module.named_parameters() if p.requires_grad]
    assert c.gradient(X, T).numel() == sum(module.get_parameter(n).numel() for n in trained)
    with torch.no_grad():
        module.table.add_(1.0)  # read at call time
    _agrees(module, X, T)
    module.b.bias.requires_grad_(True)  # thawed: read again, differentiated
    thawed = [n for n, _ in module.named_parameters() if n != "table"]
    assert relative(c.gradient(X, T),
                    Reference(module, X, T, wrt=thawed).gradient()) <= 1e-10


def test_detach_and_no_grad_regions_stop_derivatives_as_in_autograd():
    """A straight-through estimator ``y + (tanh(y) - y).detach()`` and a ``torch.no_grad()``
    region inside the forward: their values are constants of the call."""

    class StraightThrough(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(D, D), torch.nn.Linear(D, D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.a(x)
            y = y + (torch.tanh(y) - y).detach()
            with torch.no_grad():
                scale = self.b(x) * 2 + torch.zeros_like(y)
            return self.b(y) * scale

    _agrees(randomise(StraightThrough().to(DTYPE)), *_rows())


class Table(torch.nn.Module):
    def __init__(self, **options) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(6, D, **options)
        self.out = torch.nn.Linear(D, D)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.out(x + self.embedding(positions))


@pytest.mark.parametrize("options, message", [
    ({"max_norm": 1.0}, r"embedding: operation embedding_renorm_ .*without max_norm"),
    ({"scale_grad_by_freq": True}, r"embedding: operation embedding .*without "
                                   r"scale_grad_by_freq"),
])
def test_an_embedding_whose_backward_is_no_derivative_is_refused_by_name(options, message):
    module = Table(**options).to(DTYPE).eval()
    X, T = _rows()
    with pytest.raises(UnsupportedLayer, match=message):
        curvgap.curvature(module).gradient(X, T, positions=torch.tensor([[0, 1, 2, 1]] * 2))


# -- models as their library builds them, called as users call them ----------------------------
def _library_models() -> dict:
    """Hugging Face models from their configs with the library's defaults (its attention
    implementation, sdpa where it picks it), at sizes where ``d``, ``d_k`` and ``d_ff``
    differ."""
    transformers = pytest.importorskip("transformers")
    common = dict(hidden_size=8, num_attention_heads=2, intermediate_size=12,
                  num_hidden_layers=2, vocab_size=30, max_position_embeddings=16)
    return {
        "GPTNeoXModel": lambda: transformers.GPTNeoXConfig(**common),
        "PhiModel": lambda: transformers.PhiConfig(**common),
        "FalconModel": lambda: transformers.FalconConfig(hidden_size=8, num_attention_heads=2,
                                                         num_hidden_layers=2, vocab_size=30),
        "GPT2Model": lambda: transformers.GPT2Config(n_embd=8, n_head=2, n_inner=12,
                                                     n_layer=2, vocab_size=30, n_positions=16,
                                                     bos_token_id=0, eos_token_id=0),
        "LlamaModel": lambda: transformers.LlamaConfig(**common, num_key_value_heads=1),
        "Qwen2Model": lambda: transformers.Qwen2Config(**common, num_key_value_heads=1),
        "GemmaModel": lambda: transformers.GemmaConfig(**common, num_key_value_heads=1,
                                                       head_dim=4),
        "Gemma2Model": lambda: transformers.Gemma2Config(**common, num_key_value_heads=1,
                                                         head_dim=4),
        "OPTModel": lambda: transformers.OPTConfig(hidden_size=8, num_attention_heads=2,
                                                   ffn_dim=12, num_hidden_layers=2,
                                                   vocab_size=30, word_embed_proj_dim=8,
                                                   max_position_embeddings=16),
        "BertModel": lambda: transformers.BertConfig(**common),
        "T5EncoderModel": lambda: transformers.T5Config(d_model=8, num_heads=2, d_kv=4,
                                                        d_ff=12, num_layers=2, vocab_size=30,
                                                        is_encoder_decoder=False),
    }


LIBRARY_QUICK = ("GPTNeoXModel",)


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=() if name in LIBRARY_QUICK else pytest.mark.slow)
    for name in ("GPTNeoXModel", "PhiModel", "FalconModel", "GPT2Model", "LlamaModel",
                 "Qwen2Model", "GemmaModel", "Gemma2Model", "OPTModel", "BertModel",
                 "T5EncoderModel")])
def test_a_library_model_built_and_called_with_its_defaults_agrees_with_autograd(name):
    """No ``use_cache=False``, no attention implementation chosen: the model as
    ``AutoModel.from_config`` builds it. (GPT-NeoX's and Phi's parallel residual read one
    cotangent into two biases: the second's gradient was divided by the batch twice.)"""
    transformers = pytest.importorskip("transformers")
    config = _library_models()[name]()
    model = (transformers.T5EncoderModel(config) if name == "T5EncoderModel"
             else transformers.AutoModel.from_config(config))
    model = randomise(model.to(DTYPE))
    generator = torch.Generator().manual_seed(0)
    X, T = (torch.randn(2, 5, 8, generator=generator, dtype=DTYPE) for _ in range(2))
    _agrees(model, None, T, twin=True, inputs_embeds=X)


def test_a_forward_torch_export_cannot_trace_is_refused_naming_the_submodule(capfd):
    """A branch on a tensor's value inside a block: the refusal names the block's path and
    the line, and torch's own partial graph is not printed."""

    class Branching(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(D, D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:
                return self.linear(x)
            return -self.linear(x)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([Branching()])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.blocks[0](x)

    X, T = _rows()
    with pytest.raises(UnsupportedLayer, match=r"^blocks\.0 \(Branching\): operation .*"
                                               r"`if x\.sum\(\) > 0:`"):
        curvgap.curvature(Model().to(DTYPE)).gradient(X, T)
    assert "def forward" not in capfd.readouterr().err


# -- constants divide as they multiply ---------------------------------------------------------
class Divided(torch.nn.Module):
    """A layer's output divided by a constant tensor made or held as ``how``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a = torch.nn.Linear(D, D)
        self.how = how
        self.register_buffer("table", torch.linspace(1.0, 3.0, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        if self.how == "0-d tensor":
            return y / torch.tensor(2.0, dtype=x.dtype)
        if self.how == "buffer":
            return torch.div(y, self.table)
        if self.how == "sqrt of a float32 tensor":  # DeBERTa's scale, cast
            return y / torch.sqrt(torch.tensor(3.0, dtype=torch.float) * 2).to(x.dtype)
        mask = x[..., :1].gt(0)  # masked mean pooling over the rows x marks
        return (y * mask).sum(1) / mask.sum(1).clamp(min=1)


@pytest.mark.parametrize("how", ["0-d tensor", "buffer", "sqrt of a float32 tensor",
                                 "masked mean"])
def test_a_division_by_a_constant_tensor_divides(how):
    """``y / c`` for a constant tensor ``c`` was read as ``y · c``: every result off by
    ``c²`` (DeBERTa's attention scale, masked mean pooling)."""
    X, _ = _rows()
    T = torch.randn(2, D, dtype=DTYPE) if how == "masked mean" else _rows(seed=1)[1]
    _agrees(randomise(Divided(how).to(DTYPE)), X, T)


@pytest.mark.parametrize("config", ["DebertaConfig",
                                    pytest.param("DebertaV2Config", marks=pytest.mark.slow)])
def test_deberta_as_shipped_is_exact(config):
    """DeBERTa's attention divides its scores by ``sqrt(tensor(d_k) · scale)``."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModel.from_config(getattr(transformers, config)(
        hidden_size=8, num_attention_heads=2, intermediate_size=12, num_hidden_layers=2,
        vocab_size=30, max_position_embeddings=16))
    generator = torch.Generator().manual_seed(0)
    X, T = (torch.randn(2, 5, 8, generator=generator, dtype=DTYPE) for _ in range(2))
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[0, -2:] = 0
    _agrees(randomise(model.to(DTYPE)), None, T, twin=True, inputs_embeds=X,
            attention_mask=mask)


class TwoOutputs(torch.nn.Module):
    """Rows and, second, a pooled row through a layer of its own (MPNet's pooler)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a, self.pooler = torch.nn.Linear(D, D), torch.nn.Linear(D, D)
        self.how = how

    def forward(self, x: torch.Tensor):
        y = torch.tanh(self.a(x))
        if self.how == "second output":
            return y, torch.tanh(self.pooler(y[:, 0]))
        unused = self.pooler(y)  # noqa: F841 - computed, never returned
        return y


@pytest.mark.parametrize("how", ["second output", "dead code"])
def test_parameters_only_a_second_output_reads_have_exact_zeros(how):
    """They raised KeyError inside the derivation."""
    module = randomise(TwoOutputs(how).to(DTYPE))
    X, T = _rows()
    _agrees(module, X, T)
    gradient = curvgap.curvature(module).gradient(X, T)
    assert gradient[-D * D - D:].abs().max() == 0


def test_a_product_across_samples_is_refused_by_name():
    """Rows of every sample multiplied together (the batch merged into a matrix's rows): a
    KeyError inside the reader, now a refusal naming the operation."""

    class Across(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(D, D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.a(x).reshape(-1, D)
            return (y @ y.t()).reshape(x.shape[0], 4, -1)[..., :D]  # 4 rows a sample

    X, T = _rows()
    with pytest.raises(UnsupportedLayer, match=r"operation slice .*merged the batch"):
        curvgap.curvature(Across().to(DTYPE)).gradient(X, T)


# -- where the module's own numbers are not finite ---------------------------------------------
def _llama(**options):
    """A float64 Llama decoder in eager attention: its RMSNorm and softmax compute in float32
    inside, where float64's ``finfo.min`` mask is ``-inf``."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=40, hidden_size=8, intermediate_size=12,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=16,
                                      attn_implementation="eager", **options)
    return randomise(transformers.LlamaModel(config).to(DTYPE))


def test_a_sample_the_module_itself_gives_nan_for_is_refused_by_name():
    """A sample of padding only, and a left-padded one under the causal mask, leave rows of
    attention with no key: the module's float32 softmax gives NaN there (the program, in
    float64 throughout, would give finite numbers the module never computes)."""
    model = _llama()
    ids = torch.tensor([[3, 9, 23, 7, 1], [5, 6, 7, 8, 9], [4, 4, 12, 30, 2]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [0, 0, 1, 1, 1]])
    with torch.no_grad():
        own = model(ids, attention_mask=mask).last_hidden_state
    assert own[0].isfinite().all() and own[1:].isnan().flatten(1).any(1).all()
    T = torch.randn(3, 5, 8, dtype=DTYPE)
    c = curvgap.curvature(model)
    for call in (lambda: c.forward(ids, attention_mask=mask),
                 lambda: c.gradient(ids, T, attention_mask=mask)):
        with pytest.raises(ValueError, match=r"X: LlamaModel's own forward gives NaN for "
                                             r"samples 1, 2 of 3: it computes in float32 "
                                             r"\(cast from float64.*Leave those samples out"):
            call()


def test_a_batch_the_module_computes_is_answered_and_checked_again_when_changed():
    """Right padding leaves every query a key: the answer is autograd's (on the float64
    twin); the same mask then changed in place to pad a whole sample is checked again."""
    model = _llama()
    ids = torch.tensor([[3, 9, 23, 7, 1], [5, 6, 7, 8, 9]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    T = torch.randn(2, 5, 8, dtype=DTYPE)
    _agrees(model, ids, T, twin=True, attention_mask=mask)
    c = curvgap.curvature(model)
    c.gradient(ids, T, attention_mask=mask)
    mask[0] = 0
    with pytest.raises(ValueError, match=r"own forward gives NaN for sample 0 of 2"):
        c.gradient(ids, T, attention_mask=mask)


def test_a_half_precision_module_that_overflows_is_refused_by_name():
    """float16 computed by curvgap in float32: where the module's own float16 numbers
    overflow (a square past 65504), it says so rather than answer with numbers the module
    does not compute; a parameter changed in place is checked again."""

    class Squares(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(D, D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.a(x)
            return (y * y).softmax(-1)

    module = Squares().half()
    X = torch.randn(2, 4, D, generator=torch.Generator().manual_seed(0)).half()
    T = torch.rand(2, 4, D, generator=torch.Generator().manual_seed(1)).half()
    c = curvgap.curvature(module)
    assert c.gradient(X, T).isfinite().all()
    with torch.no_grad():
        module.a.weight.mul_(1e3)
        assert not module(X).isfinite().all()
    with pytest.raises(ValueError, match=r"own forward gives (NaN|inf).* of 2: it computes "
                                         r"in float16, .* curvgap computes in float32"):
        c.gradient(X, T)


def test_the_check_of_the_modules_own_forward_takes_any_output_and_inference_tensors():
    """A per-sample output ``(B,)`` that overflows names its samples; a batch made under
    ``torch.inference_mode()`` (which cannot be traced) is read as a copy."""

    class Energy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(D, D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.a(x)
            return (y * y).sum((-2, -1))

    module = Energy().half()
    with torch.inference_mode():
        X = torch.randn(2, 4, D, generator=torch.Generator().manual_seed(0)).half()
    T = torch.rand(2, generator=torch.Generator().manual_seed(1)).half()
    c = curvgap.curvature(module)
    assert c.gradient(X, T).isfinite().all()
    with torch.no_grad():
        module.a.weight[:, :] = 0
        module.a.bias[:] = 0
        module.a.bias[0] = 300  # (300² · 4 rows per sample: past float16's 65504)
    with pytest.raises(ValueError, match=r"own forward gives inf for samples 0, 1 of 2: it "
                                         r"computes in float16"):
        c.gradient(X, T)
