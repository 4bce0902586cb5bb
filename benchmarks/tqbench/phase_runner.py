"""Times each phase's first and steady request in a started engine, and builds the records.

``run`` prepares a :class:`RunContext` and starts the engine
(:func:`benchmarks.tqbench.run.start_engine`); this module runs
the phases :mod:`benchmarks.tqbench.phases` plans, one ``LLM.generate`` per request, and
turns each phase's two requests into one record: seconds, the prefix-cache hits it
expected and got, and the Triton compiles :mod:`benchmarks.tqbench.recorder` saw.
"""

from __future__ import annotations

import argparse
import contextlib
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.tqbench import logs, phases, recorder, records
from benchmarks.tqbench.phases import AUTO, PHASES, Geometry, PhasePlan

__all__ = ["TQ_ONLY_FIELDS", "PhaseRunner", "RunContext", "run_phases"]

# Blank (None) in the records of the ``auto`` preset, which has no TurboQuant layer.
TQ_ONLY_FIELDS: tuple[str, ...] = (
    *("tq_compiles_after_startup", "tq_loads_after_startup", "first_tq_jit", "steady_tq_jit"),
)


@dataclass
class RunContext:
    """What ``run`` prepared before importing anything heavy."""

    args: argparse.Namespace
    geometry: Geometry
    work: Path
    report_dir: Path
    plan: PhasePlan
    max_model_len: int
    base: dict[str, Any]
    out: Path | None
    records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def plugin_on(self) -> bool:
        return bool(self.args.plugin == "on")

    def flush(self) -> None:
        """Rewrite ``--out`` with the records so far (a killed run keeps them)."""
        if self.out is not None:
            records.write_records(self.out, self.records)


def _abort_unfinished(llm: Any) -> None:
    """After a failed ``generate``, drop its requests so later phases start clean."""
    eng = llm.llm_engine
    with contextlib.suppress(Exception):
        ids = list(eng.output_processor.request_states.keys())
        if ids:
            eng.abort_request(ids, internal=True)


class PhaseRunner:
    """Times each phase's first and steady request and turns them into records."""

    def __init__(self, ctx: RunContext, llm: Any, rec: recorder.JitRecorder) -> None:
        from vllm import SamplingParams

        a = ctx.args
        self.ctx, self.llm, self.rec = ctx, llm, rec
        self.sp = SamplingParams(
            max_tokens=a.max_tokens, ignore_eos=True, temperature=0.0, detokenize=False
        )
        self.prompts = phases.PromptSource(ctx.plan, a.vocab_size)
        self.profiled = (
            set(phases.parse_list(a.profile_phases, PHASES)) if a.profile_phases else set()
        )
        self.profiles: dict[tuple[str, str], dict[str, float]] = {}
        self.leaves: dict[tuple[str, str], list[dict[str, Any]]] = {}
        if self.profiled:
            with recorder.profiler():  # Kineto's one-time setup, outside the timed requests
                pass

    def timed(self, phase: str, part: str) -> dict[str, Any]:
        """One request of the phase: seconds, error, cached and generated tokens."""
        prompts = self.prompts.prompts(phase, part)
        self.rec.set_phase(phase, part)
        logs.marker(f"phase={phase} part={part} begin")
        prof = recorder.profiler() if phase in self.profiled else contextlib.nullcontext()
        t = time.perf_counter()
        res: dict[str, Any] = {"s": None, "error": None, "cached": None, "out_tokens": None}
        try:
            with prof as session:
                outs = self.llm.generate(
                    [{"prompt_token_ids": p} for p in prompts], self.sp, use_tqdm=False
                )
            if session is not None:
                self.profiles[phase, part] = recorder.op_cpu_times(session)
                self.leaves[phase, part] = recorder.slow_leaves(session)
            res["s"] = round(time.perf_counter() - t, 4)
            res["cached"] = sum(int(o.num_cached_tokens or 0) for o in outs)
            res["out_tokens"] = sum(len(o.outputs[0].token_ids) for o in outs if o.outputs)
        except Exception as e:
            res["s"] = round(time.perf_counter() - t, 4)
            res["error"] = f"{type(e).__name__}: {e}"[-2000:]
            traceback.print_exc()
            _abort_unfinished(self.llm)
        self.rec.set_phase("between", "")
        return res

    def record(self, phase: str) -> dict[str, Any]:
        """Run the phase (first, then steady) and build its record."""
        plan = self.ctx.plan
        first = self.timed(phase, "first")
        steady = self.timed(phase, "steady")
        failed = bool(first["error"] or steady["error"])
        rec: dict[str, Any] = {
            **self.ctx.base,
            "phase": phase,
            "status": "failed" if failed else "ok",
            "first_s": first["s"],
            "steady_s": steady["s"],
            "ratio": round(first["s"] / steady["s"], 2)
            if first["s"] and steady["s"] and not failed
            else None,
            "first_error": first["error"],
            "steady_error": steady["error"],
            "prompt_lens": plan.prompt_lens(phase),
            "expected_chunks": phases.describe_chunks(plan.expected_chunks(phase)),
            "expected_cached_tokens": plan.expected_cached(phase),
            "first_cached_tokens": first["cached"],
            "steady_cached_tokens": steady["cached"],
            "out_tokens": [first["out_tokens"], steady["out_tokens"]],
        }
        events = self.rec.phase_events(phase)
        rec.update(recorder.JitRecorder.summarize(events), jit_events=events)
        if phase in self.profiled:
            rec["profile_top_extra"] = recorder.first_request_extra(
                self.profiles.get((phase, "first"), {}), self.profiles.get((phase, "steady"), {})
            )
            rec["profile_slow_leaves"] = {
                part: self.leaves.get((phase, part), []) for part in ("first", "steady")
            }
        if plan.expected_cached(phase) == 0 and (first["cached"] or steady["cached"]):
            rec["phase_warning"] = "unexpected prefix-cache hit"
        prefix_missed = any(
            not part["error"] and (part["cached"] or 0) < plan.prefix_len
            for part in (first, steady)
        )
        if phase == "prefix_hit" and prefix_missed:
            rec["phase_warning"] = "prefix was not (fully) served from the cache"
        if self.ctx.args.preset == AUTO:
            rec.update(dict.fromkeys(TQ_ONLY_FIELDS))
        return rec


def run_phases(ctx: RunContext, llm: Any, rec: recorder.JitRecorder) -> None:
    """Every phase of ``--phases``, in the order given; records flushed after each."""
    runner = PhaseRunner(ctx, llm, rec)
    a = ctx.args
    order = phases.parse_list(a.phases, PHASES) if a.phases != "all" else PHASES
    for phase in order:
        ctx.records.append(runner.record(phase))
        ctx.flush()
    stray = rec.phase_events("between") + rec.phase_events("after_startup")
    if stray:
        for r in ctx.records:
            r["jit_outside_phases"] = [e["kernel"] for e in stray]
        ctx.flush()
