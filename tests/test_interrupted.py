"""What the CLI leaves when it is interrupted or handed a planted lock: the lock file is
never taken through a symlink or as a FIFO, SIGINT and SIGTERM unwind (stage removed, a
half-done install rolled back) into one line and exit 130."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from tq_warmup_plugin.cli import commands as cli
from tq_warmup_plugin.cli import layers
from tq_warmup_plugin.shipped import manifest, precompile


def test_the_lock_is_never_taken_through_a_symlink(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    elsewhere = tmp_path / "elsewhere"
    (cache / precompile.LOCK_FILE).symlink_to(elsewhere)
    with pytest.raises(OSError, match="is a symlink: refused"), precompile._locked(cache):
        pass
    assert not elsewhere.exists()  # "a" would have created it


def test_the_lock_is_never_a_fifo(tmp_path: Path) -> None:
    """Refused at once: opening a FIFO to append blocks until a reader comes (the old
    ``open(..., "a")`` hung here), so the attempt runs on a thread with a deadline."""
    os.mkfifo(tmp_path / precompile.LOCK_FILE)
    raised: list[BaseException] = []

    def take() -> None:
        try:
            with precompile._locked(tmp_path):
                pass
        except OSError as exc:
            raised.append(exc)

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "blocked on the FIFO"
    assert [str(e).split("] ")[-1] for e in raised] == [
        f"{precompile.LOCK_FILE} is not a regular file: refused"
    ]


def test_a_regular_lock_is_made_and_reused(tmp_path: Path) -> None:
    with precompile._locked(tmp_path):
        pass
    with precompile._locked(tmp_path):
        assert (tmp_path / precompile.LOCK_FILE).is_file()


def _stack() -> manifest.Stack:
    fields: dict[str, Any] = {f: "x" for f in manifest.STACK_FIELDS}
    return manifest.Stack(**fields)


def test_an_interrupted_install_is_rolled_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, stage = tmp_path / "cache", tmp_path / "cache" / ".stage"
    (stage / "KEY1").mkdir(parents=True)
    (stage / "KEY1" / "k.cubin").write_bytes(b"cubin")

    def interrupted(*args: object, **kwargs: object) -> dict[str, object]:
        raise KeyboardInterrupt

    monkeypatch.setattr(manifest, "build", interrupted)  # after the key dir moved in
    with pytest.raises(KeyboardInterrupt):
        precompile.install(cache, stage, ["KEY1"], {}, _stack())
    assert not (cache / "KEY1").exists()  # moved back out, into the stage (removed after)
    assert [p.name for p in stage.glob("rolled-back-*/k.cubin")] == ["k.cubin"]
    assert list(manifest.manifest_files(cache)) == []


@pytest.mark.parametrize("how", ["sigint", "sigterm"])
def test_an_interrupted_command_is_one_line_and_exit_130(
    how: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def handler(args: object) -> int:
        if how == "sigint":
            raise KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGTERM)  # delivered here, on the main thread
        raise AssertionError("SIGTERM did not unwind")

    monkeypatch.setattr(layers, "verify", handler)
    before = signal.getsignal(signal.SIGTERM)
    assert cli.main(["verify", "--cache-dir", "."]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "tq-warmup: verify interrupted: its stage is removed and nothing it had not "
        "finished installing was installed"
    ]
    assert signal.getsignal(signal.SIGTERM) is before
