"""The commands of ``curvgap`` (see :mod:`curvgap.cli`): the parser, ``main`` and each
command's run."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from .._extras import MissingExtra, missing
from ..codegen import output
from ..derivations.config import ConfigError
from .arguments import check, latex_path


def _latex(name: str, out: str, pdf: bool) -> int:
    """``curvgap latex NAME``: write ``OUT/NAME.tex`` and, with ``--pdf``, compile it (the
    paths checked already, :mod:`.arguments`)."""
    from ..codegen.backends import latex
    from ..codegen.generate import GenerationError, is_shipped_folder, render
    from ..codegen.resources import GENERATED, shipped_configs
    from ..derivations.config import load
    from ..derivations.derivation import derive

    try:
        config = load(latex_path(name))
        out = Path(out)
        shipped = {p.stem: p for p in shipped_configs()}
        if is_shipped_folder(out, GENERATED / "latex") and config.name in shipped and \
                load(shipped[config.name]) != config:
            raise GenerationError(f"NAME: {config.name!r} is a shipped config's name, and this "
                                  f"config differs from it: writing it into {out} would "
                                  "replace the shipped document; rename it or choose another "
                                  "--out")
        out.mkdir(parents=True, exist_ok=True)
        tex = out / f"{config.name}.tex"
        output.write_file(tex, render(derive(config), latex.BACKEND))
    except (GenerationError, output.OutputError, OSError) as error:
        print(f"curvgap: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {tex}")
    return _pdf(tex) if pdf else 0


def _latex_module(spec: str, kwargs: dict, shape: tuple[int, ...], out: str, pdf: bool) -> int:
    """``curvgap latex package.module:Class``: build the module (float64, eval mode), read it
    on a random input of ``shape`` and write ``OUT/Class.tex`` (and, with ``--pdf``, the PDF)."""
    from .. import adapters

    module = _module(spec, kwargs)
    if isinstance(module, int):
        return module
    tex = Path(out) / f"{spec.rpartition(':')[2].rpartition('.')[2]}.tex"
    Path(out).mkdir(parents=True, exist_ok=True)
    try:
        output.write_file(tex, adapters.curvature(module).latex(_input(shape)))
    except (adapters.UnsupportedLayer, adapters.UnsupportedOperation, ValueError,
            output.OutputError, OSError) as error:
        print(f"curvgap: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {tex}")
    return _pdf(tex) if pdf else 0


def _formula_diff(args: argparse.Namespace) -> int:
    """``curvgap formula-diff A B``: what changes in the formulas from ``A`` to ``B`` (modules
    or configs), written to ``OUT/formula_diff.tex`` (and, with ``--pdf``, the PDF)."""
    from .. import adapters
    from ..adapters.comparison import formula_diff

    sources = []
    for name, spec, kwargs, option in (
            ("A", args.a, getattr(args, "kwargs_a", {}), "--args"),
            ("B", args.b, getattr(args, "kwargs_b", {}),
             "--args-b" if args.args_b is not None else "--args")):
        source = _module(spec, kwargs, name, option) if ":" in spec else spec
        if isinstance(source, int):
            return source
        sources.append(source)
    X = _input(args.shape) if isinstance(args.shape, tuple) else None
    labels = tuple(x.strip() for x in args.labels.split(",")) if args.labels else None
    tex = Path(args.out) / "formula_diff.tex"
    try:
        text = formula_diff(*sources, X, labels)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        output.write_file(tex, text)
    except (adapters.UnsupportedLayer, adapters.UnsupportedOperation, ValueError,
            output.OutputError, OSError) as error:
        print(f"curvgap: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {tex}")
    return _pdf(tex) if args.pdf else 0


def _module(spec: str, kwargs: dict, name: str = "NAME", option: str = "--args") -> Any:
    """The module class ``spec`` (the argument ``name``: ``package.module:Class``, imported
    from the current folder too) built with ``kwargs`` (the option ``option``) in float64
    and eval mode; an exit status after saying why where it cannot be."""
    import importlib

    import torch

    where, _, qualname = spec.partition(":")
    if os.getcwd() not in sys.path:  # a module of the current folder, as `python -m` finds it
        sys.path.insert(0, os.getcwd())
    try:
        found = importlib.import_module(where)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as error:
        print(f"curvgap: error: {name}: cannot find {spec!r}: {error}", file=sys.stderr)
        return 2
    except Exception as error:  # the user's module failed while importing
        print(f"curvgap: error: {name}: importing {where!r} failed: {type(error).__name__}: "
              f"{error}", file=sys.stderr)
        return 2
    if not (isinstance(found, type) and issubclass(found, torch.nn.Module)):
        print(f"curvgap: error: {name}: expected a torch.nn.Module class, got {spec!r}, which "
              f"is {type(found).__name__}", file=sys.stderr)
        return 2
    try:
        return found(**kwargs).to(torch.float64).eval()
    except Exception as error:  # the user's constructor, whatever it raises
        print(f"curvgap: error: {option}: {qualname}(**{kwargs}) failed: "
              f"{type(error).__name__}: {error}", file=sys.stderr)
        return 2


def _input(shape: tuple[int, ...]) -> Any:
    """A module's float64 input of ``shape`` (seeded: the same every run)."""
    import torch

    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))


