"""A Triton cache manager that reads shipped, read-only cache directories first.

Enabled through Triton's own extension point, in the environment of every process
that compiles (the plugin does not set it)::

    TRITON_CACHE_MANAGER=tq_warmup_plugin.layered_cache:LayeredCacheManager
    TQ_WARMUP_CACHE_LAYERS=/opt/tq-warmup/cache:/opt/more   # read-only layers, in order

A lookup tries each layer, then Triton's own cache directory (``TRITON_CACHE_DIR``,
else ``~/.triton/cache``); a miss is compiled and written to that directory only.
Nothing is ever written into a layer. A directory that is missing or read-only never
fails a compile: a missing or unreadable layer is ignored, an unwritable cache
directory is replaced by a per-process temporary one, each with one WARNING per
directory and process.

A layer that ``tq-warmup precompile`` built holds manifests (``manifest``): the first
lookup in a process reads them and checks each against the running stack, and the
first lookup of each key directory checks that directory's files; only key
directories listed by a manifest that holds, with every file as listed, are served.
Each problem is one WARNING naming the layer, the manifest and the field or file, and
Triton compiles what was not served into its own directory. A layer without any
manifest (a plain Triton cache) is served as it is, with one WARNING that it is not
verified.

Triton interface (``triton.runtime.cache``, identical in 3.6.0, 3.7.1 and 3.8.0 as
far as this module goes): ``get_cache_manager(key)`` instantiates
``knobs.cache.manager_class`` (``TRITON_CACHE_MANAGER=module:Class``, whose MRO must
contain a class named ``CacheManager``) as ``cls(key)``, and the override and dump
managers as ``cls(key, override=True)`` / ``cls(key, dump=True)``, which this class
leaves to ``FileCacheManager`` unchanged. ``compile()`` finds a kernel with
``get_group(f"{name}.json")`` and stores it with ``put`` + ``put_group``; the launcher
build (``runtime/build.py``) and the autotuner use ``get_file`` / ``put``.
``FileCacheManager.__init__`` sets ``key``, ``cache_dir`` and ``lock_path`` before its
``os.makedirs``, in all three releases, which is how an unwritable directory is caught
here without computing Triton's paths again.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from triton.runtime.cache import FileCacheManager

from . import compat, manifest, settings

LAYERS_ENV = settings.CACHE_LAYERS_ENV
MANAGER = "tq_warmup_plugin.layered_cache:LayeredCacheManager"

_GROUP_PREFIX = compat.GROUP_PREFIX  # the file naming a kernel's files (compat.triton)

logger = logging.getLogger("vllm.tq_warmup_plugin")

_lock = threading.Lock()
_warned: set[tuple[str, str]] = set()
_unwritable: set[str] = set()  # cache roots that failed a write in this process
_fallback_root: str | None = None


def _warn_once(problem: str, path: str, message: str, *args: object) -> None:
    with _lock:
        if (problem, path) in _warned:
            return
        _warned.add((problem, path))
    logger.warning(message, *args)


@functools.lru_cache(maxsize=8)
def layer_roots(value: str) -> tuple[str, ...]:
    """The usable directories of a ``TQ_WARMUP_CACHE_LAYERS`` value (``os.pathsep``
    separated, in order, duplicates dropped); each unusable one is warned about once."""
    roots: list[str] = []
    for entry in value.split(os.pathsep):
        if not entry.strip():
            continue
        root = os.path.abspath(os.path.expanduser(entry.strip()))
        if root in roots:
            continue
        if not os.path.isdir(root):
            _warn_once(
                "layer", root, "tq-warmup: Triton cache layer %s is not a directory; ignored", root
            )
        elif not os.access(root, os.R_OK | os.X_OK):
            _warn_once(
                "layer", root, "tq-warmup: Triton cache layer %s is not readable; ignored", root
            )
        else:
            roots.append(root)
    return tuple(roots)


@dataclass
class _Trust:
    """What one layer may serve in this process."""

    root: str
    listed: dict[str, list[tuple[str, dict[str, str]]]] | None
    """Key directory -> (manifest, files) of each manifest that holds here and lists it;
    ``None``: the layer has no manifest and serves everything."""
    verdicts: dict[str, bool] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def serves(self, key: str) -> bool:
        """Whether ``key``'s directory may be read; its files are hashed on the first
        call for it: a worker reads a few of a layer's keys, 0.5 ms each on the CPU
        (``python -m benchmarks.tqbench layer-check-cost``)."""
        if self.listed is None:
            return True
        with self.lock:  # compile threads ask for the same key at once
            if key not in self.verdicts:
                self.verdicts[key] = self._check(key)
            return self.verdicts[key]

    def _check(self, key: str) -> bool:
        assert self.listed is not None
        checked = [
            (n, manifest.key_dir_problems(self.root, key, f)) for n, f in self.listed.get(key, [])
        ]
        if not checked:  # not listed by a manifest that holds: not part of what was shipped
            return False
        if any(not problems for _, problems in checked):
            return True
        name, problems = checked[0]
        for problem in problems:
            logger.warning(
                "tq-warmup: Triton cache layer %s, %s: %s; that kernel is not used and "
                "compiles into Triton's cache directory",
                self.root,
                name,
                problem,
            )
        return False


_trusts: dict[str, _Trust] = {}
_trust_lock = threading.Lock()


def _running_driver() -> Any | None:
    """Triton's active driver if it exists already, else None; never creates it.

    Triton makes a cache manager while it creates its driver (``CudaDriver`` ->
    ``CudaUtils`` -> ``compile_module_from_src``, 3.6-3.8), so a lookup may come from
    inside ``driver.active``. Asking ``driver.active`` there created a second driver
    inside the first, whose utils build asked this cache again and waited on
    ``_trust_lock`` forever: the first engine with the layer hung at startup on the
    H200 (vLLM 0.26.0, Triton 3.6.0). ``DriverConfig`` keeps ``_active`` and
    ``_default`` in 3.6.0, 3.7.1 and 3.8.0."""
    from triton.runtime.driver import driver as config

    return getattr(config, "_active", None) or getattr(config, "_default", None)


def _running_arch(active: Any) -> int | str | None:
    """The target this process compiles for; ``None`` if the driver cannot say."""
    try:
        arch: int | str = active.get_current_target().arch
    except Exception:  # no usable driver: arch is not checked (Triton's key has it anyway)
        return None
    return arch


def _running_stack(active: Any) -> manifest.Stack:
    return manifest.installed_stack(arch=_running_arch(active))


def _layer_trust(root: str) -> _Trust | None:
    """Read and check ``root``'s manifests, once per process (the first lookup after
    Triton's driver exists). ``None`` before it exists: that lookup is the driver's own
    utils build, which no manifest lists, so the layer serves nothing to it."""
    with _trust_lock:
        if root in _trusts:
            return _trusts[root]
        active = _running_driver()
        if active is None:
            return None
        files = manifest.manifest_files(root)
        if not files:
            logger.warning(
                "tq-warmup: Triton cache layer %s has no tq-warmup manifest: its kernels are "
                "used unverified (tq-warmup precompile writes one)",
                root,
            )
            _trusts[root] = _Trust(root, None)
            return _trusts[root]
        found: dict[str, manifest.Manifest] = {}
        for path in files:
            try:
                found[path.name] = manifest.read(path)
            except manifest.ManifestError as exc:
                logger.warning(
                    "tq-warmup: Triton cache layer %s: %s is not a usable manifest (%s); "
                    "nothing it lists is used",
                    root,
                    path.name,
                    exc,
                )
        try:
            running = _running_stack(active)
        except Exception as exc:  # never fail a compile: check the files only
            logger.warning(
                "tq-warmup: cannot read this process's vLLM/Triton stack (%s): Triton cache "
                "layer %s is checked file by file only",
                exc,
                root,
            )
            running = manifest.Stack()
        other = manifest.for_other_arch(found, running)
        listed: dict[str, list[tuple[str, dict[str, str]]]] = {}
        for name, shipped in found.items():
            problems = [] if name in other else manifest.stack_problems(shipped, running)
            for problem in problems:
                logger.warning(
                    "tq-warmup: Triton cache layer %s, %s: %s; none of its %d kernels is used",
                    root,
                    name,
                    problem,
                    len(shipped.files),
                )
            if problems or name in other:
                continue
            for key, names in shipped.files.items():
                listed.setdefault(key, []).append((name, dict(names)))
        _trusts[root] = _Trust(root, listed)
        return _trusts[root]


def served_by_layer(path: str) -> bool:
    """Whether a file Triton loaded lies in a layer of this manager, when it is Triton's
    manager (the report's "from the shipped cache")."""
    if os.environ.get("TRITON_CACHE_MANAGER") != MANAGER:
        return False
    from triton import knobs

    own = os.path.abspath(knobs.cache.dir) if knobs.cache.dir else ""  # never a layer
    roots = layer_roots(settings.cache_layers())
    return any(Path(path).is_relative_to(root) for root in roots if root != own)


def _fallback() -> str:
    """One private temporary cache directory per process, made on first need."""
    global _fallback_root
    with _lock:
        if _fallback_root is None:
            _fallback_root = tempfile.mkdtemp(prefix="tq-warmup-triton-cache-")
            atexit.register(shutil.rmtree, _fallback_root, ignore_errors=True)
        return _fallback_root


class _Layer(FileCacheManager):  # type: ignore[misc]
    """One key's directory in one read-only layer: Triton's own lookups, no writes.

    ``FileCacheManager.__init__`` is not called: it creates the directory. A key
    directory the layer's manifests do not vouch for is not there (``_Trust``)."""

    def __init__(self, root: str, key: str) -> None:
        self.key = key
        self.cache_dir = os.path.join(root, key)
        self.lock_path = None
        self.root = root

    def get_file(self, filename: str) -> str | None:
        trust = _layer_trust(self.root)
        if trust is None or not trust.serves(self.key):
            return None
        path: str | None = super().get_file(filename)
        return path

    def put(self, data: Any, filename: str, binary: bool = True) -> str:
        raise PermissionError(f"{self.cache_dir} is a read-only cache layer")

    def get_group(self, filename: str) -> dict[str, str] | None:
        """The group with every file found in this directory, else None.

        Triton records absolute paths at write time, so a layer built in one place
        and shipped to another would miss (3.8.0 returns None when a recorded path is
        gone, 3.6.0/3.7.1 a group without it). Each file is looked up here by name
        instead, and a group with any file missing is a miss in every release.
        """
        path = self.get_file(_GROUP_PREFIX + filename)
        if path is None:
            return None
        try:
            with open(path, encoding="utf-8") as fh:
                children = json.load(fh).get("child_paths")
        except (OSError, ValueError, AttributeError):
            return None
        if not isinstance(children, dict):
            return None
        group: dict[str, str] = {}
        for name in children:
            child = self.get_file(name)
            if child is None:
                return None
            group[name] = child
        return group


class LayeredCacheManager(FileCacheManager):  # type: ignore[misc]
    """``FileCacheManager`` on Triton's cache directory, behind read-only layers."""

    def __init__(self, key: str, override: bool = False, dump: bool = False) -> None:
        self.layers: list[_Layer] = []
        if override or dump:  # TRITON_KERNEL_OVERRIDE / TRITON_KERNEL_DUMP: Triton's own
            super().__init__(key, override=override, dump=dump)
            return
        try:
            super().__init__(key)
        except OSError:
            pass  # cache_dir is set; a write will move to the fallback (see put)
        except RuntimeError:  # TRITON_CACHE_DIR="": Triton has no directory at all
            self.key, self.cache_dir = key, ""
        own = self._root()
        if not self.cache_dir or own in _unwritable:
            self._use_fallback()
        roots = layer_roots(settings.cache_layers())
        self.layers = [_Layer(root, key) for root in roots if root != own]

    def _root(self) -> str:
        return os.path.dirname(os.path.abspath(self.cache_dir)) if self.cache_dir else ""

    def _use_fallback(self) -> None:
        self.cache_dir = os.path.join(_fallback(), self.key)
        self.lock_path = os.path.join(self.cache_dir, "lock")

    def get_file(self, filename: str) -> str | None:
        for layer in self.layers:
            path: str | None = layer.get_file(filename)
            if path is not None:
                return path
        own: str | None = super().get_file(filename)
        return own

    def get_group(self, filename: str) -> dict[str, str] | None:
        for layer in self.layers:
            group: dict[str, str] | None = layer.get_group(filename)
            if group is not None:
                return group
        own: dict[str, str] | None = super().get_group(filename)
        return own

    def put(self, data: Any, filename: str, binary: bool = True) -> str:
        try:
            path: str = super().put(data, filename, binary)
            return path
        except OSError as exc:
            own = self._root()
            if own == _fallback_root:
                raise
            with _lock:
                _unwritable.add(own)
            self._use_fallback()
            _warn_once(
                "cache dir",
                own,
                "tq-warmup: cannot write Triton's cache directory %s (%s); this process "
                "writes new kernels to %s instead, removed when it exits",
                own,
                exc,
                _fallback(),
            )
            path = super().put(data, filename, binary)
            return path


__all__ = ["LAYERS_ENV", "MANAGER", "LayeredCacheManager", "layer_roots", "served_by_layer"]
