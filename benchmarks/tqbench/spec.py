"""The ``spec`` command: are speculative-decoding tokens right with a TurboQuant KV cache?

vLLM 0.21-0.33 with a TurboQuant cache and speculative decoding captures FULL CUDA graphs
of uniform verify batches whose attention ignores the cached context (issue 10). The
plugin's spec guard (on by default, ``TQ_WARMUP_SPEC_GUARD=0`` turns it off) makes those
batches run PIECEWISE. This command shows the difference and its size: every
configuration generates greedily from the same prompts, and its tokens and chosen-token
logprobs are compared with the reference (eager, no speculative decoding): per prompt the
first divergent index, the number of differing tokens, the largest |logprob difference|
over the common prefix, and the reference's top-1/top-2 margin where a prompt diverges
(a tiny margin means a near-tie, a large one a real error). It also records the
TurboQuant Triton compiles after startup (0 expected with the plugin on) and the output
tokens/s of a timed generate after an untimed one, so users see what the guard costs.

Configurations (``--configs``: ``all``, names, or kinds expanded over ``--ks``):
``ref-eager`` (the reference, always run), ``nospec-full`` (FULL_AND_PIECEWISE, no
speculation), and for every k: ``ngram{k}-eager``, ``ngram{k}-piecewise``,
``ngram{k}-full-guard``, ``ngram{k}-full-noguard`` (``draft{k}-...`` with ``--method
draft_model``: the dummy model drafts for itself). The plugin is on in every one.

The parent imports neither vLLM nor torch. It runs one child per configuration
(``spec --child SPEC.json``; ``--jobs N`` at once on one GPU, each with a fixed KV cache
and a small ``gpu_memory_utilization``), so a crash such as an illegal memory access only
ends that child: its exit code and last error line are recorded. ``--deadline-s`` stops
starting children and kills running ones. The raw run (records.write_run: run-level
fields once, a row per configuration) goes to ``--out``, a summary JSON beside it, logs
to ``--log-dir``. The default out is under ``benchmarks/results/spec/``, not ``raw/``,
which ``collect`` reads as phase records.

A child runs the engine in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the Triton
hooks see every compile) on a dummy-weight Llama whose config.json it writes, with a
fresh Triton cache, and, on vLLM >= 0.25, the JIT monitor in ``error`` mode.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.tqbench import entry_point, logs, phases, records, tables
from benchmarks.tqbench.cli import Option, add_options, new_parser

__all__ = [
    "CHILD_FINAL",
    "DEFAULT_LOG_DIR",
    "DEFAULT_OUT_DIR",
    "ERROR_RES",
    "METHOD_PREFIX",
    "NOSPEC_FULL",
    "OK_VERDICTS",
    "OPTIONS",
    "PERIOD",
    "REFERENCE",
    "REPO_ROOT",
    "SPEC_COUNTERS",
    "SPEC_KINDS",
    "TABLE_HEADER",
    "SpecBench",
    "SpecConfig",
    "add_comparisons",
    "add_parser",
    "build_configs",
    "child_argv",
    "child_env",
    "chosen_logprobs",
    "cmd_spec",
    "compare",
    "engine_kwargs",
    "last_error_line",
    "read_result",
    "report",
    "run_child",
    "spec_config",
    "spec_prompts",
    "summarize",
    "table_rows",
    "verdict",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT_DIR = REPO_ROOT / "benchmarks" / "results" / "spec"
DEFAULT_LOG_DIR = REPO_ROOT / "benchmarks" / "results" / "logs"
REFERENCE = "ref-eager"
NOSPEC_FULL = "nospec-full"
SPEC_KINDS: tuple[str, ...] = ("eager", "piecewise", "full-guard", "full-noguard")
METHOD_PREFIX = {"ngram": "ngram", "draft_model": "draft"}
FULL, PIECEWISE = "FULL_AND_PIECEWISE", "PIECEWISE"
PERIOD = 24  # tokens in the pattern every prompt repeats
# A child's own statuses; anything else it left behind means it died on the way.
CHILD_FINAL = ("ok", "startup-failed", "generate-failed")
OK_VERDICTS = ("equal", "within-noise")
SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}
ERROR_RES = (
    re.compile(r"^\s*[\w.]*(Error|Exception|Interrupt)\b:?"),  # a traceback's last line
    re.compile(r"CUDA error|ERROR|Fatal|Aborted|Segmentation fault|core dumped"),
)


# --------------------------------------------------------------------------------------
# Pure parts: configurations, prompts, comparison, table
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpecConfig:
    """One engine: speculation (``method`` None: none), CUDA graphs, the guard."""

    name: str
    method: str | None = None
    k: int = 0
    cudagraph_mode: str | None = None  # None: enforce_eager
    guard: bool = True

    def speculative_config(self, model_dir: str) -> dict[str, Any] | None:
        """vLLM's ``speculative_config`` (keys as in 0.22 / 0.26 config/speculative.py)."""
        if self.method == "ngram":
            return {
                "method": "ngram",
                "num_speculative_tokens": self.k,
                "prompt_lookup_max": 4,
                "prompt_lookup_min": 2,
            }
        if self.method == "draft_model":
            return {"method": "draft_model", "model": model_dir, "num_speculative_tokens": self.k}
        return None


