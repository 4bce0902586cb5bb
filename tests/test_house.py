"""House rules for the package's own text, read from the files (no import of vLLM).

Lab notes stay out of the code: benchmark run letters and session numbers go to
``benchmarks/results/`` and the commit log. A docstring that restates a gate's releases
goes stale when ``NEWEST`` moves: one that names a gate still on in ``NEWEST`` must not
end its range at the release before.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

from tq_warmup_plugin.compat import NEWEST, Features, features

SRC = Path(__file__).resolve().parents[1] / "src" / "tq_warmup_plugin"

RUN_LETTERS = re.compile(r"\b[Rr]uns?\s+[A-Z]{1,2}(?![\w.])")
"""``run AX``, ``runs AY-BA``, ``(run BD)``; not ``runs V2``, ``run FA2``, ``run sm90``."""
SESSIONS = re.compile(r"\bsessions?\s+\d+", re.IGNORECASE)

PREVIOUS = f"{NEWEST[0]}.{NEWEST[1] - 1}"
_P = re.escape(PREVIOUS)
RANGE_TO_PREVIOUS = re.compile(rf"\b\d+\.\d+\s*[-\u2013]\s*{_P}(?!\d|[.:]\d)")
"""``0.21-0.33``; not ``0.21-0.33:120`` (lines of a file) nor ``0.21-0.334``."""
UP_TO_PREVIOUS = re.compile(rf"\b(?:up to|through|until|till)\s+{_P}(?!\d|[.:]\d)", re.IGNORECASE)
"""``up to 0.33``: a range by its end, never a citation of a file's lines."""

ON_IN_NEWEST = frozenset(
    gate
    for gate in Features._fields[1:]
    if getattr(features(NEWEST), gate) and getattr(features((NEWEST[0], NEWEST[1] - 1)), gate)
)
"""The gates on in the release before ``NEWEST`` and in ``NEWEST``."""


def _sources() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def lab_notes(text: str) -> list[tuple[int, str]]:
    """(line, match) of every run letter or session number in ``text``."""
    return sorted(
        (_line(text, m.start()), " ".join(m.group(0).split()))
        for rx in (RUN_LETTERS, SESSIONS)
        for m in rx.finditer(text)
    )


def _prose(text: str) -> Iterator[tuple[int, str]]:
    """(first line, text) of each docstring paragraph and each block of comments."""
    tree = ast.parse(text)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for i, stmt in enumerate(body):
            # A docstring, or the string after an assignment (an attribute's docstring).
            first = i == 0 and isinstance(
                node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
            )
            after = i > 0 and isinstance(body[i - 1], (ast.Assign, ast.AnnAssign))
            if (
                (first or after)
                and isinstance(stmt, ast.Expr)
                and isinstance(stmt.value, ast.Constant)
                and isinstance(stmt.value.value, str)
            ):
                line = stmt.lineno
                for para in stmt.value.value.split("\n\n"):
                    yield line, para
                    line += para.count("\n") + 2
    block: list[str] = []
    start = 0
    last = -1
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type != tokenize.COMMENT:
            continue
        row = tok.start[0]
        if row != last + 1 and block:
            yield start, "\n".join(block)
            block = []
        if not block:
            start = row
        block.append(tok.string.lstrip("# "))
        last = row
    if block:
        yield start, "\n".join(block)


def stale_ranges(text: str, guard: bool = False) -> list[tuple[int, str]]:
    """(line, range) of every range that ends at the release before ``NEWEST`` where it is
    a gate's own: said as "up to" that release, or in a paragraph that names a gate still
    on in ``NEWEST``, or anywhere in a ``guard`` module whose gate is."""
    found = []
    gated = guard and any(re.search(rf"\b{gate}\b", text) for gate in ON_IN_NEWEST)
    for line, para in _prose(text):
        named = {word for word in re.findall(r"\w+", para) if word in ON_IN_NEWEST}
        hits = list(UP_TO_PREVIOUS.finditer(para))
        if named or gated:
            hits += RANGE_TO_PREVIOUS.finditer(para)
        for m in hits:
            found.append((line + para.count("\n", 0, m.start()), m.group(0)))
    return sorted(found)


