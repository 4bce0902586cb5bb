"""The compile-ahead child's work (``ahead``): build one worker's TurboQuant keys, planned
from its config (``plan.request.worker_plan``), and its offline engine jobs
(``vllm_kernels.offline``) for its GPU architecture into the Triton cache its environment
names, host launchers included where Triton builds them (``compat.build_host_launcher``),
and write one JSON line: the jobs built, the error lines, the seconds, and of them those
of the plan.

A hybrid's KV-block zeroing keys come from the same plan (``Planned.zeroing``, with the
worker's real drafter), built with the engine jobs.

The worker forks it (``ahead.start``), so it has vLLM imported already; ``python -m
tq_warmup_plugin.vllm_kernels.ahead_child JSON`` runs the same work in a fresh interpreter, vLLM's
import included (``benchmarks/tqbench/ahead_cost.py`` times that). Its own module, so that
nothing the worker imports loads it before the fork.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..worker.report import error_line

if TYPE_CHECKING:
    import pluggy

    from ..compat import Features
    from ..plan.request import Planned
    from .jobs import Job

__all__ = [
    "ERRORS_KEPT",
    "FAMILY",
    "OUTPUT_LIMIT",
    "die_with_parent",
    "key_jobs",
    "main",
    "run_child",
    "serial_cpu_ops",
    "worker_plan",
]

OUTPUT_LIMIT = 1 << 16
"""The most bytes of the one JSON line, which the worker reads from a pipe whose buffer
(64 KiB on Linux) must hold it all: a child blocked on a full pipe never ends."""
ERRORS_KEPT = 8
"""Error lines kept in the result (the worker's report names the first)."""
FAMILY = "TurboQuant"
"""The jobs of TurboQuant's own keys, for error lines."""


def die_with_parent() -> None:
    """Be killed with the thread that started this process (Linux ``PR_SET_PDEATHSIG``), so
    that no compile outlives its worker, nor the child that the worker stopped: the child
    sets it for itself and for each compile process it forks. Elsewhere, nothing."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


def serial_cpu_ops() -> None:
    """Run torch's CPU operators on the calling thread alone, here and in the compile
    processes forked from here. A fork keeps the worker's OpenMP state but none of its
    thread team, and GNU OpenMP's next parallel region then waits for those threads
    forever: the V1 block tables a worker's request sizes (``cpu_block_tables``, millions
    of entries) are zero-filled in parallel, so the child hung whenever the worker had run a
    parallel CPU operator before the fork. With one thread, ATen runs every operator
    inline; the child's parallelism is its processes (``offline.build``)."""
    try:
        import torch
    except ImportError:  # nothing of torch's to run
        return
    torch.set_num_threads(1)


def worker_plan(config: Any, given: Mapping[str, Any], feats: Features) -> Planned:
    """What a worker of ``config`` will discover (``plan.request.worker_plan``, the batched
    verify path's rows where ``given["verify"]``): its TurboQuant layers and a hybrid's
    KV-block zeroing; a plan that fails raises its one line."""
    from ..plan import request as plan_request

    v2, verify = bool(given["request"]["runner_v2"]), bool(given.get("verify"))
    return plan_request.worker_plan(config, feats, int(given["arch"]), v2, verify)


def key_jobs(pm: pluggy.PluginManager, planned: Planned) -> list[Job]:
    """One job per TurboQuant key of ``planned``'s layers, as the worker's warmup plans
    them (``keyplan.plan_keys``)."""
    from functools import partial

    from ..plan import request as plan_request
    from ..worker import keyplan
    from .jobs import Job

    keys = keyplan.plan_keys(pm, plan_request.named_geometries(planned)).keys
    return [Job(FAMILY, keyplan.describe(key), partial(_compile, pm, key)) for key in keys]


def _compile(pm: pluggy.PluginManager, key: Any) -> None:
    from ..worker.keyplan import compile_one

    line = compile_one(pm, key)
    if line is not None:
        raise RuntimeError(line)


def run_child(given: Mapping[str, Any], out: int, config: Any = None) -> int:
    """Build ``given``'s jobs (``{"request", "arch", "sms", "processes", "verify"}``) and write
    the result line to file descriptor ``out``; the exit code (1 where a job failed).
    ``config``: the worker's ``VllmConfig``, which a fork shares: its TurboQuant keys come
    first, as the worker's own warmup compiles them first; None (``python -m``): the
    engine jobs alone. The TurboQuant plan failing costs its one error line, not the
    engine jobs."""
    began = time.perf_counter()
    phases: dict[str, float] = {}
    die_with_parent()
    serial_cpu_ops()
    keys = 0
    try:
        from ..shipped.precompile import use_compile_only_target
        from ..worker.plugins import plugin_manager
        from .offline import H100_SMS, EngineRequest, build, cpu_engine, jobs

        use_compile_only_target(int(given["arch"]))
        request = EngineRequest.from_dict(given["request"])
        planned, unplanned = None, []
        if config is not None:
            try:
                planned = worker_plan(config, given, request.features)
            except Exception as exc:  # a config unlike any planned: the worker plans its own
                unplanned.append(f"{FAMILY} keys not planned: {error_line(exc)}")
            else:  # a hybrid's zeroing keys are built with the engine's
                request = dataclasses.replace(request, zeroing=planned.zeroing)
        engine = cpu_engine(request)  # vLLM's import, if new
        pm = plugin_manager()
        sms = int(given.get("sms") or H100_SMS)
        todo, _, errors = jobs(pm, engine, sms=sms)
        errors = unplanned + errors
        if planned is not None:
            ours = key_jobs(pm, planned)
            keys, todo = len(ours), ours + todo
        phases["plan"] = time.perf_counter() - began
        processes = int(given["processes"])
        done, failed = build(todo, sms=sms, processes=processes, each=die_with_parent)
        result: dict[str, Any] = {"built": len(done), "errors": errors + failed, "keys": keys}
    except Exception as exc:  # one line, as the worker's own errors are
        result = {"built": 0, "errors": [error_line(exc)]}
    failures = len(result["errors"])
    result["errors"] = [str(line)[:400] for line in result["errors"][:ERRORS_KEPT]]
    result["failed"] = failures
    result["seconds"] = time.perf_counter() - began
    result.update(phases)  # where its time went: the worker's report line says it
    os.write(out, (json.dumps(result) + "\n").encode()[:OUTPUT_LIMIT])
    return 0 if not failures else 1


def main(argv: Sequence[str] | None = None) -> int:
    """The child's work in a fresh interpreter: the result line on stdout, vLLM's talk on
    stderr."""
    argv = sys.argv[1:] if argv is None else argv
    sys.stdout.flush()
    result_fd = os.dup(1)
    os.dup2(2, 1)  # vLLM's import talks on stdout; the result line is ours alone
    return run_child(json.loads(argv[0]), result_fd)


if __name__ == "__main__":
    sys.exit(main())
