"""``serve-jit``: ``vllm serve --jit-monitor-mode error`` over an HTTP mix (issue 29).

One ``vllm serve`` per row, one after another (each its own engine-core process,
vLLM's defaults: prefix caching, chunked prefill), a dummy-weight Llama whose weights
vLLM's loader scales (``dummy_scale``). A row names the KV cache dtype, the
speculative decoding and whether the plugin's engine warmers run
(``TQ_WARMUP_VLLM_KERNELS``). The mix: short prompts, a 3000-token one, shared
prefixes sent together, a burst of 16, greedy and random batches, ``logprobs`` 1, 5
and 20, ``prompt_logprobs``, ``n=2`` and stop token ids (the server has no tokenizer,
so stop *strings* cannot be asked for). Prompts repeat a pattern, so ngram drafts.

Counted per row: requests served, requests failed (HTTP 500 once the engine core is
dead), and the JIT monitor's lines after startup (``Triton kernel JIT compilation
during inference: NAME``). Writes ``result.json`` and ``SUMMARY.md``.

``--driver-cache ROOT`` serves every row from a CUDA driver cache that
``tq-warmup driver-cache --cache-dir ROOT`` built (issue 30; ``--build-driver-cache``
builds it first, for the rows' own models and speculation, with the engine's
``torch.compile`` artifacts): ``TQ_WARMUP_DRIVER_CACHE``
is ``ROOT/driver-cache``, ``TQ_WARMUP_DRIVER_CACHE_COPY_TO`` one directory all rows share
(the second row on finds the first one's copy and must re-verify it) and
``TQ_WARMUP_CACHE_PIN`` the value ``tq-warmup verify --print-pin`` gives for ROOT. Each
row then records the plugin's driver-cache line and its first launches' time.
``--side-by-side`` starts the rows at once (each its own port and KV cache bytes): the JIT
counts are what a row shows, its times are not comparable with a row alone. A row named
twice in ``--rows`` (one after another only) starts again over the Triton cache its first
start filled: its ``vLLM kernels`` line is then the warmers' cost from a warm cache.

``--in-process`` starts each row's engine in a child process of its own instead of a
server (:mod:`benchmarks.tqbench.inproc_mix`): the same flags through vLLM's own
``EngineArgs`` parser, the same environment and mix through ``LLMEngine``, and Triton's
hooks in that process count every compile after startup, whoever's kernel it is
(inductor's too), where a server's log has only what vLLM's JIT monitor names, and on
0.20-0.24, which have no monitor, nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.tqbench import entry_point, records, shipped
from benchmarks.tqbench.children import Children, child_pythonpath
from benchmarks.tqbench.cli import Option, add_options, new_parser
from benchmarks.tqbench.engine import REPO_ROOT
from benchmarks.tqbench.serve_jit_facts import job_times, row_facts, rows_table
from benchmarks.tqbench.serve_jit_workload import mix, mixtral_config, qwen3_next_config
from benchmarks.tqbench.serve_prefix import (
    Server,
    engine_flags,
    plugin_lines,
    serve_argv,
    serve_env,
    served_row,
    server_options,
)
from benchmarks.tqbench.spec_child import write_models
from benchmarks.tqbench.spec_configs import MODEL_SIZES, SpecConfig

__all__ = [
    "ROWS",
    "Prepared",
    "Row",
    "add_parser",
    "build_layer",
    "in_process_row",
    "pin_of",
    "plugin_checked",
    "prepare_row",
]


@dataclass(frozen=True)
class Row:
    """One server: its KV cache dtype, speculation, engine warmers and model."""

    kv: str
    spec: SpecConfig
    warmers: bool = True
    moe: bool = False
    """The model is a Mixtral of the same attention shape (:func:`mixtral_config`): its
    MoE layers run Triton's ``fused_moe_kernel`` on Hopper. Not Llama 4: its chunked local
    layers cannot share a KV cache group with TurboQuant's on 0.20-0.27 (startup failed
    in vLLM's grouping on the H200, 0.26.0, 2026-12-02, ``benchmarks/results/llama4/``)."""
    ahead: bool = True
    """The compile-ahead child (``TQ_WARMUP_AHEAD``); off, the warmers compile in
    ``kernel_warmup`` as before it existed."""
    hybrid: bool = False
    """The model is a small Qwen3-Next (:func:`qwen3_next_config`): gated-delta-net layers
    beside full attention, MoE on every layer, its own MTP layer; served with
    ``--gdn-prefill-backend triton`` (the staged vLLM has no FlashInfer)."""
    layer: bool = False
    """Served from a shipped layer: ``tq-warmup precompile`` builds the row's keys on the
    CPU (``CUDA_VISIBLE_DEVICES=""``, ``--arch``) with vLLM's defaults for the rest, as an
    operator would, and the server reads it through the layered cache, pinned, over an
    empty Triton cache (:func:`build_layer`)."""


