"""At ``register()``: start this process's CUDA driver JIT cache from the shipped one.

The driver reads ``CUDA_CACHE_PATH`` when CUDA initialises, so it must be set before any
CUDA context (set after torch made one, it gave no hit: vLLM 0.26.0,
``benchmarks/results/driver-cache/README.md``): ``register()`` runs early in every vLLM
process (the ``vllm.general_plugins`` entry point; vLLM initialises CUDA in the worker, after
loading its plugins), and the processes vLLM starts inherit what it set. Nothing here
imports torch or starts CUDA: the node's driver and GPUs come from ``/proc/driver/nvidia``,
the FA2 library is found without importing vLLM and compared by size (the build and
``tq-warmup verify`` compare its sha256; a same-size other build would only miss, as the
driver keys its entries).

Where an entry of ``TQ_WARMUP_DRIVER_CACHE`` matches, the driver only ever gets a copy
this process checked, made from hashed bytes, in a directory only this user can write
(issue 30): the entry's cache is never used in place (a file changed or added after the
build would be served, and the driver would write into the shipped layer). The copy is
``<base>/tq-warmup-driver-<uid>/<entry>-<content digest>``: ``base`` is
``TQ_WARMUP_DRIVER_CACHE_COPY_TO`` (absolute) or the temporary directory; the private
directory is made 0700, and used only when it is a real directory (no symlink), this
user's and closed to others. A base of this user's that others may write without the
sticky bit (a Kubernetes emptyDir is 0777) gets the sticky bit, one INFO line; another
user's is refused. A copy already there is re-hashed against the manifest and replaced
when anything differs (a planted or changed file, a link, a driver's later addition); a
new one is staged beside it and renamed into place, every file hashed as it is read, after
the entry's cache is checked to hold plain files and directories only, every listed one (a
symlinked sub-directory is refused, as ``verify`` refuses it; an unlisted plain file is
never copied). An entry bigger than the driver's cache limit (``CUDA_CACHE_MAXSIZE``, 4
GiB) is not copied (a reason in the WARNING, the next entry tried). The driver serves no
hit from a read-only cache (vLLM 0.26.0, the same record), so a copy is needed anyway.
``CUDA_CACHE_MAXSIZE`` is raised to 4 GiB unless set (the default 256 MiB may evict). A
``CUDA_CACHE_PATH`` already set is kept (one WARNING) unless
``TQ_WARMUP_DRIVER_CACHE_OVERRIDE`` is on; one that equals the choice was set by this
process's parent and is silently kept. Each process holds the copy it uses, and the copies
of entries no process uses any more are removed (``copies``). A mismatch, or a setting that
names no entry at all, is one WARNING and the driver JITs as before. Nothing here raises."""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import sys
import tempfile
import time
from collections.abc import Callable, MutableMapping, Sequence
from pathlib import Path
from typing import NamedTuple

from ..settings import Settings
from ..shipped import pins
from . import compiled, copies, host
from . import entry as driver_cache

__all__ = [
    "MAXSIZE",
    "PRIVATE_PREFIX",
    "READ_BUDGET_S",
    "TAIL",
    "Decision",
    "apply",
    "decide",
    "private_dir",
]

logger = logging.getLogger("vllm.tq_warmup_plugin")

# The most CUDA_CACHE_MAXSIZE accepts (CUDA programming guide, "JIT compilation": 4 GiB).
MAXSIZE = str(4 << 30)
READ_BUDGET_S = 2.0
"""How long ``register()`` reads manifests before it stops, one WARNING: every vLLM process
pays it, and 64 manifests at the 1 MiB cap read in about 1 s (issue 30)."""


class Decision(NamedTuple):
    """What ``apply`` does: ``use`` (set ``CUDA_CACHE_PATH=path``), ``copy`` (copy the
    entry's cache to ``path`` first), ``keep`` (nothing, silently) or ``warn`` (one
    WARNING: a mismatch, no entry at all, or a variable in the way)."""

    action: str
    line: str = ""
    path: str | None = None
    entry: Path | None = None
    manifest: driver_cache.DriverManifest | None = None


