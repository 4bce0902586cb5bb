"""The ``warm-cost`` command: where a warm worker's vLLM-kernel warmup time goes, by family.

From a shipped layer and a driver-cache entry, the serve-jit hybrid (Qwen3-Next, MTP k=2,
V1) spent 998 ms in its engine warmers and compiled nothing (H100, vLLM 0.26.0, serve-jit
run AZ): every launch a cache hit. This times the host's side of that work on this machine
(a CPU is enough), each family in a fresh interpreter over caches an earlier one filled:
- the hybrid's offline engine jobs (Triton launches, compile-only for sm90: what a shipped
  layer holds), a priming job first, so Triton's one-time setup is its own row;
- the async spec-decode correction's 4 ``torch.compile`` graphs (``Job.graphs``, run one at
  a time), on CPU tensors: Dynamo's trace and the FX graph cache's hit, not the GPU's
  module load;
- both at once, warm only: the Triton jobs with 3 graphs traced on a thread beside them,
  the engine warmers' order before ``cf87a9b``. Beside the graphs, a hybrid worker's Triton
  lookups took 3.0 s of job time, after them 0.48 s (H100, serve-jit runs BD and BE): the
  last line of the table is that ratio on this machine.

    CUDA_VISIBLE_DEVICES="" python -m benchmarks.tqbench warm-cost [--samples 3]

Prints a table (the cold run and the median warm run per family, milliseconds) and writes
JSON (default ``benchmarks/results/raw/warm-cost.json``, git-ignored). A GPU worker pays
these under one GIL, so threads do not hide them; its module loads come on top, and its
graphs cost more (172-463 ms each warm on the H100 host's CPU, serve-jit session 30).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.tqbench.cli import Option, add_options, new_parser
from benchmarks.tqbench.matrix import DEFAULT_RESULTS_DIR
from benchmarks.tqbench.register_cost import sample, write_summary

__all__ = ["BESIDE", "OPTIONS", "add_parser", "cmd_warm_cost", "medians", "table"]

_PLAN = """
import json, sys, threading, time
from collections import defaultdict
from tq_warmup_plugin.plan.request import PlanRequest, plan_geometry
from tq_warmup_plugin.vllm_kernels.offline import build, cpu_engine, jobs, planned_request
from tq_warmup_plugin.worker.plugins import plugin_manager
from tq_warmup_plugin.shipped.precompile import use_compile_only_target
use_compile_only_target(90)
spec = {"method": "mtp", "num_speculative_tokens": 2}
request = PlanRequest(kv_cache_dtype="turboquant_4bit_nc", model="qwen3-next",
    dtype="bfloat16", max_model_len=4096, max_num_seqs=32, speculative_config=spec,
    block_size=1088)
planned = plan_geometry(request, sys.argv[1])
engine = cpu_engine(planned_request(planned, spec, 20, "NVIDIA H100 80GB HBM3"))
todo = jobs(plugin_manager(), engine)[0]
ms, errors = defaultdict(float), []
def triton_jobs(todo, suffix=""):  # one at a time, as build() runs them in one process
    global errors
    for job in todo:
        start = time.perf_counter()
        errors += build([job])[1]
        ms[job.family + suffix] += (time.perf_counter() - start) * 1e3
"""

_GRAPHS = """
import torch
from types import SimpleNamespace
from tq_warmup_plugin.warmers.vllm_async_spec import SHAPES, warm_shape
from vllm.v1.spec_decode.utils import update_num_computed_tokens_for_batch_change as fix
def buffer(dtype):  # the V1 runner's CpuGpuBuffer, its .gpu here on the CPU
    return SimpleNamespace(gpu=torch.zeros(256, dtype=dtype))
# the runner's buffers, as vLLM 0.26 makes them (gpu_model_runner.py: int64 positions)
runner = SimpleNamespace(num_computed_tokens=torch.zeros(256, dtype=torch.int32),
    num_accepted_tokens=buffer(torch.int32), prev_positions=buffer(torch.int64),
    prev_num_draft_tokens=buffer(torch.int32))
def graphs(shapes):  # the warmer's own calls, one after another
    for n, m in shapes:
        start = time.perf_counter()
        warm_shape(runner, fix, n, m)
        ms["async correction graphs"] += (time.perf_counter() - start) * 1e3
"""

_TRITON_PROBE = (
    _PLAN
    + """
start = time.perf_counter()
errors += build(todo[:1])[1]
ms["Triton's first launch (setup)"] = (time.perf_counter() - start) * 1e3
triton_jobs(todo[1:])
print(json.dumps({"ms": ms, "errors": errors, "jobs": len(todo)}))
"""
)

_GRAPH_PROBE = (
    _PLAN
    + _GRAPHS
    + """
graphs(SHAPES[:1])
ms["torch.compile's first graph (setup)"] = ms.pop("async correction graphs")
graphs(SHAPES[1:])
print(json.dumps({"ms": ms, "errors": [], "jobs": len(SHAPES)}))
"""
)

_BESIDE_PROBE = (
    _PLAN
    + _GRAPHS
    + """
