"""Every ``tq-warmup`` and ``python -m benchmarks.tqbench`` command the README and docs
show parses with today's command line: a renamed or dropped flag, a missing required
one or a wrong choice fails here. Commands a CPU can run as written also run: the
``--help`` ones here, and beside a real vLLM (``real_vllm``) every ``inspect`` of a model
config this repository holds. A program may be named by a path (``.venv/bin/tq-warmup``).
Placeholders (``...``, ``<...>``) are not commands; ``[--x]`` is
checked with and without the option, ``a|b`` once per alternative."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.tqbench import cli as bench_cli
from tq_warmup_plugin.cli import commands as cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "benchmarks/results/README.md",
]
PROGRAMS = {"tq-warmup": cli.build_parser, "python -m benchmarks.tqbench": bench_cli.build_parser}


def _fenced(text: str) -> Iterator[str]:
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("#", 1)[0].split("&&"):
                yield part.strip()


def _inline(text: str) -> Iterator[str]:
    for span in re.findall(r"`([^`\n]+)`", text):
        if " --" in span:  # a subcommand named alone is a reference, not a command
            yield span.strip()


def _variants(command: str) -> list[str]:
    """``[--x 1]`` with and without it; ``a|b|c`` in one word, each alternative."""
    optional = re.search(r"\[([^\]]+)\]", command)
    if optional:
        with_it = command.replace(optional.group(0), optional.group(1), 1)
        without = command.replace(optional.group(0), "", 1)
        return _variants(with_it) + _variants(without)
    words = command.split()
    for i, word in enumerate(words):
        if "|" in word and not word.startswith("-"):
            return [
                c
                for alt in word.split("|")
                for c in _variants(" ".join([*words[:i], alt, *words[i + 1 :]]))
            ]
    return [command]


def documented() -> list[tuple[str, str, list[str]]]:
    """(doc, program, argv) of every documented command of ours."""
    found: dict[tuple[str, str, tuple[str, ...]], None] = {}
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for command in [*_fenced(text), *_inline(text)]:
            if "..." in command or "<" in command:
                continue
            for variant in _variants(command):
                for program in PROGRAMS:
                    named = re.match(rf"(\S*/)?{re.escape(program)} ", variant)
                    if named:
                        argv = shlex.split(variant[named.end() :])
                        found[(str(doc.relative_to(ROOT)), program, tuple(argv))] = None
    return [(doc, program, list(argv)) for doc, program, argv in found]


COMMANDS = documented()


def test_the_docs_show_commands_of_both_programs() -> None:
    programs = {program for _, program, _ in COMMANDS}
    assert programs == set(PROGRAMS) and len(COMMANDS) >= 10


@pytest.mark.parametrize(("doc", "program", "argv"), COMMANDS, ids=lambda v: str(v)[:60])
def test_a_documented_command_parses(doc: str, program: str, argv: list[str]) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            PROGRAMS[program]().parse_args(argv)
        except SystemExit as exc:
            assert exc.code == 0, f"{doc}: `{program} {' '.join(argv)}`: {err.getvalue().strip()}"


def test_the_check_fails_on_a_drifted_command() -> None:
    """The check bites: a flag the command line lacks, and a missing required one."""
    for argv in (["verify", "--no-such-flag"], ["verify", "--cache-dir"]):
        with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit) as exc:
            cli.build_parser().parse_args(argv)
        assert exc.value.code == 2
    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit) as exc:
        bench_cli.build_parser().parse_args(["layer-check-cost"])  # --cache-dir is required
    assert exc.value.code == 2


def test_the_commands_a_cpu_runs_as_written_run(capsys: pytest.CaptureFixture[str]) -> None:
    helps = [(p, a) for _, p, a in COMMANDS if a[-1:] == ["--help"]]
    assert helps
    for program, argv in helps:
        with pytest.raises(SystemExit) as exc:
            PROGRAMS[program]().parse_args(argv)
        assert exc.value.code == 0 and "usage:" in capsys.readouterr().out


INSPECTS = [
    (doc, argv)
    for doc, program, argv in COMMANDS
    if program == "tq-warmup"
    and argv[:1] == ["inspect"]
    and "--model" in argv
    and (ROOT / argv[argv.index("--model") + 1]).exists()
]


def test_the_readme_shows_an_inspect_a_newcomer_can_run() -> None:
    assert any(doc == "README.md" for doc, _ in INSPECTS), INSPECTS


@pytest.mark.real_vllm
@pytest.mark.parametrize(("doc", "argv"), INSPECTS, ids=lambda v: str(v)[:60])
def test_a_documented_inspect_runs_as_written(
    doc: str, argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """From the repository root, as the README has a newcomer run it, against the
    installed vLLM (CPU): it plans, and prints the plan."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert cli.main(argv) == 0, f"{doc}: tq-warmup {' '.join(argv)}"
    out = capsys.readouterr().out
    assert re.match(r"\d+ distinct kernel keys for ", out), out[:300]


def test_the_settings_table_names_every_variable_the_package_reads() -> None:
    """Every ``TQ_WARMUP*`` name in the package's source, and ``TRITON_CACHE_MANAGER``,
    has a row in the README's settings table; the table names none the code lacks."""
    source = "\n".join(p.read_text() for p in (ROOT / "src" / "tq_warmup_plugin").rglob("*.py"))
    read = set(re.findall(r'"(TQ_WARMUP[A-Z0-9_]*)"', source)) | {"TRITON_CACHE_MANAGER"}
    rows = set(re.findall(r"^\| `([A-Z][A-Z0-9_]*)` \|", (ROOT / "README.md").read_text(), re.M))
    assert read - rows == set(), f"the README's settings table lacks {sorted(read - rows)}"
    assert {r for r in rows if r.startswith("TQ_WARMUP")} <= read, sorted(rows - read)
