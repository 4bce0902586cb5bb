"""``tokens``: is every token TurboQuant serves the token it should be? (issue 28)

Cases (one child process per engine, ``tokens_child``; in-process engines, dummy
weights scaled so greedy tokens are decided):

* ``prefix-mixed``: the reproduction of upstream #46460 in one engine with vLLM's
  defaults (prefix caching on): a cached prefix P, then one step with a fresh prompt C
  at least as long as every hit's sequence beside hits B_j = P + q_j; each hit against
  itself served alone, with a control step (a shorter fresh prompt: vLLM's loop) as the
  noise floor; the prefix-cache guard off, then on, in the same engine.
* ``oracle``: one engine per feature X (``tokens_workload.ORACLE_ROWS``), each serving
  one workload (hits beside longer fresh prompts, a short prompt, one near
  ``max_model_len``, ``n = 2``; logprobs on every request) in one step with the guard on
  and off, judged against TurboQuant eager with X off serving each request alone; the
  noise floor is FULL graphs with prefix caching off in one batch.
* ``cost``: one engine, a prefix-heavy workload (80% of the requests hit the cached
  prefix), timed with the guard on and off in alternation.

Writes ``result.json`` (every child's result, the verdicts) and ``SUMMARY.md`` (the
table) into ``--out`` (default: ``benchmarks/results/raw/tokens-<run id>``, git-ignored).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.tqbench import entry_point, logs, phases, records
from benchmarks.tqbench.children import Children, Deadline, child_pythonpath, exit_now
from benchmarks.tqbench.cli import Option, add_options, new_parser
from benchmarks.tqbench.engine import REPO_ROOT
from benchmarks.tqbench.spec_child import child_env, read_result
from benchmarks.tqbench.spec_configs import MODEL_SIZES, SpecConfig
from benchmarks.tqbench.tokens_judge import judge_oracle, judge_prefix_mixed
from benchmarks.tqbench.tokens_table import cost_figures, render
from benchmarks.tqbench.tokens_workload import (
    ORACLE_ROWS,
    EngineRow,
    Request,
    Step,
    oracle_requests,
    oracle_steps,
    prefix_mixed_steps,
    prompts,
)

__all__ = ["CASES", "add_parser", "cost_steps", "plan", "select_rows"]

CASES = ("prefix-mixed", "oracle", "cost")
DEFAULT_OUT_DIR = REPO_ROOT / "benchmarks" / "results" / "raw"


def select_rows(text: str) -> list[EngineRow]:
    """The oracle rows ``--rows`` names (``all``: every one), references kept first."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    known = {r.name: r for r in ORACLE_ROWS}
    if "all" in names:
        return list(ORACLE_ROWS)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown rows {unknown}: all, or some of {', '.join(known)}")
    return [r for r in ORACLE_ROWS if r.name in names]


def cost_steps(seed: int, vocab: int, pairs: int) -> list[Step]:
    """``pairs`` x (guard on, guard off), in alternation: 32 hits of 64 new tokens on a
    cached prefix and 8 fresh prompts longer than them (80% of the requests hit)."""
    prefix = prompts(seed, vocab, [640])[0]
    tails = prompts(seed + 5, vocab, [64] * 32)
    fresh = prompts(seed + 6, vocab, [720] * 8)
    reqs = [Request(f"hit{i}", prefix + t) for i, t in enumerate(tails)]
    reqs += [Request(f"fresh{i}", p) for i, p in enumerate(fresh)]
    order = [("on", "off") if i % 2 == 0 else ("off", "on") for i in range(pairs)]
    return [Step(f"cost-{g}-{i}", reqs, g, prefix) for i, gs in enumerate(order) for g in gs]


def plan(args: argparse.Namespace) -> list[tuple[EngineRow, list[Step]]]:
    """The engines of the case and each one's steps."""
    vocab = MODEL_SIZES[args.model_size].vocab_size
    defaults = EngineRow("prefix", "prefix caching (vLLM's defaults)")
    if args.case == "prefix-mixed":
        return [(defaults, prefix_mixed_steps(args.seed, vocab))]
    if args.case == "cost":
        return [(defaults, cost_steps(args.seed, vocab, args.pairs))]
    reqs = oracle_requests(args.seed, vocab, args.max_model_len, args.max_tokens)
    prefix = prompts(args.seed, vocab, [640])[0]
    return [(row, oracle_steps(reqs, prefix, row.reference)) for row in select_rows(args.rows)]


