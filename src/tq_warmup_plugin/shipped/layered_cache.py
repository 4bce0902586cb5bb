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
Triton compiles what was not served into its own directory.

The trust model, how a layer is checked and what is served, is ``shipped.trust``'s.

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
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from triton.runtime.cache import FileCacheManager

from .. import compat, safe_io, settings
from .trust import layer_trust, private_root, warn_once

LAYERS_ENV = settings.CACHE_LAYERS_ENV
MANAGER = "tq_warmup_plugin.layered_cache:LayeredCacheManager"
"""What operators write (README, ``deploy/``): the module's old name, an alias of this
one since the package was grouped by concern, so every deployment keeps working."""
MANAGER_NAMES = (MANAGER, f"{__name__}:LayeredCacheManager")
"""Both names Triton resolves to this class."""

_GROUP_PREFIX = compat.GROUP_PREFIX  # the file naming a kernel's files (compat.triton)

logger = logging.getLogger("vllm.tq_warmup_plugin")

_lock = threading.Lock()
_unwritable: set[str] = set()  # cache roots that failed a write in this process
_fallback_root: str | None = None


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
            warn_once(
                "layer", root, "tq-warmup: Triton cache layer %s is not a directory; ignored", root
            )
        elif not os.access(root, os.R_OK | os.X_OK):
            warn_once(
                "layer", root, "tq-warmup: Triton cache layer %s is not readable; ignored", root
            )
        else:
            roots.append(root)
    return tuple(roots)


def served_by_layer(path: str) -> bool:
    """Whether a file Triton loaded was served from a layer of this manager, when it
    is Triton's manager (the report's "from the shipped cache"): served files are
    this process's private copies."""
    if os.environ.get("TRITON_CACHE_MANAGER") not in MANAGER_NAMES:
        return False
    private = private_root()
    return private is not None and Path(path).is_relative_to(private)


def _overlap(root: str, own: str) -> str | None:
    """How layer ``root`` and Triton's cache directory ``own`` overlap, if they do."""
    if not own:
        return None
    layer, cache = Path(os.path.realpath(root)), Path(os.path.realpath(own))
    if layer == cache:
        return "is"
    if layer.is_relative_to(cache):
        return "lies inside"
    return "holds" if cache.is_relative_to(layer) else None


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
    directory the layer's manifests do not vouch for is not there (``_Trust``); one
    they vouch for is served from this process's copy of its hashed files."""

    def __init__(self, root: str, key: str) -> None:
        self.key = key
        self.cache_dir = os.path.join(root, key)
        self.lock_path = None
        self.root = root

    def get_file(self, filename: str) -> str | None:
        trust = layer_trust(self.root)
        served = trust.serves(self.key) if trust is not None else None
        if served is None or filename not in served[1]:
            return None
        return os.path.join(served[0], filename)

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
            children = safe_io.read_json(path).get("child_paths")
        except (safe_io.UnsafeFile, AttributeError):
            return None
        if not isinstance(children, dict):
            return None
        group: dict[str, str] = {}
        for name in children:
            child = self.get_file(name) if isinstance(name, str) else None
            if child is None:
                return None
            group[name] = child
        return group


_T = TypeVar("_T")


def _never_raises(layer: _Layer, lookup: Callable[[str], _T | None], filename: str) -> _T | None:
    """A layer's lookup, or a miss: whatever goes wrong in a layer compiles the kernel
    instead of failing it (one WARNING per layer and process)."""
    try:
        return lookup(filename)
    except Exception as exc:
        warn_once(
            "lookup",
            layer.root,
            "tq-warmup: Triton cache layer %s failed a lookup (%s: %s); what it misses "
            "compiles into Triton's cache directory",
            layer.root,
            type(exc).__name__,
            exc,
        )
        return None


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
        for root in roots:
            how = _overlap(root, own)
            if how is not None:
                warn_once(
                    "own dir",
                    root,
                    "tq-warmup: Triton cache layer %s %s Triton's cache directory "
                    "(TRITON_CACHE_DIR=%s): Triton's own lookups and writes there are not "
                    "checked; point TRITON_CACHE_DIR at a directory of its own",
                    root,
                    how,
                    own,
                )
        self.layers = [_Layer(root, key) for root in roots if _overlap(root, own) != "is"]

    def _root(self) -> str:
        return os.path.dirname(os.path.abspath(self.cache_dir)) if self.cache_dir else ""

    def _use_fallback(self) -> None:
        self.cache_dir = os.path.join(_fallback(), self.key)
        self.lock_path = os.path.join(self.cache_dir, "lock")

    def get_file(self, filename: str) -> str | None:
        for layer in self.layers:
            path = _never_raises(layer, layer.get_file, filename)
            if path is not None:
                return path
        own: str | None = super().get_file(filename)
        return own

    def get_group(self, filename: str) -> dict[str, str] | None:
        for layer in self.layers:
            group = _never_raises(layer, layer.get_group, filename)
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
            warn_once(
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


__all__ = [
    "LAYERS_ENV",
    "MANAGER",
    "MANAGER_NAMES",
    "LayeredCacheManager",
    "layer_roots",
    "served_by_layer",
]