TAIL = "the CUDA driver JIT-compiles FlashAttention-2 as before"


def _head(root: str | None) -> str:
    return f"tq-warmup: shipped CUDA driver cache {root}"


def _describe(node: driver_cache.Node) -> str:
    gpus = ", ".join(dict.fromkeys(node.gpus)) or "none found"
    return f"driver {node.driver or 'not found'}, GPU {gpus}, FA2 library {node.fa2_size} bytes"


PRIVATE_PREFIX = "tq-warmup-driver-"


def _no_entry(root: str) -> str:
    """The WARNING for a ``TQ_WARMUP_DRIVER_CACHE`` that names no entry: no directory
    there, or one that holds none (an image built without the GPU step, or the layer
    named where its ``driver-cache`` directory was meant)."""
    where = os.path.join(root, driver_cache.DRIVER_DIR)
    if not os.path.isdir(root):
        why = "names no directory"
    elif os.path.isdir(where):
        why = f"holds no entry (the entries are in {where}: name that)"
    else:
        why = "holds no entry (tq-warmup driver-cache builds them)"
    return f"tq-warmup: TQ_WARMUP_DRIVER_CACHE={root} {why}: {TAIL}"


def decide(
    settings: Settings,
    env: MutableMapping[str, str],
    node: driver_cache.Node,
    found: Sequence[tuple[Path, driver_cache.DriverManifest | str]],
    private: Callable[[], Path | str],
) -> Decision:
    """The choice, from what was read: ``found`` is each entry with its manifest or the
    one line saying why it is not usable; ``private()`` gives the private directory the
    copy goes into, or the one line saying why there is none. Pure but for
    ``private``, which is called only once an entry matches: no directory is made, and
    no mode changed, where nothing is copied."""
    root = settings.driver_cache
    if root is None:
        return Decision("keep")
    head, tail = _head(root), TAIL
    if env.get("CUDA_CACHE_DISABLE", "0").strip() not in ("", "0"):
        return Decision("warn", f"{head}: not used, CUDA_CACHE_DISABLE is set: {tail}")
    if not found:  # a setting that names no entry says so, as any setting not understood
        return Decision("warn", _no_entry(root))
    reasons = []
    for entry, shipped in found:
        problems = [shipped] if isinstance(shipped, str) else host.match(shipped, node)
        if not problems and not isinstance(shipped, str) and shipped.size > int(MAXSIZE):
            problems = [f"{shipped.size / 2**30:.2f} GiB, over the driver's 4 GiB cache"]
        if not problems:
            break
        reasons.append(f"{entry.name}: {'; '.join(problems)}")
    else:
        return Decision(
            "warn",
            f"{head}: no entry for this node ({_describe(node)}): {' | '.join(reasons)}: {tail}",
        )
    assert not isinstance(shipped, str)
    directory = private()
    if isinstance(directory, str):
        return Decision("warn", f"{head}: not used, {directory}: {tail}")
    path = str(directory / f"{entry.name}-{driver_cache.content_digest(shipped)[:12]}")
    current = env.get("CUDA_CACHE_PATH")
    if current == path:  # this process's parent made the copy: its entry is this one's
        return Decision("keep", "", path, entry, shipped)
    if current and not settings.driver_cache_override:
        return Decision(
            "warn",
            f"{head}: not used, CUDA_CACHE_PATH={current} is set "
            f"(TQ_WARMUP_DRIVER_CACHE_OVERRIDE=1 replaces it): {tail}",
        )
    line = (
        f"{head}: CUDA_CACHE_PATH={path}, a checked copy of {entry.name} "
        f"({len(shipped.files)} files, {shipped.size / 2**20:.1f} MiB; {shipped.gpu}, "
        f"driver {shipped.driver})"
    )
    return Decision("copy", line, path, entry, shipped)