class TokensBench:
    """Runs the children (references first), judges, writes ``result.json``/``SUMMARY.md``."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.engines = args, plan(args)
        self.run_id = dt.datetime.now().strftime("%Y%m%dT%H%M%S")
        self.deadline, self.children = Deadline(args.deadline_s), Children()
        self.work_root = Path(args.work_dir or tempfile.mkdtemp(prefix="tq-tokens-")).resolve()
        self.out = Path(args.out or DEFAULT_OUT_DIR / f"tokens-{args.case}-{self.run_id}")
        self.rows: dict[str, dict[str, Any]] = {}
        self.stub = entry_point.stub_path(self.work_root / "entry-point", args.entry_point_stub)
        keep = ("preset", "max_tokens", "logprobs", "max_num_seqs", "kv_cache_gib")
        self.options: dict[str, Any] = {k: getattr(args, k) for k in keep}
        self.options.update(
            jit_monitor_mode=args.jit_monitor_mode,
            weight_scale=args.weight_scale,
            model_size=asdict(MODEL_SIZES[args.model_size]),
            max_model_len=args.max_model_len,
            gpu_mem_util=args.gpu_mem_util or phases.default_gpu_mem_util(args.jobs),
        )

    def environ(self, row: EngineRow, work: Path) -> dict[str, str]:
        env = child_env(
            SpecConfig(row.name, spec_guard=None), work, self.args.share_compile_cache, os.environ
        )
        env["PYTHONPATH"] = child_pythonpath([*self.stub, str(REPO_ROOT / "src")], env)
        cache = Path(self.args.driver_cache_from) if self.args.driver_cache_from else None
        if cache is not None and (cache / "index").is_file():  # a copy per engine
            nv = work / "nv"
            shutil.rmtree(nv, ignore_errors=True)
            shutil.copytree(cache, nv)
            env["CUDA_CACHE_PATH"] = str(nv)
        elif cache is not None:  # the first engine fills it (it runs alone)
            env["CUDA_CACHE_PATH"] = str(cache)
        return env

    def run_one(self, row: EngineRow, steps: list[Step]) -> None:
        if self.children.stopping or self.deadline.left() < 30:
            self.rows[row.name] = {"status": "skipped", "error_line": "deadline reached"}
            return
        work = self.work_root / row.name
        log = self.out / "logs" / f"{row.name}.log"
        spec = {
            "row": asdict(row),
            "options": self.options,
            "work": str(work),
            "result": str(work / "result.json"),
            "steps": [s.to_dict() for s in steps],
        }
        records.write_json_atomic(work / "spec.json", spec)
        argv = [
            sys.executable,
            "-m",
            "benchmarks.tqbench",
            "tokens",
            "--child",
            str(work / "spec.json"),
        ]
        print(f"[tokens] start {row.name} (log {log})", flush=True)
        ended = self.children.run(
            argv, log, self.environ(row, work), self.deadline.limit(self.args.timeout, margin=5)
        )
        result = read_result(work)
        text = log.read_text(errors="replace")
        if result.get("status") != "ok":
            result["error_line"] = logs.last_error_line(text) or str(result.get("error", ""))[-300:]
        result.update(
            rc=None if ended.timed_out else ended.rc,
            wall_s=round(ended.wall_s, 1),
            feature=row.feature,
            plugin_log=logs.plugin_log_lines(text),
        )
        self.rows[row.name] = result
        print(
            f"[tokens] done  {row.name}: {result.get('status')} {result.get('error_line') or ''}",
            flush=True,
        )

    def run(self) -> int:
        self.children.stop_on_sigterm()
        # The first engine runs alone: on a fresh machine the CUDA driver compiles
        # FlashAttention's sm90 PTX in it (about 130 s on the H200) into the
        # --driver-cache-from directory, which every later engine gets a copy of.
        refs = [e for e in self.engines if e[0].reference]
        ordered = refs + [e for e in self.engines if not e[0].reference]
        try:
            self.children.first_then_together(ordered, lambda e: self.run_one(*e), self.args.jobs)
        finally:
            if not self.args.work_dir:
                shutil.rmtree(self.work_root, ignore_errors=True)
        return write_outputs(self.out, self.args.case, self.rows, self.args.lp_tol, self.run_id)


def judged(case: str, rows: dict[str, dict[str, Any]], lp_tol: float) -> dict[str, Any]:
    """The case's verdicts over the engines' results (pure: ``--from-result`` re-judges)."""
    if case == "oracle":
        return judge_oracle(rows, lp_tol)
    steps = next(iter(rows.values()), {}).get("steps") or {}
    return cost_figures(steps) if case == "cost" else judge_prefix_mixed(steps, lp_tol)


_COMPACT = (
    "status",
    "feature",
    "vllm_version",
    "gpu",
    "startup_s",
    "cudagraph_mode",
    "async_scheduling",
    "prefix_caching",
    "block_size",
    "budget",
    "engine_kwargs",
    "tq_compiles_after_startup",
    "other_jit_after_startup",
    "plugin_log",
    "error_line",
)


def write_outputs(
    out: Path,
    case: str,
    rows: dict[str, dict[str, Any]],
    lp_tol: float,
    run_id: str,
    raw: bool = True,
) -> int:
    """``result.json`` (everything, the served tokens too), ``summary.json`` (the
    verdicts and each engine's setup, no tokens: small enough to commit), ``SUMMARY.md``."""
    verdicts = judged(case, rows, lp_tol)
    done = next(iter(rows.values()), {})
    run = {
        "case": case,
        "run_id": run_id,
        "date": dt.date.today().isoformat(),
        "lp_tol": lp_tol,
        "vllm_version": done.get("vllm_version"),
        "gpu": done.get("gpu"),
    }
    if raw:  # --from-result's input is the raw file: only the summaries are written
        records.write_json_atomic(
            out / "result.json", {"run": run, "verdicts": verdicts, "engines": rows}
        )
    compact = {n: {k: r.get(k) for k in _COMPACT if k in r} for n, r in rows.items()}
    records.write_json_atomic(
        out / "summary.json", {"run": run, "verdicts": verdicts, "engines": compact}
    )
    table = render(case, run, verdicts, rows)
    (out / "SUMMARY.md").write_text(table)
    print(table)
    written = "result.json, summary.json" if raw else "summary.json"
    print(f"[tokens] {out}: {written}, SUMMARY.md", flush=True)
    return 0 if all(r.get("status") == "ok" for r in rows.values()) else 1


def from_results(paths: list[Path], out: Path, lp_tol: float) -> int:
    """Judge saved ``result.json`` files again, their engines merged (a later file's engine
    replaces an earlier one's of the same name): one run split over device calls."""
    results = [json.loads(p.read_text()) for p in paths]
    rows: dict[str, dict[str, Any]] = {}
    for res in results:
        rows.update(res["engines"])
    first = results[0]["run"]
    run_id = str(first.get("run_id"))
    return write_outputs(out, first["case"], rows, lp_tol, run_id, raw=False)


def cmd_tokens(args: argparse.Namespace) -> int:
    if args.child:
        from benchmarks.tqbench.tokens_child import run_child

        exit_now(run_child(Path(args.child)))
    if args.from_result:
        paths = [Path(p) for p in args.from_result.split(",") if p.strip()]
        return from_results(paths, Path(args.out or paths[0].parent), args.lp_tol)
    if args.case == "oracle":
        select_rows(args.rows)  # an unknown row is an error before any engine starts
    entry_point.require("tokens", args.entry_point_stub)
    return TokensBench(args).run()


OPTIONS: tuple[Option, ...] = (
    ("--rows", "all", "oracle: comma list of rows (all, or names of tokens_workload.ORACLE_ROWS)"),
    ("--pairs", 3, "cost: guard on/off pairs, alternating"),
    ("--max-tokens", 32, "tokens generated per request"),
    (
        "--weight-scale",
        100.0,
        "multiply every dummy weight after startup, so greedy tokens "
        "are decided (at 1 the logits are nearly flat)",
    ),
    ("--seed", 0, "seed of the prompts"),
    ("--logprobs", 2, "logprobs per position (2: the top-1/top-2 margin too)"),
    (
        "--lp-tol",
        2**-9,
        "logprob tolerance of 'equal', and over the noise floor: one step of "
        "the bf16 grid the dummy model's logits sit on (their top-2 margins are multiples of "
        "2^-9 on the H200, 0.26.0)",
    ),
    ("--max-model-len", 2048, "max_model_len (the oracle has a prompt near it)"),
    ("--max-num-seqs", 64, "max_num_seqs"),
    ("--kv-cache-gib", 2.0, "fixed KV cache per engine (kv_cache_memory_bytes)"),
    ("--gpu-mem-util", 0.0, "gpu_memory_utilization; 0: min(0.85, 0.9/jobs - 0.03)"),
    ("--jobs", 1, "engines at once on the GPU"),
    ("--timeout", 600.0, "seconds per engine"),
    ("--deadline-s", 0.0, "after this many seconds start no engine and kill running ones"),
    ("--out", "", "output directory (default: benchmarks/results/raw/tokens-CASE-RUNID)"),
    ("--work-dir", "", "kept if given (default: a temporary directory, removed)"),
    (
        "--driver-cache-from",
        "",
        "a CUDA driver cache directory: each engine gets a copy of it as CUDA_CACHE_PATH; "
        "where it holds no 'index' yet, the first engine (run alone) fills it",
    ),
    ("--share-compile-cache", False, "engines share VLLM_CACHE_ROOT / TORCHINDUCTOR_CACHE_DIR"),
    (
        "--entry-point-stub",
        False,
        "if the plugin's entry point is not installed, declare it "
        "in a dist-info put on the children's PYTHONPATH",
    ),
)


def add_parser(subparsers: Any) -> None:
    """The ``tokens`` subcommand."""
    summary = "the token oracle: prefix-cache reproduction (#46460), every feature, the cost"
    p = new_parser(subparsers, "tokens", summary, __doc__)
    p.add_argument("--case", choices=CASES, default="prefix-mixed")
    add_options(p, OPTIONS)
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="small")
    p.add_argument("--preset", choices=phases.TQ_PRESETS, default="turboquant_4bit_nc")
    p.add_argument(
        "--jit-monitor-mode", choices=("warn", "error"), default="warn", help="vLLM >= 0.25 only"
    )
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument(
        "--from-result",
        default="",
        help="comma list of result.json files to judge "
        "again, their engines merged; runs nothing (output: --out, else beside the first)",
    )
    p.set_defaults(func=cmd_tokens)
