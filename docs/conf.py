"""Sphinx configuration of curvgap's documentation site.

Build it from the repository root, offline, with warnings as errors (as CI does)::

    pip install -e ".[docs]" && sphinx-build -W --keep-going -b html docs docs/_build/html

Pages are Markdown (MyST); the example gallery is sphinx-gallery's, built by executing every
``examples/plot_*.py``; the API reference is autodoc over the docstrings of the public surface.
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))

project = "curvgap"
author = "the curvgap developers"
copyright = "2026, the curvgap developers"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.mathjax",
    "sphinx_gallery.gen_gallery",
    "curvgap_tables",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_generated", "auto_examples/*.ipynb", "auto_examples/*.py",
                    "auto_examples/*.zip", "auto_examples/*.md5", "reproduce/*.json"]
myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "undoc-members": False}

sphinx_gallery_conf = {
    "examples_dirs": str(DOCS.parent / "examples"),
    "gallery_dirs": str(DOCS / "auto_examples"),
    # every tutorial runs; the torchrun script is a program to launch, shown in its page
    "filename_pattern": r"/plot_",
    "ignore_pattern": r"digits_vit_top_eigenvalue\.py",
    "download_all_examples": False,
    "abort_on_example_error": True,
    "remove_config_comments": True,
    "matplotlib_animations": False,
    "plot_gallery": "True",
    "within_subsection_order": "FileNameSortKey",
}

html_theme = "furo"
html_title = "curvgap"
html_static_path: list[str] = []