def private_dir(base: str, uid: int | None = None) -> Path | str:
    """``base/tq-warmup-driver-<uid>``, made 0700 if absent: the directory the copies go
    into, or why it cannot be (one line). ``base`` must be root's or this user's, and a
    directory others cannot write, or one with the sticky bit (``/tmp``); the private one
    must be a real directory, this user's, closed to others; nothing is followed through
    a link."""
    uid = os.getuid() if uid is None else uid
    where = os.path.abspath(base)
    try:
        if not os.path.lexists(where):  # made here: this user's, closed to others
            os.makedirs(where, mode=0o700)
        info = os.stat(where)
    except OSError as exc:
        return f"{where}: {exc.strerror or exc}"
    if not stat.S_ISDIR(info.st_mode):
        return f"{where} is not a directory"
    if info.st_uid not in (0, uid):
        return (
            f"{where} belongs to another user (uid {info.st_uid}), who could rename the "
            "copy away and put another in its place"
        )
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        if info.st_uid != uid:
            return (
                f"{where} is writable by others (mode {info.st_mode & 0o7777:o}) without the "
                "sticky bit and is not this user's: another user could swap the copy"
            )
        # Ours (a Kubernetes emptyDir is root's, 0777): the sticky bit, as /tmp has, so
        # that no other user can rename or remove what this user makes in it.
        os.chmod(where, stat.S_IMODE(info.st_mode) | stat.S_ISVTX)
        logger.info("tq-warmup: set the sticky bit on %s (others could write it)", where)
    private = os.path.join(where, f"{PRIVATE_PREFIX}{uid}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(private, 0o700)
    mine = os.lstat(private)
    if stat.S_ISLNK(mine.st_mode) or not stat.S_ISDIR(mine.st_mode):
        return f"{private} is not a directory (a symlink?)"
    if mine.st_uid != uid or mine.st_mode & 0o077:
        return (
            f"{private} is not this user's private directory "
            f"(owner {mine.st_uid}, mode {mine.st_mode & 0o7777:o})"
        )
    return Path(private)


def _private_for(settings: Settings) -> Path | str:
    """The private directory under ``TQ_WARMUP_DRIVER_CACHE_COPY_TO``, or under the
    temporary directory when that is unset or refused (a COPY_TO others can swap: said
    in one WARNING)."""
    if not settings.driver_cache_copy_to:
        return private_dir(tempfile.gettempdir())
    private = private_dir(settings.driver_cache_copy_to)
    if isinstance(private, str):
        logger.warning(
            "%s: TQ_WARMUP_DRIVER_CACHE_COPY_TO not used (%s): copying to the temporary "
            "directory instead",
            _head(settings.driver_cache),
            private,
        )
        return private_dir(tempfile.gettempdir())
    return private


def _place(entry: Path, shipped: driver_cache.DriverManifest, path: Path) -> str:
    """Make ``path`` a verified copy of the entry: one already there is kept only when
    every file hashes to the manifest and nothing else is there; else a new one is
    staged beside it (every file hashed as it is copied) and renamed into place.
    Returns how: ``reused`` or ``copied``."""
    if not path.is_symlink() and path.is_dir():
        if not driver_cache.tree_problems(path, shipped, path.name):
            return "reused"
    elif os.path.lexists(path):
        os.unlink(path)  # a link or a file planted at the copy's name
    staged = driver_cache.stage(path.parent)
    try:
        driver_cache.copy_entry(entry, shipped, staged)
        driver_cache.install(staged, path)
    finally:
        driver_cache.discard(staged)
    return "copied"


def _place_and_hold(entry: Path, shipped: driver_cache.DriverManifest, path: Path) -> str:
    """``_place``, then this process's hold on the copy (``copies.hold``); placed again
    once where another process's sweep took it in between."""
    how = _place(entry, shipped, path)
    try:
        copies.hold(path)
    except OSError:  # removed between the two: placed again, once
        how = _place(entry, shipped, path)
        copies.hold(path)
    return how


def _cuda_started() -> bool:
    """Whether this process already has CUDA (torch imported and initialised): the
    setting then reaches only the processes it starts. Imports nothing."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        return bool(cuda is not None and cuda.is_initialized())
    except Exception:  # a half-imported torch
        return False


def apply(
    settings: Settings,
    env: MutableMapping[str, str] | None = None,
    proc: str | Path = "/proc",
    fa2: Path | None = None,
) -> Decision:
    """Read the entries and the node, decide, copy if needed, set the environment, log
    one line. Never raises: a failure is one WARNING and nothing is set."""
    env = os.environ if env is None else env
    try:
        return _apply(settings, env, proc, fa2)
    except Exception as exc:  # nothing here may stop vLLM starting
        line = f"{_head(settings.driver_cache)}: not used ({exc}): {TAIL}"
        logger.warning(line)
        return Decision("warn", line)


def _apply(
    settings: Settings, env: MutableMapping[str, str], proc: str | Path, fa2: Path | None
) -> Decision:
    if settings.driver_cache is None:
        return Decision("keep")
    if os.path.isdir(os.path.join(settings.driver_cache, driver_cache.DRIVER_DIR)):
        line = _no_entry(settings.driver_cache)  # the layer, not its entries: no entry
        logger.warning(line)
        return Decision("warn", line)
    found: list[tuple[Path, driver_cache.DriverManifest | str]] = []
    pinned = pins.current()  # TQ_WARMUP_CACHE_PIN: only the entries it names
    node = host.read_node(proc, fa2 if fa2 is not None else host.fa2_library())
    listed, left_out = driver_cache.listing(settings.driver_cache, node)
    if left_out:
        logger.warning(
            f"{_head(settings.driver_cache)}: {left_out} entries past the first "
            f"{driver_cache.MAX_ENTRIES} not read (this driver's first, then by name): "
            "ship one layer per fleet"
        )
    deadline = time.monotonic() + READ_BUDGET_S
    for i, entry in enumerate(listed):
        if i and time.monotonic() > deadline:
            logger.warning(
                f"{_head(settings.driver_cache)}: reading manifests took over "
                f"{READ_BUDGET_S:.0f} s, {len(listed) - i} entries not read"
            )
            break
        try:
            found.append((entry, driver_cache.read(entry, pinned)))
        except (driver_cache.EntryError, OSError) as exc:
            found.append((entry, f"manifest: {exc}"))
    decision = decide(settings, env, node, found, lambda: _private_for(settings))
    if decision.action == "keep":
        if decision.entry is not None and decision.manifest is not None:
            compiled.remember(decision.entry, decision.manifest)
        if decision.path is not None:  # the parent's copy: held while this process uses it
            with contextlib.suppress(OSError):
                copies.hold(decision.path)
        return decision
    if decision.action == "warn":
        logger.warning(decision.line)
        return decision
    assert decision.path and decision.entry and decision.manifest
    t = time.perf_counter()
    path = Path(decision.path)
    try:
        how = _place_and_hold(decision.entry, decision.manifest, path)
    except (driver_cache.EntryError, OSError) as exc:
        where = decision.path
        line = f"{_head(settings.driver_cache)}: not used, copy to {where} failed ({exc}): {TAIL}"
        logger.warning(line)
        return Decision("warn", line)
    env["CUDA_CACHE_PATH"] = decision.path
    env.setdefault("CUDA_CACHE_MAXSIZE", MAXSIZE)
    compiled.remember(decision.entry, decision.manifest)
    line = f"{decision.line}; {how} in {time.perf_counter() - t:.2f} s"
    removed = copies.sweep(path.parent, keep=path.name)
    if removed:
        line += f"; removed {len(removed)} copies no process uses ({', '.join(removed)})"
    if _cuda_started():
        line += "; CUDA is already initialised here: it applies to the processes this one starts"
    logger.info(line)
    return decision._replace(line=line)