def test_no_run_letters_or_session_numbers_in_src() -> None:
    found = [
        f"{path.relative_to(SRC)}:{line}: {hit}"
        for path in _sources()
        for line, hit in lab_notes(path.read_text(encoding="utf-8"))
    ]
    assert not found, (
        "lab notes in the code: say what and why, with one sentence of evidence and a "
        "pointer to the record (benchmarks/results/...); the runs stay there:\n" + "\n".join(found)
    )


def test_no_gate_range_ending_before_newest_in_src() -> None:
    found = [
        f"{path.relative_to(SRC)}:{line}: {hit}"
        for path in _sources()
        for line, hit in stale_ranges(
            path.read_text(encoding="utf-8"), path.parent.name == "guards"
        )
    ]
    assert not found, (
        f"a gate's range restated as ending at {PREVIOUS} while the gate runs to "
        f"{NEWEST[0]}.{NEWEST[1]}: name the gate (compat.Features.<gate>) instead:\n"
        + "\n".join(found)
    )


@pytest.mark.parametrize(
    "text",
    [
        "(H100, 0.26.0, serve-jit run AZ)",
        "runs AY-BA",
        "(run BD)",
        "serve-jit runs\n    BD and BE",
        "Run AX: the hybrid",
        "until session 23 the child",
        "Sessions 24",
    ],
)
def test_lab_notes_are_found(text: str) -> None:
    assert lab_notes(text)


@pytest.mark.parametrize(
    "text",
    [
        "FA2 runs its split-KV kernel",
        "the V2 runner runs V1's sampler",
        "a worker runs V2",
        "run sm90 kernels",
        "the host runs it",
        "CI runs the release",
        "run A.B",
        "a session of vLLM",
    ],
)
def test_plain_text_is_no_lab_note(text: str) -> None:
    assert not lab_notes(text)


def test_stale_ranges_need_a_gate_or_up_to() -> None:
    gate = sorted(ON_IN_NEWEST)[0]
    assert stale_ranges(f'"""Unmerged in every release up to {PREVIOUS}."""\n')
    assert stale_ranges(f'"""Wrong tokens (0.21-{PREVIOUS}, ``{gate}``)."""\n')
    assert stale_ranges(f"x = 1\n# 0.21-{PREVIOUS}: ``{gate}``\n")
    # A range of a file's lines, a gate that ended, a paragraph without a gate: none.
    assert not stale_ranges(f'"""``{gate}``, ``utils.py`` 0.30:120-{PREVIOUS}:616."""\n')
    assert not stale_ranges(f'"""The V1 runner (0.20-{PREVIOUS})."""\n')
    assert not stale_ranges(f'"""``{gate}``.\n\nThe V1 runner (0.20-{PREVIOUS})."""\n')
    # A guard module whose gate runs to NEWEST: any range of it ends there.
    guard = f'"""The host copies (0.21-{PREVIOUS})."""\nneeded = lambda f: f.{gate}\n'
    assert stale_ranges(guard, guard=True) and not stale_ranges(guard)


def test_the_readme_s_vllm_venv_is_ignored_by_git_and_docker() -> None:
    root = SRC.parents[1]
    recipes = re.findall(r"vllm-env\.sh \S+ \S+ (\S+)", (root / "README.md").read_text())
    assert recipes, "the README's CPU recipe names no vLLM venv"
    for name in (".gitignore", ".dockerignore"):
        rules = (root / name).read_text().splitlines()
        for venv in recipes:
            assert f"{venv.rstrip('/')}/" in rules, f"{name} does not ignore {venv}/"


def test_one_recommended_release() -> None:
    """``compat.RECOMMENDED`` is the newest release, the one CI runs first with its Triton."""
    from tq_warmup_plugin import compat

    root = SRC.parents[1]
    assert compat.parse_version(compat.RECOMMENDED) == NEWEST
    first = (root / ".ci" / "vllm-releases").read_text().split("\n", 1)[0].split()
    assert first == [compat.RECOMMENDED, compat.RECOMMENDED_TRITON]
