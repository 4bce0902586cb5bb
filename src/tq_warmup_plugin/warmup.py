"""One warmup, start to end: discover, plan, compile, reserve, launch, report.

Runs inside vLLM's ``kernel_warmup``: the KV cache exists, graphs are not yet
captured and the workspace is not yet locked, in every release 0.20-0.33.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pluggy

from . import compat, keys, launches, workspace
from .discovery import discover
from .guards import draft_seq_lens
from .report import CompileCounter, Report, error_line
from .settings import Settings


def _compile_one(pm: pluggy.PluginManager, key: Hashable) -> str | None:
    """Compile one key; return an error line instead of raising."""
    try:
        if pm.hook.tq_warmup_compile(key=key) is None:
            return f"no warmer handles {key!r}"
    except Exception as exc:  # a warmer's failure must not stop the others
        name = getattr(key, "kernel", type(key).__name__)
        return f"{name}: {error_line(exc)}"
    return None


def _pin_to_callers_device() -> Callable[[], None] | None:
    """An initializer that moves a new thread to the caller's current device.

    Triton keys its in-memory kernel cache by the current device, and a new thread
    starts on device 0: without this, tensor-parallel rank 1 warmed device 0's cache
    and still compiled at runtime (seen on two H200s with vLLM 0.26.0).
    """
    try:
        from triton.runtime import driver

        active = driver.active
        device = active.get_current_device()
    except (ImportError, RuntimeError):  # no Triton, or no active driver: nothing to pin
        return None
    return lambda: active.set_current_device(device)


def compile_all(pm: pluggy.PluginManager, todo: list[Hashable], threads: int) -> list[str]:
    """Compile distinct keys, on ``threads`` threads; returns the error lines."""
    if threads <= 1 or len(todo) <= 1:
        results = [_compile_one(pm, key) for key in todo]
    else:
        with ThreadPoolExecutor(max_workers=threads, initializer=_pin_to_callers_device()) as pool:
            results = list(pool.map(lambda key: _compile_one(pm, key), todo))
        # A compile that failed on a pool thread gets one more try on this thread:
        # Triton parses kernel sources with `ast`, which CPython 3.11 does not make
        # thread-safe ("AST constructor recursion depth mismatch", seen here).
        results = [
            None if r is None else _compile_one(pm, key)
            for key, r in zip(todo, results, strict=True)
        ]
    return [r for r in results if r is not None]


def run(worker: Any, settings: Settings, pm: pluggy.PluginManager | None = None) -> Report:
    """Warm every TurboQuant kernel key this worker's runtime will launch."""
    start = time.perf_counter()
    version_text = compat.installed_vllm_version() or ""
    try:
        feats = compat.release_features(version_text)
    except compat.UnsupportedRelease as exc:
        return Report(status="unsupported", reason=str(exc), vllm_version=version_text)

    found = discover(worker, feats)
    report = Report(vllm_version=version_text, layers=len(found.geometries))
    distinct = dict.fromkeys(found.geometries.values())
    report.geometries = [g.to_dict() for g in distinct]
    report.errors.extend(f"layer {name}: {why}" for name, why in found.refused.items())
    if not found.geometries:
        report.status = "skipped"
        report.reason = "no TurboQuant attention layers in this worker"
        if found.refused:
            report.reason += f" ({len(found.refused)} refused: {report.errors[0]})"
        return report
    method, async_scheduling = compat.speculative_setup(getattr(worker, "vllm_config", None))
    problem = method and compat.spec_decode_problem(
        feats, method, async_scheduling, compat.worker_uses_v2(worker), draft_seq_lens.in_place()
    )
    if problem:  # a warning, not an error: strict mode must not refuse it
        logging.getLogger("vllm.tq_warmup_plugin").warning(problem)

    if pm is None:
        from .hookspecs import plugin_manager

        pm = plugin_manager()
    batches = pm.hook.tq_warmup_keys(geometries=found.geometries)
    the_plan = keys.plan(
        c for batch in batches for c in batch if found.paths is None or c[1] in found.paths
    )
    if found.note:
        report.notes.append(found.note)
    report.keys = the_plan.count_by_path()
    report.distinct = len(the_plan.keys)

    with CompileCounter() as counter:
        report.errors.extend(compile_all(pm, the_plan.keys, settings.threads))
    report.compiled, report.loaded = counter.compiled, counter.loaded
    report.failed = len(report.errors) - len(found.refused)

    try:
        report.workspace_bytes = workspace.reserve(
            workspace.plan_reservation(found.geometries.values()) if found.paths is None else [],
            feats,
        )
    except workspace.ReservationError as exc:  # strict mode fails startup on the error
        report.workspace_bytes = exc.reserved
        logging.getLogger("vllm.tq_warmup_plugin").warning(
            workspace.oom_warning(exc, found.geometries.values())
        )
        report.errors.append(f"workspace: out of memory for {exc.needed / 2**20:.1f} MiB")
        report.failed += 1
    if feats.prefill_buffers_cached and found.device is not None:
        for name, g in found.geometries.items():
            compat.preallocate_prefill_buffers(found.impls[name], found.device, g.max_model_len)
    report.warmup_s = time.perf_counter() - start

    if settings.launch and getattr(found.device, "type", None) == "cuda":
        todo = launches.plan(found.geometries, found.boundary, prefill_only=found.paths is not None)
        fresh = launches.not_yet_launched(todo, found.device)
        if len(fresh) < len(todo):
            repeated = len(todo) - len(fresh)
            report.notes.append(
                f"{repeated} first launches already made ({compat.rewarm_cause(feats)})"
            )
        done, report.launch_s, errors = launches.launch_all(fresh, found.impls, found.device)
        report.launches = done
        report.errors.extend(errors)
        report.failed += len(errors)
    return report
