"""The ``ahead-cost`` command: what the compile-ahead child costs, by phase, in one run.

The child's work (``tq_warmup_plugin.vllm_kernels.ahead_child.run_child``) builds a
worker's offline engine jobs (``vllm_kernels.offline``) and, since session 24, its
TurboQuant keys (the layers planned from the worker's config,
``plan.request.worker_plan``) for sm90 in forked processes. A worker
forks its child with vLLM imported (``ahead.spawn``, since session 23), so the import below
is what the child no longer pays; ``python -m tq_warmup_plugin.vllm_kernels.ahead_child``
runs the engine jobs alone in a fresh interpreter. This times, on this machine (a CPU is enough: the
compiles are Triton's, for the target):
- the import alone (what a fresh interpreter imports before its first compile);
- the whole fresh-interpreter child for a V1 ngram and a V2 engine (Llama 3's vocabulary,
  bf16, block 32), with one compile process and with ``--processes``, each over an empty
  Triton cache;
- the child's work as the fork runs it, vLLM imported first, for the same engines with the
  serve-jit runs' dense Llama (8 layers, 16/8 heads of 128) as the worker's model: the
  engine jobs alone and with the TurboQuant keys, at ``--processes``.

    CUDA_VISIBLE_DEVICES="" python -m benchmarks.tqbench ahead-cost [--processes 2]

Prints a table (the child's seconds and the ratio of N processes to 1) and writes JSON
(default ``benchmarks/results/raw/ahead-cost.json``, git-ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.tqbench.children import Children
from benchmarks.tqbench.cli import new_parser
from benchmarks.tqbench.matrix import DEFAULT_RESULTS_DIR
from benchmarks.tqbench.register_cost import sample, write_summary

__all__ = ["ENGINES", "add_parser", "child_seconds", "cmd_ahead_cost", "engine_request",
           "fork_seconds", "table", "worker_config"]  # fmt: skip

_IMPORT_PROBE = """
import json, time
t0 = time.perf_counter()
import tq_warmup_plugin.vllm_kernels.offline, tq_warmup_plugin.worker.warmup
import importlib, importlib.util
v1 = ("vllm.v1.sample.sampler", "vllm.v1.sample.rejection_sampler", "vllm.v1.worker.block_table")
for name in v1:  # the V1 runner's, which the child imports where it exists (0.20-0.33)
    if importlib.util.find_spec(name) is not None:
        importlib.import_module(name)
print(json.dumps({"seconds": time.perf_counter() - t0}))
"""

ENGINES: dict[str, dict[str, Any]] = {
    "V1, ngram k=3": {"runner_v2": False, "spec_method": "ngram", "spec_tokens": 3},
    "V2, no speculation": {"runner_v2": True, "spec_method": None, "spec_tokens": 0},
}
"""The two workers of serve-jit runs M-N, by their engine arguments."""


def engine_request(engine: dict[str, Any], version: str | None = None) -> dict[str, Any]:
    """The child's request for one of ``ENGINES`` on ``version`` (None: the installed
    vLLM), built by ``EngineRequest`` itself, so a field it gains has its default here (a
    hand-written dict went stale when the MoE fields came: every child refused it)."""
    from tq_warmup_plugin import compat
    from tq_warmup_plugin.vllm_kernels.offline import EngineRequest

    feats = compat.release_features(version or compat.installed_vllm_version() or "")
    return EngineRequest(features=feats, vocab_size=128256, model_dtype="bfloat16",
                         block_size=32, max_model_len=4096, max_num_seqs=256,
                         max_num_batched_tokens=8192, **engine).to_dict()  # fmt: skip


def child_seconds(engine: dict[str, Any], processes: int) -> dict[str, Any]:
    """One real child over an empty Triton cache: its own JSON line (jobs, errors, seconds)."""
    argument = json.dumps({"request": engine_request(engine), "arch": 90, "processes": processes})
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_CACHE_DIR": cache}
        out = Children().capture(
            [sys.executable, "-m", "tq_warmup_plugin.vllm_kernels.ahead_child", argument], env, 1200
        )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


_FORK_PROBE = """
import json, os, sys, tempfile
os.environ["CUDA_VISIBLE_DEVICES"] = ""
given, with_keys = json.loads(sys.argv[1]), sys.argv[2] == "1"
import vllm.config  # a worker has vLLM imported: the fork inherits it
from benchmarks.tqbench.ahead_cost import worker_config
from tq_warmup_plugin.vllm_kernels import ahead_child
with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as model:
    os.environ["TRITON_CACHE_DIR"] = cache
    config = worker_config(model, given["request"]) if with_keys else None
    read, write = os.pipe()
    ahead_child.run_child(given, write, config)
    os.close(write)
    print(os.read(read, ahead_child.OUTPUT_LIMIT).decode().strip())
