"""The maps hold: ``docs/architecture.md`` names every module of the package and
``tests/README.md`` every test file, and neither names a file that is not there."""

from __future__ import annotations

import re
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
