"""The module cache, shared: processes using a new module at once generate it once and all
load it; a process killed while generating leaves no part of a module; stray or corrupted
files never block a module (a corrupted one is regenerated); a folder others can write is
refused; its messages speak of the cache."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from curvgap.codegen import cache
from curvgap.codegen.generate import HEADER_MARK, body_hash, split_header
from curvgap.codegen.resources import CONFIGS
from curvgap.codegen.verify import random_case
from curvgap.derivations.config import load

CONFIG = CONFIGS / "ffn.toml"
DIMS = {"L": 3, "d": 4, "d_ff": 5}
#: Generous and load-independent: a process that takes longer than this is stuck.
PATIENCE = 300

#: What a process computes with its module, as JSON on its last line of output.
RESULT = r"""
def result(module, backend):
    import torch
    from curvgap.codegen.verify import random_case
    params, X, T = random_case(module, {"L": 3, "d": 4, "d_ff": 5}, 2, seed=7)
    if backend == "numpy":
        params, X, T = {k: v.numpy() for k, v in params.items()}, X.numpy(), T.numpy()
    loss, gradient = module.loss(params, X, T), module.gradient(params, X, T)
    return json.dumps({"loss": float(loss), "gradient": [float(g) for g in gradient]})
"""

#: One process using the module of ``argv[1]`` for ``argv[2]``: it says "ready" once
#: imported, waits for a line on stdin (so that every process starts at once), says
#: "rendering" if it renders (holding the lock ``argv[3]`` seconds), then prints its result.
USER = """
import json, sys, time
from curvgap.codegen import cache
from curvgap.derivations.config import load
real = cache.render_all
def render_all(*args, **kwargs):
    print("rendering", flush=True)
    time.sleep(float(sys.argv[3]))  # the others arrive meanwhile and wait for the lock
    return real(*args, **kwargs)
cache.render_all = render_all
""" + RESULT + """
config = load(sys.argv[1])
print("ready", flush=True)
sys.stdin.readline()
print(result(cache.module_for(config, sys.argv[2]), sys.argv[2]), flush=True)
"""


def expected() -> dict:
    """The loss and gradient of the shipped ffn module on the inputs the processes use."""
    from curvgap.generated.torch import ffn

    params, X, T = random_case(ffn, DIMS, 2, seed=7)
    return {"loss": float(ffn.loss(params, X, T)),
            "gradient": [float(g) for g in ffn.gradient(params, X, T)]}


def agrees(found: dict, reference: dict) -> bool:
    return abs(found["loss"] - reference["loss"]) <= 1e-12 * abs(reference["loss"]) and \
        np.allclose(found["gradient"], reference["gradient"], rtol=1e-12, atol=0)


@pytest.fixture
def cold(tmp_path, monkeypatch) -> Path:
    """An empty cache folder, this process's loaded modules forgotten."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("CURVGAP_CACHE", str(folder))
    monkeypatch.setattr(cache, "_LOADED", {})
    return folder


def start(script: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=os.environ.copy())


def line(process: subprocess.Popen) -> str:
    """The next line ``process`` prints (failing, with its errors, if it ends first)."""
    found: list[str] = []
    reader = threading.Thread(target=lambda: found.append(process.stdout.readline()))
    reader.start()
    reader.join(PATIENCE)
    assert found and found[0], f"no line from the process: {process.stderr.read()}"
    return found[0].strip()


def finish(process: subprocess.Popen) -> list[str]:
    """What ``process`` prints until it ends (failing unless it ends well)."""
    out, err = process.communicate(timeout=PATIENCE)
    assert process.returncode == 0, err
    return out.splitlines()


def module_files(folder: Path) -> dict[str, bytes]:
    return {p.parent.name: p.read_bytes() for p in (folder / "modules").glob("*/layer_*.py")}


def intact(data: bytes) -> bool:
    fields, body = split_header(data.decode("utf-8", errors="replace"))
    return fields.get("content-hash") == body_hash(body)


@pytest.mark.slow  # 21 s: five processes importing torch
def test_five_processes_using_a_new_module_at_once_generate_it_once(cold):
    backends = ["torch", "numpy", "torch", "numpy", "torch"]
    processes = [start(USER, CONFIG, backend, 2.0) for backend in backends]
    try:
        for process in processes:
            assert line(process) == "ready"
        for process in processes:  # the barrier: all of them start now
            process.stdin.write("go\n")
            process.stdin.flush()
        outputs = [finish(process) for process in processes]
    finally:
        for process in processes:
            process.kill()
            process.wait()
    assert sum(out.count("rendering") for out in outputs) == 1, outputs
    reference = expected()
    for out, backend in zip(outputs, backends):
        assert agrees(json.loads(out[-1]), reference), (backend, out[-1])
    files = module_files(cold)
    assert sorted(files) == ["numpy", "torch"] and all(map(intact, files.values()))
    assert not list((cold / "modules").rglob("*.tmp"))


