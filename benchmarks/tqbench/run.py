"""The ``run`` command: one configuration in this process (imports vLLM lazily).

It starts vLLM in-process with a dummy-weight Llama whose ``config.json`` it writes
itself, then times the first and a repeated request of every phase
(:mod:`benchmarks.tqbench.phases`) and records every Triton compilation after
startup, by kernel name (:mod:`benchmarks.tqbench.recorder`). Its records go to
``--out`` as a raw run file, rewritten after every phase. ``--attention-chunk N`` makes
the model a Llama 4 text model with chunked local attention of N tokens instead
(:func:`benchmarks.tqbench.phases.build_model_config`; the config id gets ``-cN``).

What is measured: ``startup_s`` (the ``LLM(...)`` constructor), ``warmup_s`` /
``launch_s`` (what the plugin says it spent, from its ``TQ_WARMUP_REPORT``, kept
under ``plugin_report``), ``first_s`` / ``steady_s`` (``LLM.generate`` of the first
and the repeated request), ``tq_compiles_after_startup`` / ``tq_loads_after_startup``
(TurboQuant kernels Triton compiled / loaded from its disk cache during the phase),
``other_jit_after_startup`` and ``jit_events`` (every event, with compile times).
With the preset ``auto`` (vLLM's own KV cache) the TurboQuant-only fields are blank.

``--tp 1`` runs the engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so
the hooks see every compile; with ``--tp`` > 1 the kernel lists come from the log
(:mod:`benchmarks.tqbench.logs`, ``hooks_in_process`` false).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.tqbench import engine, entry_point, logs, phases, recorder, tables
from benchmarks.tqbench.cli import Option, add_options, new_parser
from benchmarks.tqbench.phase_runner import RunContext, run_phases
from benchmarks.tqbench.phases import AUTO, PHASES, Geometry

__all__ = [
    "COMMON_OPTIONS",
    "REPORT_GLOB",
    "REPORT_TEMPLATE",
    "RUN_OPTIONS",
    "add_common_options",
    "add_parser",
    "apply_spec",
    "cmd_run",
    "default_monitor_mode",
    "engine_kwargs",
    "prepare",
    "set_environment",
    "start_engine",
]

REPORT_GLOB = "tq-warmup-report-*.json"
REPORT_TEMPLATE = "tq-warmup-report-{rank}.json"


def default_monitor_mode(preset: str, plugin_on: bool) -> str:
    """``error`` with the plugin on a TurboQuant cache (a missed kernel raises), else ``warn``."""
    return "error" if plugin_on and preset != AUTO else "warn"


# --------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------


def apply_spec(args: argparse.Namespace) -> None:
    """Take the arguments of ``--spec FILE`` (a JSON object of option names and values)."""
    if not args.spec:
        return
    spec = json.loads(Path(args.spec).read_text())
    unknown = sorted(set(spec) - set(vars(args)))
    if unknown:
        raise SystemExit(f"{args.spec}: unknown run options {unknown}")
    for k, v in spec.items():
        setattr(args, k, v)


def set_environment(args: argparse.Namespace, work: Path, report_dir: Path) -> None:
    """Set what Triton, vLLM and the plugin read at import time (caches, plugin switch)."""
    if not args.cache_root and not args.triton_cache_dir:
        args.cache_root = str(work / "cache")  # a fresh one, so "cold" is true
        shutil.rmtree(args.cache_root, ignore_errors=True)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["TQ_WARMUP"] = "1" if args.plugin == "on" else "0"
    os.environ["TQ_WARMUP_REPORT"] = str(report_dir / REPORT_TEMPLATE)
    if args.runner != "default":
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.runner == "v2" else "0"
    if args.cache_root:
        root = Path(args.cache_root)
        os.environ["TRITON_CACHE_DIR"] = str(root / "triton")
        if not args.share_compile_cache:
            os.environ["VLLM_CACHE_ROOT"] = str(root / "vllm")
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    if args.triton_cache_dir:
        os.environ["TRITON_CACHE_DIR"] = args.triton_cache_dir


def prepare(args: argparse.Namespace) -> RunContext:
    """Work directories, environment, phase plan and the run-level fields of the records."""
    geometry = Geometry(args.head_size, args.q_heads, args.kv_heads)
    cfg_id = args.config_id or phases.config_id(
        args.preset, args.mode, geometry, args.layers, args.budget, args.tp, args.attention_chunk
    )
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="tq-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    report_dir = work / "report"
    shutil.rmtree(report_dir, ignore_errors=True)
    report_dir.mkdir(parents=True)
    set_environment(args, work, report_dir)
    monitor_mode = args.jit_monitor_mode or default_monitor_mode(args.preset, args.plugin == "on")
    jobs = int(args.jobs)
    gpu_mem = args.gpu_mem_util or phases.default_gpu_mem_util(jobs)
    plan = phases.plan_phases(args.budget, 16, args.max_tokens)
    max_model_len = args.max_model_len or phases.auto_max_model_len(plan.required_max_model_len)
    base: dict[str, Any] = {
        "run_id": args.run_id or f"{dt.datetime.now():%Y%m%dT%H%M%S}-{os.getpid()}",
        "config_id": cfg_id,
        "date": dt.date.today().isoformat(),
        "kv_cache_dtype": args.preset,
        "mode": args.mode,
        "plugin": args.plugin,
        "triton_cache": args.triton_cache,
        "head_size": geometry.head_size,
        "q_heads": geometry.q_heads,
        "kv_heads": geometry.kv_heads,
        "layers": args.layers,
        "attention_chunk": args.attention_chunk,
        "max_model_len": max_model_len,
        "budget": args.budget,
        "tp": args.tp,
        "max_num_seqs": args.max_num_seqs,
        "max_tokens": args.max_tokens,
        "jobs": jobs,
        "gpu_memory_utilization": gpu_mem,
        "kv_cache_gib": args.kv_cache_gib,
        "jit_monitor_mode": monitor_mode,
        "runner": args.runner,
        "cuda_module_loading": os.environ.get("CUDA_MODULE_LOADING", "default (LAZY)"),
        "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR"),
        "hooks_in_process": args.tp == 1,
        "vllm_version": None,
        "gpu": None,
        "startup_s": None,
        "warmup_s": None,
        "plugin_report": None,
        "status": "ok",
    }
    if args.series:
        base["series"] = args.series
    out = Path(args.out) if args.out else None
    return RunContext(args, geometry, work, report_dir, plan, max_model_len, base, out)


# --------------------------------------------------------------------------------------
# Engine arguments and startup
# --------------------------------------------------------------------------------------


def engine_kwargs(ctx: RunContext, model_dir: Path, monitor_has_mode: bool) -> dict[str, Any]:
    """The ``LLM(...)`` keyword arguments of the configuration: the shared ones
    (:func:`benchmarks.tqbench.engine.engine_kwargs`) and the scheduler the phases assume."""
    a = ctx.args
    kwargs = engine.engine_kwargs(
        model=str(model_dir),
        preset=a.preset,
        max_model_len=ctx.max_model_len,
        max_num_seqs=a.max_num_seqs,
        gpu_mem_util=ctx.base["gpu_memory_utilization"],
        kv_cache_gib=a.kv_cache_gib,
        cudagraph_mode=a.cudagraph_mode if a.mode == "cudagraph" else None,
        enforce_eager=a.mode == "eager",
        monitor_mode=ctx.base["jit_monitor_mode"] if monitor_has_mode else None,
    )
    kwargs.update(
        max_num_batched_tokens=a.budget,
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
        tensor_parallel_size=a.tp,
    )
    return kwargs


def _read_plugin_reports(report_dir: Path) -> dict[str, Any]:
    reports: dict[str, Any] = {}
    for p in sorted(report_dir.glob(REPORT_GLOB)):
        try:
            reports[p.name] = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            reports[p.name] = {"status": "unreadable", "reason": str(e)}
    return reports


def _pick_rank0(reports: dict[str, Any]) -> dict[str, Any] | None:
    if not reports:
        return None
    names = sorted(reports)
    rep = reports[next((n for n in names if n.endswith("-0.json")), names[0])]
    return rep if isinstance(rep, dict) else None


def _config_warnings(ctx: RunContext, vcfg: Any, rep0: dict[str, Any] | None) -> list[str]:
    """Where the engine's settings differ from what the phases assume."""
    sched = vcfg.scheduler_config
    warnings = []
    if int(sched.max_num_batched_tokens) != ctx.args.budget:
        warnings.append(f"max_num_batched_tokens is {sched.max_num_batched_tokens}")
    if not sched.enable_chunked_prefill:
        warnings.append("chunked prefill is off")
    if not vcfg.cache_config.enable_prefix_caching:
        warnings.append("prefix caching is off")
    if ctx.plugin_on and ctx.args.preset != AUTO and rep0 is None:
        warnings.append("plugin on but it wrote no report (is the entry point installed?)")
    chunk = ctx.args.attention_chunk
    if chunk % int(vcfg.cache_config.block_size or 16):
        warnings.append(f"attention chunk {chunk} is not a multiple of the block size")
    overrun = phases.chunk_overrun_warning(ctx.plan, chunk, ctx.base["vllm_version"])
    if overrun:
        warnings.append(overrun)
    return warnings


