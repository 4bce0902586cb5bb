"""What the plugin writes, where someone else chose the path (issue 53): the JSON report
of ``TQ_WARMUP_REPORT`` and a layer's manifests go through ``atomic.write_file``. With
real files: a FIFO no log collector reads yet, symlinks and hard links to a victim file,
``/dev/null``, a 0777 directory (an emptyDir), one of another user, a link planted by
another user (``setpriv``), a full tmpfs. Every write runs in a thread with a timeout,
so a hang is a failure, not a stuck test run; a refusal is one WARNING and the worker
goes on starting."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import fakes
import pytest
from conftest import Log

from tq_warmup_plugin import atomic, install
from tq_warmup_plugin.settings import Settings
from tq_warmup_plugin.worker import warmup
from tq_warmup_plugin.worker.report import Report

REPORT = Report(vllm_version="0.26.0", layers=2, distinct=5, compiled=5)
NOBODY = 65534


def warm(path: Path | str, monkeypatch: pytest.MonkeyPatch, strict: bool = False) -> None:
    """A worker of rank 0 whose warmup gives ``REPORT``, writing it to ``path``; a write
    that blocks (a FIFO) is released after 5 s and fails the test."""
    monkeypatch.setattr(warmup, "run", lambda w, s: REPORT)
    settings = Settings(report_path=str(path), strict=strict)
    try:
        fakes.within(5, lambda: install.warm_worker(SimpleNamespace(rank=0), settings))
    except AssertionError:
        if stat.S_ISFIFO(os.stat(path).st_mode):  # free the blocked writer for the next test
            os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
        raise


def refused(log: Log) -> str:
    """The one WARNING after the report's INFO line."""
    lines = log()
    assert [level for level, _ in lines] == [logging.INFO, logging.WARNING], lines
    assert lines[1][1].startswith("tq-warmup: TQ_WARMUP_REPORT="), lines[1][1]
    assert "the JSON report is not written (" in lines[1][1]
    return lines[1][1]


def written(path: Path) -> bool:
    return path.is_file() and path.read_text() == REPORT.to_json()


@pytest.mark.parametrize("strict", [False, True])
def test_a_report_path_that_is_a_fifo_is_one_warning_not_a_hang(
    strict: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, log: Log
) -> None:
    """Before: ``open(path, "w")`` waited for a reader for ever, and vLLM never finished
    starting (a log collector not started yet). Strict mode does not fail on it."""
    fifo = tmp_path / "collector.fifo"
    os.mkfifo(fifo)
    warm(fifo, monkeypatch, strict)
    assert "collector.fifo is a FIFO, not a regular file" in refused(log)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)  # left as it was