#: A process generating the module of ``argv[1]`` that stops (sleeps, to be killed) at
#: the step ``argv[2]``: "rendering" (nothing written), "temporary" (the first file's
#: temporary half written) or "published" (the first file in place, not the second).
KILLED = """
import os, sys, time
from curvgap.codegen import cache, durable
from curvgap.derivations.config import load
step = sys.argv[2]
def stop():
    print(step, flush=True)
    time.sleep(3600)
real_render, real_fsync, real_folder = cache.render_all, os.fsync, durable.fsync_folder
def render_all(*args, **kwargs):
    if step == "rendering":
        stop()
    return real_render(*args, **kwargs)
def fsync(descriptor):
    if step == "temporary":
        os.ftruncate(descriptor, os.fstat(descriptor).st_size // 2)
        stop()
    return real_fsync(descriptor)
def fsync_folder(path):
    if step == "published":
        stop()
    return real_folder(path)
cache.render_all, os.fsync, durable.fsync_folder = render_all, fsync, fsync_folder
cache.module_for(load(sys.argv[1]), "torch")
"""

#: A process waiting for the lock of the module of ``argv[1]``, then using its ``argv[2]``
#: module: it says "locking" just before it asks for the lock.
WAITER = """
import fcntl, json, sys
from curvgap.codegen import cache
from curvgap.derivations.config import load
real = fcntl.flock
def flock(descriptor, operation):
    print("locking", flush=True)
    return real(descriptor, operation)
fcntl.flock = flock
real_render = cache.render_all
def render_all(*args, **kwargs):
    print("rendering", flush=True)
    return real_render(*args, **kwargs)
cache.render_all = render_all
""" + RESULT + """
print(result(cache.module_for(load(sys.argv[1]), sys.argv[2]), sys.argv[2]), flush=True)
"""


@pytest.mark.parametrize("step", ["rendering", pytest.param("temporary", marks=pytest.mark.slow),
                                  pytest.param("published", marks=pytest.mark.slow)])
def test_a_process_killed_while_generating_leaves_no_part_of_a_module(cold, step):
    killed = start(KILLED, CONFIG, step)
    waiter = None
    try:
        assert line(killed) == step  # it holds the lock, stopped at its step
        files = module_files(cold)
        if step == "published":  # the first module whole, the other not begun
            assert len(files) == 1 and intact(*files.values())
        else:
            assert files == {}
        if step == "temporary":
            assert len(list((cold / "modules").rglob(".layer_*.tmp"))) == 1
        # a process asking for a module not written yet waits for the lock
        waiter = start(WAITER, CONFIG, ({"torch", "numpy"} - set(files)).pop())
        assert line(waiter) == "locking"
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(PATIENCE)
        out = finish(waiter)  # the lock of the killed process is released
    finally:
        for process in (killed, waiter):
            if process is not None:
                process.kill()
                process.wait()
    assert out.count("rendering") == 1, out
    reference = expected()
    assert agrees(json.loads(out[-1]), reference)
    # the next use in this process: both modules whole and current, no temporary left
    for backend in ("torch", "numpy"):
        module = cache.module_for(load(CONFIG), backend)
        params, X, T = random_case(module, DIMS, 2, seed=7)
        if backend == "numpy":
            params, X, T = {k: v.numpy() for k, v in params.items()}, X.numpy(), T.numpy()
        assert abs(float(module.loss(params, X, T)) - reference["loss"]) <= 1e-12
    files = module_files(cold)
    assert sorted(files) == ["numpy", "torch"] and all(map(intact, files.values()))
    assert not list((cold / "modules").rglob("*.tmp"))


def _works(config_path: Path = CONFIG) -> None:
    module = cache.module_for(load(config_path))
    params, X, T = random_case(module, DIMS, 2, seed=7)
    assert abs(float(module.loss(params, X, T)) - expected()["loss"]) <= 1e-12


def test_stray_files_and_a_corrupted_sibling_block_nothing(cold):
    modules = cold / "modules"
    (modules / "torch").mkdir(parents=True)
    strays = {modules / "notes.txt": "mine", modules / "torch" / "notes.txt": "mine",
              modules / "torch" / "layer_0123456789abcdef.py": "# Generated by curvgap\ngarbage",
              modules / "torch" / ".layer_0123456789abcdef.py.x1.tmp": "half",
              modules / ".modules.curvgap-new" / "torch" / "x.py": "left by the old cache"}
    for path, text in strays.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    _works()
    assert all(path.read_text() == text for path, text in strays.items())