"""


def worker_config(directory: str, request: dict[str, Any]) -> Any:
    """The config of a worker serving the serve-jit runs' dense Llama (its ``config.json``
    written to ``directory``) with ``request``'s engine arguments: what the child plans the
    TurboQuant layers from."""
    from types import SimpleNamespace

    from vllm.config import ModelConfig, ParallelConfig

    from benchmarks.tqbench.phases import build_model_config, parse_geometry

    config = build_model_config(parse_geometry("128x16x8"), 8, request["max_model_len"],
                                vocab_size=request["vocab_size"])  # fmt: skip
    (Path(directory) / "config.json").write_text(json.dumps(config))
    model = ModelConfig(model=directory, skip_tokenizer_init=True, dtype="bfloat16",
                        max_model_len=request["max_model_len"])  # fmt: skip
    tokens = request["spec_tokens"]
    spec = SimpleNamespace(method=request["spec_method"], num_speculative_tokens=tokens)
    return SimpleNamespace(
        model_config=model,
        parallel_config=ParallelConfig(),
        cache_config=SimpleNamespace(cache_dtype="turboquant_4bit_nc",
                                     block_size=request["block_size"]),
        scheduler_config=SimpleNamespace(max_num_seqs=request["max_num_seqs"],
                                         max_num_batched_tokens=request["max_num_batched_tokens"]),
        speculative_config=spec if tokens else None,
    )  # fmt: skip


def fork_seconds(engine: dict[str, Any], processes: int, with_keys: bool) -> dict[str, Any]:
    """The forked child's work, vLLM imported first, over an empty Triton cache: its line."""
    given = {"request": engine_request(engine), "arch": 90, "processes": processes, "verify": True}
    out = Children().capture(
        [sys.executable, "-c", _FORK_PROBE, json.dumps(given), "1" if with_keys else "0"],
        {**os.environ, "CUDA_VISIBLE_DEVICES": ""}, 1200,
    ).check()  # fmt: skip
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def table(import_s: float, rows: list[dict[str, Any]]) -> str:
    """The printed table: the import, then each engine's child at 1 and N processes."""
    lines = [f"{'phase':<52}{'seconds':>9}{'vs 1':>7}", f"{'import (fresh interpreter)':<52}"
             f"{import_s:>9.1f}{'':>7}"]  # fmt: skip
    serial = {r["engine"]: r["seconds"] for r in rows if r["processes"] == 1 and "fork" not in r}
    for r in rows:
        if "fork" in r:
            continue
        name = f"child, {r['engine']}, {r['processes']} process(es), {r['built']} jobs"
        ratio = r["seconds"] / serial[r["engine"]] if serial.get(r["engine"]) else float("nan")
        lines.append(f"{name:<52}{r['seconds']:>9.1f}{ratio:>7.2f}")
    lines.append(f"{'fork, vLLM imported':<52}{'seconds':>9}{'vs jobs':>9}")
    alone = {r["engine"]: r["seconds"] for r in rows if r.get("fork") == "engine jobs"}
    for r in rows:
        if "fork" not in r:
            continue
        name = f"{r['engine']}, {r['fork']}, {r['built']} jobs ({r['keys']} keys)"
        ratio = r["seconds"] / alone[r["engine"]] if alone.get(r["engine"]) else float("nan")
        lines.append(f"{name:<52}{r['seconds']:>9.1f}{ratio:>9.2f}")
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
        for with_keys in (False, True):
            result = fork_seconds(engine, args.processes, with_keys)
            what = "engine jobs and TurboQuant keys" if with_keys else "engine jobs"
            rows.append({"engine": name, "processes": args.processes, "fork": what,
                         "built": result["built"], "keys": result.get("keys", 0),
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
