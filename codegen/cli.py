"""The ``curvgap`` command line: ``curvgap generate [--config FILE ...] [--out DIR]
[--check] [--force] [--no-verify]``."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

from ..derivations.config import ConfigError
from .generate import GenerationError, generate, load_configs, stale_files

VERIFY_DIMS = {"L": 3, "d": 6, "d_k": 4, "d_ff": 5}
TOLERANCE = 1e-10


def _load_module(path: Path):
    spec = importlib.util.spec_from_file_location(f"_curvgap_check_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _verify(paths: list[Path], configs: dict) -> bool:
    """Check each written module against torch.func and print a table."""
    from .verify import check_module

    print(f"\nverification against torch.func (float64, B = 2, sizes {VERIFY_DIMS}):")
    print(f"  {'module':<22}{'backend':<9}{'checks':>7}  {'max rel. error':>15}  worst")
    ok = True
    for path in paths:
        config = configs[path.stem]
        errors = check_module(config, _load_module(path), path.parent.name, VERIFY_DIMS)
        worst = max(errors, key=errors.get)
        passed = errors[worst] <= TOLERANCE
        ok &= passed
        print(f"  {path.stem:<22}{path.parent.name:<9}{len(errors):>7}  {errors[worst]:>15.2e}"
              f"  {worst}{'' if passed else '  FAILED'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="curvgap", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="derive and write generated modules")
    gen.add_argument("--config", action="append", metavar="FILE",
                     help="a config to generate (repeatable; default: every shipped config)")
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
    bench.add_argument("--out", metavar="DIR", default="bench-results",
                       help="where bench.json and bench.png go (default: bench-results/)")
    args = parser.parse_args(argv)

    if args.command == "bench":
        from ..benchmarks.suite import run

        run(args.config, args.quick, Path(args.out))
        return 0

    start = time.perf_counter()
    try:
        if args.check:
            print("checking generated files:")
            problems = stale_files(args.config, args.out)
            for path, state in problems:
                print(f"  {path}: {state}", file=sys.stderr)
            if problems:
                print(f"{len(problems)} generated file(s) are not up to date; run "
                      "`curvgap generate` (hand-edited files need --force)", file=sys.stderr)
                return 1
            print(f"all generated files are up to date ({time.perf_counter() - start:.1f} s)")
            return 0
        print("deriving and generating:")
        written = generate(args.config, args.out, args.force)
        print(f"wrote {len(written)} files in {time.perf_counter() - start:.1f} s:")
        for path in written:
            print(f"  {path}")
        if not args.no_verify:
            configs = {c.name: c for c in load_configs(args.config)}
            if not _verify(written, configs):
                print("verification FAILED", file=sys.stderr)
                return 1
        return 0
    except (ConfigError, GenerationError) as error:
        print(f"curvgap: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