def _corrupt(how: str, path: Path) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[:len(data) // 2])
    elif how == "emptied":
        path.write_bytes(b"")
    elif how == "body edited":
        path.write_bytes(data.replace(b"def loss(", b"def loss_(", 1))
    elif how == "stale":  # intact, but generated from other sources
        fields, body = split_header(data.decode())
        path.write_text(data.decode().replace(fields["source-hash"], "0" * 64))
    else:  # "header lost"
        path.write_bytes(data.split(b"\n", 3)[3])


@pytest.mark.parametrize("how", ["truncated", "emptied", "body edited", "stale", "header lost"])
def test_a_corrupted_module_is_regenerated(cold, how):
    _works()
    (path,) = (cold / "modules" / "torch").glob("layer_*.py")
    good = path.read_bytes()
    _corrupt(how, path)
    cache._LOADED.clear()
    _works()
    assert path.read_bytes() == good


def _plant(path: Path, marker: Path) -> None:
    """Replace the module at ``path`` by code that leaves ``marker``, its header's hashes
    recomputed (a content hash proves integrity, not origin)."""
    fields, _ = split_header(path.read_text())
    body = f"open({str(marker)!r}, 'w').write('ran')\n"
    path.write_text(f"# {HEADER_MARK} from config 'x' (torch backend).\n"
                    f"# source-hash: {fields['source-hash']}\n"
                    f"# content-hash: {body_hash(body)}\n{body}")


def _other_owner(path: Path, root: Path, monkeypatch) -> Path:
    """Make ``path`` another user's (as root), or this process another user (then the cache
    folder ``root`` is the first one found another user's); the folder refused."""
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534)
        return path
    monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 4242)
    return root


@pytest.mark.parametrize("where, how", [
    ("", 0o777), ("", 0o775), ("modules", 0o757), ("modules/torch", 0o770), ("", "owner"),
    ("modules/torch", "owner")])
def test_a_cache_folder_others_can_write_is_refused(cold, tmp_path, monkeypatch, where, how):
    _works()
    (path,) = (cold / "modules" / "torch").glob("layer_*.py")
    marker = tmp_path / "ran"
    _plant(path, marker)
    cache._LOADED.clear()
    folder = cold / where
    if how == "owner":
        folder = _other_owner(folder, cold, monkeypatch)
        expected = rf"expected folders of your own, got {folder} owned by user"
    else:
        folder.chmod(how)
        expected = rf"expected folders only you can write, got {folder} \(mode {how:o}\)"
    with pytest.raises(cache.CacheError, match=expected) as error:
        cache.module_for(load(CONFIG))
    message = str(error.value)
    assert f"the module cache {cold} (set by CURVGAP_CACHE)" in message
    assert "--out" not in message and not marker.exists()


@pytest.mark.parametrize("how", ["writable", "owner", "link"])
def test_an_untrusted_module_file_is_regenerated_not_run(cold, tmp_path, monkeypatch, how):
    _works()
    (path,) = (cold / "modules" / "torch").glob("layer_*.py")
    good, marker = path.read_bytes(), tmp_path / "ran"
    if how == "link":
        planted = tmp_path / "planted.py"
        planted.write_bytes(good)
        _plant(planted, marker)
        path.unlink()
        path.symlink_to(planted)
    else:
        _plant(path, marker)
        if how == "writable":
            path.chmod(0o666)
        elif os.geteuid() == 0:
            os.chown(path, 65534, 65534)
        else:
            pytest.skip("only root can give a file to another user")
    cache._LOADED.clear()
    _works()
    assert not marker.exists() and not path.is_symlink() and path.read_bytes() == good
    if how == "link":
        assert b"open(" in planted.read_bytes()  # the link's target is left as it was


