"""The warmers' keys for a set of layers: planned (deduplicated) and compiled through the
compile hook, on threads. One worker's warmup (``warmup``), ``inspect`` and ``precompile``
(the CLI) and the compile-ahead child (``ahead_child``) plan and compile through these
functions, so what the CLI prints and builds, and the error lines of a failed compile,
are the worker's. Apart from the host (``warmup``), which starts and reaps the child: the
child's module imports this one, not the host.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

import pluggy

from .. import compat
from ..geometry import Geometry
from .report import CompileCounter, Report, error_line

__all__ = ["Plan", "compile_all", "compile_into", "compile_one", "describe", "plan_keys"]

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Plan(Generic[K]):
    """Distinct keys, in first-seen order, with the layers and paths that need each."""

    layers: dict[K, list[str]]
    paths: dict[K, list[str]]

    @classmethod
    def of(cls, contributions: Iterable[tuple[str, str, K]]) -> Plan[K]:
        """Deduplicate ``(layer, path, key)`` triples by key."""
        layers: dict[K, list[str]] = {}
        paths: dict[K, list[str]] = {}
        for layer, path, key in contributions:
            layers.setdefault(key, [])
            if layer not in layers[key]:
                layers[key].append(layer)
            paths.setdefault(key, [])
            if path not in paths[key]:
                paths[key].append(path)
        return cls(layers, paths)

    @property
    def keys(self) -> list[K]:
        return list(self.layers)

    def count_by_path(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for paths in self.paths.values():
            for path in paths:
                counts[path] = counts.get(path, 0) + 1
        return counts


def plan_keys(
    pm: pluggy.PluginManager,
    geometries: Mapping[str, Geometry],
    paths: Collection[str] | None = None,
) -> Plan[Hashable]:
    """Every warmer's keys for these layers, deduplicated: the worker's plan, and the
    one ``tq-warmup inspect/precompile`` print and build; ``paths`` keeps only those
    kernel paths (a pooling model that never continues a prompt: ``discovery``)."""
    batches = pm.hook.tq_warmup_keys(geometries=geometries)
    return Plan.of(c for batch in batches for c in batch if paths is None or c[1] in paths)


def describe(key: Hashable) -> str:
    """A key's full text (``inspect``, the precompile manifest): its ``describe()``
    where it has one (``KernelKey``), else its ``repr`` (a third-party warmer's key)."""
    text = getattr(key, "describe", None)
    return str(text()) if callable(text) else repr(key)


def compile_one(pm: pluggy.PluginManager, key: Hashable) -> str | None:
    """Compile one key; return an error line instead of raising."""
    try:
        if pm.hook.tq_warmup_compile(key=key) is None:
            return f"no warmer handles {key!r}"
    except Exception as exc:  # a warmer's failure must not stop the others
        name = getattr(key, "kernel", type(key).__name__)
        return f"{name}: {error_line(exc)}"
    return None


def compile_all(
    pm: pluggy.PluginManager,
    todo: Sequence[Hashable],
    threads: int,
    progress: Callable[[int, int], None] | None = None,
) -> list[str]:
    """Compile distinct keys, on ``threads`` threads; returns the error lines.
    ``progress(done, total)``, if given, is called on this thread after each first try."""

    def tried(results: Iterable[str | None]) -> list[str | None]:
        done: list[str | None] = []
        for result in results:
            done.append(result)
            if progress is not None:
                progress(len(done), len(todo))
        return done

    if threads <= 1 or len(todo) <= 1:
        results = tried(compile_one(pm, key) for key in todo)
    else:
        with ThreadPoolExecutor(
            max_workers=threads, initializer=compat.pin_to_callers_device()
        ) as pool:
            results = tried(pool.map(lambda key: compile_one(pm, key), todo))
        # A compile that failed on a pool thread gets one more try on this thread:
        # Triton parses kernel sources with `ast`, which CPython 3.11 does not make
        # thread-safe ("AST constructor recursion depth mismatch", seen here).
        results = [
            None if r is None else compile_one(pm, key)
            for key, r in zip(todo, results, strict=True)
        ]
    return [r for r in results if r is not None]


def compile_into(
    report: Report,
    pm: pluggy.PluginManager,
    todo: Sequence[Hashable],
    threads: int,
    progress: Callable[[int, int], None] | None = None,
) -> set[str]:
    """Compile ``todo`` and count it into ``report``: ``compiled``, ``shipped`` (from a
    layer of the layered cache), ``loaded`` (from Triton's disk cache), ``failed`` and
    one error line per failed key. Returns the Triton cache key directories used
    (what ``precompile`` installs)."""
    with CompileCounter() as counter:
        errors = compile_all(pm, todo, threads, progress)
    report.compiled += counter.compiled
    report.shipped += counter.shipped
    report.loaded += counter.loaded
    report.failed += len(errors)
    report.errors.extend(errors)
    return counter.dirs
