"""What a warmup did: counted here, printed as one log line, optionally as JSON."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["CompileCounter", "Report", "error_line"]


def error_line(exc: BaseException) -> str:
    """``Type: first line of the message``: errors go to one log line."""
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


@dataclass
class Report:
    """The outcome of one worker's warmup."""

    status: str = "ok"
    """``ok``; ``skipped`` (no TurboQuant layer: nothing to do); ``unsupported`` (a vLLM
    release outside ``compat.SUPPORTED``: declined); ``failed``."""
    reason: str = ""
    vllm_version: str = ""
    layers: int = 0
    keys: dict[str, int] = field(default_factory=dict)
    """Distinct keys per kernel path (a key shared by two paths counts in both)."""
    distinct: int = 0
    compiled: int = 0
    shipped: int = 0
    """Loaded from a read-only layer of the layered cache (``layered_cache``): a shipped,
    precompiled cache whose manifest holds here."""
    loaded: int = 0
    """Loaded from Triton's own on-disk cache instead of compiled."""
    failed: int = 0
    warmup_s: float = 0.0
    """Discovery, Triton compiles and the workspace reservation."""
    workspace_bytes: int = 0
    launches: int = 0
    """Non-Triton kernel launches made so CUDA loads their modules now (``launches``)."""
    launch_s: float = 0.0
    """Their time, apart from ``warmup_s``: a cost moved from the first requests, paid
    in every process (CUDA's module loading is per process; no disk cache helps)."""
    vllm_jobs: dict[str, int] = field(default_factory=dict)
    """Jobs of the engine warmers that warmed vLLM's own kernels, per family
    (``engine_warmup``): slot mapping, rejection sampler, logprobs."""
    vllm_launches: int = 0
    """Triton launches those jobs turned into compiles and loads."""
    vllm_s: float = 0.0
    vllm_compiles: int = 0
    """Of ``vllm_launches``, those Triton compiled here (the rest came from disk)."""
    vllm_compiled: dict[str, int] = field(default_factory=dict)
    """Those compiles per kernel name: what neither a shipped layer nor the compile-ahead
    child had built."""
    vllm_family_s: dict[str, float] = field(default_factory=dict)
    """Those jobs' summed seconds per family (``EngineResult.family_seconds``); the line
    names the family with the most: job time, which threads can make more than the wall's."""
    vllm_lookup_s: float = 0.0
    """Of that job time, Triton's launches: bind, key, cache (``compat.Launches``)."""
    vllm_load_s: float = 0.0
    """And Triton's ``_init_handles``: the C launcher and the module's load on the GPU."""
    vllm_forwards: int = 0
    """Of those jobs, the model forwards (``engine_warmup.EngineResult.forwards``)."""
    vllm_forward_compiles: int = 0
    vllm_forward_s: float = 0.0
    declined: list[str] = field(default_factory=list)
    """Engine warmers with nothing to do here, and why."""
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What was left out or declined on purpose, and why (not problems)."""
    geometries: list[dict[str, Any]] = field(default_factory=list)
    """Distinct layer geometries as discovered: ``tq-warmup inspect/precompile
    --geometry-json`` plans from these exactly what this startup warmed."""

    @property
    def is_problem(self) -> bool:
        """Whether the operator should hear about it at WARNING level."""
        return self.status in ("unsupported", "failed") or bool(self.errors)

    def line(self) -> str:
        """The single INFO/WARNING line vLLM's log gets."""
        if self.status != "ok":
            return f"tq-warmup: {self.status}: {self.reason}"
        paths = ", ".join(f"{path} {n}" for path, n in self.keys.items())
        if sum(self.keys.values()) != self.distinct:  # e.g. continuation and decode share one
            paths += "; a key two paths share counts in each"
        text = (
            f"tq-warmup: {self.layers} TurboQuant layers, {self.distinct} distinct kernel keys "
            f"({paths}): {self.compiled} compiled, {self.shipped} from the shipped cache, "
            f"{self.loaded} from Triton's disk cache, "
            f"{self.failed} failed; workspace {self.workspace_bytes / 2**20:.1f} MiB; "
            f"{self.warmup_s * 1000:.0f} ms"
        )
        if self.launches:
            text += f"; {self.launches} first launches {self.launch_s * 1000:.0f} ms"
        if self.vllm_jobs:
            jobs = ", ".join(f"{family} {n}" for family, n in self.vllm_jobs.items())
            text += (
                f"; vLLM kernels: {jobs} ({self.vllm_launches} launches, "
                f"{self.vllm_compiles} compiled{_names(self.vllm_compiled)}, "
                f"{self.vllm_s * 1000:.0f} ms{_most_time(self.vllm_family_s)}"
                f"{_in_triton(self.vllm_lookup_s, self.vllm_load_s)})"
            )
            if self.vllm_forwards:
                text += (
                    f"; {self.vllm_forwards} warmup forwards {self.vllm_forward_s * 1000:.0f} ms, "
                    f"{self.vllm_forward_compiles} compiles in them"
                )
        for note in self.notes:
            text += f"; {note}"
        if self.errors:
            text += f"; first error: {self.errors[0]}"
        return text

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)