errors += build(todo[:1])[1]  # Triton's setup, then torch.compile's: a worker paid both
graphs(SHAPES[:1])
ms.clear()
tracing = threading.Thread(target=graphs, args=(SHAPES[1:],))
tracing.start()  # the 3 other graphs traced beside the Triton jobs, as before cf87a9b
triton_jobs(todo[1:], " (beside the graphs)")  # warm_cost.BESIDE
tracing.join()
ms["async correction graphs (beside the Triton jobs)"] = ms.pop("async correction graphs")
print(json.dumps({"ms": ms, "errors": errors, "jobs": len(todo)}))
"""
)
"""The Triton jobs with the graphs traced on a thread beside them: the engine warmers' order
before ``cf87a9b``, when a hybrid worker's Triton lookups took 3.0 s of job time beside the
graphs and 0.48 s after them (H100, 0.26.0, serve-jit runs BD and BE)."""


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each family's median over ``runs`` (a family missing from a run counts as 0)."""
    names = dict.fromkeys(name for run in runs for name in run)
    return {name: statistics.median(run.get(name, 0.0) for run in runs) for name in names}


BESIDE = " (beside the graphs)"
"""The suffix of a Triton family timed with the graphs traced beside it (``_BESIDE_PROBE``)."""


def table(cold: dict[str, float], warm: dict[str, float]) -> str:
    """The printed table: each family's cold and median warm milliseconds (``-``: no cold
    run), the totals without the one-time setup rows and the rows of the order before
    ``cf87a9b``, and those Triton jobs beside the graphs against the same jobs alone."""
    lines = [f"{'family':<50}{'cold ms':>10}{'warm ms':>10}"]
    for name in dict.fromkeys([*cold, *warm]):
        first = f"{cold[name]:>10.0f}" if name in cold else f"{'-':>10}"
        lines.append(f"{name:<50}{first}{warm.get(name, 0.0):>10.0f}")

    def work(ms: dict[str, float]) -> float:
        return sum(v for k, v in ms.items() if "(setup)" not in k and "(beside" not in k)

    lines.append(f"{'all but setup':<50}{work(cold):>10.0f}{work(warm):>10.0f}")
    beside = {k[: -len(BESIDE)]: v for k, v in warm.items() if k.endswith(BESIDE)}
    alone = sum(warm.get(k, 0.0) for k in beside)
    if beside and alone:
        lines.append(
            f"Triton jobs beside the graphs: {sum(beside.values()):.0f} ms warm, "
            f"alone {alone:.0f} ms ({sum(beside.values()) / alone:.1f}x)"
        )
    return "\n".join(lines)


def cmd_warm_cost(args: argparse.Namespace) -> int:
    """Run each probe cold once and warm ``--samples`` times, print the table, write JSON."""
    from benchmarks.tqbench.serve_jit_workload import qwen3_next_config

    with tempfile.TemporaryDirectory() as work:
        model = Path(work) / "model"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(qwen3_next_config(4096)))
        os.environ.update(CUDA_VISIBLE_DEVICES="", TRITON_CACHE_DIR=f"{work}/triton",
                          TORCHINDUCTOR_CACHE_DIR=f"{work}/inductor")  # fmt: skip
        runs, cold = {}, {}
        for name, probe in (("triton", _TRITON_PROBE), ("graphs", _GRAPH_PROBE)):
            runs[name] = [sample(probe, str(model)) for _ in range(1 + args.samples)]
            cold.update(runs[name].pop(0)["ms"])  # the run that filled the caches
        # over the caches the others filled: warm only
        runs["beside"] = [sample(_BESIDE_PROBE, str(model)) for _ in range(args.samples)]
    errors = [e for rs in runs.values() for r in rs for e in r["errors"]]
    warm = {k: v for rs in runs.values() for k, v in medians([r["ms"] for r in rs]).items()}
    print(table(cold, warm))
    from importlib.metadata import version

    summary = {"vllm": version("vllm"), "cpus": os.cpu_count(), "samples": args.samples,
               "cold_ms": cold, "warm_median_ms": warm, "runs": runs,
               "errors": errors[:8]}  # fmt: skip
    write_summary(args.out, summary)
    return 0 if not errors else 1


OPTIONS: tuple[Option, ...] = (
    ("--samples", 3, "warm runs after the cold one"),
    ("--out", str(DEFAULT_RESULTS_DIR / "raw" / "warm-cost.json"), "the JSON summary"),
)


def add_parser(subparsers: Any) -> None:
    """The ``warm-cost`` subcommand."""
    summary = "where a warm worker's vLLM-kernel warmup time goes, by family (CPU is enough)"
    p = new_parser(subparsers, "warm-cost", summary, __doc__)
    add_options(p, OPTIONS)
    p.set_defaults(func=cmd_warm_cost)
