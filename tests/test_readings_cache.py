"""A module's reading is kept on disk: a new curvature object (as in a new process) of a
module read before answers without tracing it again, exactly; a module whose code or
structure differs, a file changed by someone else or damaged, is read again."""

import importlib
import os
import stat

import pytest
import torch

import curvgap
from curvgap.adapters import readings
from tests.reference import Reference, randomise, relative

DTYPE = torch.float64
curvature_module = importlib.import_module("curvgap.adapters.curvature")


class Gated(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(5, 6), torch.nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)) * torch.sigmoid(self.a(x)))


class Other(Gated):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _data(batch: int = 3, length: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch * 10 + length)
    return (torch.randn(batch, length, 5, generator=generator, dtype=DTYPE),
            torch.randn(batch, length, 5, generator=generator, dtype=DTYPE))


@pytest.fixture
def traces(monkeypatch, tmp_path):
    """The traces made from now on (module class names), in a cache of the test's own (the
    run's shared one may hold these modules' readings already)."""
    monkeypatch.setenv("CURVGAP_CACHE", str(tmp_path / "cache"))
    made = []
    real = curvature_module.trace

    def counted(module, *args, **kwargs):
        made.append(type(module).__name__)
        return real(module, *args, **kwargs)

    monkeypatch.setattr(curvature_module, "trace", counted)
    return made


def test_a_module_read_before_is_answered_from_disk_exactly(traces):
    module = randomise(Gated().to(DTYPE))
    X, T = _data()
    curvgap.curvature(module).gradient(X, T)
    assert traces == ["Gated"]
    again = randomise(Gated().to(DTYPE), seed=3)  # another instance, other weights
    X, T = _data(2, 7)  # other sizes
    c = curvgap.curvature(again)
    assert relative(c.gradient(X, T), Reference(again, X, T).gradient()) <= 1e-10
    assert traces == ["Gated"]  # not traced again
    curvgap.curvature(randomise(Other().to(DTYPE))).gradient(X, T)
    assert traces == ["Gated", "Other"]  # other code: read


@pytest.mark.parametrize("damage", ["writable by others", "truncated"])
def test_a_reading_changed_by_someone_else_or_damaged_is_read_again(traces, damage):
    module = randomise(Gated().to(DTYPE))
    X, T = _data()
    c = curvgap.curvature(module, "mse")
    c.gradient(X, T)
    key = readings.reading_key(module, next(iter(c._traced)), "mse")
    path = readings.trusted_folder("readings") / f"{key}.pkl"
    assert path.exists()
    before = len(traces)
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:100])
    else:
        os.chmod(path, os.stat(path).st_mode | stat.S_IWOTH)
    c = curvgap.curvature(module, "mse")
    assert relative(c.gradient(X, T), Reference(module, X, T).gradient()) <= 1e-10
    assert len(traces) == before + 1  # read again


def _squash(u: torch.Tensor) -> torch.Tensor:
    return torch.tanh(u)


class Helped(Gated):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(_squash(self.a(x)))


def test_a_helper_replaced_is_read_again_in_this_process_and_on_disk(traces, monkeypatch):
    module = randomise(Helped().to(DTYPE))
    X, T = _data()
    c = curvgap.curvature(module)
    c.gradient(X, T)
    before = len(traces)
    monkeypatch.setitem(globals(), "_squash", torch.sigmoid)  # the function forward calls
    assert relative(c.gradient(X, T), Reference(module, X, T).gradient()) <= 1e-10
    assert len(traces) == before + 1
    fresh = curvgap.curvature(module)  # as in a new process: the disk's reading is the new one
    assert relative(fresh.gradient(X, T), Reference(module, X, T).gradient()) <= 1e-10


class Chosen(torch.nn.Module):
    """An activation chosen by an option held in a dict, and an attribute that is an
    object of no meaningful text."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.a = torch.nn.Linear(5, 5)
        self.options = {"activation": name}
        self.tag = object()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(torch, self.options["activation"])(self.a(x))


def test_options_in_a_dict_name_their_own_reading_and_an_opaque_attribute_none(traces):
    X, T = _data()
    for name in ("tanh", "sigmoid"):
        module = randomise(Chosen(name).to(DTYPE))
        c = curvgap.curvature(module)
        assert relative(c.gradient(X, T), Reference(module, X, T).gradient()) <= 1e-10
        assert readings.reading_key(module, next(iter(c._traced)), "mse") is None  # object()
    module.tag = 3  # plain now: kept on disk, and the option changed in place is read again
    c = curvgap.curvature(module)
    c.gradient(X, T)
    assert readings.reading_key(module, next(iter(c._traced)), "mse") is not None
    module.options["activation"] = "tanh"
    assert relative(c.gradient(X, T), Reference(module, X, T).gradient()) <= 1e-10


class Scaled(Gated):
    SCALE = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.SCALE * self.a(x)))


def test_a_class_constant_changed_is_read_again(traces, monkeypatch):
    module = randomise(Scaled().to(DTYPE))
    X, T = _data()
    c = curvgap.curvature(module)
    c.gradient(X, T)
    monkeypatch.setattr(Scaled, "SCALE", 0.5)
    assert relative(c.gradient(X, T), Reference(module, X, T).gradient()) <= 1e-10
    fresh = curvgap.curvature(module)
    assert relative(fresh.gradient(X, T), Reference(module, X, T).gradient()) <= 1e-10


def test_a_stale_reading_on_disk_is_caught_by_its_first_check(traces, monkeypatch):
    """Were two modules ever to share a name on disk (a value no fingerprint sees), the
    reading loaded is checked once against the module's own output and read again."""
    X, T = _data()
    first = randomise(Gated().to(DTYPE))
    curvgap.curvature(first).gradient(X, T)
    other = randomise(Other().to(DTYPE))
    monkeypatch.setattr(readings, "reading_key",  # every module: the same name
                        lambda module, signature, loss: "0" * 32)
    monkeypatch.setattr(curvature_module, "reading_key", readings.reading_key)
    curvgap.curvature(first).gradient(X, T)  # stored under the shared name
    before = len(traces)
    c = curvgap.curvature(other)
    assert relative(c.gradient(X, T), Reference(other, X, T).gradient()) <= 1e-10
    assert len(traces) == before + 1  # the stale reading refused, the module read
