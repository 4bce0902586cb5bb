"""The driver copies in ``tq-warmup-driver-<uid>``: held by each process that uses one, and
those of entries no process uses any more removed.

Why: each entry version a node serves leaves its copy, ``<entry>-<digest>`` (hundreds of
MiB of the driver's cache), and a fleet that rolls layers would fill the node's disk or
``/dev/shm`` with copies nothing reads.

What: every process whose ``CUDA_CACHE_PATH`` is a copy holds a shared ``flock`` on it for
its life (``atomic.hold``): the process that placed it and every vLLM process that inherits
the variable (``register()`` runs in each). The first holder marks the copy with a sibling
file ``<name>.held``. A marked copy that no process holds and that is older than ``AGE_S``
(placed, not held yet) is removed, under its exclusive lock, by the next ``register()`` that
places a copy in the same directory; at most ``MAX_LOOKED`` names are looked at. An unmarked
copy (made by a release that does not hold its copies, whose users cannot be seen) is left.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path

from .. import atomic

__all__ = ["AGE_S", "HELD_SUFFIX", "MAX_LOOKED", "hold", "release", "sweep"]

HELD_SUFFIX = ".held"
AGE_S = 60.0
MAX_LOOKED = 64

_held: dict[str, int] = {}
"""This process's holds, by path: each a descriptor kept open until exit."""


def hold(path: str | os.PathLike[str]) -> None:
    """Hold the copy ``path`` (a shared ``flock`` until this process ends) and mark it as
    held by its users. OSError where it cannot be held at once (being removed)."""
    where = os.fspath(path)
    known = _held.get(where)
    if known is not None:
        with contextlib.suppress(OSError):
            if os.fstat(known).st_ino == os.stat(where).st_ino:
                return
        os.close(_held.pop(where))  # a copy replaced since: hold the new one
    fd = atomic.hold(where, shared=True)
    _held[where] = fd
    mark = where + HELD_SUFFIX
    if not os.path.lexists(mark):
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK
        with contextlib.suppress(FileExistsError):
            os.close(os.open(mark, flags, 0o600))


def release() -> None:
    """Drop this process's holds (its exit does the same)."""
    while _held:
        os.close(_held.popitem()[1])


def sweep(private: Path, keep: str, age_s: float = AGE_S) -> list[str]:
    """Remove the marked copies in ``private`` that no process holds, older than
    ``age_s``, except ``keep``; returns their names."""
    removed: list[str] = []
    now = time.time()
    try:
        names = sorted(os.listdir(private))[:MAX_LOOKED]
    except OSError:
        return removed
    for mark in names:
        name = mark.removesuffix(HELD_SUFFIX)
        if name in (mark, keep) or name.startswith("."):
            continue
        path = private / name
        try:
            if path.is_symlink() or not path.is_dir() or now - path.stat().st_mtime < age_s:
                continue
        except OSError:
            continue
        fd = atomic.abandoned(path)
        if fd is None:  # a live process uses it
            continue
        try:
            shutil.rmtree(path, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.unlink(private / mark)
        finally:
            os.close(fd)
        if not os.path.lexists(path):
            removed.append(name)
    return removed