def spec_config(method: str, k: int, kind: str) -> SpecConfig:
    """The configuration of one kind (:data:`SPEC_KINDS`) at ``k`` speculative tokens."""
    mode = {"eager": None, "piecewise": PIECEWISE}.get(kind, FULL)
    name = f"{METHOD_PREFIX[method]}{k}-{kind}"
    return SpecConfig(name, method, k, mode, guard=kind != "full-noguard")


def build_configs(selection: str, ks: Sequence[int], method: str) -> list[SpecConfig]:
    """The configurations ``--configs`` names, the reference first, without repeats.

    Items: ``all``, ``ref-eager``, ``nospec-full``, a kind (expanded over ``ks``) or a
    full name such as ``ngram3-full-noguard`` (any k).
    """
    if method not in METHOD_PREFIX:
        raise ValueError(f"method must be one of {sorted(METHOD_PREFIX)}, got {method!r}")
    if not ks or any(k < 1 for k in ks):
        raise ValueError(f"ks must be positive, got {list(ks)}")
    name_re = re.compile(rf"{METHOD_PREFIX[method]}(\d+)-({'|'.join(SPEC_KINDS)})")
    out = {REFERENCE: SpecConfig(REFERENCE)}
    for item in [t.strip() for t in selection.split(",") if t.strip()]:
        m = name_re.fullmatch(item)
        if item in ("all", NOSPEC_FULL):
            out[NOSPEC_FULL] = SpecConfig(NOSPEC_FULL, cudagraph_mode=FULL)
        if item == "all" or item in SPEC_KINDS:
            kinds = SPEC_KINDS if item == "all" else (item,)
            out.update({c.name: c for k in ks for c in (spec_config(method, k, x) for x in kinds)})
        elif m:
            out.setdefault(item, spec_config(method, int(m.group(1)), m.group(2)))
        elif item not in (REFERENCE, NOSPEC_FULL):
            raise ValueError(
                f"unknown configuration {item!r}: all, {REFERENCE}, {NOSPEC_FULL}, "
                f"{'/'.join(SPEC_KINDS)} or a name like {METHOD_PREFIX[method]}3-full-guard"
            )
    return list(out.values())


