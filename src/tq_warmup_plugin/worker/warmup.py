"""The host: builds the warmers' plugin manager and runs one worker's warmup with it.

Start to end: discover, plan, compile, reserve, launch, report. Runs inside vLLM's
``kernel_warmup``: the KV cache exists, graphs are not yet captured and the workspace
is not yet locked, in every supported release. The CLI plans and compiles through the
same functions (``plugin_manager``; ``plan_keys`` and ``compile_into`` of ``keyplan``,
whose names this module keeps), so what ``inspect`` prints and ``precompile`` builds, and
the error lines of a failed compile, are the worker's.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import pluggy

from .. import compat
from ..geometry import Geometry
from ..guards import draft_seq_lens, prefix_fast_path
from ..settings import Settings
from ..vllm_kernels import ahead
from ..vllm_kernels import run as engine_warmup
from . import launches, spec_problem, workspace
from .discovery import discover
from .keyplan import Plan, compile_all, compile_into, compile_one, describe, plan_keys
from .plugins import plugin_manager
from .report import Report

# A child of vLLM's "vllm" logger inherits its handlers and format.
logger = logging.getLogger("vllm.tq_warmup_plugin")

__all__ = [
    "Plan",
    "compile_all",
    "compile_into",
    "compile_one",
    "describe",
    "plan_keys",
    "plugin_manager",
    "run",
]


def _with_workspace_sizes(
    geometries: dict[str, Geometry], feats: compat.Features
) -> dict[str, Geometry]:
    """On HIP, the geometries with the real workspace buffer sizes, which decode and
    dequantization pointers take their storage from (``Geometry.workspace_bytes``)."""
    if not any(g.pointer_ranges for g in geometries.values()):
        return geometries
    sizes = workspace.buffer_sizes(feats)
    return {name: dataclasses.replace(g, workspace_bytes=sizes) for name, g in geometries.items()}


def run(worker: Any, settings: Settings, pm: pluggy.PluginManager | None = None) -> Report:
    """Warm every TurboQuant kernel key this worker's runtime will launch, then reap the
    compile-ahead child (``ahead``): after the engine warmers, which found on disk what it
    had built (a child still running then is stopped), and on every other way out too."""
    try:
        report = _run(worker, settings, pm)
    finally:
        line = ahead.wait()
    if line:
        report.notes.append(line)
    return report


def _run(worker: Any, settings: Settings, pm: pluggy.PluginManager | None) -> Report:
    start = time.perf_counter()
    version_text = compat.installed_vllm_version() or ""
    try:
        feats = compat.release_features(version_text)
    except compat.UnsupportedRelease as exc:
        return Report(status="unsupported", reason=str(exc), vllm_version=version_text)
    # Everything below is one-off work (compiles, first launches, the engine warmers'
    # inputs): kept out of the allocator peak an extensible KV cache reserves for serving.
    with compat.kv_warmup_window(worker, feats):
        return _warm(worker, settings, pm, feats, version_text, start)


def _warm(
    worker: Any,
    settings: Settings,
    pm: pluggy.PluginManager | None,
    feats: compat.Features,
    version_text: str,
    start: float,
) -> Report:
    found = discover(worker, feats)
    report = Report(vllm_version=version_text, layers=len(found.geometries))
    report.errors.extend(f"layer {name}: {why}" for name, why in found.refused.items())
    if found.note:
        report.notes.append(found.note)
    if not found.geometries:
        report.status = "skipped"
        report.reason = "no TurboQuant attention layers in this worker"
        if found.flydsl:  # they exist, but run none of the warmed kernels
            report.reason = found.note
        if found.refused:
            report.reason += f" ({len(found.refused)} refused: {report.errors[0]})"
        return report
    method, async_scheduling = compat.speculative_setup(getattr(worker, "vllm_config", None))
    problem = method and spec_problem.spec_decode_problem(
        feats,
        method,
        async_scheduling,
        compat.worker_uses_v2(worker, feats),
        draft_seq_lens.in_place(),
        verify_batched=any(g.verify_len for g in found.geometries.values()),
    )
    if problem:  # a warning, not an error: strict mode must not refuse it
        logger.warning(problem)
    unguarded = prefix_fast_path.missing(feats, settings.prefix_guard)
    if unguarded:  # the install's WARNING was said; strict mode refuses to start
        report.errors.append(unguarded)

    # Reserved before compiling: on HIP the workspace's final size is part of the keys.
    try:
        report.workspace_bytes = workspace.reserve(
            workspace.plan_reservation(found.geometries.values()) if found.paths is None else [],
            feats,
        )
    except workspace.ReservationError as exc:  # strict mode fails startup on the error
        report.workspace_bytes = exc.reserved
        logger.warning(workspace.oom_warning(exc, found.geometries.values()))
        report.errors.append(f"workspace: out of memory for {exc.needed / 2**20:.1f} MiB")
        report.failed += 1
    geometries = _with_workspace_sizes(found.geometries, feats)
    report.geometries = [g.to_dict() for g in dict.fromkeys(geometries.values())]

    if pm is None:
        pm = plugin_manager()
    the_plan = plan_keys(pm, geometries, found.paths)
    report.keys = the_plan.count_by_path()
    report.distinct = len(the_plan.keys)
    compile_into(report, pm, the_plan.keys, settings.threads)
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
    if getattr(found.device, "type", None) == "cuda":  # before anything torch.compiles
        _load_compiled(report)
    if settings.vllm_kernels:
        _warm_vllm_kernels(report, worker, feats, pm, found.device, settings.threads)
    return report


def _load_compiled(report: Report) -> None:
    """The shipped driver-cache entry's ``torch.compile`` artifacts (``driver.compiled``):
    the warmers' graphs, and a first request's, then load instead of compiling."""
    from ..driver import compiled

    loaded = compiled.load()
    if loaded is None:
        return
    line, ok = loaded
    if not ok:
        logger.warning(f"tq-warmup: {line}")
    report.notes.append(line)


def _warm_vllm_kernels(
    report: Report,
    worker: Any,
    feats: compat.Features,
    pm: pluggy.PluginManager,
    device: Any,
    threads: int,
) -> None:
    """vLLM's own kernels this TurboQuant worker reaches (``engine_warmup``); loaded on
    the GPU only where the layers live on one (the CLI and CPU tests compile only). A
    plugin manager without engine warmers reads nothing of the runner."""
    if not pm.hook.tq_warmup_engine_jobs.get_hookimpls():
        return
    engine, why = engine_warmup.engine_or_reason(worker, feats)
    if engine is None:
        report.errors.append(why)
        return
    done = engine_warmup.run(pm, engine, getattr(device, "type", None) == "cuda", threads)
    report.vllm = done
    report.errors.extend(done.errors)
    report.failed += len(done.errors)
