"""The path arguments of every command, checked before any work and before the heavy imports:
a config file that cannot be read, or an output folder that cannot be made or written, is a
:class:`~curvgap.derivations.config.ConfigError` or :class:`~curvgap.codegen.output.OutputError`
whose one line names the argument, what was expected and what was given."""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from pathlib import Path

from ..codegen import output
from ..codegen.resources import CONFIGS, shipped_configs
from ..derivations.config import ConfigError, load, read_table

#: a module's class as ``curvgap latex`` takes it: ``package.module:Class``
MODULE_SPEC = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def check(args: argparse.Namespace) -> None:
    """Check the path arguments of ``args.command``; ``bench`` and ``reproduce`` get their
    ``--out`` as a :class:`Path`."""
    if args.command == "generate":
        if args.out is not None:
            folder = _folder(args.out, "; leave --out out to write the package's generated/")
            if not args.check:
                output.check_switchable(folder)
        for given in args.config or ():
            _check_file(given, "--config", "a TOML file")
        if args.config:  # (validating a config may import SymPy, a model config torch)
            from ..models.model_config import is_model_table, validate_model
        for given in args.config or ():
            table = read_table(given)
            if is_model_table(table):
                validate_model(table, given)
            else:
                load(given)
    elif args.command == "latex":
        written = (".tex", ".pdf") if args.pdf else (".tex",)
        if ":" in args.name:  # a module, package.module:Class
            name = module_arguments(args)
            folder = _folder(args.out)
        else:
            for option, value in (("--args", args.args), ("--shape", args.shape)):
                if value is not None:
                    raise ConfigError(f"{option}: only for a module given as "
                                      f"package.module:Class, got NAME {args.name!r}")
            path = latex_path(args.name)
            folder = _folder(args.out)  # before reading the config (which imports SymPy)
            name = load(path).name
        output.check_files(folder, [name + suffix for suffix in written])
    elif args.command == "formula-diff":
        diff_arguments(args)
        folder = _folder(args.out)
        output.check_files(folder, ["formula_diff" + suffix for suffix in
                                    ((".tex", ".pdf") if args.pdf else (".tex",))])
    else:
        if args.command == "bench" and args.config not in _shipped():
            raise ConfigError(f"--config: expected a shipped config name "
                              f"({', '.join(_shipped())}), got {args.config!r}")
        args.out = _results_folder(args)


def latex_path(name: str, option: str = "NAME") -> Path:
    """The config file ``curvgap latex NAME`` typesets: the shipped config of that name, else
    the file ``NAME`` (the argument ``option``)."""
    if name in _shipped():
        return CONFIGS / f"{name}.toml"
    if not name.endswith(".toml") and not Path(name).exists():
        raise ConfigError(f"{option}: expected a shipped config name ({', '.join(_shipped())}) "
                          f"or a .toml file, got {name!r}")
    _check_file(name, option, "a shipped config name or a .toml file")
    return Path(name)


def module_arguments(args: argparse.Namespace) -> str:
    """Check ``curvgap latex package.module:Class --args JSON --shape B,L,d``: ``args.kwargs``
    becomes the constructor's keyword arguments (a JSON object, never evaluated as code) and
    ``args.shape`` the input's shape; the class's name (the document's) is returned."""
    _module_spec(args.name, "NAME")
    args.kwargs, args.shape = _kwargs(args.args, "--args"), _shape(args.shape)
    return args.name.rpartition(".")[2].rpartition(":")[2]


def diff_arguments(args: argparse.Namespace) -> None:
    """Check ``curvgap formula-diff A B``: each of ``A`` and ``B`` a module
    (``package.module:Class``, then ``args.kwargs_a``, ``args.kwargs_b`` its constructor's
    arguments: ``--args``, updated by ``--args-b`` for ``B``, and ``args.shape`` the input's
    shape) or a config (a shipped name or a TOML file, loaded)."""
    modules = [":" in spec for spec in (args.a, args.b)]
    if args.labels is not None:
        labels = args.labels.split(",")
        if len(labels) != 2 or not all(x.strip() for x in labels):
            raise ConfigError(f"--labels: expected two names separated by a comma, such as "
                              f"post-LN,pre-LN, got {args.labels!r}")
    for option, spec, module in (("A", args.a, modules[0]), ("B", args.b, modules[1])):
        if module:
            _module_spec(spec, option)
        else:
            load(latex_path(spec, option))
    if not modules[1] and args.args_b is not None:
        raise ConfigError(f"--args-b: only for B given as a module (package.module:Class), "
                          f"got the config {args.b!r}")
    if not any(modules):
        for option, value in (("--args", args.args), ("--args-b", args.args_b),
                              ("--shape", args.shape)):
            if value is not None:
                raise ConfigError(f"{option}: only for a module given as package.module:Class, "
                                  f"got configs {args.a!r} and {args.b!r}")
        return
    args.kwargs_a = _kwargs(args.args, "--args")
    args.kwargs_b = {**args.kwargs_a, **_kwargs(args.args_b, "--args-b")}
    args.shape = _shape(args.shape)


