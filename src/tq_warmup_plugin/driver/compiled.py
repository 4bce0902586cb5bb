"""The ``torch.compile`` artifacts a driver-cache entry ships: saved by the build's engine,
handed to torch in each worker's ``kernel_warmup`` before the warmers compile.

Why: what a shipped Triton layer cannot hold is what ``torch.compile`` generates for the device
in the worker: from a shipped layer the V1 sampler's rank count (inductor's
``triton_per_fused_ge_sum_0``) was most of a V1 worker's warmers, and a hybrid with MTP
compiled 7 such graphs (``benchmarks/results/serve-jit/SUMMARY.md``). ``precompile`` runs on a
CPU and cannot build them; the driver-cache build already starts an engine of the fleet's model
on one of its GPUs (``driver.build``), whose warmers compile exactly these graphs.

How: torch's own "mega-cache" (``torch.compiler.save_cache_artifacts`` and
``load_cache_artifacts``, torch 2.7+): inductor's FX graph cache entries with their
Triton kernels bundled, and AOTAutograd's, each keyed by torch itself on the graph, the
torch and Triton versions and the device. Loading writes them into this process's
inductor caches, so the warmers' compiles of the same graphs are cache hits; an
artifact of another stack or graph only misses. With them a MoE worker from a layer
and an entry compiled nothing (vLLM 0.26.0, the same record).

Trust: artifacts are pickles, and loading one runs code, as the driver cache's GPU code
is code the driver runs. They are read only from the entry ``driver.startup`` chose for
this process (its manifest matched this node and, with ``TQ_WARMUP_CACHE_PIN``, is
pinned), through a ``compiled`` directory that is no symlink, as a regular file of the
manifest's size (bounded by ``MAX_COMPILED_BYTES``), and handed to torch only when the
bytes read hash to the manifest's sha256: no copy, so nothing can change between the
check and the load. A failure is one WARNING line and the graphs compile as before.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import NamedTuple

from .. import safe_io
from . import entry as driver_cache

__all__ = ["Chosen", "chosen", "load", "read", "remember", "save"]


class Chosen(NamedTuple):
    """The driver-cache entry this process uses, and its manifest as read and matched."""

    entry: Path
    manifest: driver_cache.DriverManifest


_chosen: list[Chosen] = []


def remember(entry: Path, manifest: driver_cache.DriverManifest) -> None:
    """Called by ``driver.startup`` once it uses ``entry`` (copied, or its copy found
    already set by this process's parent)."""
    _chosen[:] = [Chosen(entry, manifest)]


def chosen() -> Chosen | None:
    return _chosen[0] if _chosen else None


def read(entry: Path, manifest: driver_cache.DriverManifest) -> list[tuple[str, bytes]]:
    """Each ``compiled`` file the manifest lists, its bytes checked against its sha256;
    ``EntryError`` (one line) on the first that cannot be read or differs."""
    if not manifest.compiled:
        return []
    import hashlib  # not at module level: register() imports this module and hashes nothing

    try:
        fd = os.open(
            entry / driver_cache.COMPILED_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
        )
    except OSError as exc:
        raise driver_cache.EntryError(
            f"{driver_cache.COMPILED_DIR}: not a directory ({exc.strerror or exc})"
        ) from None
    found = []
    try:
        for name, (sha, size) in sorted(manifest.compiled.items()):
            where = f"{driver_cache.COMPILED_DIR}/{name}"
            try:
                data = safe_io.read_bytes(
                    name, driver_cache.MAX_COMPILED_BYTES, size=size, dir_fd=fd
                )
            except (safe_io.UnsafeFile, OSError) as exc:
                raise driver_cache.EntryError(f"{where}: {exc}") from None
            digest = hashlib.sha256(data).hexdigest()
            if digest != sha:
                raise driver_cache.EntryError(
                    f"{where}: sha256 {digest[:12]}, the manifest says {sha[:12]}"
                )
            found.append((name, data))
    finally:
        os.close(fd)
    return found


def load(choice: Chosen | None = None) -> tuple[str, bool] | None:
    """Hand torch the chosen entry's artifacts: ``(line, ok)`` for the report (an INFO
    note, or a WARNING when ``ok`` is False), or None where there are none to load."""
    choice = choice or chosen()
    if choice is None or not choice.manifest.compiled:
        return None
    head = f"torch.compile artifacts of {choice.entry.name}"
    start = time.perf_counter()
    try:
        files = read(choice.entry, choice.manifest)
        import torch

        graphs = 0
        for _, data in files:
            info = torch.compiler.load_cache_artifacts(data)
            graphs += sum(len(v) for v in getattr(info, "artifacts", {}).values())
    except Exception as exc:  # a bad file or torch's refusal: compile as before
        why = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        return f"{head}: not loaded ({why}): their graphs compile here", False
    size = sum(len(data) for _, data in files)
    took = (time.perf_counter() - start) * 1e3
    return f"{head}: {graphs} loaded ({size / 2**10:.0f} KiB) in {took:.0f} ms", True


def save(path: Path) -> dict[str, int]:
    """In the build's engine child, after its requests: every artifact this process's
    ``torch.compile`` made, written to ``path``; how many of each kind (empty: none)."""
    import torch

    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return {}
    data, info = saved
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return {str(kind): len(names) for kind, names in info.artifacts.items() if names}
