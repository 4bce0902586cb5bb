"""TQ_WARMUP* environment parsing."""

from __future__ import annotations

import os
from pathlib import Path

import fakes
import pytest

from tq_warmup_plugin import settings
from tq_warmup_plugin.settings import DEFAULT_THREADS, Settings, load, parse


@pytest.fixture(autouse=True)
def cpus(monkeypatch: pytest.MonkeyPatch) -> int:
    """16 CPUs, whatever this machine has (the thread cap reads ``cpu_count()``)."""
    monkeypatch.setattr(settings, "cpu_count", lambda: 16)
    return 16


def test_defaults() -> None:
    assert load({}) == Settings(
        enabled=True, strict=False, report_path=None, threads=DEFAULT_THREADS, launch=True
    )
    assert 1 <= DEFAULT_THREADS <= 4
    assert parse({}) == (Settings(), [])


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_cpu_count_is_this_process_s() -> None:
    """A process pinned to one CPU (``taskset``, a container's cpuset) counts one, and
    compiles serially by default, however many the machine has."""
    code = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
        "from tq_warmup_plugin import settings\n"
        "print(settings.cpu_count(), settings.DEFAULT_THREADS, os.cpu_count())\n"
    )
    pinned, threads, machine = map(int, fakes.fresh_python(code).split())
    assert (pinned, threads) == (1, 1)
    assert machine == os.cpu_count()  # the machine's count, which the pin must not use


@pytest.mark.parametrize(
    ("raw", "launch"), [("0", False), ("off", False), ("1", True), ("", True), (" ON ", True)]
)
def test_launch(raw: str, launch: bool) -> None:
    assert parse({"TQ_WARMUP_LAUNCH": raw}) == (Settings(launch=launch), [])


@pytest.mark.parametrize("raw", ["0", "false", "FALSE", "Off", "no", " No "])
def test_tq_warmup_disables(raw: str) -> None:
    assert parse({"TQ_WARMUP": raw}) == (Settings(enabled=False), [])


@pytest.mark.parametrize("raw", ["1", "true", "YES", "on", ""])
def test_tq_warmup_stays_enabled(raw: str) -> None:
    assert parse({"TQ_WARMUP": raw}) == (Settings(enabled=True), [])


@pytest.mark.parametrize(
    ("raw", "strict"), [("1", True), ("True", True), ("on", True), ("0", False), ("", False)]
)
def test_strict(raw: str, strict: bool) -> None:
    assert parse({"TQ_WARMUP_STRICT": raw}) == (Settings(strict=strict), [])


@pytest.mark.parametrize(
    ("name", "raw", "field", "default"),
    [
        ("TQ_WARMUP", "disable", "enabled", "on"),
        ("TQ_WARMUP", "garbage", "enabled", "on"),
        ("TQ_WARMUP", " ", "enabled", "on"),
        ("TQ_WARMUP_STRICT", "y", "strict", "off"),
        ("TQ_WARMUP_STRICT", "maybe", "strict", "off"),
        ("TQ_WARMUP_LAUNCH", "maybe", "launch", "on"),
        ("TQ_WARMUP_LAUNCH", "disabled", "launch", "on"),
        ("TQ_WARMUP_SPEC_GUARD", "nope", "spec_guard", "on"),
    ],
)
def test_an_unrecognised_flag_keeps_the_default_and_says_so(
    name: str, raw: str, field: str, default: str
) -> None:
    got, problems = parse({name: raw})
    assert got == Settings()
    assert getattr(got, field) is (default == "on")
    also = " / piecewise" if name == "TQ_WARMUP_SPEC_GUARD" else ""
    assert problems == [
        f"tq-warmup: {name}={raw!r} is not one of 1, true, on, yes / 0, false, off, no "
        f"(any case){also}: using the default ({default})"
    ]


@pytest.mark.parametrize(
    ("raw", "path"),
    [
        ("/tmp/r-{rank}.json", "/tmp/r-{rank}.json"),
        ("", None),
        ("my report.json", "my report.json"),
    ],
)
def test_report_path(raw: str, path: str | None) -> None:
    assert parse({"TQ_WARMUP_REPORT": raw}) == (Settings(report_path=path), [])


@pytest.mark.parametrize("raw", [" ", "  \t", "\n"])
def test_a_blank_report_path_is_unset_and_says_so(raw: str) -> None:
    assert parse({"TQ_WARMUP_REPORT": raw}) == (
        Settings(report_path=None),
        [
            f"tq-warmup: TQ_WARMUP_REPORT={raw!r} is blank: no JSON report is written "
            "(accepted: a file path, '{rank}' replaced by the worker's rank)"
        ],
    )


