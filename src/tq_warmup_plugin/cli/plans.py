"""The plan a command prints or builds: the keys of the flags' geometries, the engine
warmers' offline jobs, and the progress lines a terminal sees (``inspect``,
``precompile``, ``driver-cache``)."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Hashable

import pluggy

from .. import compat
from ..geometry import Geometry
from ..plan.request import Planned
from ..vllm_kernels.jobs import Engine, Job
from ..worker import warmup
from .inputs import geometries

__all__ = ["boundary", "engine_jobs", "engine_of", "layers_text", "plan_of", "progress", "stage"]


def plan_of(
    args: argparse.Namespace, pm: pluggy.PluginManager
) -> tuple[warmup.Plan[Hashable], dict[str, Geometry], Planned]:
    # vLLM's import (and a model's ModelConfig) is the slow part: tens of seconds on a CPU
    if args.model is not None:
        stage(f"importing vLLM and reading {args.model} with its ModelConfig")
    else:
        stage("importing vLLM to plan the keys")
    named, planned = geometries(args)
    return warmup.plan_keys(pm, named), named, planned


def layers_text(n: int) -> str:
    return f"{n} TurboQuant layer{'' if n == 1 else 's'}" if n else "TurboQuant layers"


def boundary(planned: Planned) -> dict[str, tuple[int, int, int]]:
    """A dense model's boundary layers have the TurboQuant layers' heads; a worker only
    launches their decode if it finds them on plain FlashAttention 2. Hybrids have none."""
    g = planned.geometry
    return {"boundary": (g.num_heads, g.num_kv_heads, g.head_size)} if planned.boundary else {}


def engine_of(args: argparse.Namespace, planned: Planned) -> tuple[Engine | None, str]:
    """The engine the plan's worker would read (``vllm_kernels.offline``), or None and why not."""
    from ..vllm_kernels.offline import cpu_engine, planned_request

    if not planned.vocab_size:
        return None, "need --model or --vocab-size for their keys"
    wanted = planned.geometry.features.version
    installed = compat.installed_vllm_version()
    if compat.parse_version(installed) != wanted:  # their keys come from its code
        return None, (
            f"their keys come from the installed vLLM's code ({installed or 'none installed'})"
            f", not {wanted[0]}.{wanted[1]}'s: run inspect where vLLM {wanted[0]}.{wanted[1]} "
            "is installed"
        )
    spec = args.speculative_config
    request = planned_request(planned, spec, args.max_logprobs, args.gpu_name, args.runner)
    return cpu_engine(request), f"{'V2' if request.runner_v2 else 'V1'} runner" + (
        f", {spec['method']} k={spec['num_speculative_tokens']}"
        if spec
        else ", no speculative decoding"
    )


def engine_jobs(
    args: argparse.Namespace, planned: Planned, pm: pluggy.PluginManager
) -> tuple[Engine | None, str, list[Job], list[str], list[str]]:
    """The engine, its description, its offline jobs, the lines of what is not planned and
    one error line per warmer that raised while planning."""
    from ..vllm_kernels.offline import jobs

    engine, what = engine_of(args, planned)
    if engine is None:
        return None, what, [], [], []
    todo, declined, errors = jobs(pm, engine)
    notes = [f"{d.family}: {d.why}" for d in declined]
    if planned.moe and not planned.experts:
        why = planned.experts_why or "no experts in the config"
        notes.append(f"fused MoE: {why}; the worker's forwards warm it at startup")
    return engine, what, todo, notes, errors


def stage(text: str) -> None:
    """One progress line on a terminal's stderr (never in a pipe or a log)."""
    if sys.stderr.isatty():
        print(f"tq-warmup: {text} ...", file=sys.stderr, flush=True)


def progress(done: int, total: int) -> None:
    if sys.stderr.isatty():
        filled = math.floor(30 * done / max(total, 1))
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{total}")
        sys.stderr.flush()
        if done == total:
            sys.stderr.write("\n")
