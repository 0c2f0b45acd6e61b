"""The examples of the README and of the documentation's pages run as written: every
``python`` block, and every ``bash`` block that is not an installation or a long job with a
test of its own (``--pdf``, ``bench``, ``reproduce``, ``torchrun``), in a fresh folder."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "docs" / "guide").glob("*.md"))]
BLOCKS = [(page.relative_to(ROOT).as_posix(), kind, code) for page in PAGES
          for kind, code in re.findall(r"^```(python|bash)\n(.*?)^```", page.read_text(),
                                       re.M | re.S)]
LONG = ("pip install", "--pdf", "curvgap bench", "curvgap reproduce", "torchrun")
EXAMPLES = [(page, kind, code) for page, kind, code in BLOCKS
            if kind == "python" or not any(word in code for word in LONG)]


def test_the_pages_have_examples_to_run():
    assert any(page == "README.md" and kind == "python" for page, kind, _ in EXAMPLES)
    assert any(kind == "bash" for _, kind, _ in EXAMPLES)


#: Examples that derive a config from scratch, a layer's Hessian blocks for an operator or a
#: dataset, a language model's own loss, a whole model's Hessian or blocks across its layers,
#: two modules' formulas compared, and the GPU page (on a CPU, the quick start again) run
#: with ``-m slow`` (CI); the README's quick start runs in the quick run too.
SLOW = ("curvgap generate --config", "eigsh", "DataLoader", 'loss="model"', "inputs_embeds",
        'Model("digits_vit")', "torch.cuda", "formula_diff")


@pytest.mark.parametrize("kind, code", [
    pytest.param(kind, code, marks=pytest.mark.slow)
    if page != "README.md" and any(w in code for w in SLOW) else (kind, code)
    for page, kind, code in EXAMPLES],
    ids=[f"{page}-{kind}-{n}" for n, (page, kind, _) in enumerate(EXAMPLES)])
def test_example_runs(kind, code, tmp_path):
    command = [sys.executable, "-c", code] if kind == "python" else ["bash", "-ec", code]
    run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