CHILDREN = Children()
"""This run's children, every one in its own process group and killed on SIGTERM: the
servers, the in-process engines, ``precompile``, ``driver-cache`` and ``verify``."""


HYBRID_GDN = "triton"
"""The hybrid's ``--gdn-prefill-backend``: the staged vLLM has no FlashInfer."""


HYBRID_SEQS = 32
"""The hybrid's ``--max-num-seqs`` (:func:`prepare_row` says why)."""


_NGRAM = SpecConfig("ngram", "ngram", 3)


ROWS: dict[str, Row] = {
    "tq-ngram": Row("tq", _NGRAM),
    "tq-ngram-off": Row("tq", _NGRAM, warmers=False),
    "auto-ngram": Row("auto", _NGRAM),
    "tq": Row("tq", SpecConfig("plain")),
    "tq-off": Row("tq", SpecConfig("plain"), warmers=False),
    "auto": Row("auto", SpecConfig("plain")),
    "tq-draft": Row("tq", SpecConfig("draft", "draft_model", 3)),
    "tq-draft-off": Row("tq", SpecConfig("draft", "draft_model", 3), warmers=False),
    "tq-eagle": Row("tq", SpecConfig("eagle", "eagle", 3)),
    "tq-eagle-off": Row("tq", SpecConfig("eagle", "eagle", 3), warmers=False),
    "tq-mtp": Row("tq", SpecConfig("mtp", "mtp", 1)),
    "tq-mtp-off": Row("tq", SpecConfig("mtp", "mtp", 1), warmers=False),
    "tq-moe": Row("tq", SpecConfig("plain"), moe=True),
    "tq-moe-off": Row("tq", SpecConfig("plain"), warmers=False, moe=True),
    "tq-ngram-noahead": Row("tq", _NGRAM, ahead=False),
    "tq-noahead": Row("tq", SpecConfig("plain"), ahead=False),
    "tq-moe-noahead": Row("tq", SpecConfig("plain"), moe=True, ahead=False),
    "tq-hybrid-mtp": Row("tq", SpecConfig("mtp", "mtp", 2), hybrid=True),
    "tq-hybrid-mtp-off": Row("tq", SpecConfig("mtp", "mtp", 2), warmers=False, hybrid=True),
    "tq-layer": Row("tq", SpecConfig("plain"), layer=True),
    "tq-ngram-layer": Row("tq", _NGRAM, layer=True),
    "tq-moe-layer": Row("tq", SpecConfig("plain"), moe=True, layer=True),
    "tq-layer-noahead": Row("tq", SpecConfig("plain"), layer=True, ahead=False),
    "tq-draft-layer": Row("tq", SpecConfig("draft", "draft_model", 3), layer=True),
    "tq-hybrid-mtp-layer": Row("tq", SpecConfig("mtp", "mtp", 2), hybrid=True, layer=True),
}


def _send(srv: Server, model: str, body: dict[str, Any]) -> str:
    try:
        srv.post("/v1/completions", {"model": model, "ignore_eos": True, **body})
    except Exception as e:  # HTTP 500 after the engine died, a timeout, a refused connection
        return f"{type(e).__name__}: {e}"[:200]
    return ""


def _workload(srv: Server, model: str, args: argparse.Namespace) -> dict[str, Any]:
    vocab = MODEL_SIZES["small"].vocab_size
    served, failures = 0, []
    for wave in mix(args.seed, vocab):
        with ThreadPoolExecutor(max_workers=len(wave)) as pool:
            for err in pool.map(lambda b: _send(srv, model, b), wave):
                if err:
                    failures.append(err)
                else:
                    served += 1
    return {"served": served, "failed": len(failures), "first_failure": failures[:1]}


