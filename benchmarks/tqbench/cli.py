"""The command line: one subcommand per module that exposes ``add_parser(subparsers)``.

Each module's parser sets ``func=`` (called with the parsed arguments; its int is the
exit code). Nothing here imports vLLM or torch: ``run`` imports them when it runs.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = [
    "COMMAND_MODULES",
    "PACKAGE",
    "Option",
    "add_options",
    "build_parser",
    "command_modules",
    "main",
    "new_parser",
]

# (flag, default, help): the type comes from the default; False is a switch.
Option = tuple[str, Any, str]

PACKAGE = "benchmarks.tqbench"
# The modules that add a subcommand, in --help order. Each must import: a module that
# does not is an error that names it, never a subcommand silently missing from --help.
COMMAND_MODULES = (
    "run",
    "matrix",
    "collect",
    "spec",
    "shipped",
    "register_cost",
    "ahead_cost",
    "warm_cost",
    "layer_check_cost",
    "gemm_shapes",
    "driver_cache_proof",
    "tokens",
    "serve_prefix",
    "serve_jit",
    "kv_reserve",
    "free_guards",
)


def command_modules(names: Sequence[str] = COMMAND_MODULES) -> list[ModuleType]:
    """The modules of :data:`COMMAND_MODULES`, imported; ImportError names the one that failed."""
    found = []
    for name in names:
        full = f"{PACKAGE}.{name}"
        try:
            found.append(importlib.import_module(full))
        except ImportError as e:
            raise ImportError(f"tqbench: the command module {full} does not import: {e}") from e
    return found


def new_parser(subparsers: Any, name: str, summary: str, doc: str | None) -> Any:
    """A subcommand's parser: ``summary`` in the list of commands, ``doc`` under its --help."""
    return subparsers.add_parser(
        name, help=summary, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def add_options(parser: argparse.ArgumentParser, options: Sequence[Option]) -> None:
    """Add each ``(flag, default, help)``: ``False`` is a switch, else typed as the default."""
    for flag, default, text in options:
        if default is False:
            parser.add_argument(flag, action="store_true", help=text)
        else:
            parser.add_argument(flag, type=type(default), default=default, help=text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.tqbench",
        description="First-request latency of vLLM with a TurboQuant KV cache, with and "
        "without tq-warmup. Run from the repository root.",
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    for module in command_modules():
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.func(args)
    return result
