"""A driver-cache entry's stages: private directories made beside where an entry goes, held
with ``flock`` by their maker while it lives, installed with one ``os.rename``, and found
(``verify``) and removed (the next :func:`stage`) once their maker was killed."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

from ..atomic import abandoned, hold, replace_dir

__all__ = ["FRESH_S", "HELD_PREFIX", "STAGE_PREFIX", "discard", "install", "stage", "stale_stages"]

STAGE_PREFIX = ".tq-warmup-stage-"

HELD_PREFIX = f"{STAGE_PREFIX}held-"
"""A stage whose maker holds its ``flock`` while it lives (``atomic.hold``): once no one
holds it, the maker died (killed mid-build or mid-copy) and the next ``stage`` removes it."""
FRESH_S = 60.0  # a stage younger than this may be between mkdtemp and its flock
_held: dict[str, int] = {}  # this process's stages -> the descriptor holding each


def stage(parent: str | Path) -> Path:
    """A new private directory in ``parent`` (same file system: ``os.rename`` works),
    held until :func:`discard`; first the stages of dead makers there are removed
    (``stale_stages``: a killed ``driver-cache`` build's in the layer, a killed
    ``register()``'s copy in the private directory)."""
    Path(parent).mkdir(parents=True, exist_ok=True)
    for stale in stale_stages(parent, remove=True):
        shutil.rmtree(stale, ignore_errors=True)
    made = tempfile.mkdtemp(prefix=HELD_PREFIX, dir=parent)
    try:
        _held[made] = hold(made)
    except OSError:
        shutil.rmtree(made, ignore_errors=True)
        raise
    return Path(made)


def discard(staged: Path) -> None:
    """Remove what is left of ``staged`` (nothing once installed), then let it go."""
    shutil.rmtree(staged, ignore_errors=True)
    fd = _held.pop(str(staged), None)
    if fd is not None:
        os.close(fd)


def stale_stages(parent: str | Path, remove: bool = False) -> list[Path]:
    """The stages in ``parent`` that no live process holds: ``verify`` names them all;
    with ``remove``, those a maker of this release held (an older release's held none,
    and may still be building). Each is checked under its ``flock``, let go at once."""
    try:
        with os.scandir(parent) as it:
            stages = [
                Path(e.path)
                for e in it
                if e.name.startswith(STAGE_PREFIX) and e.is_dir(follow_symlinks=False)
            ]
    except OSError:
        return []
    found, now = [], time.time()
    for path in sorted(stages):
        if remove and not path.name.startswith(HELD_PREFIX):
            continue
        with contextlib.suppress(OSError):  # one made this instant, not held yet: left
            if remove and now - path.stat().st_mtime < FRESH_S:
                continue
        held = abandoned(path)
        if held is not None:
            os.close(held)
            found.append(path)
    return found


def install(staged: Path, final: Path) -> Path:
    """Move a complete ``staged`` directory to ``final`` with one ``os.rename``: a
    reader sees the old entry, none, or this one, never a half-written one. An old
    ``final`` is first renamed away and removed (``atomic.replace_dir``)."""

    def aside() -> Path:
        # held-prefixed: a kill before the removal below leaves it to the next stage()
        return final.with_name(f"{HELD_PREFIX}replaced-{uuid.uuid4().hex}")

    for old in replace_dir(staged, final, aside):
        shutil.rmtree(old, ignore_errors=True)
    return final
