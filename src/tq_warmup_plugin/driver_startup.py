"""At ``register()``: start this process's CUDA driver JIT cache from the shipped one.

The driver reads ``CUDA_CACHE_PATH`` when CUDA initialises, so it must be set before any
CUDA context (on the H200, driver 580.159.04, 2026-12-01: a launch whose module the cache
held was a hit in 13 s with the variable set before CUDA, and was no hit within 110 s with
it set after torch made a context): ``register()`` runs early in every vLLM process (the
``vllm.general_plugins`` entry point; vLLM initialises CUDA in the worker, after loading its
plugins), and the processes vLLM starts inherit what it set. Nothing here imports torch or
starts CUDA: the node's driver and GPUs come from ``/proc/driver/nvidia``, the FA2 library
is found without importing vLLM and compared by size (the build and ``tq-warmup verify``
compare its sha256; a same-size other build would only miss, as the driver keys its
entries).

Where an entry of ``TQ_WARMUP_DRIVER_CACHE`` matches: ``CUDA_CACHE_PATH`` is the entry's
cache itself when it is writable, else a copy (the driver serves no hit from a read-only
one: the same launch over a read-only bind mount was no hit within 110 s on the H200), made
once per directory (stage + rename, every file hashed as it is copied) into
``TQ_WARMUP_DRIVER_CACHE_COPY_TO`` or the temporary directory; ``CUDA_CACHE_MAXSIZE`` is
raised to 4 GiB unless set (the default 256 MiB may evict). A ``CUDA_CACHE_PATH`` already
set is kept (one WARNING) unless ``TQ_WARMUP_DRIVER_CACHE_OVERRIDE`` is on; one that equals
the choice was set by this process's parent and is silently kept. A mismatch is one WARNING
and the driver JITs as before. Nothing here raises.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, MutableMapping, Sequence
from pathlib import Path
from typing import NamedTuple

from . import driver_cache
from .settings import Settings

__all__ = ["MAXSIZE", "TAIL", "Decision", "apply", "decide"]

logger = logging.getLogger("vllm.tq_warmup_plugin")

# The most CUDA_CACHE_MAXSIZE accepts (CUDA programming guide, "JIT compilation": 4 GiB).
MAXSIZE = str(4 << 30)


class Decision(NamedTuple):
    """What ``apply`` does: ``use`` (set ``CUDA_CACHE_PATH=path``), ``copy`` (copy the
    entry's cache to ``path`` first), ``keep`` (nothing, silently), ``info`` (nothing
    shipped: one INFO line) or ``warn`` (one WARNING: a mismatch, or a variable in the way)."""

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


def decide(
    settings: Settings,
    env: MutableMapping[str, str],
    node: driver_cache.Node,
    found: Sequence[tuple[Path, driver_cache.DriverManifest | str]],
    writable: Callable[[Path], bool],
    temp_dir: str,
) -> Decision:
    """The choice, from what was read (pure): ``found`` is each entry with its manifest
    or the one line saying why it is not usable; ``temp_dir`` holds the copy when
    neither a copy directory is set nor the entry is writable."""
    root = settings.driver_cache
    if root is None:
        return Decision("keep")
    head, tail = _head(root), TAIL
    if env.get("CUDA_CACHE_DISABLE", "0").strip() not in ("", "0"):
        return Decision("warn", f"{head}: not used, CUDA_CACHE_DISABLE is set: {tail}")
    if not found:  # nothing shipped (an image built without a GPU step): not a mismatch
        return Decision("info", f"{head}: no entry (built by tq-warmup driver-cache): {tail}")
    reasons = []
    for entry, shipped in found:
        problems = [shipped] if isinstance(shipped, str) else driver_cache.match(shipped, node)
        if not problems:
            break
        reasons.append(f"{entry.name}: {'; '.join(problems)}")
    else:
        return Decision(
            "warn",
            f"{head}: no entry for this node ({_describe(node)}): {' | '.join(reasons)}: {tail}",
        )
    assert not isinstance(shipped, str)
    cache = entry / driver_cache.CACHE_DIR
    if settings.driver_cache_copy_to:
        action, path = "copy", str(Path(settings.driver_cache_copy_to, entry.name))
    elif writable(cache):
        action, path = "use", str(cache)
    else:
        action, path = "copy", str(Path(temp_dir, entry.name))
    current = env.get("CUDA_CACHE_PATH")
    if current == path:
        return Decision("keep")
    if current and not settings.driver_cache_override:
        return Decision(
            "warn",
            f"{head}: not used, CUDA_CACHE_PATH={current} is set "
            f"(TQ_WARMUP_DRIVER_CACHE_OVERRIDE=1 replaces it): {tail}",
        )
    how = "a copy of " if action == "copy" else ""
    line = (
        f"{head}: CUDA_CACHE_PATH={path}, {how}{entry.name} ({len(shipped.files)} files, "
        f"{shipped.size / 2**20:.1f} MiB; {shipped.gpu}, driver {shipped.driver})"
    )
    return Decision(action, line, path, entry, shipped)


def _copy(entry: Path, shipped: driver_cache.DriverManifest, path: Path) -> None:
    """Make ``path`` a complete copy, once: a stage beside it, renamed into place; if
    another process got there first, its copy is used."""
    if path.is_dir():
        return
    staged = driver_cache.stage(path.parent)
    try:
        driver_cache.copy_entry(entry, shipped, staged)
        try:
            os.rename(staged, path)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
    finally:
        shutil.rmtree(staged, ignore_errors=True)


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
    found: list[tuple[Path, driver_cache.DriverManifest | str]] = []
    for entry in driver_cache.entries(settings.driver_cache):
        try:
            found.append((entry, driver_cache.read(entry)))
        except (driver_cache.EntryError, OSError) as exc:
            found.append((entry, f"manifest: {exc}"))
    node = driver_cache.read_node(proc, fa2 if fa2 is not None else driver_cache.fa2_library())
    decision = decide(
        settings,
        env,
        node,
        found,
        lambda p: p.is_dir() and os.access(p, os.W_OK),
        os.path.join(tempfile.gettempdir(), f"tq-warmup-driver-cache-{os.getuid()}"),
    )
    if decision.action == "keep":
        return decision
    if decision.action == "info":
        logger.info(decision.line)
        return decision
    if decision.action == "warn":
        logger.warning(decision.line)
        return decision
    assert decision.path and decision.entry and decision.manifest
    if decision.action == "copy":
        try:
            _copy(decision.entry, decision.manifest, Path(decision.path))
        except (driver_cache.EntryError, OSError) as exc:
            where = decision.path
            line = (
                f"{_head(settings.driver_cache)}: not used, copy to {where} failed ({exc}): {TAIL}"
            )
            logger.warning(line)
            return Decision("warn", line)
    env["CUDA_CACHE_PATH"] = decision.path
    env.setdefault("CUDA_CACHE_MAXSIZE", MAXSIZE)
    line = decision.line
    if _cuda_started():
        line += "; CUDA is already initialised here: it applies to the processes this one starts"
    logger.info(line)
    return decision._replace(line=line)
