"""The driver copies: held by the processes that use them, the unheld old ones of entries
no longer shipped removed by the next ``register()``, with real processes and kills."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_driver_startup import copy_name, layer  # noqa: F401 (a fixture)

from tq_warmup_plugin import atomic
from tq_warmup_plugin.driver import copies
from tq_warmup_plugin.driver import startup as driver_startup
from tq_warmup_plugin.settings import Settings

SRC = str(Path(copies.__file__).resolve().parents[2])
HOLDER = (
    "import sys, time\n"
    "from tq_warmup_plugin.driver import copies\n"
    "copies.hold(sys.argv[1])\n"
    "print('held', flush=True)\n"
    "time.sleep(600)\n"
)


@pytest.fixture(autouse=True)
def _released() -> Iterator[None]:
    yield
    copies.release()


def old_copy(private: Path, name: str, marked: bool = True, age_s: float = 3600) -> Path:
    path = private / name
    (path / "ab").mkdir(parents=True)
    (path / "ab" / "index").write_bytes(b"x" * 1000)
    if marked:
        (private / (name + copies.HELD_SUFFIX)).touch()
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def held_elsewhere(path: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)],
        env={**os.environ, "PYTHONPATH": SRC},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_copy_a_live_process_uses_stays_and_goes_once_it_is_killed(tmp_path: Path) -> None:
    stale = old_copy(tmp_path, "entry-a-111111111111")
    proc = held_elsewhere(stale)
    try:
        assert copies.sweep(tmp_path, keep="entry-b-222222222222") == []
        assert (stale / "ab" / "index").is_file()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert copies.sweep(tmp_path, keep="entry-b-222222222222") == ["entry-a-111111111111"]
    assert sorted(os.listdir(tmp_path)) == []  # the copy and its mark


def test_what_a_sweep_leaves(tmp_path: Path) -> None:
    kept = old_copy(tmp_path, "current-333333333333")
    unmarked = old_copy(tmp_path, "older-release-444444444444", marked=False)
    young = old_copy(tmp_path, "young-555555555555", age_s=0)
    stage = old_copy(tmp_path, ".tq-warmup-stage-held-x")
    target = old_copy(tmp_path, "elsewhere")
    (tmp_path / "linked-666666666666").symlink_to(target)
    (tmp_path / ("linked-666666666666" + copies.HELD_SUFFIX)).touch()
    removed = copies.sweep(tmp_path, keep=kept.name)
    assert removed == ["elsewhere"]  # a marked, unheld, old copy; nothing else
    for path in (kept, unmarked, young, stage, tmp_path / "linked-666666666666"):
        assert os.path.lexists(path), path
    assert not target.exists()


def test_register_holds_its_copy_and_removes_the_unheld_old_ones(
    tmp_path: Path,
    layer: tuple[Path, Path, Path],  # noqa: F811 (test_driver_startup's fixture)
    caplog: pytest.LogCaptureFixture,
) -> None:
    root, proc, fa2 = layer
    settings = Settings(driver_cache=str(root), driver_cache_copy_to=str(tmp_path / "nv"))
    private = tmp_path / "nv" / f"{driver_startup.PRIVATE_PREFIX}{os.getuid()}"
    private.mkdir(parents=True, mode=0o700)
    gone = old_copy(private, "entry-old-777777777777")
    other = old_copy(private, "entry-other-888888888888")
    user = held_elsewhere(other)  # another server on the node, on another layer
    try:
        with caplog.at_level(logging.INFO, "vllm.tq_warmup_plugin"):
            decision = driver_startup.apply(settings, {}, proc, fa2)
    finally:
        user.send_signal(signal.SIGKILL)
        user.wait()
    mine = private / copy_name(next(root.iterdir()))
    assert decision.path == str(mine) and (mine / "ab/cd/1234").is_file()
    assert not gone.exists() and other.exists()
    assert "; removed 1 copies no process uses (entry-old-777777777777)" in decision.line
    assert atomic.abandoned(mine) is None  # this process holds it
    assert (private / (mine.name + copies.HELD_SUFFIX)).is_file()
    copies.release()
    fd = atomic.abandoned(mine)
    assert fd is not None
    os.close(fd)


KILLED_MID_INSTALL = (
    "import os, shutil, signal, sys\n"
    "from pathlib import Path\n"
    "from tq_warmup_plugin.driver import stages\n"
    "shutil.rmtree = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)\n"
    "stages.install(Path(sys.argv[1]), Path(sys.argv[2]))\n"
)


def test_a_copy_replaced_by_a_process_killed_before_removing_the_old_one(tmp_path: Path) -> None:
    """The old copy, renamed aside, is left by the kill; ``verify`` names it and the next
    copy's ``stage()`` removes it."""
    from tq_warmup_plugin.driver import stages

    final = old_copy(tmp_path, "entry-999999999999", marked=False)
    staged = tmp_path / "new"
    (staged / "ab").mkdir(parents=True)
    done = subprocess.run(
        [sys.executable, "-c", KILLED_MID_INSTALL, str(staged), str(final)],
        env={**os.environ, "PYTHONPATH": SRC},
    )
    assert done.returncode == -signal.SIGKILL
    (left,) = [p for p in tmp_path.iterdir() if p.name.startswith(stages.STAGE_PREFIX)]
    assert (left / "ab" / "index").is_file() and (final / "ab").is_dir()  # the new one is in
    assert stages.stale_stages(tmp_path) == [left]  # verify names it
    stages.discard(stages.stage(tmp_path))
    assert not left.exists() and sorted(p.name for p in tmp_path.iterdir()) == [final.name]


def test_a_copy_swept_before_it_was_held_is_placed_again(
    tmp_path: Path,
    layer: tuple[Path, Path, Path],  # noqa: F811 (test_driver_startup's fixture)
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another process's sweep may remove a reused copy between this process's check of it
    and its hold: the hold fails, the copy is placed again and held."""
    import shutil

    root, proc, fa2 = layer
    settings = Settings(driver_cache=str(root), driver_cache_copy_to=str(tmp_path / "nv"))
    real_hold, tries = copies.hold, []

    def swept_first(path: str | os.PathLike[str]) -> None:
        tries.append(path)
        if len(tries) == 1:
            shutil.rmtree(path)  # the other process's sweep
            raise FileNotFoundError(path)
        real_hold(path)

    monkeypatch.setattr(copies, "hold", swept_first)
    decision = driver_startup.apply(settings, {}, proc, fa2)
    assert decision.action == "copy" and len(tries) == 2
    assert (Path(str(decision.path)) / "ab/cd/1234").read_bytes() == b"sass" * 100
    assert atomic.abandoned(str(decision.path)) is None  # held
