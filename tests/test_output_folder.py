"""The output folder switches whole: an error at any step of a write, or a kill -9 at any
instant, leaves it wholly old or wholly new, and the next run cleans what was left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from curvgap import cli
from curvgap.codegen import output
from curvgap.codegen.generate import GenerationError, render_all, write
from curvgap.codegen.resources import CONFIGS, GENERATED
from curvgap.derivations.config import load

SMALL = [load(CONFIGS / name) for name in ("layernorm.toml", "ffn.toml")]
STEPS = ("_copy_tree", "_rename", "_write_durably", "_exchange", "_swap", "fsync_folder",
         "_remove")


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (no caches), by relative path."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def states(tmp_path_factory) -> tuple[list, dict, dict]:
    """The rendered files, and the old and new state of a folder holding them."""
    rendered = render_all(SMALL, report=lambda line: None)
    folder = tmp_path_factory.mktemp("states") / "out"
    write(rendered, folder)
    (folder / "numpy" / "__init__.py").write_text("")  # a file the write must keep
    new = snapshot(folder)
    for item in rendered:  # the old state: other (stale) bodies, same paths
        path = folder / item.relative_path
        path.write_text(path.read_text().replace("source-hash: ", "source-hash: 0", 1))
    return rendered, snapshot(folder), new


def _restore(folder: Path, state: dict[str, bytes]) -> None:
    output.recover(folder)
    if folder.exists():
        output._remove(folder)
    for relative, data in state.items():
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / relative).write_bytes(data)


def _faulty(monkeypatch, fail_at: int) -> list[str]:
    """Make the ``fail_at``-th filesystem step of :mod:`codegen.output` raise OSError."""
    calls: list[str] = []
    for name in STEPS:
        real = getattr(output, name)

        def step(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            if len(calls) == fail_at:
                raise OSError(5, f"injected failure in {_name}")
            return _real(*args, **kwargs)
        monkeypatch.setattr(output, name, step)
    return calls


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two renames"])
def test_an_error_at_any_step_leaves_the_folder_old_or_new(tmp_path, monkeypatch, states,
                                                           exchange):
    rendered, old, new = states
    folder = tmp_path / "out"
    if not exchange:  # the fallback where the system has no atomic exchange
        monkeypatch.setattr(output, "_swap", lambda a, b: False)
    _restore(folder, old)
    with monkeypatch.context() as patch:
        calls = _faulty(patch, 0)
        write(rendered, folder, force=True)
    assert snapshot(folder) == new
    outcomes = set()
    for k in range(1, len(calls) + 1):
        _restore(folder, old)
        with monkeypatch.context() as patch:
            _faulty(patch, k)
            try:
                write(rendered, folder, force=True)
            except GenerationError as error:
                assert "was left as it was" in str(error)
                assert snapshot(folder) == old, f"step {k} ({calls[k - 1]})"
                outcomes.add("old")
            else:
                assert snapshot(folder) == new, f"step {k} ({calls[k - 1]})"
                outcomes.add("new")
        # the next run cleans what was left, and writes the new state
        write(rendered, folder, force=True)
        assert snapshot(folder) == new and not output.leftovers(folder), k
    assert outcomes == {"old", "new"}


SLOW_WRITER = """
import json, sys, time
from pathlib import Path
from curvgap.codegen import output
for name in {steps!r}:
    real = getattr(output, name)
    def slow(*args, _real=real, **kwargs):
        time.sleep(0.004)
        return _real(*args, **kwargs)
    setattr(output, name, slow)
