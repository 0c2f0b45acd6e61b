"""A LaTeX document compiled to PDF with ``pdflatex``, in a folder of its own (its ``.aux``,
``.log`` and ``.toc`` stay there); only the PDF comes out, whole or not at all."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from ... import output

INSTALL = "apt-get install texlive-latex-base texlive-latex-recommended"


class PdfError(RuntimeError):
    """pdflatex is missing (``missing``) or failed (the message ends with its log's end)."""

    def __init__(self, message: str, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing


def compile_pdf(text: str, pdf: Path) -> str:
    """Compile the document ``text`` into ``pdf`` (replaced in one step); pdflatex's log.
    :class:`PdfError` if pdflatex is missing or fails."""
    if shutil.which("pdflatex") is None:
        raise PdfError(f"pdf: compiling needs pdflatex, which is not installed (Debian: {INSTALL})",
                       missing=True)
    pdf = Path(pdf)
    if pdf.suffix != ".pdf":
        raise PdfError(f"pdf: expected a path ending in .pdf, got {str(pdf)!r}")
    with tempfile.TemporaryDirectory(prefix="curvgap-latex-") as work:
        (Path(work) / "document.tex").write_text(text, encoding="utf-8")
        for _ in range(2):  # the second run fills in the table of contents
            run = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error",
                                  "document.tex"], cwd=work, capture_output=True, text=True,
                                 errors="replace")
            if run.returncode:
                raise PdfError(f"pdflatex failed on the document for {pdf}:\n"
                               f"{run.stdout[-3000:]}")
        with output.replacing(pdf) as temporary:
            shutil.copyfile(Path(work) / "document.pdf", temporary)
    return run.stdout
