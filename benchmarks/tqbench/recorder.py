"""Records the Triton compiles of one process by phase, and reads torch.profiler sessions.

Compilations are seen through ``triton.knobs.runtime.jit_cache_hook`` /
``jit_post_compile_hook`` and ``triton.knobs.compilation.listener``. vLLM's JIT
monitor replaces ``jit_post_compile_hook`` with a wrapper when startup ends
(and, in ``error`` mode, raises before calling the hook it wrapped), so the
recorder wraps the hook again after startup to stay outermost; every hook
forwards to the one it replaced. Nothing here imports torch or Triton at import time.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from tq_warmup_plugin.compat import KERNEL_MODULES

__all__ = [
    "TQ_KERNELS",
    "JitRecorder",
    "breakdown",
    "first_request_extra",
    "is_tq_kernel",
    "op_cpu_times",
    "profiler",
    "slow_leaves",
    "startup_summary",
]

TQ_KERNELS: frozenset[str] = frozenset(KERNEL_MODULES)


def is_tq_kernel(name: str, module: str | None = None) -> bool:
    """Whether a kernel (short or dotted name, or its module) is one of TurboQuant's."""
    short = name.rsplit(".", 1)[-1]
    return short in TQ_KERNELS or (module is not None and "turboquant" in module)


def startup_summary(events: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """TurboQuant kernels compiled / loaded while the engine started, and totals."""
    tq = [e for e in events if is_tq_kernel(e["kernel"], e.get("module"))]
    return {
        "tq_compiled": sorted({e["kernel"] for e in tq if e["cache_hit"] is not True}),
        "tq_loaded": sorted({e["kernel"] for e in tq if e["cache_hit"] is True}),
        "all_compiled_n": sum(e["cache_hit"] is not True for e in events),
        "all_loaded_n": sum(e["cache_hit"] is True for e in events),
    }


class JitRecorder:
    """Records every Triton compile / disk-cache load in this process, by phase.

    * ``knobs.runtime.jit_cache_hook`` (called before ``compile()``): start time.
    * ``knobs.compilation.listener`` (called inside ``compile()``): ``cache_hit``,
      i.e. whether the kernel came from Triton's disk cache; also catches
      compiles that do not go through a ``@triton.jit`` launch.
    * ``knobs.runtime.jit_post_compile_hook`` (after ``compile()``): duration.

    Each hook forwards to the hook it replaced. :meth:`ensure_outermost` re-wraps
    ``jit_post_compile_hook`` when someone (vLLM's JIT monitor) replaced it, so
    the event is recorded before a monitor in ``error`` mode raises.
    """

    def __init__(self, knobs: Any) -> None:
        self.knobs = knobs
        self.events: list[dict[str, Any]] = []
        self.phase = "startup"
        self.part = ""
        self._t0 = time.perf_counter()
        self._lock = threading.Lock()
        self._tls = threading.local()
        self._post_wrapper: Callable[..., Any] | None = None

    # -- installation ------------------------------------------------------------------

    def install(self) -> None:
        rt = self.knobs.runtime
        prev_cache_hook = rt.jit_cache_hook

        def cache_hook(**kwargs: Any) -> Any:
            with contextlib.suppress(Exception):
                self._tls.start = time.perf_counter()
            if prev_cache_hook is not None:
                return prev_cache_hook(**kwargs)
            return None

        rt.jit_cache_hook = cache_hook

        comp = self.knobs.compilation
        prev_listener = comp.listener

        def listener(**kwargs: Any) -> None:
            with contextlib.suppress(Exception):
                self._on_listener(kwargs)
            if prev_listener is not None:
                prev_listener(**kwargs)

        comp.listener = listener
        self._wrap_post_hook()

    def ensure_outermost(self) -> bool:
        """Re-wrap ``jit_post_compile_hook`` if it was replaced; True if it was."""
        if self.knobs.runtime.jit_post_compile_hook is self._post_wrapper:
            return False
        self._wrap_post_hook()
        return True

    def _wrap_post_hook(self) -> None:
        rt = self.knobs.runtime
        inner = rt.jit_post_compile_hook
        tls = self._tls

        def post_hook(**kwargs: Any) -> Any:
            if getattr(tls, "busy", False):  # an outer wrapper of ours already recorded it
                return inner(**kwargs) if inner is not None else None
            tls.busy = True
            try:
                with contextlib.suppress(Exception):
                    self._on_post(kwargs)
                return inner(**kwargs) if inner is not None else None
            finally:
                tls.busy = False

        rt.jit_post_compile_hook = post_hook
        self._post_wrapper = post_hook

    def set_phase(self, phase: str, part: str) -> None:
        self.phase, self.part = phase, part

    # -- event handling ----------------------------------------------------------------

    def _new_event(self, name: str, module: str | None) -> dict[str, Any]:
        ev: dict[str, Any] = {
            "kernel": name,
            "module": module,
            "phase": self.phase,
            "part": self.part,
            "t": round(time.perf_counter() - self._t0, 4),
            "cache_hit": None,
            "compile_s": None,
            "post_hook": False,
        }
        with self._lock:
            self.events.append(ev)
        return ev

    def _on_listener(self, kwargs: dict[str, Any]) -> None:
        src = kwargs.get("src")
        name = str(getattr(src, "name", None) or "<unknown>")
        fn = getattr(src, "fn", None)
        module = getattr(fn, "module", None)  # JITFunction.module: the kernel's module name
        ev = self._new_event(name, module if isinstance(module, str) else None)
        ev["cache_hit"] = bool(kwargs.get("cache_hit"))
        self._tls.last = ev

    def _on_post(self, kwargs: dict[str, Any]) -> None:
        info = kwargs.get("fn")
        name = str(getattr(info, "name", None) or "<unknown>")
        module = getattr(info, "module", None)
        ev = getattr(self._tls, "last", None)
        self._tls.last = None
        if ev is None or ev["post_hook"] or ev["kernel"] != name.rsplit(".", 1)[-1]:
            ev = self._new_event(name, module if isinstance(module, str) else None)
        elif isinstance(module, str):
            ev["module"] = module
        ev["post_hook"] = True
        start = getattr(self._tls, "start", None)
        if start is not None:
            ev["compile_s"] = round(time.perf_counter() - start, 4)
            self._tls.start = None

    # -- summaries ---------------------------------------------------------------------

    def phase_events(self, phase: str) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(e) for e in self.events if e["phase"] == phase]

    @staticmethod
    def summarize(events: Sequence[dict[str, Any]]) -> dict[str, Any]:
        tq = [e for e in events if is_tq_kernel(e["kernel"], e.get("module"))]
        other = [e for e in events if e not in tq]
        return {
            "tq_compiles_after_startup": [e["kernel"] for e in tq if e["cache_hit"] is not True],
            "tq_loads_after_startup": [e["kernel"] for e in tq if e["cache_hit"] is True],
            "first_tq_jit": [e["kernel"] for e in tq if e["part"] == "first"],
            "steady_tq_jit": [e["kernel"] for e in tq if e["part"] == "steady"],
            "other_jit_after_startup": [e["kernel"] for e in other],
        }