def _pdf(tex: Path) -> int:
    """Compile ``tex`` beside itself; the exit status."""
    from ..codegen.backends.latex.pdf import PdfError, compile_pdf

    try:
        compile_pdf(tex.read_text(encoding="utf-8"), tex.with_suffix(".pdf"))
    except PdfError as error:
        print(f"curvgap: error: {error}", file=sys.stderr)
        return 2 if error.missing else 1
    print(f"wrote {tex.with_suffix('.pdf')}")
    return 0


def _parser() -> argparse.ArgumentParser:
    """The command line: one subcommand per job."""
    parser = argparse.ArgumentParser(
        prog="curvgap",
        description="Exact Jacobians and Hessians of Transformer layers: generate the modules "
                    "and documents, typeset one document, benchmark, reproduce the paper's "
                    "analyses. Run 'curvgap COMMAND --help' for the options of each command.")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="derive and write generated modules")
    gen.add_argument("--config", action="append", metavar="FILE",
                     help="a config to generate, or a model config (its sublayers' "
                          "modules, and the model verified; repeatable; default: every "
                          "shipped config)")
    gen.add_argument("--out", metavar="DIR", help="output folder (default: generated/)")
    gen.add_argument("--check", action="store_true",
                     help="write nothing; fail if a file is missing, stale or hand-edited")
    gen.add_argument("--force", action="store_true", help="overwrite hand-edited files")
    gen.add_argument("--no-verify", action="store_true",
                     help="skip the numerical check of the written modules")
    bench = commands.add_parser("bench", help="time generated code against torch.func "
                                              "and curvlinops")
    bench.add_argument("--config", default="paper_block", help="a shipped config name")
    bench.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (a smoke test)")
    bench.add_argument("--scale", action="store_true",
                       help="the HVP, Gauss–Newton product, diagonal, structured block and "
                            "dense-block memory from the headline size to GPT-2 width")
    bench.add_argument("--accuracy", action="store_true",
                       help="the errors of torch.func's and curvlinops' Hessian products "
                            "on common Transformer layers, beside curvgap's")
    bench.add_argument("--models", action="store_true",
                       help="whole models at real size (GPT-2 small, a Llama layer at hidden "
                            "2048, ViT-B/16) against autograd: time, memory, agreement, the "
                            "top eigenvalue")
    bench.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                       help="where --models runs (default: cpu)")
    bench.add_argument("--fused", action="store_true",
                       help="with --models or --scale: curvgap's code through torch.compile "
                            "too (fused=True; compiled in each row's warm-up)")
    bench.add_argument("--distributed", action="store_true",
                       help="curvature over the digits ViT's training set on 1 and 2 "
                            "processes (torch.distributed, gloo on 127.0.0.1)")
    bench.add_argument("--out", metavar="DIR", default="bench-results",
                       help="where bench.json and bench.png go (default: bench-results/)")
    latex = commands.add_parser("latex", help="write one config's or module's formulas as a "
                                              "LaTeX document")
    latex.add_argument("name", help="a shipped config name, a config file, or a module's class "
                                    "as package.module:Class (with --args and --shape)")
    latex.add_argument("--args", metavar="JSON",
                       help="a module's constructor arguments, a JSON object ('{\"d\": 8}')")
    latex.add_argument("--shape", metavar="B,L,D",
                       help="a module's input shape, batch first (a float64 input)")
    latex.add_argument("--out", metavar="DIR", default=".",
                       help="where <name>.tex (and .pdf) go (default: the current folder)")
    latex.add_argument("--pdf", action="store_true", help="also compile it with pdflatex")
    diff = commands.add_parser("formula-diff", help="what changes in the formulas from one "
                                                    "block to another, side by side (LaTeX)")
    diff.add_argument("a", metavar="A", help="the first block: a shipped config name, a config "
                                            "file, or a module's class as package.module:Class")
    diff.add_argument("b", metavar="B", help="the second block, as A")
    diff.add_argument("--args", metavar="JSON",
                      help="the modules' constructor arguments, a JSON object")
    diff.add_argument("--args-b", metavar="JSON",
                      help="B's arguments that differ from --args ('{\"norm_first\": true}')")
    diff.add_argument("--shape", metavar="B,L,D",
                      help="the modules' input shape, batch first (a float64 input)")
    diff.add_argument("--labels", metavar="A,B", help="the two columns' headings")
    diff.add_argument("--out", metavar="DIR", default=".",
                      help="where formula_diff.tex (and .pdf) go (default: the current folder)")
    diff.add_argument("--pdf", action="store_true", help="also compile it with pdflatex")
    reproduce = commands.add_parser("reproduce", help="the paper's analyses: bounds, Hessian "
                                                      "structure, scaling, convergence")
    reproduce.add_argument("--quick", action="store_true", help="small sizes (under 2 minutes)")
    reproduce.add_argument("--out", metavar="DIR", default="reproduce-results",
                           help="where the figures and report go (default: reproduce-results/)")
    return parser