def _module_spec(spec: str, option: str) -> None:
    if not MODULE_SPEC.fullmatch(spec):
        raise ConfigError(f"{option}: expected a module as package.module:Class (dotted Python "
                          f"names), got {spec!r}")


def _kwargs(text: str | None, option: str) -> dict:
    """A constructor's keyword arguments given as a JSON object (never evaluated as code)."""
    try:
        kwargs = json.loads(text or "{}")
    except json.JSONDecodeError as error:
        raise ConfigError(f"{option}: expected the constructor's keyword arguments as a JSON "
                          f"object such as '{{\"d\": 8}}', got {text!r} ({error.msg})"
                          ) from None
    if not isinstance(kwargs, dict):
        raise ConfigError(f"{option}: expected a JSON object of keyword arguments, got {text!r}")
    return kwargs


def _shape(text: str | None) -> tuple[int, ...]:
    """A module's input shape given as ``B,L,D``."""
    if text is None:
        raise ConfigError("--shape: a module needs its input's shape, such as 2,8,16 (batch, "
                          "length, width), got none")
    parts = text.split(",")
    if not all(p.strip().isdigit() and int(p) >= 1 for p in parts) or len(parts) < 2:
        raise ConfigError(f"--shape: expected two or more positive integers separated by "
                          f"commas (batch first), such as 2,8,16, got {text!r}")
    return tuple(int(p) for p in parts)


def _shipped() -> list[str]:
    return [path.stem for path in shipped_configs()]


def _check_file(given: str, option: str, expected: str) -> None:
    """:class:`ConfigError` unless ``given`` names a file (what it holds is read apart)."""
    path = Path(given)
    if given.strip() == "":
        raise ConfigError(f"{option}: expected {expected}, got an empty string (an unset "
                          "variable?)")
    if path.is_dir():
        raise ConfigError(f"{option}: expected {expected}, got the folder {given!r}")
    if not path.exists():
        raise ConfigError(f"{option}: expected {expected}, got {given!r}, which does not "
                          "exist")


def _folder(given: str, hint: str = "") -> Path:
    """``--out``, checked (:func:`output.check_folder`)."""
    if given.strip() == "":
        raise output.OutputError(f"--out: expected a folder path, got an empty string (an "
                                 f"unset variable?){hint}")
    folder = Path(given)
    output.check_folder(folder)
    return folder


def _results_folder(args: argparse.Namespace) -> Path:
    """The ``--out`` of ``bench`` or ``reproduce``: a folder or a path where one can be made,
    none of the files the run writes there a symbolic link or a folder."""
    folder = _folder(args.out)
    _writable(folder)
    if args.command == "reproduce":
        from ..analysis.reproduce import FIGURES  # (its import builds a model)

        names = ["report.md", "report.json", *FIGURES.values()]
    elif args.distributed:
        names = ["distributed.json"]
    elif args.models:
        names = ["models.json"]
    elif args.accuracy:
        names = ["accuracy.json"]
    elif args.scale:
        names = ["scale.json"]
    else:
        names = ["bench.json", "bench.png"]
    output.check_files(folder, names)
    return folder


def _writable(folder: Path) -> None:
    """:class:`~curvgap.codegen.output.OutputError` unless ``folder`` can be made and a file
    written in it, tried now (permission bits do not tell, for root or /proc)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise output.OutputError(f"--out: expected a folder that can be made and written, got "
                                 f"{str(folder)!r} ({type(error).__name__}: "
                                 f"{error.strerror or error})") from None
