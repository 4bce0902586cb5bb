"""What a warmup did: counted here, printed as one log line, optionally as JSON."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from ..vllm_kernels.jobs import EngineResult

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
    vllm: EngineResult = field(default_factory=EngineResult)
    """What the engine warmers did (``vllm_kernels.run``): their jobs per family, the
    Triton launches those jobs turned into compiles and loads, what still compiled here
    per kernel name, each family's job seconds, Triton's share of them, the model
    forwards, the warmers that declined and why."""
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
        vllm = self.vllm
        if vllm.jobs:
            jobs = ", ".join(f"{family} {n}" for family, n in vllm.jobs.items())
            text += (
                f"; vLLM kernels: {jobs} ({vllm.kernels} launches, "
                f"{vllm.compiled} compiled{_names(vllm.compiled_names)}, "
                f"{vllm.seconds * 1000:.0f} ms{_most_time(vllm.family_seconds)}"
                f"{_in_triton(*vllm.triton_seconds)})"
            )
            forwards, compiles, seconds = vllm.forwards
            if forwards:
                text += (
                    f"; {forwards} warmup forwards {seconds * 1000:.0f} ms, "
                    f"{compiles} compiles in them"
                )
        for note in self.notes:
            text += f"; {note}"
        if self.errors:
            text += f"; first error: {self.errors[0]}"
        return text

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Report:
        """The report ``to_json`` wrote (the engine warmers' result nested, its pairs as
        tuples again)."""
        data = json.loads(text)
        vllm = dict(data.pop("vllm", {}))
        for pair in ("forwards", "triton_seconds"):
            if pair in vllm:
                vllm[pair] = tuple(vllm[pair])
        return cls(**data, vllm=EngineResult(**vllm))


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