def start_engine(ctx: RunContext, rec: recorder.JitRecorder) -> Any | None:
    """Start ``LLM(...)``; fill the run-level fields. None (and a failed record) if it fails."""
    import triton
    import vllm
    from vllm import LLM

    base = ctx.base
    base["vllm_version"] = vllm.__version__
    base["triton_version"] = triton.__version__
    with contextlib.suppress(Exception):
        import torch

        base["torch_version"] = torch.__version__
    base["plugin_entry_point_found"] = entry_point.found()
    monitor_module, monitor_has_mode = engine.jit_monitor_support(vllm.__version__)
    if not monitor_has_mode:
        base["jit_monitor_mode"] = "warn (no jit_monitor_mode before 0.25)"

    model_dir = ctx.work / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    a = ctx.args
    model_cfg = phases.build_model_config(
        ctx.geometry,
        a.layers,
        ctx.max_model_len,
        a.vocab_size,
        a.intermediate_size,
        a.attention_chunk,
    )
    (model_dir / "config.json").write_text(json.dumps(model_cfg, indent=1))
    kwargs = engine_kwargs(ctx, model_dir, monitor_has_mode)
    logs.marker(
        f"config={base['config_id']} plugin={a.plugin} cache={a.triton_cache} starting engine"
    )
    t0 = time.perf_counter()
    try:
        llm = LLM(**kwargs)
    except Exception as e:
        traceback.print_exc()
        base.update(
            phase="startup",
            status="failed",
            startup_s=round(time.perf_counter() - t0, 3),
            error=f"{type(e).__name__}: {e}"[-4000:],
            gpu=engine.gpu_name() or "unknown-gpu",
        )
        base["plugin_report"] = _pick_rank0(_read_plugin_reports(ctx.report_dir))
        ctx.records.append(base)
        ctx.flush()
        return None
    startup_s = time.perf_counter() - t0
    rewrapped = rec.ensure_outermost()
    rec.set_phase("after_startup", "")
    logs.marker("startup done")

    try:
        jit_monitor_active: bool | None = importlib.import_module(monitor_module).is_active()
    except ImportError:  # 0.20: no monitor at all
        jit_monitor_active = None

    vcfg = llm.llm_engine.vllm_config
    block_size = int(vcfg.cache_config.block_size or 16)
    ctx.plan = phases.plan_phases(a.budget, block_size, a.max_tokens)
    reports = _read_plugin_reports(ctx.report_dir)
    rep0 = _pick_rank0(reports)
    warnings = _config_warnings(ctx, vcfg, rep0)
    base.update(
        gpu=engine.gpu_name() or "unknown-gpu",
        startup_s=round(startup_s, 3),
        warmup_s=rep0.get("warmup_s") if rep0 else None,
        launch_s=rep0.get("launch_s") if rep0 else None,
        plugin_report=rep0,
        plugin_reports=reports if len(reports) > 1 else None,
        block_size=block_size,
        cudagraph_mode=str(vcfg.compilation_config.cudagraph_mode),
        jit_monitor_active=jit_monitor_active,
        # 0.34 has no V1 runner, and no flag: every worker runs V2
        model_runner="v2" if getattr(vcfg, "use_v2_model_runner", True) else "v1",
        monitor_rewrapped=rewrapped,
        config_warnings=warnings,
        startup_jit=recorder.startup_summary(rec.phase_events("startup")),
    )
    for w in warnings:
        logs.marker(f"WARNING {w}")
    return llm


