"""``free-guards``: what each token guard costs against the wrong path it replaces (issue 52).

Two parts, one engine at a time on the GPU, in one run:

* ``prefix``: one engine with vLLM's defaults (prefix caching, chunked prefill, async
  scheduling where the release has it on, FULL_AND_PIECEWISE; the KV cache sized by vLLM
  unless ``--kv-cache-gib``) serves each workload of :mod:`free_guards_workload` (``hits``,
  ``chat``, ``long``) ``--pairs`` times with the prefix-cache guard on and off in
  alternation, after one untimed pass (``free_guards_child``). Per workload: guard-on over
  guard-off output tokens/s (the median of the pairs, and each pair), TTFT p50/p99 of each
  pass and the p99 ratio, and the prefill calls that mixed cached context into vLLM's fast
  path (the steps the guard changes).
* ``verify``: the ``spec`` command's ``full-batched`` and ``full-noguard`` rows (ngram,
  dummy weights, so both accept every draft) for each k of ``--ks`` at each batch size
  of ``--batch``: batched over unguarded FULL graphs, ``{"k=1": {"bs1": r, ...}}``.

Writes the raw runs (the child's result, the spec run) under ``--out`` (default
``benchmarks/results/raw/free-guards-<run id>``, git-ignored) and ``summary.json`` and
``SUMMARY.md`` into ``--summary-dir`` (default ``benchmarks/results/free-guards``).
``--from-result`` summarizes a saved run again without a GPU.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.tqbench import entry_point, logs, phases, records, tables
from benchmarks.tqbench.children import Children, Deadline, child_pythonpath, exit_now
from benchmarks.tqbench.cli import Option, add_options, new_parser
from benchmarks.tqbench.engine import REPO_ROOT
from benchmarks.tqbench.free_guards_workload import (
    WORKLOADS,
    prefix_ratios,
    verify_ratios,
    workload,
)
from benchmarks.tqbench.spec_child import child_env, read_json
from benchmarks.tqbench.spec_configs import MODEL_SIZES, SpecConfig

__all__ = ["PARTS", "add_parser", "summarize", "verify_argv"]

PARTS = ("prefix", "verify")
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "raw"
DEFAULT_SUMMARY = REPO_ROOT / "benchmarks" / "results" / "free-guards"


def _names(text: str, known: tuple[str, ...], what: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"{what}: {unknown or 'none'}: some of {', '.join(known)}")
    return names


def verify_argv(args: argparse.Namespace, out: Path) -> list[str]:
    """The ``spec`` command line of the verify part (the Llama-3-8B shape by default)."""
    argv = ["spec", "--model-size", args.model_size, "--method", "ngram"]
    argv += ["--configs", "full-batched,full-noguard", "--ks", args.ks, "--batch", args.batch]
    argv += ["--no-reference"]  # dummy weights: both accept every draft, the same tokens
    argv += ["--prompts", str(max(int(b) for b in args.batch.split(",")))]
    argv += ["--prompt-len", "1000", "--max-tokens", "256", "--repeats", "3"]
    argv += ["--max-num-seqs", str(max(16, *(int(b) for b in args.batch.split(","))))]
    argv += ["--timeout", str(args.timeout), "--out", str(out / "spec.jsonl")]
    argv += ["--log-dir", str(out / "logs"), "--preset", args.preset]
    argv += ["--profile"] if args.profile else []
    if args.kv_cache_gib:
        argv += ["--kv-cache-gib", str(args.kv_cache_gib)]
    return argv + (["--entry-point-stub"] if args.entry_point_stub else [])


def summarize(prefix: dict[str, Any] | None, spec: dict[str, Any] | None) -> dict[str, Any]:
    """The summary (pure): ``prefix_ratio`` per workload, ``verify`` by k and batch size."""
    out: dict[str, Any] = {"prefix_ratio": {}, "prefix_passes": {}, "verify": {}}
    for name, passes in ((prefix or {}).get("workloads") or {}).items():
        out["prefix_ratio"][name] = prefix_ratios(passes)
        out["prefix_passes"][name] = [
            {k: p.get(k) for k in ("guard", "tok_s", "ttft_p50_ms", "ttft_p99_ms", "mixed")}
            for p in passes
        ]
    by_k: dict[int, dict[str, float]] = {}
    for name, row in ((spec or {}).get("configs") or {}).items():
        if name.endswith("-full-batched") and row.get("over_noguard_by_batch"):
            by_k[int(name.removeprefix("ngram").split("-")[0])] = row["over_noguard_by_batch"]
    out["verify"] = verify_ratios(by_k)
    for key in ("vllm_version", "gpu", "status", "tq_compiles_after_startup", "error_line"):
        out.setdefault("engine", {})[key] = (prefix or {}).get(key)
    return out


def render(summary: dict[str, Any]) -> str:
    """Two tables: the prefix guard per workload, the batched verify per k and batch."""
    rows = [
        [
            name,
            f"{r['ratio']}" if r.get("ratio") is not None else "-",
            " ".join(map(str, r.get("pairs") or [])) or "-",
            f"{r['ttft_p99_ratio']}" if r.get("ttft_p99_ratio") is not None else "-",
            str(r.get("mixed_steps", 0)),
        ]
        for name, r in summary["prefix_ratio"].items()
    ]
    head = ["workload", "on/off tok/s", "pairs", "TTFT p99 on/off", "mixed prefills"]
    text = tables.render(head, rows) if rows else "prefix: not run"
    ks = summary["verify"]
    cols = sorted({b for by in ks.values() for b in by}, key=lambda b: int(b[2:]))
    vrows = [[k, *(str(by.get(b, "-")) for b in cols)] for k, by in ks.items()]
    verify = tables.render(["batched/FULL", *cols], vrows) if vrows else "verify: not run"
    return f"{text}\n\n{verify}\n"


class FreeGuards:
    """Runs the parts one engine at a time, writes the raw runs and the summary."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run_id = dt.datetime.now().strftime("%Y%m%dT%H%M%S")
        self.out = Path(args.out or DEFAULT_OUT / f"free-guards-{self.run_id}").resolve()
        self.work = Path(args.work_dir or tempfile.mkdtemp(prefix="tq-free-guards-")).resolve()
        self.deadline, self.children = Deadline(args.deadline_s), Children()
        vocab = MODEL_SIZES[args.model_size].vocab_size
        names = _names(args.workloads, WORKLOADS, "--workloads")
        self.loads = [workload(n, args.seed, vocab, args.turns) for n in names]

    def options(self) -> dict[str, Any]:
        longest = max(load.longest() for load in self.loads)
        return {
            "preset": self.args.preset,
            "model_size": asdict(MODEL_SIZES[self.args.model_size]),
            "max_model_len": self.args.max_model_len or -(-longest // 1024) * 1024,
            "max_num_seqs": max(self.args.max_num_seqs, *(w.in_flight for w in self.loads)),
            "kv_cache_gib": self.args.kv_cache_gib,
            "gpu_mem_util": self.args.gpu_mem_util,
            "weight_scale": 1.0,
            "jit_monitor_mode": self.args.jit_monitor_mode,
            "pairs": self.args.pairs,
            "profile": self.args.profile,
            "max_tokens": 1,
        }

    def prefix(self) -> dict[str, Any]:
        work = self.work / "prefix"
        spec = {
            "options": self.options(),
            "work": str(work),
            "result": str(self.out / "prefix.json"),
            "workloads": [w.to_dict() for w in self.loads],
        }
        records.write_json_atomic(work / "spec.json", spec)
        env = child_env(SpecConfig("prefix", spec_guard=None), work, False, os.environ)
        stub = entry_point.stub_path(self.work / "entry-point", self.args.entry_point_stub)
        env["PYTHONPATH"] = child_pythonpath([*stub, str(REPO_ROOT / "src")], env)
        argv = [sys.executable, "-m", "benchmarks.tqbench", "free-guards"]
        log = self.out / "logs" / "prefix.log"
        print(f"[free-guards] prefix engine (log {log})", flush=True)
        limit = self.deadline.limit(self.args.timeout, margin=5)
        ended = self.children.run([*argv, "--child", str(work / "spec.json")], log, env, limit)
        result = read_json(self.out / "prefix.json")
        if result.get("status") != "ok":
            text = log.read_text(errors="replace") if log.is_file() else ""
            result["error_line"] = logs.last_error_line(text) or str(result.get("error", ""))
        result["rc"] = None if ended.timed_out else ended.rc
        return result

    def verify(self) -> dict[str, Any]:
        from benchmarks.tqbench import spec as spec_cmd
        from benchmarks.tqbench.cli import build_parser

        print("[free-guards] verify engines (spec)", flush=True)
        spec_cmd.cmd_spec(build_parser().parse_args(verify_argv(self.args, self.out)))
        raw = self.out / "spec.jsonl"
        return spec_cmd.report(raw)[1] if raw.is_file() else {}

    def run(self) -> int:
        self.children.stop_on_sigterm()
        parts = _names(self.args.parts, PARTS, "--parts")
        try:
            prefix = self.prefix() if "prefix" in parts else None
            spec = self.verify() if "verify" in parts else None
        finally:
            if not self.args.work_dir:
                shutil.rmtree(self.work, ignore_errors=True)
        records.write_json_atomic(self.out / "parts.json", {"prefix": prefix, "spec": spec})
        return write(self.args, summarize(prefix, spec), self.run_id)


def write(args: argparse.Namespace, summary: dict[str, Any], run_id: str) -> int:
    """``summary.json`` and ``SUMMARY.md`` into ``--summary-dir``; prints the tables."""
    summary["run"] = {
        "run_id": run_id,
        "date": dt.date.today().isoformat(),
        "command": "python -m benchmarks.tqbench " + " ".join(sys.argv[1:] or ["free-guards"]),
        "model_size": args.model_size,
        "preset": args.preset,
    }
    out = Path(args.summary_dir)
    records.write_json_atomic(out / "summary.json", summary)
    text = render(summary)
    (out / "SUMMARY.md").write_text(f"# free-guards {run_id}\n\n```\n{text}```\n")
    print(text, flush=True)
    engine = summary.get("engine") or {}
    return 0 if engine.get("status") in ("ok", None) else 1


def cmd_free_guards(args: argparse.Namespace) -> int:
    if args.child:
        from benchmarks.tqbench.free_guards_child import run_child

        exit_now(run_child(Path(args.child)))
    try:
        _names(args.parts, PARTS, "--parts")
        _names(args.workloads, WORKLOADS, "--workloads")
    except ValueError as e:
        print(f"free-guards: {e}", file=sys.stderr)
        return 2
    if args.from_result:
        parts = read_json(Path(args.from_result))
        return write(args, summarize(parts.get("prefix"), parts.get("spec")), "from-result")
    entry_point.require("free-guards", args.entry_point_stub)
    return FreeGuards(args).run()


OPTIONS: tuple[Option, ...] = (
    ("--parts", "prefix,verify", "comma list: prefix, verify"),
    ("--workloads", ",".join(WORKLOADS), "prefix: comma list of workloads"),
    ("--pairs", 3, "prefix: guard on/off pairs per workload, alternating"),
    ("--turns", 0, "prefix: turns of chat and long (0: three times their in-flight count)"),
    ("--seed", 0, "seed of the prompts"),
    ("--ks", "1,2,3,4", "verify: speculative tokens (comma list)"),
    ("--batch", "1,8,16", "verify: batch sizes (comma list)"),
    ("--max-model-len", 0, "0: the longest turn, rounded up to 1024"),
    ("--max-num-seqs", 64, "max_num_seqs (at least each workload's in-flight count)"),
    ("--kv-cache-gib", 0.0, "0: vLLM sizes the KV cache (its default); else a fixed size"),
    ("--gpu-mem-util", 0.9, "gpu_memory_utilization (vLLM's default 0.9)"),
    ("--timeout", 1200.0, "seconds per engine"),
    ("--deadline-s", 0.0, "after this many seconds start no engine and kill running ones"),
    ("--out", "", "raw runs (default: benchmarks/results/raw/free-guards-RUNID)"),
    ("--summary-dir", str(DEFAULT_SUMMARY), "where summary.json and SUMMARY.md go"),
    ("--work-dir", "", "kept if given (default: a temporary directory)"),
    (
        "--profile",
        False,
        "one more pass each way (prefix) and generate per batch (verify) "
        "under torch's profiler: top kernels by GPU time, host names by CPU time",
    ),
    ("--entry-point-stub", False, "declare the plugin's entry point for the children if needed"),
    ("--from-result", "", "a saved parts.json to summarize again; runs nothing"),
)


def add_parser(subparsers: Any) -> None:
    """The ``free-guards`` subcommand."""
    summary = "each token guard's cost against the wrong path it replaces"
    p = new_parser(subparsers, "free-guards", summary, __doc__)
    add_options(p, OPTIONS)
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="llama3-8b")
    p.add_argument("--preset", choices=phases.TQ_PRESETS, default="turboquant_4bit_nc")
    p.add_argument("--jit-monitor-mode", choices=("warn", "error"), default="warn")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_free_guards)