@dataclass(frozen=True)
class Prepared:
    """A row's engine, however it starts (``vllm serve`` or in this process's child)."""

    model_dir: Path
    kv: str
    extra: list[str]
    """The row's own engine flags, beyond ``engine_flags``."""
    env: dict[str, str]
    spec: dict[str, Any] | None
    built: dict[str, Any]


def prepare_row(
    args: argparse.Namespace, name: str, work: Path, with_layer: bool = True
) -> Prepared:
    """Write row ``name``'s model (and, ``with_layer``, its shipped layer) under ``work``;
    its flags and environment."""
    row = ROWS[name]
    opts = {"model_size": asdict(MODEL_SIZES["small"]), "max_model_len": args.max_model_len}
    model_dir, head_dir = write_models(row.spec, opts, work / name)
    if row.moe:
        config = mixtral_config(json.loads((model_dir / "config.json").read_text()))
        (model_dir / "config.json").write_text(json.dumps(config, indent=1))
    if row.hybrid:
        config = qwen3_next_config(args.max_model_len)
        (model_dir / "config.json").write_text(json.dumps(config, indent=1))
    env = serve_env(args, work / name / "triton", Path(args.stub))
    # inductor's FX graph cache is per user (/tmp/torchinductor_USER): a row's own, or the
    # rank count and the async correction a row before compiled would start warm here
    env["TORCHINDUCTOR_CACHE_DIR"] = str(work / name / "inductor")
    env["TQ_WARMUP_VLLM_KERNELS"] = "1" if row.warmers else "0"
    env["TQ_WARMUP_AHEAD"] = "1" if row.ahead else "0"
    if args.driver_cache:
        env.update(
            TQ_WARMUP_DRIVER_CACHE=str(Path(args.driver_cache) / "driver-cache"),
            TQ_WARMUP_DRIVER_CACHE_COPY_TO=str(work / "driver-copy"),
        )
        if args.pin:  # else verify failed: the row shows the plugin's decision unpinned
            env["TQ_WARMUP_CACHE_PIN"] = args.pin
    kv = args.preset if row.kv == "tq" else "auto"
    flags: list[str] = []
    if args.side_by_side:
        flags += ["--gpu-memory-utilization", args.gpu_share]
    if args.jit_verbose:  # each event, with its constexprs, signature and key (0.25+)
        flags += ["--jit-monitor-verbose"]
    if row.hybrid:
        # One Mamba state block per decode sequence: H200's default 1024 exceed the 542
        # blocks 4 GiB hold (startup failed in CUDA graph capture, 0.26.0, serve-jit run R);
        # 256 captured FULL graphs of up to 512 tokens at 1-2 s each and passed 240 s of
        # startup (run R). 32 (the mix's bursts are 16) captures graphs up to 96 tokens.
        flags += ["--gdn-prefill-backend", HYBRID_GDN, "--max-num-seqs", str(HYBRID_SEQS)]
    spec = row.spec.speculative_config(str(model_dir), head_dir)
    built: dict[str, Any] = {}
    if row.layer and with_layer:
        layer = work / name / "layer"
        built = build_layer(args, model_dir, spec, layer)
        env.update(shipped.layered_env(layer))
        pins = [p for p in (env.get("TQ_WARMUP_CACHE_PIN", ""), built.get("pin", "")) if p]
        env["TQ_WARMUP_CACHE_PIN"] = ",".join(pins)
    if spec is not None:
        flags += ["--speculative-config", json.dumps(spec)]
    return Prepared(model_dir, kv, flags, env, spec, built)