def spec_prompts(
    n: int = 8, seed: int = 0, lens: tuple[int, int] = (150, 430), vocab_size: int = 1024
) -> list[list[int]]:
    """``n`` prompts, each a random ``PERIOD``-token pattern repeated, lengths evenly from
    ``lens[0]`` to ``lens[1]``: ngram finds its drafts, so verify batches are uniform."""
    min_len, max_len = lens
    if not 0 < min_len <= max_len or n < 1:
        raise ValueError("need n >= 1 and 0 < shortest <= longest")
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        pattern = [rng.randrange(3, vocab_size) for _ in range(PERIOD)]
        length = min_len + round(i * (max_len - min_len) / max(1, n - 1))
        prompts.append((pattern * (length // PERIOD + 1))[:length])
    return prompts


def chosen_logprobs(
    token_ids: Sequence[int], positions: Sequence[Mapping[int, Any] | None] | None
) -> tuple[list[float | None], list[float | None]]:
    """Per generated token: its logprob, and the margin between the two best logprobs
    at that position (None with fewer than two). Values: vLLM ``Logprob`` or floats."""
    lps: list[float | None] = []
    margins: list[float | None] = []
    for j, tok in enumerate(token_ids):
        pos = positions[j] if positions is not None and j < len(positions) else None
        values = {t: float(getattr(v, "logprob", v)) for t, v in (pos or {}).items()}
        lps.append(values.get(tok))
        best = sorted(values.values(), reverse=True)
        margins.append(best[0] - best[1] if len(best) > 1 else None)
    return lps, margins


def compare(ref: Mapping[str, Any], got: Mapping[str, Any]) -> dict[str, Any]:
    """How far ``got``'s tokens and logprobs are from ``ref``'s (rows with ``tokens``,
    ``logprobs`` and ``margins``: one list per prompt)."""
    ref_t, got_t = ref.get("tokens") or [], got.get("tokens") or []
    first: list[int | None] = []
    differing = compared = 0
    max_lp: float | None = None
    margins: list[float] = []
    at_divergence: list[float | None] = []
    for i, want in enumerate(ref_t):
        have = got_t[i] if i < len(got_t) else []
        length = max(len(want), len(have))
        diff = [j for j in range(length) if j >= min(len(want), len(have)) or want[j] != have[j]]
        differing, compared = differing + len(diff), compared + length
        first.append(diff[0] if diff else None)
        prefix = diff[0] if diff else length
        for a, b in zip(
            _nth(ref, "logprobs", i)[:prefix], _nth(got, "logprobs", i)[:prefix], strict=False
        ):
            if a is not None and b is not None:
                max_lp = max(max_lp or 0.0, abs(a - b))
        margin = _nth(ref, "margins", i)[prefix : prefix + 1] if diff else []
        margins.extend(m for m in margin if m is not None)
        if diff:  # how sure the reference was of the token this engine did not pick
            at_divergence.append(margin[0] if margin else None)
    return {
        "exact": differing == 0 and len(got_t) == len(ref_t),
        "prompts_divergent": sum(d is not None for d in first) + max(0, len(got_t) - len(ref_t)),
        "first_divergence": first,
        "tokens_differing": differing,
        "tokens_compared": compared,
        "max_lp_delta": max_lp,
        "ref_margin_at_divergence": max(margins) if margins else None,
        "divergence_margins": at_divergence,
    }


def _nth(row: Mapping[str, Any], key: str, i: int) -> list[Any]:
    values = row.get(key) or []
    return list(values[i] or []) if i < len(values) else []


def verdict(row: Mapping[str, Any], lp_tol: float, floor: float | None) -> str:
    """``equal``; ``within-noise``; ``WRONG``; or the failure status.

    ``floor`` is how far the no-spec FULL_AND_PIECEWISE engine of the same run is from
    the eager reference: the same attention through other kernels. bf16 logits put
    near-ties one ulp apart, so that engine already picks other tokens than eager where
    the reference's top-1/top-2 margin is that small (seen on the H200, 0.22 and 0.26).
    ``within-noise``: every divergence where the reference's margin is within the floor,
    and no logprob of the common prefix further off than the floor (each + ``lp_tol``).
    """
    cmp = row.get("cmp")
    if row.get("status") != "ok":
        return str(row.get("status"))
    if not cmp:
        return "no-reference"
    delta = cmp.get("max_lp_delta") or 0.0
    if cmp["exact"] and delta <= lp_tol:
        return "equal"
    if floor is None:
        return "WRONG"
    bound = floor + lp_tol
    decided = [m for m in cmp.get("divergence_margins") or [] if m is None or m > bound]
    return "WRONG" if decided or delta > bound else "within-noise"


def add_comparisons(rows: Sequence[dict[str, Any]], lp_tol: float) -> None:
    """Compare every finished row with the reference row; set ``cmp``, ``timed_cmp``
    (the timed generate against the reference), ``verdict`` and ``speedup_vs_ref``."""
    ref = next((r for r in rows if r["name"] == REFERENCE and r.get("status") == "ok"), None)
    for r in rows:
        ok = ref is not None and r.get("status") == "ok"
        r["cmp"] = compare(ref, r) if ok and ref is not None else None
        timed = {"tokens": r.get("timed_tokens"), "logprobs": r.get("timed_logprobs")}
        r["timed_cmp"] = compare(ref, timed) if ok and ref is not None else None
        base = ref.get("tok_s") if ref else None
        r["speedup_vs_ref"] = round(r["tok_s"] / base, 3) if base and r.get("tok_s") else None
    floor_row = next((r for r in rows if r["name"] == NOSPEC_FULL and r.get("cmp")), None)
    floor = (floor_row["cmp"].get("max_lp_delta") or 0.0) if floor_row else None
    for r in rows:
        r["noise_floor"] = floor
        r["verdict"] = verdict(r, lp_tol, floor)


def _num(x: Any, fmt: str) -> str:
    return format(x, fmt) if isinstance(x, (int, float)) else "-"


def _divergence_cell(cmp: Mapping[str, Any] | None) -> str:
    if not cmp:
        return "-"
    idx = [d for d in cmp["first_divergence"] if d is not None]
    n = len(cmp["first_divergence"])
    if not idx:
        return f"0/{n}"
    span = str(min(idx)) if min(idx) == max(idx) else f"{min(idx)}-{max(idx)}"
    return f"{cmp['prompts_divergent']}/{n} @{span}"


def _compiles_cell(r: Mapping[str, Any]) -> str:
    """TurboQuant compiles after startup: ``0``, ``2c names...``, or ``-`` (not recorded)."""
    if "tq_compiles_after_startup" not in r:
        return "-"
    cell = tables.kernel_summary(dict(r))
    return "0" if cell == "-" else cell


def _acceptance(counters: Mapping[str, int] | None) -> str:
    if not counters or not counters.get("draft_tokens"):
        return "-"
    return f"{counters.get('accepted_tokens', 0) / counters['draft_tokens']:.2f}"


TABLE_HEADER = (
    "config",
    "verdict",
    "cudagraph mode (asked -> vLLM's)",
    "tok/s",
    "x ref",
    "diverged @index",
    "tokens differing",
    "max |dlogprob|",
    "ref max margin there",
    "tq jit after startup",
    "accept",
    "error",
)


def table_rows(rows: Iterable[Mapping[str, Any]]) -> list[tuple[str, ...]]:
    """One table row per configuration (cells under :data:`TABLE_HEADER`)."""
    out: list[tuple[str, ...]] = []
    for r in rows:
        cmp = r.get("cmp")
        asked = r.get("cudagraph_mode_asked") or "eager"
        mode = f"{asked} -> {r['cudagraph_mode']}" if r.get("cudagraph_mode") else asked
        differing = f"{cmp['tokens_differing']}/{cmp['tokens_compared']}" if cmp else "-"
        out.append(
            (
                str(r["name"]),
                str(r.get("verdict") or r.get("status")),
                mode,
                _num(r.get("tok_s"), ".0f"),
                _num(r.get("speedup_vs_ref"), ".2f"),
                _divergence_cell(cmp),
                differing,
                _num(cmp and cmp.get("max_lp_delta"), ".2e"),
                _num(cmp and cmp.get("ref_margin_at_divergence"), ".2e"),
                _compiles_cell(r),
                _acceptance(r.get("spec_counters")),
                str(r.get("error_line") or "")[:80],
            )
        )
    return out


def summarize(run: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The small summary JSON: per configuration its verdict and figures, and the answers
    (guard off wrong? guard on equal? TurboQuant compiles after startup?)."""
    keep = ("vllm_version", "gpu", "date", "run_id", "preset", "method", "geometry")
    configs = {}
    for r in rows:
        cmp = r.get("cmp") or {}
        configs[r["name"]] = {
            "verdict": r.get("verdict"),
            "status": r.get("status"),
            "tok_s": r.get("tok_s"),
            "speedup_vs_ref": r.get("speedup_vs_ref"),
            "prompts_divergent": cmp.get("prompts_divergent"),
            "first_divergence": cmp.get("first_divergence"),
            "tokens_differing": cmp.get("tokens_differing"),
            "max_lp_delta": cmp.get("max_lp_delta"),
            "divergence_margins": cmp.get("divergence_margins"),
            "cudagraph_mode": r.get("cudagraph_mode"),
            "acceptance": _acceptance(r.get("spec_counters")),
            "tq_compiles_after_startup": r.get("tq_compiles_after_startup"),
            "error_line": r.get("error_line"),
        }

    def verdicts(suffix: str) -> list[Any]:
        return [r.get("verdict") for r in rows if str(r["name"]).endswith(suffix)]

    on, off = verdicts("-full-guard"), verdicts("-full-noguard")
    if not any(r["name"] == REFERENCE and r.get("status") == "ok" for r in rows):
        on = off = []  # nothing to compare with: no answer either way
    ok_rows = [r for r in rows if r.get("status") == "ok"]
    return {
        "run": {k: run.get(k) for k in keep},
        "configs": configs,
        "guard_off_wrong_or_crashed": all(v not in OK_VERDICTS for v in off) if off else None,
        "guard_on_right": all(v in OK_VERDICTS for v in on) if on else None,
        "noise_floor": next((r.get("noise_floor") for r in rows), None),
        "tq_compiles_after_startup": sum(
            len(r.get("tq_compiles_after_startup") or []) for r in ok_rows
        ),
    }


def last_error_line(text: str) -> str | None:
    """The line of a child's log that best says why it failed: the last exception line
    (``RuntimeError: CUDA error: ...``), else the last ERROR / CUDA error / fatal line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for pattern in ERROR_RES:
        hit = next((ln for ln in reversed(lines) if pattern.search(ln)), None)
        if hit is not None:
            return hit[-500:]
    return None


def child_env(cfg: SpecConfig, work: Path, share_compile_cache: bool) -> dict[str, str]:
    """What a child's environment adds: in-process engine, plugin on, the guard, caches."""
    env = {
        "PYTHONUNBUFFERED": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "TQ_WARMUP": "1",
        "TQ_WARMUP_SPEC_GUARD": "1" if cfg.guard else "0",
        "TQ_WARMUP_REPORT": str(work / "tq-warmup-report.json"),
        "TRITON_CACHE_DIR": str(work / "triton"),
    }
    if not share_compile_cache:
        env.update(
            VLLM_CACHE_ROOT=str(work / "vllm"), TORCHINDUCTOR_CACHE_DIR=str(work / "inductor")
        )
    return env


def engine_kwargs(
    cfg: SpecConfig, opts: Mapping[str, Any], model_dir: str, monitor_mode: str | None
) -> dict[str, Any]:
    """``LLM(...)`` keywords (names as in 0.22 and 0.26 entrypoints/llm.py and EngineArgs)."""
    kwargs: dict[str, Any] = {
        "model": model_dir,
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "dtype": "bfloat16",
        "kv_cache_dtype": opts["preset"],
        "enforce_eager": cfg.cudagraph_mode is None,
        "max_model_len": opts["max_model_len"],
        "max_num_seqs": opts["max_num_seqs"],
        "gpu_memory_utilization": opts["gpu_mem_util"],
        "seed": 0,
        "disable_log_stats": False,  # LLM.get_metrics(): the acceptance counters
    }
    if opts.get("budget"):  # the chunked-prefill budget a precompiled plan was made for
        kwargs["max_num_batched_tokens"] = opts["budget"]
    if opts["kv_cache_gib"] > 0:
        kwargs["kv_cache_memory_bytes"] = int(opts["kv_cache_gib"] * (1 << 30))
    if cfg.cudagraph_mode is not None:
        kwargs["compilation_config"] = {"cudagraph_mode": cfg.cudagraph_mode}
    spec = cfg.speculative_config(model_dir)
    if spec is not None:
        kwargs["speculative_config"] = spec
    if monitor_mode:
        kwargs["jit_monitor_mode"] = monitor_mode
    return kwargs


# --------------------------------------------------------------------------------------
# Child: one configuration in this process (imports vLLM)
# --------------------------------------------------------------------------------------


def _outputs(outs: Sequence[Any]) -> dict[str, list[Any]]:
    """Token ids, chosen logprobs and top-2 margins of ``LLM.generate``'s outputs."""
    got: dict[str, list[Any]] = {"tokens": [], "logprobs": [], "margins": []}
    for o in outs:
        c = o.outputs[0]
        lps, margins = chosen_logprobs(list(c.token_ids), c.logprobs)
        got["tokens"].append(list(c.token_ids))
        got["logprobs"].append(lps)
        got["margins"].append(margins)
    return got


def _gpu(torch: Any) -> str | None:
    with contextlib.suppress(Exception):
        return str(torch.cuda.get_device_name(0))
    return None


def _spec_counters(llm: Any) -> dict[str, int] | None:
    counters: dict[str, int] = {}
    with contextlib.suppress(Exception):
        for m in llm.get_metrics():
            key = SPEC_COUNTERS.get(m.name)
            if key is not None:
                counters[key] = counters.get(key, 0) + int(m.value)
    return counters or None


def run_child(spec_path: Path) -> int:
    """Start the engine, generate (untimed, then timed), write the result file."""
    spec = json.loads(spec_path.read_text())
    cfg, opts, work = SpecConfig(**spec["config"]), spec["options"], Path(spec["work"])
    out = Path(spec["result"])
    res: dict[str, Any] = {"status": "importing", "entry_point_found": entry_point.found()}

    def save(**fields: Any) -> None:
        res.update(fields)
        records.write_json_atomic(out, res)

    save()
    import triton

    from benchmarks.tqbench.recorder import JitRecorder, startup_summary
    from benchmarks.tqbench.run import jit_monitor_support

    rec = JitRecorder(triton.knobs)
    rec.install()
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    has_mode = jit_monitor_support(vllm.__version__)[1]
    model_dir = work / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    model_cfg = phases.build_model_config(
        phases.parse_geometry(opts["geometry"]), opts["layers"], opts["max_model_len"]
    )
    (model_dir / "config.json").write_text(json.dumps(model_cfg, indent=1))
    kwargs = engine_kwargs(
        cfg, opts, str(model_dir), opts["jit_monitor_mode"] if has_mode else None
    )
    save(
        status="starting",
        vllm_version=vllm.__version__,
        triton_version=triton.__version__,
        torch_version=torch.__version__,
        engine_kwargs=kwargs,
    )
    logs.marker(f"spec config={cfg.name} starting engine")
    t0 = time.perf_counter()
    try:
        llm = LLM(**kwargs)
    except Exception as e:
        traceback.print_exc()
        save(
            status="startup-failed",
            error=f"{type(e).__name__}: {e}"[-4000:],
            startup_s=round(time.perf_counter() - t0, 3),
            gpu=_gpu(torch),
        )
        return 1
    scale = float(opts["weight_scale"])
    if scale != 1.0:
        # In place: the captured CUDA graphs read the same tensors.
        llm.apply_model(lambda model: [p.data.mul_(scale) for p in model.parameters()])
    rec.ensure_outermost()
    rec.set_phase("after_startup", "")
    logs.marker("startup done")
    vcfg = llm.llm_engine.vllm_config
    report = work / "tq-warmup-report.json"
    save(
        status="generating",
        startup_s=round(time.perf_counter() - t0, 3),
        gpu=_gpu(torch),
        cudagraph_mode=str(vcfg.compilation_config.cudagraph_mode),
        speculative_config=str(vcfg.speculative_config),
        block_size=vcfg.cache_config.block_size,
        plugin_report=json.loads(report.read_text()) if report.is_file() else None,
        startup_jit=startup_summary(rec.phase_events("startup")),
    )
    sp = SamplingParams(
        temperature=0.0,
        max_tokens=opts["max_tokens"],
        logprobs=opts["logprobs"],
        seed=0,
        ignore_eos=True,
        detokenize=False,
    )
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    try:
        for part in ("first", "steady"):
            rec.set_phase("generate", part)
            logs.marker(f"phase=generate part={part} begin")
            t = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            wall = time.perf_counter() - t
            got = _outputs(outs)
            if part == "first":
                save(warm_s=round(wall, 4), **got)
        n_out = sum(len(ids) for ids in got["tokens"])
        save(
            status="ok",
            timed_s=round(wall, 4),
            out_tokens=n_out,
            tok_s=round(n_out / wall, 1),
            timed_tokens=got["tokens"],
            timed_logprobs=got["logprobs"],
        )
    except Exception as e:
        traceback.print_exc()
        save(status="generate-failed", error=f"{type(e).__name__}: {e}"[-4000:])
    events = rec.phase_events("after_startup") + rec.phase_events("generate")
    save(spec_counters=_spec_counters(llm), **JitRecorder.summarize(events))
    return 0 if res["status"] == "ok" else 1


def child_argv(spec_file: Path) -> list[str]:
    """The command that runs one engine from its spec file (``spec --child``)."""
    return [sys.executable, "-m", "benchmarks.tqbench", "spec", "--child", str(spec_file)]


def read_result(work: Path) -> dict[str, Any]:
    """A child's result file, or ``{}`` when it wrote none (killed, or failed at import)."""
    with contextlib.suppress(OSError, ValueError):
        result: dict[str, Any] = json.loads((work / "result.json").read_text())
        return result
    return {}


# --------------------------------------------------------------------------------------
# Parent: one child per configuration
# --------------------------------------------------------------------------------------


class SpecBench:
    """Runs the children, compares, writes the raw run and the summary."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run_id = dt.datetime.now().strftime("%Y%m%dT%H%M%S")
        self.t0 = time.monotonic()
        self.configs = build_configs(args.configs, _ints(args.ks), args.method)
        self.prompts = spec_prompts(args.prompts, args.prompt_seed)
        need = max(len(p) for p in self.prompts) + args.max_tokens + max(_ints(args.ks))
        self.max_model_len = args.max_model_len or phases.auto_max_model_len(need)
        self.work_root = Path(args.work_dir or tempfile.mkdtemp(prefix="tq-spec-")).resolve()
        self.log_dir = Path(args.log_dir).resolve() / f"spec-{self.run_id}"
        self.out = Path(args.out or DEFAULT_OUT_DIR / f"{self.run_id}{records.RAW_SUFFIX}")
        self.rows: dict[str, dict[str, Any]] = {}
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.lock = threading.Lock()
        self.pythonpath = [str(REPO_ROOT)]
        self.entry_point = "installed" if entry_point.found() else "missing"
        if self.entry_point == "missing" and args.entry_point_stub:
            self.pythonpath.insert(0, str(entry_point.write_stub(self.work_root / "entry-point")))
            self.entry_point = "stub"
        opts = {
            k: getattr(args, k)
            for k in (
                "preset",
                "geometry",
                "layers",
                "max_tokens",
                "logprobs",
                "max_num_seqs",
                "kv_cache_gib",
                "jit_monitor_mode",
                "weight_scale",
            )
        }
        opts.update(
            max_model_len=self.max_model_len,
            gpu_mem_util=args.gpu_mem_util or phases.default_gpu_mem_util(args.jobs),
        )
        self.options = opts

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
                "period": PERIOD,
                "seed": self.args.prompt_seed,
            },
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

    def remaining(self) -> float:
        if not self.args.deadline_s:
            return float("inf")
        return float(self.args.deadline_s) - (time.monotonic() - self.t0)

    def run_one(self, cfg: SpecConfig) -> None:
        row: dict[str, Any] = {**asdict(cfg), "cudagraph_mode_asked": cfg.cudagraph_mode}
        del row["cudagraph_mode"]  # vLLM's resolved mode comes from the child
        left = self.remaining()
        if left < 30:
            self._finish(cfg, {**row, "status": "skipped", "error_line": "deadline reached"})
            return
        work = self.work_root / cfg.name
        log = self.log_dir / f"{cfg.name}.log"
        spec = {
            "config": asdict(cfg),
            "options": self.options,
            "prompts": self.prompts,
            "work": str(work),
            "result": str(work / "result.json"),
        }
        records.write_json_atomic(work / "spec.json", spec)
        env = {**os.environ, **child_env(cfg, work, self.args.share_compile_cache)}
        env["PYTHONPATH"] = os.pathsep.join(
            [*self.pythonpath, *filter(None, [env.get("PYTHONPATH")])]
        )
        argv = child_argv(work / "spec.json")
        limit = min(float(self.args.timeout), left - 5)
        print(f"[spec] start {cfg.name} (log {log})", flush=True)
        t = time.monotonic()
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as logf:
            proc = subprocess.Popen(
                argv,
                cwd=REPO_ROOT,
                env=env,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            with self.lock:
                self.procs[proc.pid] = proc
            try:
                rc: int | None = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                rc = None
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            with self.lock:
                self.procs.pop(proc.pid, None)
        text = log.read_text(errors="replace")
        result = read_result(work)
        row.update(
            result,
            rc=rc,
            wall_s=round(time.monotonic() - t, 1),
            log=str(log),
            plugin_log=logs.plugin_log_lines(text),
        )
        if row.get("status") not in CHILD_FINAL:
            killed = "killed at deadline" if limit < self.args.timeout else "timed out"
            row["status"] = f"crashed (rc {rc})" if rc is not None else killed
        elif rc:
            row["exit"] = f"rc {rc} after {row['status']}"
        if row["status"] != "ok":
            row["error_line"] = last_error_line(text) or str(row.get("error", ""))[-300:]
        self._finish(cfg, row)

    def _finish(self, cfg: SpecConfig, row: dict[str, Any]) -> None:
        with self.lock:
            self.rows[cfg.name] = row
        self.save()
        print(f"[spec] done  {cfg.name}: {row['status']} {row.get('error_line') or ''}", flush=True)

    def kill_all(self, signum: int = 0, _frame: Any = None) -> None:
        with self.lock:
            procs = list(self.procs.values())
        for p in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        if signum:
            raise SystemExit(128 + signum)

    def run(self) -> int:
        with contextlib.suppress(ValueError):  # only possible in the main thread
            signal.signal(signal.SIGTERM, self.kill_all)
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
            # The reference runs alone first: a fresh machine's CUDA driver compiles
            # FlashAttention's sm90 PTX in the first engine (2-5 min on the H200), and N
            # children starting together would each pay it.
            first, *rest = self.configs
            self.run_one(first)
            with ThreadPoolExecutor(max_workers=max(1, self.args.jobs)) as pool:
                for fut in [pool.submit(self.run_one, c) for c in rest]:
                    fut.result()
        except BaseException:
            self.kill_all()
            raise
        finally:
            if not self.args.work_dir:
                shutil.rmtree(self.work_root, ignore_errors=True)
        run, rows = self.save()
        print()
        print(tables.render(TABLE_HEADER, table_rows(rows)))
        summary = summarize(run, rows)
        records.write_json_atomic(self.out.with_suffix(".summary.json"), summary)
        print(f"\n[spec] raw run: {self.out}; summary: {self.out.with_suffix('.summary.json')}")
        return 0 if all(r.get("status") == "ok" for r in rows) else 1


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def report(raw: Path, lp_tol: float | None = None) -> tuple[str, dict[str, Any]]:
    """The table and summary of a raw run, compared afresh (no GPU needed)."""
    run, rows = records.read_run(raw)
    add_comparisons(rows, run.get("lp_tol", 1e-3) if lp_tol is None else lp_tol)
    return tables.render(TABLE_HEADER, table_rows(rows)), summarize(run, rows)


def cmd_spec(args: argparse.Namespace) -> int:
    """``spec --child FILE`` runs one configuration; ``--from-raw FILE`` reports a raw run
    again; otherwise the whole comparison."""
    if args.from_raw:
        for name in args.from_raw.split(","):
            table, summary = report(Path(name))
            print(f"{name} ({summary['run'].get('vllm_version')}):\n{table}\n")
            records.write_json_atomic(Path(name).with_suffix(".summary.json"), summary)
        return 0
    if args.child:  # exit at once: a broken CUDA context can hang the interpreter's exit
        rc = run_child(Path(args.child))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    try:
        phases.parse_geometry(args.geometry)
        build_configs(args.configs, _ints(args.ks), args.method)
    except ValueError as e:
        raise SystemExit(f"spec: {e}") from e
    if args.layers < 6:
        raise SystemExit("spec: --layers must be >= 6 (TurboQuant leaves 2 layers at each end)")
    return SpecBench(args).run()


OPTIONS: tuple[Option, ...] = (
    ("--configs", "all", "comma list: all, ref-eager, nospec-full, kinds "
     f"{'/'.join(SPEC_KINDS)} (over --ks) or names like ngram3-full-noguard"),
    ("--ks", "1,3", "speculative tokens per step (comma list)"),
    ("--geometry", "128x16x8", "HEADSIZExQHEADSxKVHEADS"),
    ("--layers", 8, "hidden layers of the dummy Llama (>= 6)"),
    ("--max-tokens", 64, "tokens generated per prompt"),
    ("--weight-scale", 1.0, "multiply every dummy weight (vLLM draws them from +-1e-3) after "
     "startup: at 1 the logits are nearly flat and attention barely moves them"),
    ("--prompts", 8, "prompts (150-430 tokens, a 24-token pattern repeated)"),
    ("--prompt-seed", 0, "seed of the prompts' patterns"),
    ("--logprobs", 2, "logprobs per position (2: also the top-1/top-2 margin)"),
    ("--lp-tol", 1e-3, "logprob tolerance of 'equal', and over the no-spec graph engine's floor"),
    ("--max-model-len", 0, "0: a multiple of 1024 that fits"),
    ("--max-num-seqs", 16, "max_num_seqs"),
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
    summary = "speculative decoding with TurboQuant: tokens vs the eager reference, guard on/off"
    p = new_parser(subparsers, "spec", summary, __doc__)
    add_options(p, OPTIONS)
    p.add_argument("--method", choices=sorted(METHOD_PREFIX), default="ngram")
    p.add_argument("--preset", choices=phases.TQ_PRESETS, default="turboquant_4bit_nc")
    p.add_argument("--jit-monitor-mode", choices=("warn", "error"), default="error",
                   help="vLLM >= 0.25 only (older releases have no such option)")  # fmt: skip
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument(
        "--from-raw",
        default="",
        help="comma list of raw runs to report again "
        "(table, and each one's .summary.json rewritten); runs nothing",
    )
    p.set_defaults(func=cmd_spec)
