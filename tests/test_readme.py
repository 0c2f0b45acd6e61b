"""The README's examples run as written: every ``python`` block, and every ``bash`` block
that is not an installation or a long job with a test of its own (``--pdf``, ``bench``,
``reproduce``, ``torchrun``), in a fresh folder."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```(python|bash)\n(.*?)^```", README.read_text(), re.M | re.S)
LONG = ("pip install", "--pdf", "curvgap bench", "curvgap reproduce", "torchrun")
EXAMPLES = [(kind, code) for kind, code in BLOCKS
            if kind == "python" or not any(word in code for word in LONG)]


def test_the_readme_has_examples_to_run():
    assert sum(kind == "python" for kind, _ in EXAMPLES) >= 2
    assert any(kind == "bash" for kind, _ in EXAMPLES)


#: Examples that derive a config from scratch, or a layer's Hessian blocks for an operator or
#: a dataset, run with ``-m slow`` (CI).
SLOW = ("curvgap generate --config", "eigsh", "DataLoader")


@pytest.mark.parametrize("kind, code", [
    pytest.param(kind, code, marks=pytest.mark.slow) if any(w in code for w in SLOW)
    else (kind, code)
    for kind, code in EXAMPLES], ids=[f"{k}-{n}" for n, (k, _) in enumerate(EXAMPLES)])
def test_readme_example_runs(kind, code, tmp_path):
    command = [sys.executable, "-c", code] if kind == "python" else ["bash", "-ec", code]
    run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