# --------------------------------------------------------------------------------------
# Command
# --------------------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    """Run one configuration in this process and write its records to ``--out``."""
    apply_spec(args)
    if args.plugin not in ("on", "off"):
        print("run needs --plugin on|off (or a --spec that sets plugin)", file=sys.stderr)
        return 2
    if args.triton_cache == "warm" and not args.cache_root and not args.triton_cache_dir:
        print("--triton-cache warm needs --cache-root or --triton-cache-dir", file=sys.stderr)
        return 2
    try:
        phases.check_attention_chunk(args.attention_chunk)
    except ValueError as e:
        print(f"--attention-chunk: {e}", file=sys.stderr)
        return 2
    ctx = prepare(args)
    if ctx.max_model_len < ctx.plan.required_max_model_len:
        needed = ctx.plan.required_max_model_len
        ctx.base.update(
            phase="startup",
            status="failed",
            error=f"max_model_len {ctx.max_model_len} < {needed} needed",
        )
        ctx.records.append(ctx.base)
        ctx.flush()
        print(ctx.base["error"], file=sys.stderr)
        return 2

    import triton

    rec = recorder.JitRecorder(triton.knobs)
    rec.install()
    llm = start_engine(ctx, rec)
    if llm is None:
        return 1
    run_phases(ctx, llm, rec)
    tables.print_tables(ctx.records)
    sys.stdout.flush()
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    return 0 if all(r["status"] == "ok" for r in ctx.records) else 3