files = json.loads(Path(sys.argv[2]).read_text())
print("ready", flush=True)
output.switch(Path(sys.argv[1]), files)
print("done", flush=True)
"""


def _start_writer(folder: Path, files: Path) -> subprocess.Popen:
    script = SLOW_WRITER.format(steps=STEPS)
    process = subprocess.Popen([sys.executable, "-c", script, str(folder), str(files)],
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"
    return process


def test_kill_at_any_instant_leaves_the_folder_old_or_new(tmp_path, states):
    rendered, old, new = states
    folder, files = tmp_path / "out", tmp_path / "files.json"
    files.write_text(json.dumps({item.relative_path: item.text for item in rendered}))
    _restore(folder, old)
    start = time.perf_counter()
    process = _start_writer(folder, files)
    assert process.stdout.readline().strip() == "done" and process.wait() == 0
    duration = time.perf_counter() - start
    assert snapshot(folder) == new
    outcomes = []
    for n in range(14):
        _restore(folder, old)
        process = _start_writer(folder, files)
        time.sleep(duration * n / 12)
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        state = snapshot(folder)
        assert state in (old, new), f"kill {n}: a mixed folder"
        outcomes.append("old" if state == old else "new")
        output.recover(folder)  # what the next run does first
        assert snapshot(folder) == state and not output.leftovers(folder)
    assert "old" in outcomes and "new" in outcomes, outcomes


def test_check_reports_what_an_interrupted_run_left(tmp_path, capsys, states):
    rendered, _, new = states
    folder = tmp_path / "out"
    _restore(folder, new)
    output.beside(folder, "new").mkdir()
    args = ["generate", "--check", "--out", str(folder)]
    for config in ("layernorm", "ffn"):
        args += ["--config", str(CONFIGS / f"{config}.toml")]
    assert cli.main(args) == 1
    assert "a run stopped before its switch" in capsys.readouterr().err
    write(rendered, folder)
    assert cli.main(args) == 0 and not output.leftovers(folder)


def test_a_folder_with_files_curvgap_did_not_write_is_refused(tmp_path, states):
    rendered = states[0]
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(GenerationError, match="holds 'notes.txt', which curvgap did not write"):
        write(rendered, folder)
    assert snapshot(folder) == {"notes.txt": b"mine"} and not output.leftovers(folder)


def test_a_folder_whose_parents_do_not_exist_yet_is_made(tmp_path, states):
    rendered, _, new = states
    folder = tmp_path / "a" / "b" / "out"
    write(rendered, folder)
    assert snapshot(folder).keys() == new.keys() - {"numpy/__init__.py"}


# -- paths: the folder written is the one meant, checked before any derivation -------------

MINE = 'name = "layernorm"\nkind = "layernorm"\neps = 1e-3\naffine = false\n'


@pytest.fixture
def nothing_derived(monkeypatch):
    """Fail the test if anything is derived (a path refusal must come first)."""
    import curvgap.derivations.derivation as model
    from curvgap.codegen import generate as generation

    def derive(*args, **kwargs):
        raise AssertionError("derived before the path was checked")
    monkeypatch.setattr(generation, "derive", derive)
    monkeypatch.setattr(model, "derive", derive)


@pytest.mark.parametrize("spelling", ["generated", "./generated", "codegen/../generated",
                                      "generated/", "a link to it"])
def test_the_shipped_folder_however_spelt_keeps_its_modules(spelling, tmp_path, monkeypatch,
                                                            capsys, nothing_derived):
    monkeypatch.chdir(GENERATED.parent)
    if spelling == "a link to it":
        (tmp_path / "link").symlink_to(GENERATED)
        spelling = str(tmp_path / "link")
    config = tmp_path / "mine.toml"
    config.write_text(MINE)
    before = snapshot(GENERATED)
    assert cli.main(["generate", "--no-verify", "--config", str(config), "--out", spelling]) == 2
    assert "'name' 'layernorm' is a shipped config's, and this config differs from it" in \
        capsys.readouterr().err
    assert snapshot(GENERATED) == before


@pytest.mark.parametrize("spelling", ["generated/latex", "codegen/../generated/latex"])
def test_latex_keeps_the_shipped_documents(spelling, tmp_path, monkeypatch, capsys,
                                           nothing_derived):
    monkeypatch.chdir(GENERATED.parent)
    config = tmp_path / "mine.toml"
    config.write_text(MINE)
    before = snapshot(GENERATED)
    assert cli.main(["latex", str(config), "--out", spelling]) == 2
    assert capsys.readouterr().err.strip() == (
        f"curvgap: error: NAME: 'layernorm' is a shipped config's name, and this config "
        f"differs from it: writing it into {spelling} would replace the shipped document; "
        "rename it or choose another --out")
    assert snapshot(GENERATED) == before


def test_a_linked_output_folder_stays_a_link_and_its_target_gets_the_files(tmp_path, states,
                                                                           monkeypatch):
    rendered, old, new = states
    real, link = tmp_path / "real", tmp_path / "link"
    _restore(real, old)
    link.symlink_to("real")
    with monkeypatch.context() as patch:  # all-or-nothing, as for a folder
        _faulty(patch, 5)
        with pytest.raises(GenerationError, match="was left as it was"):
            write(rendered, link, force=True)
    assert os.readlink(link) == "real" and snapshot(real) == old
    write(rendered, link, force=True)
    assert os.readlink(link) == "real" and snapshot(real) == new
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]  # nothing beside


def test_generate_through_a_linked_output_folder(tmp_path, capsys):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert cli.main(["generate", "--no-verify", "--config", str(CONFIGS / "ffn.toml"),
                     "--out", str(tmp_path / "link")]) == 0
    assert (tmp_path / "link").is_symlink()
    assert sorted(snapshot(tmp_path / "real")) == ["latex/ffn.tex", "numpy/ffn.py",
                                                   "torch/ffn.py"]
    assert cli.main(["generate", "--check", "--config", str(CONFIGS / "ffn.toml"),
                     "--out", str(tmp_path / "link")]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]


@pytest.mark.parametrize("spelling, where", [(".", "the current folder"),
                                             ("sub/..", "the current folder"),
                                             ("..", "a folder above the current one")])
def test_the_current_folder_and_those_above_it_are_refused(spelling, where, tmp_path,
                                                           monkeypatch, capsys, nothing_derived):
    here = tmp_path / "here"
    (here / "sub").mkdir(parents=True)
    (here / "notes.txt").write_text("mine")
    monkeypatch.chdir(here)
    before = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    assert cli.main(["generate", "--no-verify", "--config", str(CONFIGS / "ffn.toml"),
                     "--out", spelling]) == 2
    err = capsys.readouterr().err
    assert (f"--out: expected a folder of its own (generation replaces it whole), got "
            f"{spelling!r}, {where}") in err and "such as --out generated-modules" in err
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == before
    with pytest.raises(ValueError, match="expected a folder of its own"):  # the Python API
        from curvgap.codegen.generate import generate
        generate([CONFIGS / "ffn.toml"], spelling, report=lambda line: None)


#: Every command with an --out, and the arguments it needs.
COMMANDS = {"generate": ["generate", "--no-verify", "--config", str(CONFIGS / "ffn.toml")],
            "latex": ["latex", "ffn"], "bench": ["bench", "--quick"],
            "bench --scale": ["bench", "--quick", "--scale"],
            "bench --distributed": ["bench", "--quick", "--distributed"],
            "reproduce": ["reproduce", "--quick"]}


@pytest.fixture
def nothing_run(monkeypatch, request, capsys):
    """Fail the test if a benchmark or the analyses start, or anything is derived."""
    import importlib

    def run(*args, **kwargs):
        raise AssertionError("ran before the path was checked")
    for module, name in (("benchmarks.suite", "run"), ("benchmarks.scale", "run_scale"),
                         ("benchmarks.distributed", "run_distributed"),
                         ("analysis.reproduce", "run")):  # importing some derives a module
        monkeypatch.setattr(importlib.import_module(f"curvgap.{module}"), name, run)
    capsys.readouterr()  # the line saying so, on a first use of the cache: not the command's
    request.getfixturevalue("nothing_derived")


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("under", ["afile.txt/sub", "afile.txt/a/b", "dangling/sub"])
def test_a_path_under_a_file_fails_before_any_work(command, under, tmp_path, monkeypatch,
                                                   capsys, nothing_run):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile.txt").write_text("mine")
    (tmp_path / "dangling").symlink_to("gone")
    assert cli.main([*COMMANDS[command], "--out", under]) == 2
    stop = under.split("/")[0]
    what = "a file" if stop == "afile.txt" else "a symbolic link to nothing"
    assert capsys.readouterr().err.strip() == (
        f"curvgap: error: --out: expected a folder path, got {under!r}, but {stop!r} is "
        f"{what}: no folder can be made under it")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile.txt", "dangling"]
    assert (tmp_path / "afile.txt").read_text() == "mine"


@pytest.mark.parametrize("command", COMMANDS)
def test_a_folder_that_cannot_be_written_fails_before_any_work(command, tmp_path, monkeypatch,
                                                               capsys, nothing_run):
    locked = tmp_path / "locked"
    locked.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if Path(path) == locked
                        else real(path, mode, **kw))  # root may write anywhere: simulated
    assert cli.main([*COMMANDS[command], "--out", str(locked / "out")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"curvgap: error: --out: expected a folder that can be written, got "
        f"{str(locked / 'out')!r}, but {str(locked)!r} cannot be written")


#: What each command writes in its --out folder (one of them, each).
WRITES = [("latex", "ffn.tex"), ("bench", "bench.json"), ("bench", "bench.png"),
          ("bench --scale", "scale.json"), ("bench --distributed", "distributed.json"),
          ("reproduce", "report.md"), ("reproduce", "convergence.png")]


@pytest.mark.parametrize("command, name", WRITES)
def test_no_file_is_written_through_a_link(command, name, tmp_path, capsys, nothing_run):
    target = tmp_path / "elsewhere"
    target.write_text("mine")
    out = tmp_path / "results"
    out.mkdir()
    (out / name).symlink_to(target)
    assert cli.main([*COMMANDS[command], "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"curvgap: error: --out: expected {str(out / name)!r} to be a file or absent, got a "
        f"symbolic link to {str(target)!r}; curvgap does not write through links: remove it "
        "or choose another folder")
    assert target.read_text() == "mine" and (out / name).is_symlink()


def test_a_file_written_whole_is_never_written_through_a_link(tmp_path):
    """What the commands write at their end (bench.json, bench.png, scale.json, …)."""
    target = tmp_path / "elsewhere"
    target.write_text("mine")
    (tmp_path / "bench.json").symlink_to(target)
    with pytest.raises(output.OutputError, match="got a symbolic link to"):
        output.write_file(tmp_path / "bench.json", "{}")
    with pytest.raises(output.OutputError, match="got a symbolic link to"):
        with output.replacing(tmp_path / "bench.json") as temporary:
            temporary.write_text("{}")
    assert target.read_text() == "mine" and (tmp_path / "bench.json").is_symlink()
    output.write_file(tmp_path / "scale.json", "{}")
    with output.replacing(tmp_path / "bench.png") as temporary:
        assert temporary.suffix == ".png"
        temporary.write_bytes(b"png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "bench.png",
                                                          "elsewhere", "scale.json"]
