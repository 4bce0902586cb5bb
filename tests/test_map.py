"""The maps hold: ``docs/architecture.md`` names every module of the package and
``tests/README.md`` every test file, and neither names a file that is not there."""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import re
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "tq_warmup_plugin"
TESTS = ROOT / "tests"
NAMED = re.compile(r"`([\w/]+\.py)`")


def _section(text: str, heading: str) -> str:
    body = text.split(f"\n{heading}\n", 1)[1]
    return body.split("\n## ", 1)[0]


def package_modules() -> set[str]:
    """Every module, by its path in the package; a folder's ``__init__.py`` is its row."""
    found = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")}
    return {m for m in found if m == "__init__.py" or not m.endswith("/__init__.py")}


def test_the_architecture_map_names_every_module_and_only_modules() -> None:
    named = set(NAMED.findall(_section((ROOT / "docs/architecture.md").read_text(), "## The map")))
    named = {n for n in named if not n.startswith("tests/")}
    modules = package_modules()
    assert modules - named == set(), "modules the map does not name"
    assert named - modules == set(), "the map names modules that are not there"


def test_the_tests_map_names_every_test_file_and_only_test_files() -> None:
    named = {n.removeprefix("tests/") for n in NAMED.findall((TESTS / "README.md").read_text())}
    # the modules a test covers, the package's or the benchmarks'
    named = {n for n in named if not (PACKAGE / n).is_file() and not (ROOT / n).is_file()}
    files = {p.relative_to(TESTS).as_posix() for p in TESTS.rglob("*.py")}
    assert files - named == set(), "test files tests/README.md does not name"
    assert named - files == set(), "tests/README.md names files that are not there"


def test_at_most_twelve_modules_sit_at_the_top_level() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 12, top


PROBE_IMPORT = re.compile(
    r"from (tq_warmup_plugin[\w.]*) import ([\w, ]+)|import (tq_warmup_plugin[\w.]*)"
)


def test_every_plugin_import_in_a_probe_string_resolves() -> None:
    """The code benchmarks and tests run in a fresh interpreter (``python -c`` probes)
    imports the plugin by today's module paths: a moved module fails here, not on a GPU."""
    missing = []
    for path in sorted([*(ROOT / "benchmarks").rglob("*.py"), *TESTS.rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                continue
            for found in PROBE_IMPORT.finditer(node.value):
                base, names, module = found.groups()
                wanted = (
                    [module] if module else [f"{base}.{n.split()[0]}" for n in names.split(",")]
                )
                missing += [
                    f"{path.name}:{node.lineno}: {name}" for name in wanted if not _resolves(name)
                ]
    assert missing == []


def _resolves(name: str) -> bool:
    """A module, or a name a module defines."""
    with warnings.catch_warnings():  # the old engine path warns
        warnings.simplefilter("ignore", DeprecationWarning)
        with contextlib.suppress(ImportError):
            if importlib.util.find_spec(name) is not None:
                return True
        parent, _, attribute = name.rpartition(".")
        try:
            return hasattr(importlib.import_module(parent), attribute)
        except ImportError:
            return False


MAX_LINES = 500


def test_no_module_over_five_hundred_lines() -> None:
    sizes = {
        path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines())
        for top in (ROOT / "src", ROOT / "benchmarks")
        for path in top.rglob("*.py")
    }
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}
