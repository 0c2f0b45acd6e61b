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
from curvgap.codegen.resources import CONFIGS
from curvgap.derivations.config import load

SMALL = [load(CONFIGS / name) for name in ("layernorm.toml", "ffn.toml")]
STEPS = ("_copy_tree", "_rename", "_write_durably", "_exchange", "_swap", "_fsync_folder",
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