@pytest.mark.parametrize(
    ("raw", "threads"), [("4", 4), (" 8 ", 8), ("1", 1), ("16", 16), ("", DEFAULT_THREADS)]
)
def test_threads(raw: str, threads: int) -> None:
    assert parse({"TQ_WARMUP_THREADS": raw}) == (Settings(threads=threads), [])


ACCEPTED = "a whole number from 1 to 16, this machine's CPU count"


@pytest.mark.parametrize(
    ("raw", "threads", "problem"),
    [
        ("abc", DEFAULT_THREADS, f"is not {ACCEPTED}: using the default ({DEFAULT_THREADS})"),
        ("2.5", DEFAULT_THREADS, f"is not {ACCEPTED}: using the default ({DEFAULT_THREADS})"),
        (" ", DEFAULT_THREADS, f"is not {ACCEPTED}: using the default ({DEFAULT_THREADS})"),
        ("0", 1, f"is not {ACCEPTED}: using 1 (serial)"),
        ("-3", 1, f"is not {ACCEPTED}: using 1 (serial)"),
        ("17", 16, f"is more than this machine's 16 CPUs: capped at 16 (accepted: {ACCEPTED})"),
        (
            "99999999999999999999",
            16,
            f"is more than this machine's 16 CPUs: capped at 16 (accepted: {ACCEPTED})",
        ),
    ],
)
def test_odd_threads_say_what_is_used(raw: str, threads: int, problem: str) -> None:
    assert parse({"TQ_WARMUP_THREADS": raw}) == (
        Settings(threads=threads),
        [f"tq-warmup: TQ_WARMUP_THREADS={raw!r} {problem}"],
    )


def test_threads_are_capped_at_this_machine_s_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(settings, "cpu_count", lambda: 2)
    got, problems = parse({"TQ_WARMUP_THREADS": "6"})
    assert got.threads == 2
    assert problems == [
        "tq-warmup: TQ_WARMUP_THREADS='6' is more than this machine's 2 CPUs: capped at 2 "
        "(accepted: a whole number from 1 to 2, this machine's CPU count)"
    ]


def test_every_odd_variable_is_one_line() -> None:
    env = {
        "TQ_WARMUP": "disable",
        "TQ_WARMUP_STRICT": "y",
        "TQ_WARMUP_REPORT": " ",
        "TQ_WARMUP_THREADS": "abc",
        "TQ_WARMUP_LAUNCH": "nein",
        "TQ_WARMUP_SPEC_GUARD": "nein",
    }
    got, problems = parse(env)
    assert got == Settings()
    assert [p.split("=")[0] for p in problems] == [f"tq-warmup: {name}" for name in env]


def test_reads_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TQ_WARMUP", "off")
    monkeypatch.setenv("TQ_WARMUP_THREADS", "3")
    assert load() == Settings(enabled=False, threads=3)
    assert parse() == (Settings(enabled=False, threads=3), [])


@pytest.mark.parametrize(
    ("value", "guard", "piecewise"),
    [
        ("", True, False),
        ("1", True, False),
        ("piecewise", True, True),
        (" PieceWise ", True, True),
        ("0", False, False),
        ("off", False, False),
    ],
)
def test_spec_guard_values(value: str, guard: bool, piecewise: bool) -> None:
    settings, problems = parse({"TQ_WARMUP_SPEC_GUARD": value})
    assert (settings.spec_guard, settings.spec_piecewise, problems) == (guard, piecewise, [])


@pytest.mark.parametrize(
    ("name", "hint"),
    [
        ("TQ_WARMUP_THREAD", "did you mean TQ_WARMUP_THREADS?"),
        ("TQ_WARMUP_DRIVER_CACHE_COPYTO", "did you mean TQ_WARMUP_DRIVER_CACHE_COPY_TO?"),
        ("TQ_WARMUPS", "did you mean TQ_WARMUP?"),
        ("TQ_WARMUP_FOO", "known: TQ_WARMUP, TQ_WARMUP_AHEAD, "),
    ],
)
def test_a_variable_the_plugin_does_not_read_is_one_line_naming_it(name: str, hint: str) -> None:
    """Before: ignored without a word (a typo'd setting kept its default silently)."""
    got, problems = parse({name: "1", "TQ_WARMUP_STRICT": "1", "OTHER_TQ_WARMUP": "1"})
    assert got == Settings(strict=True)
    (line,) = problems
    assert line.startswith(f"tq-warmup: {name} is not a setting of this plugin: ignored ({hint}")