def test_a_report_path_that_is_a_symlink_never_writes_what_it_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, log: Log
) -> None:
    """Before: the (root) worker overwrote whatever the link named."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "r-0.json").symlink_to(victim)
    warm(tmp_path / "r-{rank}.json", monkeypatch)
    assert "r-0.json is a symlink, not a regular file" in refused(log)
    assert victim.read_text() == "precious" and (tmp_path / "r-0.json").is_symlink()


def test_a_report_path_that_is_a_device_is_refused(
    monkeypatch: pytest.MonkeyPatch, log: Log
) -> None:
    """Before: written into ``/dev/null`` (any device the path named)."""
    warm("/dev/null", monkeypatch)
    assert "null is a character device, not a regular file" in refused(log)


def test_a_report_hard_linked_to_another_file_replaces_the_name_not_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, log: Log
) -> None:
    """Before: written in place, through every hard link to the old report's inode;
    now a new file is renamed over the name (a reader sees the old or the new one)."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.link(victim, tmp_path / "r.json")
    warm(tmp_path / "r.json", monkeypatch)
    assert [level for level, _ in log()] == [logging.INFO]
    assert victim.read_text() == "precious" and written(tmp_path / "r.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "victim"]  # no temp left


@pytest.mark.parametrize("mode", [0o755, 0o777, 0o1777])
def test_a_report_in_another_users_directory_is_refused(
    mode: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, log: Log
) -> None:
    """Before: written into a directory of uid 65534, who can rename or swap any name in
    it between any check and the write, sticky bit or not."""
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root (CI runs as root)")
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chown(shared, NOBODY, NOBODY)
    shared.chmod(mode)
    warm(shared / "r.json", monkeypatch)
    assert f"directory {shared} belongs to another user (uid {NOBODY})" in refused(log)
    assert list(shared.iterdir()) == []


@pytest.mark.parametrize("mode", [0o777, 0o775])
def test_a_report_in_a_directory_of_ours_others_may_write_gets_the_sticky_bit(
    mode: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, log: Log
) -> None:
    """A Kubernetes emptyDir is the pod user's and 0777. Before: written without a word,
    any other user able to rename the report away or plant its name as a link; now the
    directory gets the sticky bit first (as ``/tmp``), one INFO line."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    warm(shared / "r.json", monkeypatch)
    assert log()[1:] == [
        (logging.INFO, f"tq-warmup: set the sticky bit on {shared} (others could write it)")
    ]
    assert stat.S_IMODE(shared.stat().st_mode) == mode | stat.S_ISVTX and written(shared / "r.json")


def test_a_report_in_a_sticky_directory_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, log: Log
) -> None:
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)  # as /tmp
    warm(shared / "r.json", monkeypatch)
    assert [level for level, _ in log()] == [logging.INFO] and written(shared / "r.json")


@pytest.fixture
def world() -> Iterator[Path]:
    """A directory another user can reach (``tmp_path`` is root's 0700 tree)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("another user needs root and setpriv (CI runs as root)")
    top = Path(tempfile.mkdtemp(prefix="tq-warmup-world-"))
    top.chmod(0o755)
    yield top
    shutil.rmtree(top)


def as_nobody(*argv: str) -> None:
    cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv]
    subprocess.run(cmd, check=True, capture_output=True, timeout=10)


@pytest.mark.parametrize("mode", [0o777, 0o1777], ids=["emptydir", "sticky"])
def test_a_link_another_user_planted_is_not_followed(
    world: Path, monkeypatch: pytest.MonkeyPatch, log: Log, mode: int
) -> None:
    """The issue's case: a real process of uid 65534 plants the report's name as a link to
    a root file in a shared directory, root's and 0777 (an emptyDir) or sticky. Before:
    the root worker wrote through it (where ``fs.protected_symlinks`` is 0, as on this
    machine and many containers). Now: one WARNING; an emptyDir gets the sticky bit."""
    victim = world / "victim"
    victim.write_text("precious")
    shared = world / "shared"
    shared.mkdir()
    shared.chmod(mode)
    as_nobody("ln", "-s", str(victim), str(shared / "r-0.json"))
    assert (shared / "r-0.json").lstat().st_uid == NOBODY
    warm(shared / "r-{rank}.json", monkeypatch)
    assert "r-0.json is a symlink, not a regular file" in log()[-1][1]
    assert victim.read_text() == "precious" and shared.stat().st_mode & stat.S_ISVTX


def test_a_full_file_system_keeps_the_old_report_whole(tmp_path: Path) -> None:
    """A report that does not fit (a 64 KiB tmpfs, in a private mount namespace, one
    fresh interpreter): before, the old report was truncated and a part of the new one
    written, which no reader can parse; now the old one stays whole, no temporary file
    is left, and the WARNING names the reason."""
    if not fakes.tmpfs_in_private_namespace():
        pytest.skip("no private mount namespace with a tmpfs here (CI runs as root)")
    code = (  # install._emit, as warm_worker calls it: no warmup module to import
        "import json, os, sys, types\n"
        "from tq_warmup_plugin import install\n"
        "from tq_warmup_plugin.worker.report import Report\n"
        "from tq_warmup_plugin.settings import Settings\n"
        "d = sys.argv[1]; settings = Settings(report_path=d + '/r.json')\n"
        "big = Report(keys={str(i): i for i in range(10**4)})\n"
        "for report in (Report(vllm_version='old'), big):\n"
        "    try:\n"
        "        install._emit(report, settings, types.SimpleNamespace(rank=0))\n"
        "    except OSError as exc:  # what warm_worker caught before\n"
        "        print(exc, file=sys.stderr)\n"
        "print(json.load(open(d + '/r.json'))['vllm_version'], sorted(os.listdir(d)))\n"
    )
    src = str(Path(atomic.__file__).parents[1])
    script = (
        f'mount -t tmpfs -o size=64k tmpfs "$1" && PYTHONPATH={src} "{sys.executable}" -c "$2" "$1"'
    )
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, "sh", str(mnt), code],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.stdout == "old ['r.json']\n", done
    assert done.stderr == (
        f"tq-warmup: TQ_WARMUP_REPORT={mnt}/r.json: the JSON report is not written "
        "(No space left on device)\n"
    )


# --- atomic.write_file itself ---------------------------------------------------------


def test_write_file_refuses_what_is_not_a_file_name_in_a_directory(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    cases = {
        str(tmp_path / "d"): "d is a directory, not a regular file",
        str(tmp_path / "missing" / "r.json"): f"directory {tmp_path / 'missing'}: No such file",
        "/": "names no file",
        str(tmp_path / "nul\0.json"): "embedded null byte",
    }
    for path, why in cases.items():
        with pytest.raises(atomic.UnsafeWrite, match=why):
            atomic.write_file(path, b"x")
    atomic.write_file(tmp_path / "ok.json", b"{}", mode=0o600)
    assert (tmp_path / "ok.json").read_bytes() == b"{}"
    assert stat.S_IMODE((tmp_path / "ok.json").stat().st_mode) == 0o600
