"""The ``ahead-cost`` command: what the compile-ahead child costs, by phase, in one run.

The child's work (``tq_warmup_plugin.ahead_child.run_child``) builds a worker's offline
engine jobs (``engine_plan``) for sm90 in forked processes. A worker forks its child with
vLLM imported (``ahead.spawn``, since session 23), so the import below is what the child no
longer pays; ``python -m tq_warmup_plugin.ahead_child`` runs the same work in a fresh
interpreter. This times, on this machine (a CPU is enough: the compiles are Triton's, for
the target):
- the import alone (what a fresh interpreter imports before its first compile);
- the whole fresh-interpreter child for a V1 ngram and a V2 engine (Llama 3's vocabulary,
  bf16, block 32), with one compile process and with ``--processes``, each over an empty
  Triton cache.

    CUDA_VISIBLE_DEVICES="" python -m benchmarks.tqbench ahead-cost [--processes 2]

Prints a table (the child's seconds and the ratio of N processes to 1) and writes JSON
(default ``benchmarks/results/raw/ahead-cost.json``, git-ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from benchmarks.tqbench.cli import new_parser
from benchmarks.tqbench.matrix import DEFAULT_RESULTS_DIR
from benchmarks.tqbench.register_cost import sample, write_summary

__all__ = ["ENGINES", "add_parser", "child_seconds", "cmd_ahead_cost", "table"]

_IMPORT_PROBE = """
import json, time
t0 = time.perf_counter()
import tq_warmup_plugin.engine_plan, tq_warmup_plugin.warmup
import vllm.v1.sample.sampler, vllm.v1.sample.rejection_sampler, vllm.v1.worker.block_table
print(json.dumps({"seconds": time.perf_counter() - t0}))
"""

ENGINES: dict[str, dict[str, Any]] = {
    "V1, ngram k=3": {"runner_v2": False, "spec_method": "ngram", "spec_tokens": 3},
    "V2, no speculation": {"runner_v2": True, "spec_method": None, "spec_tokens": 0},
}
"""The two workers of serve-jit runs M-N, by their engine arguments."""


def _request(engine: dict[str, Any]) -> dict[str, Any]:
    from tq_warmup_plugin import compat

    return {
        "features": compat.installed_vllm_version(),
        "vocab_size": 128256,
        "model_dtype": "bfloat16",
        "block_size": 32,
        "max_model_len": 4096,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
        "draft_probs": False,
        "max_logprobs": 20,
        **engine,
    }


def child_seconds(engine: dict[str, Any], processes: int) -> dict[str, Any]:
    """One real child over an empty Triton cache: its own JSON line (jobs, errors, seconds)."""
    argument = json.dumps({"request": _request(engine), "arch": 90, "processes": processes})
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_CACHE_DIR": cache}
        out = subprocess.run(
            [sys.executable, "-m", "tq_warmup_plugin.ahead_child", argument],
            env=env, capture_output=True, text=True, timeout=1200,
        )  # fmt: skip
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def table(import_s: float, rows: list[dict[str, Any]]) -> str:
    """The printed table: the import, then each engine's child at 1 and N processes."""
    lines = [f"{'phase':<52}{'seconds':>9}{'vs 1':>7}", f"{'import (fresh interpreter)':<52}"
             f"{import_s:>9.1f}{'':>7}"]  # fmt: skip
    serial = {r["engine"]: r["seconds"] for r in rows if r["processes"] == 1}
    for r in rows:
        name = f"child, {r['engine']}, {r['processes']} process(es), {r['built']} jobs"
        ratio = r["seconds"] / serial[r["engine"]] if serial.get(r["engine"]) else float("nan")
        lines.append(f"{name:<52}{r['seconds']:>9.1f}{ratio:>7.2f}")
    return "\n".join(lines)


def cmd_ahead_cost(args: argparse.Namespace) -> int:
    """Time the import and the children, print the table, write the JSON."""
    import_s = float(sample(_IMPORT_PROBE)["seconds"])
    rows = []
    for name, engine in ENGINES.items():
        for processes in sorted({1, args.processes}):
            result = child_seconds(engine, processes)
            rows.append({"engine": name, "processes": processes, "built": result["built"],
                         "errors": result["errors"], "seconds": result["seconds"]})  # fmt: skip
    print(table(import_s, rows))
    from importlib.metadata import version

    summary = {"vllm": version("vllm"), "cpus": os.cpu_count(), "import_s": import_s,
               "children": rows}  # fmt: skip
    write_summary(args.out, summary)
    return 0 if not any(r["errors"] for r in rows) else 1


def add_parser(subparsers: Any) -> None:
    """The ``ahead-cost`` subcommand."""
    summary_line = "what the compile-ahead child costs: its import, its compiles (CPU is enough)"
    p = new_parser(subparsers, "ahead-cost", summary_line, __doc__)
    p.add_argument("--processes", type=int, default=2, help="compile processes to compare with 1")
    p.add_argument("--out", default=str(DEFAULT_RESULTS_DIR / "raw" / "ahead-cost.json"))
    p.set_defaults(func=cmd_ahead_cost)