def _generate(args: argparse.Namespace) -> int:
    """``curvgap generate``: write (or, with ``--check``, check) the generated files and
    verify the written modules."""
    from ..codegen.backends import MODULE_BACKENDS
    from ..codegen.generate import (
        GenerationError,
        generate,
        load_configs,
        output_folder,
        relative_path,
        stale_files,
    )
    from .verification import split_models, verify

    start = time.perf_counter()
    try:
        paths, models = split_models(args.config)  # a model config: its sublayers' modules
        if args.check:
            print("checking generated files:")
            problems = stale_files(paths, args.out)
            for path, state in problems:
                print(f"  {path}: {state}", file=sys.stderr)
            if problems:
                print(f"{len(problems)} generated file(s) are not up to date; run "
                      "`curvgap generate` (hand-edited files need --force)", file=sys.stderr)
                return 1
            print(f"all generated files are up to date ({time.perf_counter() - start:.1f} s)")
            return 0
        print("deriving and generating:")
        written = generate(paths, args.out, args.force)
        if written:
            print(f"wrote {len(written)} files in {time.perf_counter() - start:.1f} s:")
            for path in written:
                print(f"  {path}")
        else:
            print(f"nothing changed: every file is current ({time.perf_counter() - start:.1f} s)")
        if not args.no_verify:
            folder = output_folder(args.out)
            configs = {c.name: c for c in load_configs(paths, folder)}
            modules = [folder / relative_path(c, b) for c in configs.values()
                       for b in MODULE_BACKENDS]
            if not verify(modules, configs, models):
                print("verification FAILED", file=sys.stderr)
                return 1
            print(f"done in {time.perf_counter() - start:.1f} s")
        return 0
    except (ConfigError, GenerationError) as error:
        print(f"curvgap: error: {error}", file=sys.stderr)
        return 2


def needs(args: argparse.Namespace) -> tuple[tuple[str, ...], str, str]:
    """The optional packages (import names) the command of ``args`` needs, the command in
    words and the extra that installs them."""
    if args.command == "reproduce":
        return ("matplotlib", "scipy", "sklearn"), "curvgap reproduce", "analysis"
    if args.command != "bench" or args.accuracy or args.scale:
        return (), "", ""
    if args.distributed:  # the digits ViT of curvgap.analysis (its spectra use scipy)
        return ("sklearn", "scipy"), "curvgap bench --distributed", "analysis"
    if args.models:
        return ("transformers",), "curvgap bench --models", "transformers"
    return ("matplotlib",), "curvgap bench", "bench"


def torch_cuda() -> bool:
    """Whether torch sees a GPU (imports torch)."""
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    """Run the ``curvgap`` command line; the exit status (0 ok, 1 failed, 2 bad input). The
    optional packages a command needs and its path arguments are checked before any work,
    a missing one or a bad one stopping it with one line (:mod:`.arguments`); ``--help``
    imports neither torch nor SymPy."""
    args = _parser().parse_args(argv)
    if args.command == "bench" and args.device == "cuda" and not args.models:
        print("curvgap: error: --device cuda: expected --models with it (the other bench "
              "modes run on the CPU)", file=sys.stderr)
        return 2
    if args.command == "bench" and args.fused and not (args.models or args.scale):
        print("curvgap: error: --fused: expected --models or --scale with it (the tables it "
              "adds fused routes to)", file=sys.stderr)
        return 2
    try:
        absent = missing(*needs(args))
        if absent:
            raise MissingExtra(absent)
        check(args)
        return _run(args)
    except (MissingExtra, ConfigError, output.OutputError) as error:
        print(f"curvgap: error: {error}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    """The command of ``args``, its arguments checked."""
    if args.command == "bench" and args.accuracy:
        from ..benchmarks.accuracy import run_accuracy

        run_accuracy(args.out)
        return 0
    if args.command == "bench" and args.distributed:
        from ..benchmarks.distributed import run_distributed

        run_distributed(args.quick, args.out)
        return 0
    if args.command == "bench" and args.models:
        from ..benchmarks.models import run_models

        if args.device == "cuda" and not torch_cuda():
            print("curvgap: error: --device cuda: expected a GPU that torch can use, got none "
                  "(torch.cuda.is_available() is False)", file=sys.stderr)
            return 2
        run_models(args.quick, args.out, args.device, args.fused)
        return 0
    if args.command == "bench" and args.scale:
        from ..benchmarks.scale import run_scale

        run_scale(args.config, args.quick, args.out, fused=args.fused)
        return 0
    if args.command == "bench":
        from ..benchmarks.suite import run

        run(args.config, args.quick, args.out)
        return 0
    if args.command == "reproduce":
        from ..analysis.reproduce import run as reproduce_run

        reproduce_run(args.quick, args.out)
        return 0
    if args.command == "formula-diff":
        return _formula_diff(args)
    if args.command == "latex":
        if ":" in args.name:
            return _latex_module(args.name, args.kwargs, args.shape, args.out, args.pdf)
        return _latex(args.name, args.out, args.pdf)
    return _generate(args)


if __name__ == "__main__":
    sys.exit(main())