COMMON_OPTIONS: tuple[Option, ...] = (
    ("--layers", 6, "hidden layers (>= 6)"),
    (
        "--attention-chunk",
        0,
        "N > 0: a Llama 4 text model whose RoPE layers are chunked local attention of N "
        "tokens (a multiple of 16; see phases.build_model_config); 0: a plain Llama",
    ),
    ("--budget", 512, "chunked-prefill token budget (max_num_batched_tokens), > 128"),
    ("--tp", 1, "tensor-parallel size"),
    ("--max-model-len", 0, "0: the smallest multiple of 1024 the phases need"),
    ("--max-num-seqs", 32, "scheduler max_num_seqs"),
    ("--max-tokens", 8, "tokens generated per request"),
    (
        "--kv-cache-gib",
        2.0,
        "fixed KV cache size instead of a share of the measured free memory "
        "(vLLM still runs its profiling forward); 0: from --gpu-mem-util",
    ),
    ("--gpu-mem-util", 0.0, "gpu_memory_utilization; 0: min(0.85, 0.9/jobs - 0.03)"),
    ("--jobs", 1, "concurrent subprocesses on the GPU"),
    (
        "--cudagraph-mode",
        "",
        "cudagraph mode for --mode cudagraph (e.g. FULL_AND_PIECEWISE, "
        "PIECEWISE, FULL_DECODE_ONLY); empty: vLLM's default",
    ),
    (
        "--share-compile-cache",
        False,
        "do not isolate VLLM_CACHE_ROOT / TORCHINDUCTOR_CACHE_DIR per run",
    ),
    (
        "--series",
        "",
        "label stored with every record (which code, which machine); the summary "
        "groups by it (matrix default: 'matrix <run id>')",
    ),
)

RUN_OPTIONS: tuple[Option, ...] = (
    ("--spec", "", "JSON object of run options (names with '_'); what matrix gives each child"),
    ("--head-size", 128, "attention head size"),
    ("--q-heads", 16, "query heads"),
    ("--kv-heads", 8, "KV heads"),
    ("--triton-cache-dir", "", "sets TRITON_CACHE_DIR"),
    ("--cache-root", "", "sets TRITON_CACHE_DIR=<root>/triton (and vLLM/Inductor caches)"),
    (
        "--phases",
        "all",
        f"comma list of {PHASES}, run in the order given (default: all, in that order)",
    ),
    (
        "--profile-phases",
        "",
        "comma list of phases whose first and steady request run under torch.profiler; "
        "the records get the ops whose CPU time differs most (where a first request's "
        "extra time goes)",
    ),
    ("--vocab-size", 1024, "dummy model vocabulary"),
    ("--intermediate-size", 1024, "dummy model MLP size"),
    ("--work-dir", "", "model config and plugin report go here"),
    ("--out", "", "write the records here (a raw run, JSON Lines)"),
    ("--run-id", "", "default: time and process id"),
    ("--config-id", "", "default: from preset, mode, geometry, layers, budget, tp"),
)


def add_common_options(p: argparse.ArgumentParser) -> None:
    """Options ``run`` and ``matrix`` share (model, scheduler, GPU sharing, caches)."""
    add_options(p, COMMON_OPTIONS)
    p.add_argument(
        "--runner",
        choices=phases.RUNNERS,
        default="default",
        help="model runner: v1/v2 set VLLM_USE_V2_MODEL_RUNNER=0/1; default: vLLM's choice",
    )


def add_parser(subparsers: Any) -> None:
    """The ``run`` subcommand."""
    r = new_parser(
        subparsers, "run", "run one configuration in this process (imports vLLM)", __doc__
    )
    r.add_argument("--preset", choices=phases.PRESETS, default="turboquant_4bit_nc")
    r.add_argument("--mode", choices=phases.MODES, default="eager")
    r.add_argument("--plugin", choices=("on", "off"), default=None, help="required")
    r.add_argument(
        "--triton-cache",
        choices=("cold", "warm"),
        default="cold",
        help="label only: whether the Triton cache dir is fresh",
    )
    r.add_argument(
        "--jit-monitor-mode",
        choices=("warn", "error"),
        default="",
        help="default: error with the plugin on a TurboQuant cache, else warn",
    )
    add_options(r, RUN_OPTIONS)
    add_common_options(r)
    r.set_defaults(func=cmd_run)
