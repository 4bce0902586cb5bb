"""TQ_WARMUP* environment parsing."""

from __future__ import annotations

import pytest

from tq_warmup_plugin.settings import DEFAULT_THREADS, Settings, load


def test_defaults() -> None:
    assert load({}) == Settings(
        enabled=True, strict=False, report_path=None, threads=DEFAULT_THREADS, launch=True
    )
    assert 1 <= DEFAULT_THREADS <= 4


@pytest.mark.parametrize(
    ("raw", "launch"), [("0", False), ("off", False), ("1", True), ("", True), ("maybe", True)]
)
def test_launch(raw: str, launch: bool) -> None:
    assert load({"TQ_WARMUP_LAUNCH": raw}).launch is launch


@pytest.mark.parametrize("raw", ["0", "false", "FALSE", "Off", "no", " No "])
def test_tq_warmup_disables(raw: str) -> None:
    assert load({"TQ_WARMUP": raw}).enabled is False


@pytest.mark.parametrize("raw", ["1", "true", "YES", "on", "", "garbage"])
def test_tq_warmup_stays_enabled(raw: str) -> None:
    assert load({"TQ_WARMUP": raw}).enabled is True


@pytest.mark.parametrize(
    ("raw", "strict"),
    [("1", True), ("True", True), ("on", True), ("0", False), ("maybe", False), ("", False)],
)
def test_strict(raw: str, strict: bool) -> None:
    assert load({"TQ_WARMUP_STRICT": raw}).strict is strict


@pytest.mark.parametrize(
    ("raw", "path"), [("/tmp/r-{rank}.json", "/tmp/r-{rank}.json"), ("", None)]
)
def test_report_path(raw: str, path: str | None) -> None:
    assert load({"TQ_WARMUP_REPORT": raw}).report_path == path


@pytest.mark.parametrize(
    ("raw", "threads"),
    [
        ("4", 4),
        (" 8 ", 8),
        ("1", 1),
        ("0", 1),
        ("-3", 1),
        ("abc", DEFAULT_THREADS),
        ("2.5", DEFAULT_THREADS),
        ("", DEFAULT_THREADS),
    ],
)
def test_threads(raw: str, threads: int) -> None:
    assert load({"TQ_WARMUP_THREADS": raw}).threads == threads


def test_reads_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TQ_WARMUP", "off")
    monkeypatch.setenv("TQ_WARMUP_THREADS", "3")
    assert load() == Settings(enabled=False, threads=3)