# --------------------------------------------------------------------------------------
# torch.profiler (``run --profile-phases``)
# --------------------------------------------------------------------------------------


def profiler() -> Any:
    """A torch.profiler session over CPU and CUDA, recording input shapes."""
    from torch.profiler import ProfilerActivity, profile

    # Shapes name the specialization behind a slow first call (which GEMM, which attention).
    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True)


def breakdown(prof: Any, top: int = 15) -> dict[str, Any]:
    """Where a profiled stretch spent its time: the ``top`` names by self GPU time (the
    kernels) and by self CPU time (host work and launches), each with its call count."""

    def device_us(e: Any) -> float:  # torch 2.4+: device_*; older: cuda_*
        found = getattr(e, "self_device_time_total", None)
        return float(e.self_cuda_time_total if found is None else found)

    events = list(prof.key_averages())
    gpu = sorted((e for e in events if device_us(e) > 0), key=device_us, reverse=True)
    cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
    return {
        "gpu_us": round(sum(device_us(e) for e in events)),
        "cpu_us": round(sum(e.self_cpu_time_total for e in events)),
        "kernels": [
            {"name": e.key[:120], "calls": e.count, "us": round(device_us(e))} for e in gpu[:top]
        ],
        "host": [
            {"name": e.key[:120], "calls": e.count, "us": round(e.self_cpu_time_total)}
            for e in cpu[:top]
        ],
    }


def op_cpu_times(prof: Any) -> dict[str, float]:
    """Total CPU microseconds per op name (includes children: a launch and what it waits on)."""
    return {e.key: float(e.cpu_time_total) for e in prof.key_averages()}


def slow_leaves(prof: Any, min_us: float = 2000.0, top: int = 12) -> list[dict[str, Any]]:
    """The slowest childless CPU events (module loads, syncs, launches) with their callers.

    A one-time cost (CUDA loading a kernel's module, a cuBLAS handle) is a leaf under the op
    that needed it; the caller chain and the nearest op's input shapes say which specialization.
    """
    leaves = [e for e in prof.events() if not e.cpu_children and e.cpu_time_total >= min_us]
    leaves.sort(key=lambda e: -e.cpu_time_total)
    rows = []
    for e in leaves[:top]:
        chain: list[str] = []
        shapes, parent = None, e.cpu_parent
        while parent is not None and len(chain) < 6:
            chain.append(parent.name)
            if shapes is None and parent.input_shapes:
                shapes = str(parent.input_shapes)[:300]
            parent = parent.cpu_parent
        rows.append(
            {"leaf": e.name, "us": round(e.cpu_time_total), "callers": chain, "shapes": shapes}
        )
    return rows


def first_request_extra(
    first: dict[str, float], steady: dict[str, float], top: int = 15
) -> list[dict[str, Any]]:
    """The ops whose CPU time grew most from the steady to the first request."""
    extra = sorted(first, key=lambda k: steady.get(k, 0.0) - first[k])[:top]
    return [
        {"op": k, "first_us": round(first[k]), "steady_us": round(steady.get(k, 0.0))}
        for k in extra
    ]