def run_row(args: argparse.Namespace, name: str, port: int, work: Path, out: Path,
            children: Children, start: int = 1) -> dict[str, Any]:  # fmt: skip
    """One server of row ``name`` (with ``--in-process``, one engine in a child of this
    process); ``start`` > 1 reuses the row's Triton cache."""
    row = ROWS[name]
    p = prepare_row(args, name, work)
    result: dict[str, Any] = {"row": name, "kv": p.kv, "spec": p.spec, "warmers": row.warmers,
                              "ahead": row.ahead, "start": start}  # fmt: skip
    if p.built:
        result["layer"] = p.built
    suffix = "" if start == 1 else f"-start{start}"
    if args.in_process:
        row_result = in_process_row(args, p, out / f"inproc-{name}{suffix}.log", result)
    else:
        row_result = _served(args, p, port, out / f"serve-{name}{suffix}.log", result, children)
    return {**plugin_checked(row_result, p.env), **row_facts(row_result.get("plugin_lines") or [])}


def _served(args: argparse.Namespace, p: Prepared, port: int, log: Path,
            result: dict[str, Any], children: Children) -> dict[str, Any]:  # fmt: skip
    """One row as ``vllm serve`` over the HTTP mix (``serve_prefix.served_row``)."""
    argv = serve_argv(args, p.model_dir, port, p.kv, args.jit_mode) + p.extra
    srv = Server(port, args.request_timeout)

    def workload() -> dict[str, Any]:
        done = _workload(srv, str(p.model_dir), args)
        return {**done, "status": "ok" if done["failed"] == 0 else "requests-failed"}

    return served_row(srv, children, (argv, log, p.env, args.startup_timeout), result,
                      workload)  # fmt: skip


