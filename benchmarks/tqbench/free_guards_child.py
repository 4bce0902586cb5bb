"""One ``free-guards`` prefix engine in this process: each workload served in passes,
the prefix-cache guard on and off in alternation.

The engine is vLLM's in-process one (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the guard
is switched between passes of the same engine (``tokens_child.guard_switch``: the same
weights, graphs and caches). A pass keeps the workload's in-flight count by adding a turn
each time one finishes (``LLMEngine.add_request`` / ``step``): the batches follow the step
count, so both guard states see the same ones. The probe beneath the guard counts the
prefill calls whose batch mixes cached context into vLLM's fast path (``mixed``).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.tqbench import spec_child
from benchmarks.tqbench.free_guards_workload import Turn, Workload, pass_figures
from benchmarks.tqbench.tokens_child import BranchProbe, finish, guard_switch, start_engine
from benchmarks.tqbench.tokens_workload import EngineRow

__all__ = ["ROW", "run_child", "serve"]

ROW = EngineRow("prefix", "vLLM's defaults: prefix caching, chunked prefill, FULL_AND_PIECEWISE")


def serve(
    llm_engine: Any,
    turns: list[Turn],
    in_flight: int,
    params: Callable[[Turn], Any],
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    """Serve ``turns`` with at most ``in_flight`` unfinished: output tokens, the wall
    time from the first add to the last output, and each turn's time to first token."""
    pending, names = deque(turns), {}
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    finished, out_tokens = 0, 0

    def top_up() -> None:
        while pending and len(added) - finished < in_flight:
            t = pending.popleft()
            got = llm_engine.add_request(t.name, {"prompt_token_ids": t.prompt}, params(t))
            names[got or t.name] = t.name
            added[t.name] = clock()

    start = clock()
    top_up()
    while pending or llm_engine.has_unfinished_requests():
        for out in llm_engine.step():
            name = names.get(out.request_id, out.request_id)
            new = sum(len(c.token_ids) for c in out.outputs)  # DELTA: this step's tokens
            out_tokens += new
            if new and name not in first:
                first[name] = clock()
            if out.finished:
                finished += 1
        if not llm_engine.has_unfinished_requests():  # none left running, whatever was said
            finished = len(added)
        top_up()
    wall = clock() - start
    ttft = [first[n] - added[n] for n in first]
    return {"wall_s": round(wall, 4), "out_tokens": out_tokens, "ttft_s": ttft}


def run_pass(
    llm: Any,
    load: Workload,
    guard: str,
    switch: Callable[[str], bool],
    probe: BranchProbe,
    around: Any = None,
) -> dict[str, Any]:
    """One pass of ``load``: the guard's state, the cache reset and warmed, the turns
    (inside the context manager ``around`` where one is given, such as a profiler)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    def params(t: Turn) -> Any:
        return SamplingParams(
            temperature=0.0,
            max_tokens=t.max_tokens,
            ignore_eos=True,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )

    guarded = switch(guard)
    llm.reset_prefix_cache()
    if load.warm:
        warm = [{"prompt_token_ids": p} for p in load.warm]
        llm.generate(warm, SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
    probe.reset()
    with around if around is not None else contextlib.nullcontext():
        served = serve(llm.llm_engine, load.turns, load.in_flight, params)
    branches = probe.reset()
    return {
        "guard": guard,
        "guard_in_place": guarded,
        **pass_figures(served["wall_s"], served["out_tokens"], served["ttft_s"]),
        "wall_s": served["wall_s"],
        "out_tokens": served["out_tokens"],
        "mixed": branches.get("fast_with_cached", 0),
        "branches": {k: v for k, v in branches.items() if k != "lost_prefix_example"},
    }


def profiled(
    llm: Any, load: Workload, guard: str, switch: Callable[[str], bool], probe: BranchProbe
) -> dict[str, Any]:
    """One more pass under torch's profiler: its figures and where its time went."""
    from benchmarks.tqbench import recorder

    session = recorder.profiler()
    figures = run_pass(llm, load, guard, switch, probe, around=session)
    return {**figures, "breakdown": recorder.breakdown(session)}


def run_child(spec_path: Path) -> int:
    """Start the engine, serve every workload ``pairs`` times each way, save after each."""
    spec = json.loads(spec_path.read_text())
    opts, work = spec["options"], Path(spec["work"])
    loads = [Workload.from_dict(w) for w in spec["workloads"]]
    res, save, rec = spec_child.begin_child(Path(spec["result"]))
    started = start_engine(ROW, opts, work, save, rec)
    if started is None:
        return 1
    llm, _, fields = started
    save(**fields)
    probe, out, profiles = BranchProbe(), {}, {}

    def serve_workloads() -> None:
        switch = guard_switch(probe)
        for load in loads:
            rec.set_phase("generate", load.name)
            run_pass(llm, load, "off", switch, probe)  # untimed: first-use costs of the shapes
            passes = []
            for i in range(int(opts["pairs"])):
                for guard in ("on", "off") if i % 2 == 0 else ("off", "on"):
                    passes.append(run_pass(llm, load, guard, switch, probe))
                    out[load.name] = passes
                    save(workloads=out)
            if opts.get("profile"):
                profiles[load.name] = {
                    g: profiled(llm, load, g, switch, probe) for g in ("on", "off")
                }
                save(profiles=profiles)

    return finish(serve_workloads, res, save, rec)
