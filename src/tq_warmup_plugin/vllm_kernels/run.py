"""The host of the engine warmers: runs their jobs, counts what they compiled.

TurboQuant's keys are compiled from pure ``KernelKey``s (``warmup``). vLLM's own
kernels around them are warmed by calling vLLM's launcher code with launches turned
into compiles and loads (``compat.compile_only_launches``), because their keys depend
on objects the runner built (block tables, the model's logits) that vLLM warms for
``--kv-cache-dtype auto`` and not for TurboQuant's block sizes and sampling modes
(``engine``). A job that raises is one error line, as a failed key is: strict mode
fails startup on it, any other mode starts.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import pluggy

from .. import compat
from ..worker.report import CompileCounter, error_line
from .jobs import Declined, Engine, EngineResult, Job

__all__ = ["engine_or_reason", "plan", "run", "run_job"]

logger = logging.getLogger("vllm.tq_warmup_plugin")


def run_job(job: Job) -> str | None:
    """Run one job; the error line of a job that raised, else None."""
    try:
        job.run()
    except Exception as exc:
        return f"{job.family} ({job.what}): {error_line(exc)}"
    return None


def _timed(job: Job) -> tuple[str | None, float]:
    """``run_job`` and its seconds."""
    start = time.perf_counter()
    error = run_job(job)
    return error, time.perf_counter() - start


def plan(pm: pluggy.PluginManager, engine: Engine) -> tuple[list[Job], list[Declined], list[str]]:
    """Every warmer's contribution for this engine: jobs, declines, and one error line per
    warmer that raised while planning (each warmer is called on its own, so one that
    raises costs only its own jobs). A job two warmers contribute (equal family and
    ``what``) runs once."""
    jobs: dict[tuple[str, str], Job] = {}
    declined: list[Declined] = []
    errors: list[str] = []
    for impl in pm.hook.tq_warmup_engine_jobs.get_hookimpls():
        try:
            # a warmer's own hookimpl, called with the hook's arguments it declares
            called = impl.function(**{name: engine for name in impl.argnames})
            batch = list(cast(Iterable[Job | Declined], called))
        except Exception as exc:
            errors.append(f"engine warmer {impl.plugin_name}: {error_line(exc)}")
            continue
        for item in batch:
            if isinstance(item, Declined):
                declined.append(item)
            else:
                jobs.setdefault((item.family, item.what), item)
    return list(jobs.values()), declined, errors


def run(pm: pluggy.PluginManager, engine: Engine, load: bool, threads: int = 1) -> EngineResult:
    """Run every job with launches compiled (``load``: and loaded on the GPU) instead,
    ``threads`` at a time: the compiles are Triton's, which the TurboQuant keys already
    run concurrently (``warmup.compile_all``). Serially they cost a cold worker ten seconds
    or more, most of it ``_topk_topp_kernel``, whose every variant is a compile of the
    vocabulary's loop (``VOCAB_SIZE`` is a constexpr; vLLM 0.26.0,
    ``benchmarks/results/serve-jit/SUMMARY.md``)."""
    start = time.perf_counter()
    result = EngineResult()
    jobs, declined, result.errors = plan(pm, engine)  # a warmer that raised: its line
    for item in declined:
        level = logging.WARNING if item.warn else logging.INFO
        logger.log(level, "tq-warmup: %s: not warmed: %s", item.family, item.why)
        result.declined.append(f"{item.family}: {item.why}")

    real = [job for job in jobs if job.real]
    skipped = [job for job in jobs if not job.real]
    outcomes: list[tuple[str | None, float]] = []
    if real:  # model forwards: serially, launches running, and what they compiled
        forwards_start = time.perf_counter()
        with CompileCounter() as counter:
            outcomes += [_timed(job) for job in real]
        result.forwards = (len(real), counter.compiled, time.perf_counter() - forwards_start)
    graphs = [job for job in skipped if job.graphs]  # one after another (``Job.graphs``)
    others = [job for job in skipped if not job.graphs]
    if others and not engine.pooling:  # the model's GEMM on this thread (``logits``)
        with contextlib.suppress(Exception):  # a job that reads them names what failed
            _ = engine.model_logits
    pool_of = ThreadPoolExecutor(max(1, threads), initializer=compat.pin_to_callers_device())
    with CompileCounter() as counter, compat.compile_only_launches(load) as met:
        with pool_of as pool:
            outcomes += pool.map(_timed, others)
        # After the Triton jobs, not beside them: Dynamo's traces and Triton's cache hits
        # are both Python under one GIL, so beside each other they cannot overlap and only
        # slow each other (vLLM 0.26.0, benchmarks/results/serve-jit/SUMMARY.md).
        outcomes += [_timed(job) for job in graphs]
    result.compiled, result.compiled_names = counter.compiled, dict(counter.names)
    for job, (error, seconds) in zip(real + others + graphs, outcomes, strict=True):
        family = job.family
        result.family_seconds[family] = result.family_seconds.get(family, 0.0) + seconds
        if error is None:
            result.jobs[family] = result.jobs.get(family, 0) + 1
        else:
            result.errors.append(error)
    result.kernels = len(met)
    result.triton_seconds = (met.lookup_s, met.load_s)
    result.seconds = time.perf_counter() - start
    return result


def engine_or_reason(worker: Any, feats: compat.Features) -> tuple[Engine | None, str]:
    """The worker's ``Engine``, or None and why it cannot be read (one line)."""
    try:
        return Engine(**compat.engine_of(worker, feats)), ""
    except Exception as exc:
        return None, f"engine warmers: cannot read the engine: {error_line(exc)}"
