"""The ``spec`` command: are speculative-decoding tokens right with a TurboQuant KV cache, how fast?

vLLM 0.21-0.33 with a TurboQuant cache and speculative decoding captures FULL CUDA graphs
of uniform verify batches whose attention ignores the cached context (issue 10). The
plugin's spec guard (``TQ_WARMUP_SPEC_GUARD``: unset or ``1`` auto, ``piecewise``, ``0``
off; :mod:`benchmarks.tqbench.spec_configs`) keeps those batches right. This command
shows the difference and its cost: every configuration generates greedily from the same
prompts, and its tokens and chosen-token logprobs are compared with the reference (eager,
no speculative decoding; :mod:`benchmarks.tqbench.verdicts`). It also records the
TurboQuant Triton compiles after startup (0 expected with the plugin on), the draft
acceptance, and the output tokens/s: the best of ``--repeats`` timed generates after an
untimed one, per ``--batch`` size (:mod:`benchmarks.tqbench.spec_child`).

Configurations (``--configs``: ``all``, names, or kinds expanded over ``--ks``):
``ref-eager`` (the reference, always run), ``nospec-full`` (FULL_AND_PIECEWISE, no
speculation), and for every k: ``ngram{k}-eager``, ``ngram{k}-piecewise``,
``ngram{k}-full-batched``, ``ngram{k}-full-guard``, ``ngram{k}-full-noguard``
(``draft{k}-``, ``mtp{k}-``, ``eagle{k}-`` with ``--method draft_model``, ``mtp``,
``eagle``). The plugin is on in every one.

The model: ``--model-size small`` (8 layers, 128x16x8, the default) or ``llama3-8b``
(32 layers, hidden 4096, 32/8 heads of 128, MLP 14336, vocabulary 128256);
``--geometry`` / ``--layers`` override either. vLLM's dummy weights give nearly flat
logits, so every engine emits the same tokens and ngram accepts every draft;
``--weight-scale 100`` makes the tokens decided (the model no longer follows the
prompts' pattern, so drafts are often rejected: see the ``accept`` column), and
``--prompt-kind random`` gives prompts without repeats, where ngram often finds fewer
drafts than k.

Issue 23's speed table (Llama-3-8B shape, 1000-token prompts, 256 greedy tokens, one
engine at a time, best of 3), written as a second table (rows: nospec-full, full-guard,
full-noguard, full-batched; columns: batch x k) and in the summary's ``speed_table``::

    python -m benchmarks.tqbench spec --model-size llama3-8b --batch 1,8 --ks 1,2,4 \\
        --configs nospec-full,full-guard,full-noguard,full-batched \\
        --prompts 8 --prompt-len 1000 --max-tokens 256 --repeats 3

and the tokens of the same configurations at decided logits, with async scheduling on and
drafts often rejected: add ``--weight-scale 100 --async-scheduling on``.

The parent imports neither vLLM nor torch. It runs one child per configuration
(``spec --child SPEC.json``; ``--jobs N`` at once on one GPU, each with a fixed KV cache
and a small ``gpu_memory_utilization``: timings are then noisier), so a crash such as an
illegal memory access only ends that child: its exit code and last error line are
recorded. ``--deadline-s`` stops starting children and kills running ones
(:mod:`benchmarks.tqbench.children`). The raw run (records.write_run: run-level fields
once, a row per configuration) goes to ``--out``, a summary JSON beside it, logs to
``--log-dir``. The default out is under ``benchmarks/results/spec/``, not ``raw/``,
which ``collect`` reads as phase records. ``--from-raw`` reports a raw run again.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import tempfile
import threading
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from benchmarks.tqbench import entry_point, logs, phases, records, tables
from benchmarks.tqbench.children import Children, Deadline, child_pythonpath, exit_now
from benchmarks.tqbench.cli import Option, add_options, new_parser
from benchmarks.tqbench.engine import REPO_ROOT
from benchmarks.tqbench.spec_child import (
    CHILD_FINAL,
    child_argv,
    child_env,
    read_result,
    run_child,
)
from benchmarks.tqbench.spec_configs import (
    METHOD_PREFIX,
    MODEL_SIZES,
    PERIOD,
    PROMPT_KINDS,
    REFERENCE,
    SPEC_KINDS,
    ModelSize,
    SpecConfig,
    build_configs,
    spec_prompts,
)
from benchmarks.tqbench.spec_tables import TABLE_HEADER, speed_table, table_rows
from benchmarks.tqbench.verdicts import add_comparisons, summarize

__all__ = [
    "DEFAULT_LOG_DIR",
    "DEFAULT_OUT_DIR",
    "OPTIONS",
    "SpecBench",
    "add_parser",
    "batches",
    "cmd_spec",
    "model_size",
    "report",
    "run_summary",
]

DEFAULT_OUT_DIR = REPO_ROOT / "benchmarks" / "results" / "spec"
DEFAULT_LOG_DIR = REPO_ROOT / "benchmarks" / "results" / "logs"


def model_size(args: argparse.Namespace) -> ModelSize:
    """``--model-size``, with ``--geometry`` / ``--layers`` where given."""
    size = MODEL_SIZES[args.model_size]
    return replace(size, geometry=args.geometry or size.geometry, layers=args.layers or size.layers)


def batches(text: str) -> list[int]:
    """``--batch``: prompts generated together, per timed pass (empty: all ``--prompts``)."""
    return _ints(text)


def run_summary(run: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """:func:`benchmarks.tqbench.verdicts.summarize` plus the speed table."""
    summary = summarize(run, rows)
    header, cells = speed_table(rows, (run.get("prompts") or {}).get("n"))
    summary["speed_table"] = {"header": header, "rows": cells}
    return summary


class SpecBench:
    """Runs the children, compares, writes the raw run and the summary."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run_id = dt.datetime.now().strftime("%Y%m%dT%H%M%S")
        self.deadline = Deadline(args.deadline_s)
        self.children = Children()
        self.configs = build_configs(args.configs, _ints(args.ks), args.method)
        if args.no_reference:  # a speed run: no tokens compared, one engine fewer
            self.configs = [c for c in self.configs if c.name != REFERENCE]
        lens = (args.prompt_len, args.prompt_len) if args.prompt_len else (150, 430)
        kind = args.prompt_kind
        self.prompts = spec_prompts(args.prompts, args.prompt_seed, lens, kind=kind)
        extra = max(batches(args.batch) or [0]) - len(self.prompts)
        more = spec_prompts(extra, args.prompt_seed + 1, lens, kind=kind) if extra > 0 else []
        self.speed_prompts = self.prompts + more
        need = max(len(p) for p in self.speed_prompts) + args.max_tokens + max(_ints(args.ks))
        self.max_model_len = args.max_model_len or phases.auto_max_model_len(need)
        self.work_root = Path(args.work_dir or tempfile.mkdtemp(prefix="tq-spec-")).resolve()
        self.log_dir = Path(args.log_dir).resolve() / f"spec-{self.run_id}"
        self.out = Path(args.out or DEFAULT_OUT_DIR / f"{self.run_id}{records.RAW_SUFFIX}")
        self.rows: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()
        self.stub: list[str] = []
        self.entry_point = "installed" if entry_point.found() else "missing"
        if self.entry_point == "missing" and args.entry_point_stub:
            self.stub = [str(entry_point.write_stub(self.work_root / "entry-point"))]
            self.entry_point = "stub"
        size = model_size(args)
        keep: tuple[str, ...] = ("preset", "max_tokens", "logprobs", "max_num_seqs", "kv_cache_gib")
        keep += ("jit_monitor_mode", "weight_scale", "repeats", "async_scheduling", "profile")
        self.options: dict[str, Any] = {k: getattr(args, k) for k in keep}
        self.options.update(
            method=args.method,
            geometry=size.geometry,
            layers=size.layers,
            model_size=asdict(size),
            batches=batches(args.batch),
            max_model_len=self.max_model_len,
            gpu_mem_util=args.gpu_mem_util or phases.default_gpu_mem_util(args.jobs),
        )

    def run_fields(self) -> dict[str, Any]:
        """What every row shares (the raw run's first line)."""
        done = [r for r in self.rows.values() if r.get("vllm_version")]
        first = done[0] if done else {}
        return {
            "kind": "spec",
            "run_id": self.run_id,
            "series": self.args.series or f"spec {self.run_id}",
            "date": dt.date.today().isoformat(),
            "vllm_version": first.get("vllm_version"),
            "gpu": first.get("gpu"),
            "method": self.args.method,
            "ks": _ints(self.args.ks),
            "prompts": {
                "n": len(self.prompts),
                "lens": [len(p) for p in self.prompts],
                "period": PERIOD if self.args.prompt_kind == "repeat" else None,
                "seed": self.args.prompt_seed,
            },
            "prompt_kind": self.args.prompt_kind,
            "model_size": self.args.model_size,
            "jobs": self.args.jobs,
            "lp_tol": self.args.lp_tol,
            "plugin_entry_point": self.entry_point,
            **self.options,
        }

    def save(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        with self.lock:
            rows = [self.rows[c.name] for c in self.configs if c.name in self.rows]
            add_comparisons(rows, self.args.lp_tol)
            run = self.run_fields()
            records.write_run(self.out, run, rows)
        return run, rows

    def child_spec(self, cfg: SpecConfig, work: Path) -> dict[str, Any]:
        """What one child is given (its spec file)."""
        spec: dict[str, Any] = {
            "config": asdict(cfg),
            "options": self.options,
            "prompts": self.prompts,
            "work": str(work),
            "result": str(work / "result.json"),
        }
        if self.speed_prompts != self.prompts:
            spec["speed_prompts"] = self.speed_prompts
        return spec

    def child_environ(self, cfg: SpecConfig, work: Path) -> dict[str, str]:
        """The child's whole environment (:func:`benchmarks.tqbench.spec_child.child_env`)."""
        env = child_env(cfg, work, self.args.share_compile_cache, os.environ)
        env["PYTHONPATH"] = child_pythonpath(self.stub, env)
        return env

    def run_one(self, cfg: SpecConfig) -> None:
        row: dict[str, Any] = {**asdict(cfg), "cudagraph_mode_asked": cfg.cudagraph_mode}
        del row["cudagraph_mode"]  # vLLM's resolved mode comes from the child
        if self.children.stopping or self.deadline.left() < 30:
            self._finish(cfg, {**row, "status": "skipped", "error_line": "deadline reached"})
            return
        work = self.work_root / cfg.name
        log = self.log_dir / f"{cfg.name}.log"
        records.write_json_atomic(work / "spec.json", self.child_spec(cfg, work))
        limit = self.deadline.limit(self.args.timeout, margin=5)
        print(f"[spec] start {cfg.name} (log {log})", flush=True)
        ended = self.children.run(
            child_argv(work / "spec.json"), log, self.child_environ(cfg, work), limit
        )
        rc = None if ended.timed_out else ended.rc
        text = log.read_text(errors="replace")
        row.update(
            read_result(work),
            rc=rc,
            wall_s=round(ended.wall_s, 1),
            log=str(log),
            plugin_log=logs.plugin_log_lines(text),
        )
        if row.get("status") not in CHILD_FINAL:
            killed = "killed at deadline" if limit < self.args.timeout else "timed out"
            row["status"] = f"crashed (rc {rc})" if rc is not None else killed
        elif rc:
            row["exit"] = f"rc {rc} after {row['status']}"
        if row["status"] != "ok":
            row["error_line"] = logs.last_error_line(text) or str(row.get("error", ""))[-300:]
        self._finish(cfg, row)

    def _finish(self, cfg: SpecConfig, row: dict[str, Any]) -> None:
        with self.lock:
            self.rows[cfg.name] = row
        self.save()
        print(f"[spec] done  {cfg.name}: {row['status']} {row.get('error_line') or ''}", flush=True)

    def run(self) -> int:
        self.children.stop_on_sigterm()
        if self.entry_point == "missing":
            print(
                "[spec] WARNING: the plugin's entry point is not installed: vLLM will not "
                "load it (pip install --no-deps ., or --entry-point-stub)",
                flush=True,
            )
        print(
            f"[spec] {len(self.configs)} configurations, jobs={self.args.jobs}, "
            f"logs in {self.log_dir}",
            flush=True,
        )
        try:
            self.children.first_then_together(self.configs, self.run_one, self.args.jobs)
        finally:
            if not self.args.work_dir:
                shutil.rmtree(self.work_root, ignore_errors=True)
        run, rows = self.save()
        print()
        print(render(run, rows))
        summary = run_summary(run, rows)
        records.write_json_atomic(self.out.with_suffix(".summary.json"), summary)
        print(f"\n[spec] raw run: {self.out}; summary: {self.out.with_suffix('.summary.json')}")
        return 0 if all(r.get("status") == "ok" for r in rows) else 1


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def render(run: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The per-configuration table, then the speed table."""
    header, cells = speed_table(rows, (run.get("prompts") or {}).get("n"))
    speed = f"\n\nspeed (output tok/s):\n{tables.render(header, cells)}" if cells else ""
    return tables.render(TABLE_HEADER, table_rows(rows)) + speed


def report(raw: Path, lp_tol: float | None = None) -> tuple[str, dict[str, Any]]:
    """The tables and summary of a raw run, compared afresh (no GPU needed)."""
    run, rows = records.read_run(raw)
    add_comparisons(rows, run.get("lp_tol", 1e-3) if lp_tol is None else lp_tol)
    return render(run, rows), run_summary(run, rows)


def check(args: argparse.Namespace) -> None:
    """Refuse options no child could run, in one line each (SystemExit)."""
    try:
        phases.parse_geometry(model_size(args).geometry)
        build_configs(args.configs, _ints(args.ks), args.method)
        wanted = batches(args.batch)
    except ValueError as e:
        raise SystemExit(f"spec: {e}") from e
    if model_size(args).layers < 6:
        raise SystemExit("spec: --layers must be >= 6 (TurboQuant leaves 2 layers at each end)")
    if any(b < 1 for b in wanted) or args.repeats < 1 or args.prompt_len < 0:
        raise SystemExit("spec: --batch sizes and --repeats must be >= 1, --prompt-len >= 0")
    if max(wanted or [args.prompts]) > args.max_num_seqs:
        raise SystemExit(
            f"spec: --max-num-seqs {args.max_num_seqs} is below the largest batch "
            f"{max(wanted or [args.prompts])}: vLLM would not run it as one batch"
        )


def cmd_spec(args: argparse.Namespace) -> int:
    """``spec --child FILE`` runs one configuration; ``--from-raw FILE`` reports a raw run
    again; otherwise the whole comparison."""
    if args.from_raw:
        for name in args.from_raw.split(","):
            table, summary = report(Path(name))
            print(f"{name} ({summary['run'].get('vllm_version')}):\n{table}\n")
            records.write_json_atomic(Path(name).with_suffix(".summary.json"), summary)
        return 0
    if args.child:
        exit_now(run_child(Path(args.child)))
    check(args)
    return SpecBench(args).run()


OPTIONS: tuple[Option, ...] = (
    ("--configs", "all", "comma list: all, ref-eager, nospec-full, kinds "
     f"{'/'.join(SPEC_KINDS)} (over --ks) or names like ngram3-full-noguard"),
    ("--ks", "1,3", "speculative tokens per step (comma list)"),
    ("--geometry", "", "HEADSIZExQHEADSxKVHEADS (default: --model-size's)"),
    ("--layers", 0, "hidden layers of the dummy model, >= 6 (default: --model-size's)"),
    ("--max-tokens", 64, "tokens generated per prompt"),
    ("--weight-scale", 1.0, "multiply every dummy weight (vLLM draws them from +-1e-3) after "
     "startup: at 1 the logits are nearly flat and attention barely moves them"),
    ("--prompts", 8, "prompts compared with the reference"),
    ("--prompt-len", 0, "tokens per prompt; 0: lengths evenly from 150 to 430"),
    ("--prompt-seed", 0, "seed of the prompts"),
    ("--batch", "", "comma list of batch sizes: each timed generate runs this many prompts "
     "together (default: all --prompts)"),
    ("--repeats", 1, "timed generates per batch size after an untimed one; the best counts"),
    ("--no-reference", False, "run no reference engine (a speed run: tokens not compared)"),
    ("--profile", False, "one more generate per batch size under torch's profiler: the "
     "top kernels by GPU time and host names by CPU time, in the raw row"),
    ("--logprobs", 2, "logprobs per position (2: also the top-1/top-2 margin)"),
    ("--lp-tol", 1e-3, "logprob tolerance of 'equal', and over the no-spec graph engine's floor"),
    ("--max-model-len", 0, "0: a multiple of 1024 that fits"),
    ("--max-num-seqs", 16, "max_num_seqs (at least the largest batch)"),
    ("--kv-cache-gib", 2.0, "fixed KV cache per engine (kv_cache_memory_bytes); 0: vLLM sizes it"),
    ("--gpu-mem-util", 0.0, "gpu_memory_utilization; 0: min(0.85, 0.9/jobs - 0.03)"),
    ("--jobs", 1, "children at once on the GPU"),
    ("--timeout", 600.0, "seconds per child"),
    ("--deadline-s", 0.0, "after this many seconds start no child and kill running ones"),
    ("--out", "", f"raw run file (default {DEFAULT_OUT_DIR}/<run id>.jsonl)"),
    ("--log-dir", str(DEFAULT_LOG_DIR), "logs go to <dir>/spec-<run id>/"),
    ("--work-dir", "", "kept if given (default: a tmp dir, removed)"),
    ("--series", "", "label stored in the raw run"),
    ("--share-compile-cache", False, "children share VLLM_CACHE_ROOT / TORCHINDUCTOR_CACHE_DIR"),
    ("--entry-point-stub", False, "if the plugin's entry point is not installed, declare it "
     "in a dist-info put on the children's PYTHONPATH"),
)  # fmt: skip


def add_parser(subparsers: Any) -> None:
    """The ``spec`` subcommand."""
    summary = "speculative decoding with TurboQuant: tokens vs the eager reference, speed"
    p = new_parser(subparsers, "spec", summary, __doc__)
    add_options(p, OPTIONS)
    p.add_argument("--method", choices=sorted(METHOD_PREFIX), default="ngram")
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="small",
                   help="the dummy model's shape (llama3-8b: issue 23's speed table)")  # fmt: skip
    p.add_argument("--prompt-kind", choices=PROMPT_KINDS, default="repeat",
                   help="repeat: a 24-token pattern repeated (ngram finds drafts); "
                   "random: no repeats (ngram often finds fewer than k)")  # fmt: skip
    p.add_argument("--async-scheduling", choices=("on", "off"), default="",
                   help="vLLM's async_scheduling engine argument (default: vLLM's)")  # fmt: skip
    p.add_argument("--preset", choices=phases.TQ_PRESETS, default="turboquant_4bit_nc")
    p.add_argument("--jit-monitor-mode", choices=("warn", "error"), default="error",
                   help="vLLM >= 0.25 only (older releases have no such option)")  # fmt: skip
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument(
        "--from-raw",
        default="",
        help="comma list of raw runs to report again "
        "(tables, and each one's .summary.json rewritten); runs nothing",
    )
    p.set_defaults(func=cmd_spec)