def _most_time(seconds: dict[str, float]) -> str:
    """``, most job time: EAGLE helpers 719 ms`` (its jobs' seconds summed, so on threads
    it may exceed the wall time), or nothing."""
    if not seconds:
        return ""
    family, took = max(seconds.items(), key=lambda item: (item[1], item[0]))
    return f", most job time: {family} {took * 1000:.0f} ms"


def _in_triton(lookup_s: float, load_s: float) -> str:
    """``, in Triton: lookups 120 ms, loads 300 ms`` (job time, summed over threads), or
    nothing where no launch was met: the rest of the job time is vLLM's own code."""
    if not lookup_s and not load_s:
        return ""
    return f", in Triton: lookups {lookup_s * 1000:.0f} ms, loads {load_s * 1000:.0f} ms"


def _names(counts: dict[str, int]) -> str:
    """``: _topk_topp_kernel x6, _ranks_kernel`` (most first), or nothing."""
    if not counts:
        return ""
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return ": " + ", ".join(name if n == 1 else f"{name} x{n}" for name, n in ranked)


class CompileCounter:
    """Counts Triton compilations and cache loads while active, and the cache key
    directories they used.

    Chains ``triton.knobs.compilation.listener``, which Triton calls from
    ``compile()`` with ``cache_hit`` for both outcomes and ``metadata_group``, the
    kernel's file name -> path (triton 3.6-3.8). A hit whose files lie in a layer of
    the layered cache is ``shipped``, any other hit ``loaded``. Compiles may run on
    worker threads, hence the lock.
    """

    def __init__(self) -> None:
        self.compiled = 0
        self.shipped = 0
        self.loaded = 0
        self.dirs: set[str] = set()
        """Names of the Triton cache key directories of every kernel compiled or loaded."""
        self.names: dict[str, int] = {}
        """Compiles per kernel name (``src.name``), for the report of what still compiled."""
        self._lock = threading.Lock()
        self._previous: Any = None
        self._in_layer: Callable[[str], bool] = lambda path: False

    def _listener(self, *, cache_hit: bool, **kwargs: Any) -> None:
        paths = list((kwargs.get("metadata_group") or {}).values())
        shipped = cache_hit and bool(paths) and self._in_layer(paths[0])
        with self._lock:
            if paths:  # all files of a kernel lie in its key directory
                self.dirs.add(os.path.basename(os.path.dirname(paths[0])))
            if not cache_hit:
                self.compiled += 1
                name = str(getattr(kwargs.get("src"), "name", "?"))
                self.names[name] = self.names.get(name, 0) + 1
            elif shipped:
                self.shipped += 1
            else:
                self.loaded += 1
        if self._previous is not None:
            self._previous(cache_hit=cache_hit, **kwargs)

    def __enter__(self) -> CompileCounter:
        from triton import knobs

        from ..shipped.layered_cache import served_by_layer

        self._in_layer = served_by_layer
        self._previous = knobs.compilation.listener
        knobs.compilation.listener = self._listener
        return self

    def __exit__(self, *exc: object) -> None:
        from triton import knobs

        knobs.compilation.listener = self._previous