def test_every_variable_the_plugin_reads_is_known() -> None:
    """``KNOWN`` is what the package reads: a name it reads never warns."""
    import re

    root = Path(settings.__file__).parent
    read = {
        name
        for path in root.rglob("*.py")
        for name in re.findall(r"\"(TQ_WARMUP[A-Z_]*)\"", path.read_text())
        if name != "TQ_WARMUP_"
    }
    assert read <= settings.KNOWN, read - settings.KNOWN
    assert parse(dict.fromkeys(settings.KNOWN, ""))[1] == []


def test_a_pin_item_not_understood_is_one_line_at_register() -> None:
    """Before: said nowhere: the item pinned nothing, and every manifest was refused
    with a WARNING that did not name the typo."""
    good = "sha256:" + "ab" * 32
    _, problems = parse({"TQ_WARMUP_CACHE_PIN": f"{good}, sha256:abc"})
    assert problems == [
        "tq-warmup: TQ_WARMUP_CACHE_PIN item 'sha256:abc' is not sha256:<64 hex digits>: "
        "it pins nothing"
    ]


@pytest.mark.parametrize("manager", [None, "", "triton.runtime.cache:FileCacheManager"])
def test_layers_that_triton_will_not_read_are_one_line(manager: str | None) -> None:
    """Before: ``TQ_WARMUP_CACHE_LAYERS`` without the layered cache manager was read by
    nothing and said nothing: every kernel compiled cold."""
    env = {"TQ_WARMUP_CACHE_LAYERS": "/layers/current"}
    if manager is not None:
        env["TRITON_CACHE_MANAGER"] = manager
    shown = "unset" if manager is None else repr(manager)
    assert parse(env)[1] == [
        f"tq-warmup: TQ_WARMUP_CACHE_LAYERS is set but TRITON_CACHE_MANAGER is {shown}, not "
        "tq_warmup_plugin.layered_cache:LayeredCacheManager: Triton reads no layer"
    ]
    for name in settings.MANAGERS:
        assert parse({**env, "TRITON_CACHE_MANAGER": name})[1] == []


def test_the_manager_names_are_the_layered_cache_s() -> None:
    pytest.importorskip("triton")
    from tq_warmup_plugin.shipped import layered_cache

    assert settings.MANAGERS[1] == f"{layered_cache.__name__}:LayeredCacheManager"
    assert layered_cache.MANAGER_NAMES == settings.MANAGERS


@pytest.mark.parametrize("value", [",", " , ", "sha256:"])
def test_a_pin_that_names_no_manifest_is_one_line_and_serves_nothing(value: str) -> None:
    """Before: ``,`` pinned nothing and said nothing: every manifest refused in silence."""
    from tq_warmup_plugin.shipped import pins

    settings_, problems = parse({"TQ_WARMUP_CACHE_PIN": value})
    assert pins.current({"TQ_WARMUP_CACHE_PIN": value}) == frozenset()
    assert len(problems) == 1 and "TQ_WARMUP_CACHE_PIN" in problems[0]
    assert value.strip() in problems[0]
    assert settings_.trusted.startswith("nothing shipped")


def test_a_pin_with_the_unverified_opt_in_says_the_opt_in_is_ignored() -> None:
    """Before: both set was silent, and a layer without a manifest was served unchecked
    beside the pin. ``doctor`` shows ``trusted``: what a shipped cache may serve."""
    good = "sha256:" + "ab" * 32
    both = {"TQ_WARMUP_CACHE_PIN": good, "TQ_WARMUP_CACHE_UNVERIFIED": "1"}
    settings_, problems = parse(both)
    assert problems == [
        "tq-warmup: TQ_WARMUP_CACHE_UNVERIFIED=1 is ignored: TQ_WARMUP_CACHE_PIN is set, and "
        "a layer without a manifest it names is not served"
    ]
    assert settings_.trusted == "only the 1 manifest(s) TQ_WARMUP_CACHE_PIN names"
    assert parse({})[0].trusted == "any manifest that matches its files"
    unverified = parse({"TQ_WARMUP_CACHE_UNVERIFIED": "1"})[0].trusted
    assert unverified == "any manifest that matches its files; a layer without one, unchecked"
