"""``atomic.replace_dir``: the one directory replace of precompile and the driver cache."""

from __future__ import annotations

import errno
import itertools
import os
from pathlib import Path

import pytest

from tq_warmup_plugin import atomic


def _dir(path: Path, text: str) -> Path:
    path.mkdir()
    (path / "f").write_text(text)
    return path


def test_a_free_target_is_one_rename_and_nothing_moves_aside(tmp_path: Path) -> None:
    staged = _dir(tmp_path / "staged", "new")
    assert atomic.replace_dir(staged, tmp_path / "final", lambda: tmp_path / "x") == []
    assert (tmp_path / "final" / "f").read_text() == "new" and not staged.exists()


def test_an_old_directory_is_moved_aside_whole_and_returned(tmp_path: Path) -> None:
    _dir(tmp_path / "final", "old")
    staged = _dir(tmp_path / "staged", "new")
    moved = atomic.replace_dir(staged, tmp_path / "final", lambda: tmp_path / "aside")
    assert moved == [tmp_path / "aside"] and (tmp_path / "aside" / "f").read_text() == "old"
    assert (tmp_path / "final" / "f").read_text() == "new"


def test_a_writer_that_keeps_putting_one_back_is_an_error_not_a_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    final = _dir(tmp_path / "final", "old")
    staged = _dir(tmp_path / "staged", "new")
    names = (tmp_path / f"aside{i}" for i in itertools.count())
    rename = os.rename

    def racing(src: str | Path, dst: str | Path) -> None:
        rename(src, dst)
        if Path(src) == final:  # another writer installs its own at once
            _dir(final, "theirs")

    monkeypatch.setattr(atomic.os, "rename", racing)
    with pytest.raises(OSError) as raised:
        atomic.replace_dir(staged, final, lambda: next(names))
    assert raised.value.errno == errno.EEXIST and "keeps being replaced" in str(raised.value)
    assert staged.is_dir() and (final / "f").read_text() == "theirs"  # ours never half-in
    assert len(list(tmp_path.glob("aside*"))) == atomic.ATTEMPTS
