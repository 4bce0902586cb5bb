"""One atomic directory replace, for the two writers of shipped directories
(``shipped.precompile``'s key directories and ``driver.entry``'s entries).

A reader of a shared directory must see the old directory, none, or the new one, never
a half-written one: the new one is built beside the old one on the same file system and
moved in with one ``os.rename``. ``rename`` does not replace a non-empty directory, so an
old one is first renamed aside; another writer may put its own back in between, hence
the bounded retry.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

__all__ = ["replace_dir"]

ATTEMPTS = 3


def replace_dir(staged: Path, final: Path, aside: Callable[[], Path]) -> list[Path]:
    """Move the complete directory ``staged`` to ``final``; where ``final`` held a
    directory, it is first renamed to a fresh ``aside()`` path (on the same file system).
    Returns the paths it moved aside, oldest first (empty when ``final`` was free), for
    the caller to remove or to put back on a rollback. Raises OSError when another
    writer keeps putting a directory at ``final``, or on any other rename failure."""
    moved: list[Path] = []
    for _ in range(ATTEMPTS):
        try:
            os.rename(staged, final)
            return moved
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        target = aside()
        try:
            os.rename(final, target)
        except FileNotFoundError:  # another writer moved it first: try again
            continue
        moved.append(target)
    raise OSError(errno.EEXIST, f"{final} keeps being replaced by another writer")