def test_a_cache_that_cannot_be_made_says_so(tmp_path, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    monkeypatch.setenv("CURVGAP_CACHE", str(afile / "cache"))
    monkeypatch.setattr(cache, "_LOADED", {})
    with pytest.raises(cache.CacheError, match=rf"the module cache {afile / 'cache'} \(set by "
                                               rf"CURVGAP_CACHE\): cannot make the folder "
                                               rf"{afile / 'cache'}: Not a directory; set "
                                               r"CURVGAP_CACHE to a folder you can write"):
        cache.module_for(load(CONFIG))
    assert afile.read_text() == "mine"


def _text(body: str, source: str = "s" * 8) -> str:
    return (f"# {HEADER_MARK} from a test.\n# source-hash: {source}\n"
            f"# content-hash: {body_hash(body)}\n{body}")


def test_cached_module_takes_any_key_and_renders_only_when_needed(cold):
    calls = []

    def render():
        calls.append(1)
        return {"torch": _text("VALUE = 42\n"), "numpy": _text("VALUE = 43\n")}

    key = "ab" * 20
    assert cache.cached_module(key, "torch", render).VALUE == 42
    assert cache.cached_module(key, "torch", render).VALUE == 42  # loaded once
    cache._LOADED.clear()
    assert cache.cached_module(key, "numpy", render).VALUE == 43  # written by the first
    assert cache.cached_module(key, "torch", render, source="s" * 8).VALUE == 42
    assert len(calls) == 1
    cache._LOADED.clear()  # another source hash: regenerated
    assert cache.cached_module(key, "torch", lambda: {"torch": _text("VALUE = 44\n", "t" * 8)},
                               source=lambda: "t" * 8).VALUE == 44


@pytest.mark.parametrize("key, backend, render, error, message", [
    ("ABCDEF0123", "torch", None, ValueError,
     r"key: expected a lowercase hex digest of 8 to 128 digits, got 'ABCDEF0123'"),
    ("../../x", "torch", None, ValueError, r"key: expected a lowercase hex digest"),
    ("abcdef0123", "jax", None, ValueError,
     r"backend: expected one of \['numpy', 'torch'\], got 'jax'"),
    ("abcdef0123", "torch", lambda: {"numpy": _text("A = 1\n")}, cache.CacheError,
     r"render: expected the files' texts by backend name, 'torch' among them, got the "
     r"backends \['numpy'\]"),
    ("abcdef0123", "torch", lambda: {"torch": "A = 1\n"}, cache.CacheError,
     r"render: expected each text to start with a curvgap header whose content hash is its "
     r"body's, got another for 'torch'"),
])
def test_cached_module_refuses_bad_arguments(cold, key, backend, render, error, message):
    with pytest.raises(error, match=message):
        cache.cached_module(key, backend, render or (lambda: {}))
    assert not list(cold.rglob("layer_*"))


def test_module_for_keeps_its_signature(cold):
    config = load(CONFIG)
    torch_module, numpy_module = cache.module_for(config), cache.module_for(config, "numpy")
    assert torch_module is cache.module_for(config, backend="torch")
    assert Path(torch_module.__file__).parent == cold / "modules" / "torch"
    assert Path(numpy_module.__file__).parent == cold / "modules" / "numpy"
    params, X, T = random_case(torch_module, DIMS, 2, seed=7)
    numpy_loss = numpy_module.loss({k: v.numpy() for k, v in params.items()}, X.numpy(),
                                   T.numpy())
    assert abs(float(numpy_loss) - float(torch_module.loss(params, X, T))) <= 1e-12


def test_a_generation_says_so_in_one_line_and_a_cached_use_says_nothing(cold, capsys):
    import re

    import torch

    import curvgap

    layer = torch.nn.Linear(4, 3).double()
    X, T = torch.randn(2, 5, 4, dtype=torch.float64), torch.randn(2, 5, 3, dtype=torch.float64)
    curvgap.curvature(layer).loss(X, T)
    err = capsys.readouterr().err
    assert re.fullmatch(r"curvgap: reading Linear's forward for these kinds of inputs "
                        r"\(torch.export; kept on disk\) \.\.\. done in \d+\.\d s\n"
                        r"curvgap: generating the torch code of Linear's loss, gradient and "
                        r"curvature products: not in the module cache "
                        rf"{re.escape(str(cold / 'modules'))} yet \.\.\. done in \d+\.\d s\n",
                        err), err
    cache._LOADED.clear()  # read from the cache's folder, as a new process would
    curvgap.curvature(torch.nn.Linear(4, 3).double()).loss(X, T)
    assert capsys.readouterr().err == ""


def test_the_generation_line_can_be_silenced_and_says_when_it_failed(cold, capsys,
                                                                      monkeypatch):
    def render():
        raise RuntimeError("no")

    with pytest.raises(RuntimeError, match="no"):
        cache.cached_module("cd" * 20, "torch", render, what="a test module")
    assert capsys.readouterr().err == (f"curvgap: generating a test module: not in the module "
                                       f"cache {cold / 'modules'} yet ... failed\n")
    monkeypatch.setenv(cache.QUIET, "1")
    assert cache.cached_module("cd" * 20, "torch", lambda: {"torch": _text("VALUE = 1\n")},
                               what="a test module").VALUE == 1
    assert capsys.readouterr().err == ""