def plugin_checked(row: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """``row``, its status ``no-plugin`` where the plugin was to run (``TQ_WARMUP`` not 0)
    and its engine logged no ``tq-warmup:`` line: what it served, it served without the
    plugin, and the table must not count it as the plugin's row."""
    started = row.get("status") not in (None, "startup-failed")
    if started and env.get("TQ_WARMUP", "1") != "0" and not row.get("plugin_lines"):
        return {**row, "status": "no-plugin", "status_served": row.get("status")}
    return row


def in_process_row(args: argparse.Namespace, p: Prepared, log: Path,
                   result: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """One row as an engine in a child's own process (:mod:`benchmarks.tqbench.inproc_mix`):
    the same flags, environment and mix, every compile after startup seen by Triton's
    hooks, vLLM's kernels and inductor's too, where a server's log shows only what its JIT
    monitor names (none before 0.25)."""
    given = p.model_dir.parent / "inproc.json"
    written = p.model_dir.parent / "inproc-result.json"
    written.unlink(missing_ok=True)
    flags = engine_flags(args, p.kv, args.jit_mode)
    vocab = MODEL_SIZES["small"].vocab_size
    given.write_text(json.dumps({"flags": ["--model", str(p.model_dir), *flags, *p.extra],
                                 "result": str(written), "seed": args.seed,
                                 "vocab": vocab}))  # fmt: skip
    report = log.with_suffix(".report.json")  # the plugin's report: every family's job time
    report.unlink(missing_ok=True)
    env = {**p.env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TQ_WARMUP_REPORT": str(report)}
    argv = [sys.executable, "-m", "benchmarks.tqbench.inproc_mix", str(given)]
    result["engine"] = "in-process"
    ended = CHILDREN.run(argv, log, env, args.startup_timeout + args.request_timeout * 10)
    rc = -9 if ended.timed_out else ended.rc
    try:
        result.update(json.loads(written.read_text()))
    except (OSError, ValueError):
        result.update(status=f"died (exit {rc})")
    result["jit_after_startup"] = result.get("compiled_after_startup")
    result["plugin_lines"] = plugin_lines(log.read_text(errors="replace"))
    result.update(job_times(report))
    return result


def build_layer(args: argparse.Namespace, model_dir: Path, spec: dict[str, Any] | None,
                layer: Path) -> dict[str, Any]:  # fmt: skip
    """Build a row's shipped layer with ``tq-warmup precompile`` on the CPU, for
    ``--layer-arch``, and pin it: ``{seconds, rc, last_line, pin, verify}``. Only the
    flags a row sets are passed (the model, its length, the preset, the speculation):
    the rest are precompile's defaults, which are vLLM's."""
    argv = [sys.executable, "-m", "tq_warmup_plugin.cli", "precompile", "--model",
            str(model_dir), "--kv-cache-dtype", args.preset, "--max-model-len",
            str(args.max_model_len), "--arch", str(args.layer_arch), "--cache-dir",
            str(layer)]  # fmt: skip
    if spec is not None:
        argv += ["--speculative-config", json.dumps(spec)]
    gpu = gpu_name()
    if gpu:  # a MoE model's keys follow this GPU's tuned configs (precompile: an H200's)
        argv += ["--gpu-name", gpu]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": child_pythonpath([str(REPO_ROOT / "src")], os.environ)}  # fmt: skip
    started = time.perf_counter()
    out = CHILDREN.capture(argv, env, 900)
    seconds = round(time.perf_counter() - started, 1)
    lines = (out.stdout + out.stderr).strip().splitlines()
    # its one summary line (keys, vLLM's jobs, host launchers), not torch's last warning
    said = [x for x in out.stdout.splitlines() if x.startswith("tq-warmup: ") and " keys " in x]
    line = (said or lines or [""])[-1][:400]
    pin, verify = pin_of(str(layer)) if out.rc == 0 else ("", "")
    print(f"serve-jit: precompile {out.rc} in {seconds} s: {line}", flush=True)
    return {"seconds": seconds, "rc": out.rc, "last_line": line, "pin": pin,
            "verify": verify}  # fmt: skip


def gpu_name() -> str:
    """This machine's first GPU as vLLM names it (``torch.cuda.get_device_name``, which
    ``nvidia-smi`` prints the same), or "" without one."""
    try:
        done = CHILDREN.capture(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], os.environ, 30
        )
    except OSError:
        return ""
    return (done.stdout.strip().splitlines() or [""])[0].strip() if done.rc == 0 else ""


def build_driver_cache(args: argparse.Namespace, names: list[str], work: Path) -> Path:
    """A fleet's GPU step for ``names``' models: ``tq-warmup driver-cache`` (its engine on,
    the row's speculation) into one layer root, each build seeded by the one before, so
    the entry holds every row's FlashAttention-2 modules and ``torch.compile`` artifacts.
    Each build line is printed; the root is returned."""
    root = work / "fleet"
    for name in dict.fromkeys(names):
        p = prepare_row(args, name, work / "fleet-models", with_layer=False)
        argv = [sys.executable, "-m", "tq_warmup_plugin.cli", "driver-cache", "--model",
                str(p.model_dir), "--kv-cache-dtype", args.preset, "--max-model-len",
                str(args.max_model_len), "--dtype", "bfloat16",
                "--cache-dir", str(root)]  # fmt: skip
        if p.spec is not None:
            argv += ["--speculative-config", json.dumps(p.spec)]
        if ROWS[name].hybrid:  # the engine the row serves with, or its graphs differ
            argv += ["--max-num-seqs", str(HYBRID_SEQS),
                     "--engine-args", json.dumps({"gdn_prefill_backend": HYBRID_GDN})]  # fmt: skip
        env = {**p.env, "TORCHINDUCTOR_CACHE_DIR": str(work / "fleet-models" / name / "ind")}
        env.pop("TQ_WARMUP_DRIVER_CACHE", None)
        started = time.perf_counter()
        done = CHILDREN.capture(argv, env, args.startup_timeout + 300)
        said = [x for x in done.stdout.splitlines() if x.startswith("tq-warmup: driver cache")]
        tail = (said or (done.stderr or done.stdout).strip().splitlines() or [""])[-1][:600]
        print(f"serve-jit: driver-cache {name} rc {done.rc} in "
              f"{time.perf_counter() - started:.1f} s: {tail}", flush=True)  # fmt: skip
    return root


def pin_of(root: str) -> tuple[str, str]:
    """``(TQ_WARMUP_CACHE_PIN value, verify's summary line)`` for the layer ``root``:
    what ``tq-warmup verify --print-pin`` prints."""
    argv = [sys.executable, "-m", "tq_warmup_plugin.cli", "verify", "--cache-dir", root,
            "--print-pin"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src")}
    out = CHILDREN.capture(argv, env, 120)
    lines = out.stdout.splitlines()
    pin = next((ln.split("=", 1)[1] for ln in lines if ln.startswith("TQ_WARMUP_CACHE_PIN=")), "")
    summary = next((ln for ln in lines if " problem" in ln), out.stderr.strip()[-300:])
    return pin, summary


def cmd_serve_jit(args: argparse.Namespace) -> int:
    out = Path(args.out or REPO_ROOT / "benchmarks" / "results" / "raw" / "serve-jit")
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="tq-serve-jit-")).resolve()
    names = [n for n in args.rows.split(",") if n]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        print(f"serve-jit: unknown rows {unknown}; known: {', '.join(ROWS)}", file=sys.stderr)
        return 2
    if args.side_by_side and args.in_process:
        print("serve-jit: --in-process rows run one after another", file=sys.stderr)
        return 2
    if args.side_by_side and len(set(names)) < len(names):
        print("serve-jit: a row named twice starts again after the first: not side by side",
              file=sys.stderr)  # fmt: skip
        return 2
    children = CHILDREN
    children.stop_on_sigterm()
    # Written once, before any server reads it (rows side by side would rewrite it).
    args.stub = str(entry_point.write_stub(work / "entry-point", plugin=not entry_point.found(),
                                           weight_scale=True))  # fmt: skip
    # vLLM checks utilization x total <= free memory at startup: each row its share.
    args.gpu_share = f"{min(0.85, 0.9 / len(names) - 0.03):.2f}"
    head: dict[str, Any] = {"options": vars(args)}
    if args.build_driver_cache and not args.driver_cache:
        args.driver_cache = str(build_driver_cache(args, names, work))
        if args.build_only:  # a call of its own: a hybrid's build and rows pass 600 s
            head["verify"] = pin_of(args.driver_cache)[1]
            records.write_json_atomic(out / "result.json", {**head, "rows": []})
            print(f"serve-jit: built {args.driver_cache}: {head['verify']}", flush=True)
            return 0
    if args.driver_cache:
        args.pin, head["verify"] = pin_of(args.driver_cache)
        print(f"serve-jit: {head['verify']}; pin {args.pin[:80]}", flush=True)
    rows: list[dict[str, Any]] = []

    def one(i: int) -> dict[str, Any]:
        start = names[: i + 1].count(names[i])
        return run_row(args, names[i], args.port + i, work, out, children, start)

    if args.side_by_side:
        with ThreadPoolExecutor(max_workers=len(names)) as pool:
            rows = list(pool.map(one, range(len(names))))
    else:
        for i in range(len(names)):
            rows.append(one(i))
            records.write_json_atomic(out / "result.json", {**head, "rows": rows})
    records.write_json_atomic(out / "result.json", {**head, "rows": rows})
    table = rows_table(rows)
    (out / "SUMMARY.md").write_text(table)
    print(table, flush=True)
    return 0


OPTIONS: tuple[Option, ...] = (
    ("--rows", "tq-ngram,tq-ngram-off", "servers to run, in order (serve_jit.ROWS)"),
    ("--jit-mode", "error", "--jit-monitor-mode (0.25+): error or warn"),
    ("--driver-cache", "", "a layer root with driver-cache/: every row served from it, pinned"),
    (
        "--build-driver-cache",
        False,
        "first build that root here (tq-warmup driver-cache, its engine on, for every row's "
        "model and speculation: a fleet's GPU step), then serve every row from it",
    ),
    ("--build-only", False, "with --build-driver-cache: build it and serve no row"),
    ("--jit-verbose", False, "--jit-monitor-verbose: every JIT event with its key"),
    ("--layer-arch", 90, "the SM the *-layer rows' precompile builds for (an H200: 90)"),
    ("--side-by-side", False, "start every row at once (JIT counts only; times not comparable)"),
    (
        "--in-process",
        False,
        "each row an engine in a child process of its own (no server), the same flags and mix: "
        "Triton's hooks count every compile after startup (0.20-0.24 have no JIT monitor)",
    ),
    *server_options("serve-jit", 4096, 4.0, 8031),
)


def add_parser(subparsers: Any) -> None:
    """The ``serve-jit`` subcommand."""
    p = new_parser(subparsers, "serve-jit", "JIT-monitor error mode through vllm serve", __doc__)
    add_options(p, OPTIONS)
    p.add_argument("--preset", default="turboquant_4bit_nc")
    p.set_defaults(func=cmd_serve_jit)
