"""First-request latency of vLLM with a TurboQuant KV cache, with and without tq-warmup.

vLLM's TurboQuant attention backend runs Triton kernels (``_tq_decode_stage1``,
``_fwd_kernel_stage2``, ``_tq_full_dequant_kv``, ``_tq_fused_store_mse`` /
``_tq_fused_store_fp8``) that are not all compiled while the engine starts, so
the first requests that reach a new kernel path pay a JIT compile. This script
measures that: for each configuration it starts vLLM in-process with a
dummy-weight Llama model whose ``config.json`` it writes itself, then times the
first and a repeated request of five request shapes, and records every Triton
compilation that happens after startup, by kernel name.

Phases, in this order (B = ``--budget``, the chunked-prefill token budget):

``decode``
    one short prompt (32 tokens) and ``--max-tokens`` decode steps.
``batch``
    8 short prompts at once (a batched prefill, then batched decode steps).
``long``
    one prompt of 3*B tokens: chunks B, B, B, i.e. two continuation chunks of
    more than 128 tokens (the "dequantise the cache + FlashAttention" path).
``short_tail``
    one prompt of B+100 tokens: its last chunk (100 tokens) is a continuation
    chunk of 128 tokens or fewer (the "decode kernel as prefill" path).
``prefix_hit``
    the block-aligned first ~2*B tokens of the ``long`` prompt (a prefix-cache
    hit) plus 40 new tokens: a short continuation over a long cached context.

"first" is the first request of a phase; "steady" is a second request of the
same shape with different token ids (prefix caching is on, so an identical
repeat would only hit the cache; ``prefix_hit`` reuses the prefix of the
second ``long`` prompt). Each record carries ``first_cached_tokens`` /
``steady_cached_tokens`` and ``expected_chunks`` to show that the phase is
what it claims.

Every configuration is run three times, each in a fresh process (Triton's
in-memory kernel cache would otherwise hide compiles): plugin on with a cold
Triton disk cache, plugin off (``TQ_WARMUP=0``) with a cold cache, and plugin
on with the warm disk cache left by the first run. With the plugin on, vLLM's
JIT monitor runs in ``error`` mode, so a kernel the plugin missed raises; that
is recorded as a failed phase with the message. With the plugin off it runs in
the default ``warn`` mode.

Usage
-----
One configuration, in this process (imports vLLM)::

    python benchmarks/first_request.py run --preset turboquant_4bit_nc \\
        --mode eager --head-size 128 --q-heads 16 --kv-heads 8 --plugin on \\
        --out /tmp/rec.json

(without ``--cache-root`` / ``--triton-cache-dir`` it uses a fresh Triton cache
under ``--work-dir``, so the run is "cold").

The whole matrix (the parent does not import vLLM or torch; it spawns one
``run`` subprocess per configuration and variant)::

    python benchmarks/first_request.py matrix --presets all \\
        --modes eager,cudagraph --geometries 128x16x8,64x16x2 --jobs 4 --tp 1

It prints a table (one row per phase: first_s, steady_s, their ratio, the
TurboQuant kernels JIT-compiled after startup) and a startup table (engine
startup time and the time the plugin says it spent), and merges the records
into ``benchmarks/results/<YYYY-MM-DD>-<gpu>-vllm<version>.json`` (a JSON list;
records of the same run id, config, variant and phase are replaced). Each
subprocess's full log goes to ``--log-dir`` (default
``benchmarks/results/logs/<run id>/``); the results file is rewritten after
every finished subprocess, so a matrix killed part-way keeps what it measured.

Subsets (``--presets turboquant_k8v4 --modes eager``), ``--variants`` and
``--deadline-s`` (stop starting runs, and kill running ones, after that many
seconds; the rest are recorded as skipped/failed) let a matrix be split across
several device calls with a per-call time limit; later calls merge into the
same results file. On a machine that returns only a few files, point
``--results-dir`` at the returned folder and pack ``--log-dir`` into one archive.

Rough cost (H200, tp 1, ``--jobs 1``, after the one-time CUDA driver PTX
compile): a run is ~10 s of imports plus 15-30 s (eager) or 40-70 s
(cudagraph, cold torch.compile) of startup plus a few seconds of requests, so a
configuration (three runs) takes ~1.5 min eager and ~3 min cudagraph.

What is measured
----------------
``startup_s``
    wall time of the ``LLM(...)`` constructor (engine start, including
    torch.compile / CUDA graph capture in cudagraph mode and the plugin).
``warmup_s``
    the time the plugin says it spent, from its JSON report
    (``TQ_WARMUP_REPORT``, one per rank); its other fields are kept under
    ``plugin_report``. Its ``tq-warmup:`` log line is kept as ``plugin_log``.
``first_s`` / ``steady_s``
    wall time of ``LLM.generate`` for the first / repeated request.
``tq_compiles_after_startup``
    TurboQuant kernel names that Triton compiled (not loaded from its disk
    cache) during the phase; ``tq_loads_after_startup`` lists those loaded from
    the disk cache (Triton's ``knobs.compilation.listener`` reports
    ``cache_hit``). Non-TurboQuant kernels are under ``other_jit_after_startup``
    and every event (with per-kernel compile time) under ``jit_events``.

Compilations are seen through ``triton.knobs.runtime.jit_cache_hook`` /
``jit_post_compile_hook`` and ``triton.knobs.compilation.listener``. vLLM's JIT
monitor replaces ``jit_post_compile_hook`` with a wrapper when startup ends
(and, in ``error`` mode, raises before calling the hook it wrapped), so the
script wraps the hook again after startup to stay outermost; every hook
forwards to the one it replaced.

Caveats
-------
* ``--tp 1`` runs the engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING
  =0``) so the hooks see every compile. With ``--tp`` > 1 the model runs in
  worker processes the hooks cannot see: the kernel lists then come from vLLM's
  JIT-monitor log lines ("Triton kernel JIT compilation during inference:
  NAME"), attributed to phases by marker lines this script prints, and a
  compile the monitor does not report is not seen (``hooks_in_process`` is
  false in such records). In ``error`` mode with tp > 1 a miss kills a worker
  and therefore the rest of that run.
* ``--jobs N`` runs N subprocesses on the same GPU at once, each with
  ``gpu_memory_utilization`` about 0.9/N (``--gpu-mem-util``) and a fixed KV
  cache size (``--kv-cache-gib``: vLLM then does not size the cache from the
  free memory it measures, which other processes on the GPU would disturb).
  Timings are then noisier: Triton compiles are CPU-bound and the runs share CPU
  cores and the GPU. Use
  ``--jobs 1`` for the numbers you quote. With ``--jobs`` > 1 the first run is
  made alone first so that one-time costs (the CUDA driver compiling
  FlashAttention PTX into ``CUDA_CACHE_PATH``) are not paid N times at once.
* "cold" means a fresh Triton cache and, unless ``--share-compile-cache``,
  fresh vLLM / Inductor caches (``VLLM_CACHE_ROOT``,
  ``TORCHINDUCTOR_CACHE_DIR``) too; "warm" reuses the plugin-on cold run's
  directories. The CUDA driver cache (``CUDA_CACHE_PATH``) is left alone: set
  it to a persistent directory.
* The plugin has to be installed with its entry point (``pip install
  --no-deps .``; a bare ``PYTHONPATH=src`` registers no entry point).
  ``plugin_entry_point_found`` records whether vLLM can discover it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib
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
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PRESETS: tuple[str, ...] = (
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
)
MODES: tuple[str, ...] = ("eager", "cudagraph")
VARIANTS: tuple[str, ...] = ("on-cold", "off-cold", "on-warm")
RUNNERS: tuple[str, ...] = ("default", "v1", "v2")
PHASES: tuple[str, ...] = ("decode", "batch", "long", "short_tail", "prefix_hit")
TQ_KERNELS: frozenset[str] = frozenset(
    {
        "_tq_decode_stage1",
        "_fwd_kernel_stage2",
        "_tq_full_dequant_kv",
        "_tq_fused_store_mse",
        "_tq_fused_store_fp8",
    }
)
# vLLM's TurboQuant backend (_CONTINUATION_DECODE_THRESHOLD): continuation chunks of at
# most this many tokens use the decode kernel, longer ones dequantise the cache.
CONTINUATION_DECODE_THRESHOLD = 128
MARKER = "[tq-bench]"
PLUGIN_LOG_PREFIX = "tq-warmup:"
MONITOR_RE = re.compile(r"Triton kernel JIT compilation during inference: (\S+?)(?:\s\(|\.\s|\.?$)")
MARKER_RE = re.compile(re.escape(MARKER) + r" (?:phase=(\S+) part=(\S+) begin|(startup done))")
DEFAULT_RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPORT_GLOB = "tq-warmup-report-*.json"
REPORT_TEMPLATE = "tq-warmup-report-{rank}.json"


# --------------------------------------------------------------------------------------
# Pure helpers
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Geometry:
    """Attention geometry: head size, query heads, KV heads."""

    head_size: int
    q_heads: int
    kv_heads: int

    @property
    def label(self) -> str:
        return f"{self.head_size}x{self.q_heads}x{self.kv_heads}"


def parse_geometry(text: str) -> Geometry:
    """Parse ``HEADSIZExQHEADSxKVHEADS`` (e.g. ``128x16x8``)."""
    parts = text.lower().strip().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"geometry must be HEADSIZExQHEADSxKVHEADS, got {text!r}")
    hs, q, kv = (int(p) for p in parts)
    if q % kv:
        raise ValueError(f"query heads ({q}) must be a multiple of KV heads ({kv})")
    return Geometry(hs, q, kv)


def parse_list(text: str, allowed: Sequence[str] | None = None) -> list[str]:
    """Split a comma list; ``all`` expands to ``allowed``."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if allowed is not None:
        if items == ["all"]:
            return list(allowed)
        bad = [t for t in items if t not in allowed]
        if bad:
            raise ValueError(f"unknown value(s) {bad}; choose from {list(allowed)} or 'all'")
    return items


def chunk_schedule(new_tokens: int, budget: int, cached: int = 0) -> list[dict[str, int]]:
    """Chunks the scheduler makes of one request's prompt when it runs alone.

    Each chunk: ``tokens`` (query length) and ``context`` (tokens already in the
    cache when it runs). ``context`` > 0 marks a continuation chunk.
    """
    chunks: list[dict[str, int]] = []
    done = 0
    while done < new_tokens:
        n = min(budget, new_tokens - done)
        chunks.append({"tokens": n, "context": cached + done})
        done += n
    return chunks


def describe_chunks(chunks: Iterable[dict[str, int]]) -> str:
    """``512, 512+c, 100+c`` style summary (``+c``: continuation, ``*``: <= 128 path)."""
    out = []
    for c in chunks:
        if c["context"] == 0:
            out.append(str(c["tokens"]))
        elif c["tokens"] <= CONTINUATION_DECODE_THRESHOLD:
            out.append(f"{c['tokens']}+c*")
        else:
            out.append(f"{c['tokens']}+c")
    return ", ".join(out)


@dataclass(frozen=True)
class PhasePlan:
    """Prompt lengths of every phase, derived from the chunk budget."""

    budget: int
    block_size: int
    max_tokens: int
    short_len: int
    batch_size: int
    long_len: int
    short_tail_len: int
    prefix_len: int
    prefix_tail: int

    @property
    def required_max_model_len(self) -> int:
        longest = max(self.long_len, self.short_tail_len, self.prefix_len + self.prefix_tail)
        return longest + self.max_tokens

    def prompt_lens(self, phase: str) -> list[int]:
        if phase == "decode":
            return [self.short_len]
        if phase == "batch":
            return [self.short_len] * self.batch_size
        if phase == "long":
            return [self.long_len]
        if phase == "short_tail":
            return [self.short_tail_len]
        if phase == "prefix_hit":
            return [self.prefix_len + self.prefix_tail]
        raise ValueError(phase)

    def expected_cached(self, phase: str) -> int:
        return self.prefix_len if phase == "prefix_hit" else 0

    def expected_chunks(self, phase: str) -> list[dict[str, int]]:
        """Prefill chunks of one prompt of the phase (``batch``: all prompts together)."""
        if phase == "batch":
            return chunk_schedule(self.short_len * self.batch_size, self.budget)
        if phase == "prefix_hit":
            return chunk_schedule(self.prefix_tail, self.budget, cached=self.prefix_len)
        return chunk_schedule(self.prompt_lens(phase)[0], self.budget)


def plan_phases(
    budget: int,
    block_size: int = 16,
    max_tokens: int = 8,
    short_len: int = 32,
    batch_size: int = 8,
    short_tail: int = 100,
    prefix_tail: int = 40,
) -> PhasePlan:
    """Choose prompt lengths so each phase exercises the path it is named after.

    ``long`` = 3*budget: chunks of exactly ``budget`` tokens, so both continuation
    chunks are longer than 128 tokens (and no short last chunk sneaks in).
    ``short_tail`` = budget + ``short_tail`` (<= 128): one full chunk, then a short
    continuation. ``prefix_hit`` = the block-aligned 2*budget-token prefix of the
    ``long`` prompt plus ``prefix_tail`` new tokens.
    """
    if budget <= CONTINUATION_DECODE_THRESHOLD:
        raise ValueError(
            f"budget must exceed {CONTINUATION_DECODE_THRESHOLD} tokens, or no continuation "
            "chunk can take the > 128-token (dequantise) path"
        )
    if not 0 < short_tail <= CONTINUATION_DECODE_THRESHOLD:
        raise ValueError(f"short_tail must be in 1..{CONTINUATION_DECODE_THRESHOLD}")
    if not 0 < prefix_tail <= CONTINUATION_DECODE_THRESHOLD:
        raise ValueError(f"prefix_tail must be in 1..{CONTINUATION_DECODE_THRESHOLD}")
    if short_len > budget:
        raise ValueError("short prompts must fit one chunk")
    long_len = 3 * budget
    prefix_len = (2 * budget // block_size) * block_size
    if prefix_len <= 0:
        raise ValueError("block size larger than two chunks")
    return PhasePlan(
        budget=budget,
        block_size=block_size,
        max_tokens=max_tokens,
        short_len=short_len,
        batch_size=batch_size,
        long_len=long_len,
        short_tail_len=budget + short_tail,
        prefix_len=prefix_len,
        prefix_tail=prefix_tail,
    )


def auto_max_model_len(required: int, multiple: int = 1024) -> int:
    """Smallest multiple of ``multiple`` that holds ``required`` tokens."""
    return -(-required // multiple) * multiple


def build_model_config(
    geometry: Geometry,
    layers: int,
    max_position_embeddings: int,
    vocab_size: int = 1024,
    intermediate_size: int = 1024,
) -> dict[str, Any]:
    """A ``config.json`` for a small dummy-weight Llama with the given attention shape."""
    if layers < 6:
        raise ValueError("TurboQuant leaves the first two and last two layers alone: use >= 6")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": geometry.q_heads * geometry.head_size,
        "head_dim": geometry.head_size,
        "num_attention_heads": geometry.q_heads,
        "num_key_value_heads": geometry.kv_heads,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }


def make_prompts(n: int, length: int, seed: int, vocab_size: int) -> list[list[int]]:
    """``n`` prompts of random token ids (not the special ids 0..2)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for _ in range(n)]


def default_gpu_mem_util(jobs: int, total: float = 0.9, margin: float = 0.03) -> float:
    """Per-process ``gpu_memory_utilization`` so that ``jobs`` processes fit together."""
    return round(max(0.05, min(0.85, total / max(1, jobs) - margin)), 3)


def gpu_slug(name: str) -> str:
    """``NVIDIA H200`` -> ``nvidia-h200``."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug or "unknown-gpu"


def jit_monitor_support(vllm_version: str) -> tuple[str, bool]:
    """Where vLLM's JIT monitor lives and whether ``jit_monitor_mode`` exists.

    0.25+: ``vllm.utils.jit_monitor`` and ``observability_config.jit_monitor_mode``
    (``warn``/``error``). 0.22 (and the releases around it) has a warn-only monitor in
    ``vllm.triton_utils.jit_monitor``; 0.20 has none, which ``cmd_run`` tolerates.
    """
    from tq_warmup_plugin.compat import parse_version

    if (parse_version(vllm_version) or (0, 0)) >= (0, 25):
        return "vllm.utils.jit_monitor", True
    return "vllm.triton_utils.jit_monitor", False


def results_path(results_dir: Path, date: str, gpu: str, vllm_version: str) -> Path:
    """``<dir>/<YYYY-MM-DD>-<gpu slug>-vllm<version>.json``."""
    return results_dir / f"{date}-{gpu_slug(gpu)}-vllm{vllm_version}.json"


def config_id(preset: str, mode: str, geometry: Geometry, layers: int, budget: int, tp: int) -> str:
    return (
        f"{preset}-{mode}-h{geometry.head_size}q{geometry.q_heads}kv{geometry.kv_heads}"
        f"-L{layers}-b{budget}-tp{tp}"
    )


def record_key(rec: dict[str, Any]) -> tuple[Any, ...]:
    """Identity of a record in the results file."""
    return (
        rec.get("series"),
        rec.get("run_id"),
        rec.get("config_id"),
        rec.get("plugin"),
        rec.get("triton_cache"),
        rec.get("phase"),
    )


def merge_records(
    existing: Sequence[dict[str, Any]], new: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """``existing`` + ``new``; a new record replaces an existing one with the same key."""
    new_keys = {record_key(r) for r in new}
    merged = [r for r in existing if record_key(r) not in new_keys]
    merged.extend(new)
    return merged


def parse_monitor_log(text: str) -> dict[str, list[str]]:
    """Kernel names from vLLM JIT-monitor lines, keyed by ``phase/part`` (or ``startup``).

    Attribution uses the marker lines the ``run`` role prints before each request
    (needs unbuffered output, which the ``matrix`` role arranges).
    """
    out: dict[str, list[str]] = {}
    where = "startup"
    for line in text.splitlines():
        m = MARKER_RE.search(line)
        if m:
            where = "after_startup" if m.group(3) else f"{m.group(1)}/{m.group(2)}"
            continue
        jm = MONITOR_RE.search(line)
        if jm:
            out.setdefault(where, []).append(jm.group(1))
    return out


def apply_log(records: Sequence[dict[str, Any]], log_text: str) -> None:
    """Add what only a run's log shows: the plugin's lines and the JIT monitor's kernels.

    With tp > 1 compiles happen in worker processes the run's hooks cannot see, so
    ``tq_compiles_after_startup`` comes from the monitor's lines there.
    """
    monitor = parse_monitor_log(log_text)
    plugin_lines = plugin_log_lines(log_text)
    for r in records:
        r["plugin_log"] = plugin_lines
        phase = r.get("phase")
        # Unique short names: warn mode logs a kernel once, error mode may repeat it
        # (the raise and its traceback).
        logged = list(
            dict.fromkeys(
                k.rsplit(".", 1)[-1]
                for k in monitor.get(f"{phase}/first", []) + monitor.get(f"{phase}/steady", [])
            )
        )
        r["monitor_log_kernels"] = logged
        if r.get("hooks_in_process") is False:
            r["tq_compiles_after_startup"] = [k for k in logged if is_tq_kernel(k)]
            r["other_jit_after_startup"] = [k for k in logged if not is_tq_kernel(k)]


def plugin_log_lines(text: str) -> list[str]:
    """The plugin's ``tq-warmup:`` log lines (one per rank), from the message onwards."""
    lines = []
    for line in text.splitlines():
        idx = line.find(PLUGIN_LOG_PREFIX)
        if idx >= 0:
            lines.append(line[idx:].strip())
    return lines


def tail_lines(text: str, n: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])


def is_tq_kernel(name: str, module: str | None = None) -> bool:
    short = name.rsplit(".", 1)[-1]
    return short in TQ_KERNELS or (module is not None and "turboquant" in module)


def fill_missing_phases(
    records: Sequence[dict[str, Any]],
    base: dict[str, Any],
    error: str,
    phases: Sequence[str] = PHASES,
) -> list[dict[str, Any]]:
    """Add a failed record for every phase a crashed/killed run did not report."""
    seen = {r.get("phase") for r in records}
    out = list(records)
    empty: dict[str, Any] = {"first_s": None, "steady_s": None, "tq_compiles_after_startup": []}
    for phase in phases:
        if phase not in seen:
            out.append(
                {
                    **run_level_fields(base),
                    **empty,
                    "phase": phase,
                    "status": "failed",
                    "error": error,
                }
            )
    return out


def startup_summary(events: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """TurboQuant kernels compiled / loaded while the engine started, and totals."""
    tq = [e for e in events if is_tq_kernel(e["kernel"], e.get("module"))]
    return {
        "tq_compiled": sorted({e["kernel"] for e in tq if e["cache_hit"] is not True}),
        "tq_loaded": sorted({e["kernel"] for e in tq if e["cache_hit"] is True}),
        "all_compiled_n": sum(e["cache_hit"] is not True for e in events),
        "all_loaded_n": sum(e["cache_hit"] is True for e in events),
    }


# Fields that belong to one phase; a crashed run's remaining phases must not inherit them.
PHASE_KEYS: frozenset[str] = frozenset(
    {
        "phase",
        "status",
        "error",
        "first_s",
        "steady_s",
        "ratio",
        "first_error",
        "steady_error",
        "prompt_lens",
        "expected_chunks",
        "expected_cached_tokens",
        "first_cached_tokens",
        "steady_cached_tokens",
        "out_tokens",
        "tq_compiles_after_startup",
        "tq_loads_after_startup",
        "first_tq_jit",
        "steady_tq_jit",
        "other_jit_after_startup",
        "jit_events",
        "phase_warning",
        "profile_top_extra",
        "profile_slow_leaves",
    }
)


def run_level_fields(rec: dict[str, Any]) -> dict[str, Any]:
    """A record without its phase fields (what all phases of one run share)."""
    return {k: v for k, v in rec.items() if k not in PHASE_KEYS}


def _fmt_s(x: Any) -> str:
    return f"{x:.3f}" if isinstance(x, (int, float)) else "-"


def _short_preset(preset: Any) -> str:
    return str(preset).removeprefix("turboquant_")


def _kernel_summary(rec: dict[str, Any]) -> str:
    compiled = rec.get("tq_compiles_after_startup") or []
    loaded = rec.get("tq_loads_after_startup") or []
    if not compiled and not loaded:
        return "-"
    parts = [n.removeprefix("_") for n in sorted(set(compiled))]
    text = f"{len(compiled)}c"
    if loaded:
        text += f"+{len(loaded)}l"
    return f"{text} {','.join(parts)}" if parts else text


_CONFIG_COLUMNS = ("preset", "mode", "geom", "tp", "plugin", "cache")


def _config_cells(r: dict[str, Any]) -> tuple[str, ...]:
    """The cells under ``_CONFIG_COLUMNS`` that say which run a row belongs to."""
    return (
        _short_preset(r.get("kv_cache_dtype")),
        str(r.get("mode")),
        f"{r.get('head_size')}x{r.get('q_heads')}x{r.get('kv_heads')}",
        str(r.get("tp")),
        str(r.get("plugin")),
        str(r.get("triton_cache")),
    )


def format_table(records: Sequence[dict[str, Any]]) -> str:
    """One row per (config, variant, phase): first_s, steady_s, ratio, TQ compiles."""
    header = (
        *_CONFIG_COLUMNS,
        "phase",
        "status",
        "first_s",
        "steady_s",
        "ratio",
        "tq jit after startup (c=compiled, l=disk load)",
    )
    rows: list[tuple[str, ...]] = []
    order = {p: i for i, p in enumerate(("startup", *PHASES))}
    for r in sorted(
        records,
        key=lambda r: (
            str(r.get("config_id")),
            str(r.get("plugin")) != "on",
            str(r.get("triton_cache")),
            order.get(str(r.get("phase")), 99),
        ),
    ):
        first, steady = r.get("first_s"), r.get("steady_s")
        ratio = (
            f"{first / steady:.1f}x"
            if isinstance(first, (int, float)) and isinstance(steady, (int, float)) and steady
            else "-"
        )
        rows.append(
            (
                *_config_cells(r),
                str(r.get("phase")),
                str(r.get("status")),
                _fmt_s(first),
                _fmt_s(steady),
                ratio,
                _kernel_summary(r),
            )
        )
    return _render(header, rows)


def format_startup_table(records: Sequence[dict[str, Any]]) -> str:
    """One row per (config, variant): engine startup time and the plugin's own time."""
    header = (
        *_CONFIG_COLUMNS,
        "startup_s",
        "warmup_s",
        "launch_s",
        "plugin status",
        "compiled/loaded",
        "failed phases",
    )
    seen: dict[tuple[Any, ...], dict[str, Any]] = {}
    failed: dict[tuple[Any, ...], int] = {}
    for r in records:
        k = (r.get("config_id"), r.get("plugin"), r.get("triton_cache"))
        seen.setdefault(k, r)
        failed[k] = failed.get(k, 0) + (r.get("status") != "ok")
    rows = []
    for k in sorted(seen, key=lambda k: (str(k[0]), str(k[1]) != "on", str(k[2]))):
        r = seen[k]
        rep = r.get("plugin_report") or {}
        rows.append(
            (
                *_config_cells(r),
                _fmt_s(r.get("startup_s")),
                _fmt_s(r.get("warmup_s")),
                _fmt_s(rep.get("launch_s")),
                str(rep.get("status", "-")),
                f"{rep.get('compiled', '-')}/{rep.get('loaded', '-')}",
                str(failed[k]),
            )
        )
    return _render(header, rows)


def print_tables(records: Sequence[dict[str, Any]]) -> None:
    """The per-phase table, a blank line, the startup table."""
    print(format_table(records))
    print()
    print(format_startup_table(records))


def _render(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [len(h) for h in header]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines.extend("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows)
    return "\n".join(lines)


def load_records(path: Path) -> list[dict[str, Any]]:
    """Records from a JSON list file (missing or unreadable: empty)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [r for r in data if isinstance(r, dict)] if isinstance(data, list) else []


def write_json_atomic(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------
# Triton compile recorder (run role)
# --------------------------------------------------------------------------------------


class JitRecorder:
    """Records every Triton compile / disk-cache load in this process, by phase.

    * ``knobs.runtime.jit_cache_hook`` (called before ``compile()``): start time.
    * ``knobs.compilation.listener`` (called inside ``compile()``): ``cache_hit``,
      i.e. whether the kernel came from Triton's disk cache; also catches
      compiles that do not go through a ``@triton.jit`` launch.
    * ``knobs.runtime.jit_post_compile_hook`` (after ``compile()``): duration.

    Each hook forwards to the hook it replaced. :meth:`ensure_outermost` re-wraps
    ``jit_post_compile_hook`` when someone (vLLM's JIT monitor) replaced it, so
    the event is recorded before a monitor in ``error`` mode raises.
    """

    def __init__(self, knobs: Any) -> None:
        self.knobs = knobs
        self.events: list[dict[str, Any]] = []
        self.phase = "startup"
        self.part = ""
        self._t0 = time.perf_counter()
        self._lock = threading.Lock()
        self._tls = threading.local()
        self._post_wrapper: Callable[..., Any] | None = None

    # -- installation ------------------------------------------------------------------

    def install(self) -> None:
        rt = self.knobs.runtime
        prev_cache_hook = rt.jit_cache_hook

        def cache_hook(**kwargs: Any) -> Any:
            with contextlib.suppress(Exception):
                self._tls.start = time.perf_counter()
            if prev_cache_hook is not None:
                return prev_cache_hook(**kwargs)
            return None

        rt.jit_cache_hook = cache_hook

        comp = self.knobs.compilation
        prev_listener = comp.listener

        def listener(**kwargs: Any) -> None:
            with contextlib.suppress(Exception):
                self._on_listener(kwargs)
            if prev_listener is not None:
                prev_listener(**kwargs)

        comp.listener = listener
        self._wrap_post_hook()

    def ensure_outermost(self) -> bool:
        """Re-wrap ``jit_post_compile_hook`` if it was replaced; True if it was."""
        if self.knobs.runtime.jit_post_compile_hook is self._post_wrapper:
            return False
        self._wrap_post_hook()
        return True

    def _wrap_post_hook(self) -> None:
        rt = self.knobs.runtime
        inner = rt.jit_post_compile_hook
        tls = self._tls

        def post_hook(**kwargs: Any) -> Any:
            if getattr(tls, "busy", False):  # an outer wrapper of ours already recorded it
                return inner(**kwargs) if inner is not None else None
            tls.busy = True
            try:
                with contextlib.suppress(Exception):
                    self._on_post(kwargs)
                return inner(**kwargs) if inner is not None else None
            finally:
                tls.busy = False

        rt.jit_post_compile_hook = post_hook
        self._post_wrapper = post_hook

    def set_phase(self, phase: str, part: str) -> None:
        self.phase, self.part = phase, part

    # -- event handling ----------------------------------------------------------------

    def _new_event(self, name: str, module: str | None) -> dict[str, Any]:
        ev: dict[str, Any] = {
            "kernel": name,
            "module": module,
            "phase": self.phase,
            "part": self.part,
            "t": round(time.perf_counter() - self._t0, 4),
            "cache_hit": None,
            "compile_s": None,
            "post_hook": False,
        }
        with self._lock:
            self.events.append(ev)
        return ev

    def _on_listener(self, kwargs: dict[str, Any]) -> None:
        src = kwargs.get("src")
        name = str(getattr(src, "name", None) or "<unknown>")
        fn = getattr(src, "fn", None)
        module = getattr(fn, "module", None)  # JITFunction.module: the kernel's module name
        ev = self._new_event(name, module if isinstance(module, str) else None)
        ev["cache_hit"] = bool(kwargs.get("cache_hit"))
        self._tls.last = ev

    def _on_post(self, kwargs: dict[str, Any]) -> None:
        info = kwargs.get("fn")
        name = str(getattr(info, "name", None) or "<unknown>")
        module = getattr(info, "module", None)
        ev = getattr(self._tls, "last", None)
        self._tls.last = None
        if ev is None or ev["post_hook"] or ev["kernel"] != name.rsplit(".", 1)[-1]:
            ev = self._new_event(name, module if isinstance(module, str) else None)
        elif isinstance(module, str):
            ev["module"] = module
        ev["post_hook"] = True
        start = getattr(self._tls, "start", None)
        if start is not None:
            ev["compile_s"] = round(time.perf_counter() - start, 4)
            self._tls.start = None

    # -- summaries ---------------------------------------------------------------------

    def phase_events(self, phase: str) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(e) for e in self.events if e["phase"] == phase]

    @staticmethod
    def summarize(events: Sequence[dict[str, Any]]) -> dict[str, Any]:
        tq = [e for e in events if is_tq_kernel(e["kernel"], e.get("module"))]
        other = [e for e in events if e not in tq]
        return {
            "tq_compiles_after_startup": [e["kernel"] for e in tq if e["cache_hit"] is not True],
            "tq_loads_after_startup": [e["kernel"] for e in tq if e["cache_hit"] is True],
            "first_tq_jit": [e["kernel"] for e in tq if e["part"] == "first"],
            "steady_tq_jit": [e["kernel"] for e in tq if e["part"] == "steady"],
            "other_jit_after_startup": [e["kernel"] for e in other],
        }


# --------------------------------------------------------------------------------------
# run role: one configuration in this process
# --------------------------------------------------------------------------------------


PREWARMS: tuple[str, ...] = ("fa2", "gemm16", "fa2paged")


def _profiler() -> Any:
    from torch.profiler import ProfilerActivity, profile

    # Shapes name the specialization behind a slow first call (which GEMM, which attention).
    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True)


def op_cpu_times(prof: Any) -> dict[str, float]:
    """Total CPU microseconds per op name (includes children: a launch and what it waits on)."""
    return {e.key: float(e.cpu_time_total) for e in prof.key_averages()}


def slow_leaves(prof: Any, min_us: float = 2000.0, top: int = 12) -> list[dict[str, Any]]:
    """The slowest childless CPU events (module loads, syncs, launches) with their callers.

    A one-time cost (CUDA loading a kernel's module, a cuBLAS handle) is a leaf under the op
    that needed it; the caller chain and the nearest op's input shapes say which specialization.
    """
    leaves = [e for e in prof.events() if not e.cpu_children and e.cpu_time_total >= min_us]
    leaves.sort(key=lambda e: -e.cpu_time_total)
    rows = []
    for e in leaves[:top]:
        chain: list[str] = []
        shapes, parent = None, e.cpu_parent
        while parent is not None and len(chain) < 6:
            chain.append(parent.name)
            if shapes is None and parent.input_shapes:
                shapes = str(parent.input_shapes)[:300]
            parent = parent.cpu_parent
        rows.append(
            {"leaf": e.name, "us": round(e.cpu_time_total), "callers": chain, "shapes": shapes}
        )
    return rows


def first_request_extra(
    first: dict[str, float], steady: dict[str, float], top: int = 15
) -> list[dict[str, Any]]:
    """The ops whose CPU time grew most from the steady to the first request."""
    extra = sorted(first, key=lambda k: steady.get(k, 0.0) - first[k])[:top]
    return [
        {"op": k, "first_us": round(first[k]), "steady_us": round(steady.get(k, 0.0))}
        for k in extra
    ]


def prewarm_launches(which: Sequence[str], geometry: Geometry) -> dict[str, float]:
    """Launch the non-Triton kernels of the long-continuation path once on dummy tensors.

    ``fa2``: vLLM's FlashAttention-2 varlen with a causal query shorter than its keys (the
    continuation shape) in bf16; ``gemm16``: an fp16 GEMM like the MSE key un-rotation;
    ``fa2paged``: a one-token decode over a 2048-token paged bf16 cache, which FlashAttention
    splits over the keys -- what the full-precision boundary layers (FlashAttention backend)
    run on the first long-context decode in eager mode. An experiment (the seconds each
    took), not part of the plugin.
    """
    import torch
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func

    took: dict[str, float] = {}
    d, hq, hk = geometry.head_size, geometry.q_heads, geometry.kv_heads
    dev = torch.device("cuda")
    for name in which:
        t = time.perf_counter()
        if name == "fa2":
            q = torch.randn(16, hq, d, device=dev, dtype=torch.bfloat16)
            kv = torch.randn(48, hk, d, device=dev, dtype=torch.bfloat16)
            flash_attn_varlen_func(
                q=q,
                k=kv,
                v=kv,
                cu_seqlens_q=torch.tensor([0, 16], device=dev, dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, 48], device=dev, dtype=torch.int32),
                max_seqlen_q=16,
                max_seqlen_k=48,
                softmax_scale=d**-0.5,
                causal=True,
                fa_version=2,
            )
        elif name == "fa2paged":
            block, blocks = 32, 64
            cache = torch.randn(blocks, block, hk, d, device=dev, dtype=torch.bfloat16)
            flash_attn_varlen_func(
                q=torch.randn(1, hq, d, device=dev, dtype=torch.bfloat16),
                k=cache,
                v=cache,
                cu_seqlens_q=torch.tensor([0, 1], device=dev, dtype=torch.int32),
                seqused_k=torch.tensor([block * blocks], device=dev, dtype=torch.int32),
                max_seqlen_q=1,
                max_seqlen_k=block * blocks,
                softmax_scale=d**-0.5,
                causal=True,
                block_table=torch.arange(blocks, device=dev, dtype=torch.int32)[None],
                fa_version=2,
            )
        else:
            a = torch.randn(hk * 512, d, device=dev, dtype=torch.float16)
            _ = a @ torch.randn(d, d, device=dev, dtype=torch.float16)
        torch.cuda.synchronize()
        took[name] = round(time.perf_counter() - t, 4)
    return took


def _marker(text: str) -> None:
    print(f"{MARKER} {text}", file=sys.stderr, flush=True)


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
    for name in sorted(reports):
        if name.endswith("-0.json"):
            rep = reports[name]
            return rep if isinstance(rep, dict) else None
    rep = reports[sorted(reports)[0]]
    return rep if isinstance(rep, dict) else None


def _plugin_entry_point_found() -> bool:
    from importlib.metadata import entry_points

    try:
        return any(ep.name == "tq_warmup" for ep in entry_points(group="vllm.general_plugins"))
    except Exception:
        return False


def _abort_unfinished(llm: Any) -> None:
    """After a failed ``generate``, drop its requests so later phases start clean."""
    eng = llm.llm_engine
    with contextlib.suppress(Exception):
        ids = list(eng.output_processor.request_states.keys())
        if ids:
            eng.abort_request(ids, internal=True)


def _gpu_name() -> str:
    with contextlib.suppress(Exception):
        from vllm.platforms import current_platform

        return str(current_platform.get_device_name(0))
    with contextlib.suppress(Exception):
        import torch

        return str(torch.cuda.get_device_name(0))
    return "unknown-gpu"


def cmd_run(args: argparse.Namespace) -> int:
    """Run one configuration in this process and write its records to ``--out``."""
    geometry = Geometry(args.head_size, args.q_heads, args.kv_heads)
    plugin_on = args.plugin == "on"
    cfg_id = args.config_id or config_id(
        args.preset, args.mode, geometry, args.layers, args.budget, args.tp
    )
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="tq-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    report_dir = work / "report"
    shutil.rmtree(report_dir, ignore_errors=True)
    report_dir.mkdir(parents=True)

    if not args.cache_root and not args.triton_cache_dir:
        if args.triton_cache == "warm":
            print("--triton-cache warm needs --cache-root or --triton-cache-dir", file=sys.stderr)
            return 2
        args.cache_root = str(work / "cache")  # a fresh one, so "cold" is true
        shutil.rmtree(args.cache_root, ignore_errors=True)

    # Environment first: Triton and vLLM read it at import time.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["TQ_WARMUP"] = "1" if plugin_on else "0"
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
    monitor_mode = args.jit_monitor_mode or ("error" if plugin_on else "warn")
    jobs = int(args.jobs)
    gpu_mem = args.gpu_mem_util or default_gpu_mem_util(jobs)

    plan = plan_phases(args.budget, 16, args.max_tokens)
    max_model_len = args.max_model_len or auto_max_model_len(plan.required_max_model_len)

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
    records: list[dict[str, Any]] = []
    out_path = Path(args.out) if args.out else None

    def flush() -> None:
        if out_path is not None:
            write_json_atomic(out_path, records)

    if max_model_len < plan.required_max_model_len:
        base.update(
            phase="startup",
            status="failed",
            error=f"max_model_len {max_model_len} < {plan.required_max_model_len} needed",
        )
        records.append(base)
        flush()
        print(base["error"], file=sys.stderr)
        return 2

    model_dir = work / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    model_cfg = build_model_config(
        geometry, args.layers, max_model_len, args.vocab_size, args.intermediate_size
    )
    (model_dir / "config.json").write_text(json.dumps(model_cfg, indent=1))

    import triton

    recorder = JitRecorder(triton.knobs)
    recorder.install()

    import vllm
    from vllm import LLM, SamplingParams

    base["vllm_version"] = vllm.__version__
    base["triton_version"] = triton.__version__
    with contextlib.suppress(Exception):
        import torch

        base["torch_version"] = torch.__version__
    base["plugin_entry_point_found"] = _plugin_entry_point_found()
    monitor_module, monitor_has_mode = jit_monitor_support(vllm.__version__)
    if not monitor_has_mode:
        base["jit_monitor_mode"] = "warn (no jit_monitor_mode before 0.25)"

    llm_kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "skip_tokenizer_init": True,
        "load_format": "dummy",
        "dtype": "bfloat16",
        "kv_cache_dtype": args.preset,
        "max_model_len": max_model_len,
        "max_num_batched_tokens": args.budget,
        "max_num_seqs": args.max_num_seqs,
        "enable_chunked_prefill": True,
        "enable_prefix_caching": True,
        "enforce_eager": args.mode == "eager",
        "tensor_parallel_size": args.tp,
        "gpu_memory_utilization": gpu_mem,
        "seed": 0,
    }
    if monitor_has_mode:
        llm_kwargs["jit_monitor_mode"] = monitor_mode
    if args.kv_cache_gib > 0:
        llm_kwargs["kv_cache_memory_bytes"] = int(args.kv_cache_gib * (1 << 30))
    if args.mode == "cudagraph" and args.cudagraph_mode:
        llm_kwargs["compilation_config"] = {"cudagraph_mode": args.cudagraph_mode}

    _marker(f"config={cfg_id} plugin={args.plugin} cache={args.triton_cache} starting engine")
    t0 = time.perf_counter()
    try:
        llm = LLM(**llm_kwargs)
    except Exception as e:
        traceback.print_exc()
        base.update(
            phase="startup",
            status="failed",
            startup_s=round(time.perf_counter() - t0, 3),
            error=f"{type(e).__name__}: {e}"[-4000:],
            gpu=_gpu_name(),
        )
        base["plugin_report"] = _pick_rank0(_read_plugin_reports(report_dir))
        records.append(base)
        flush()
        return 1
    startup_s = time.perf_counter() - t0
    rewrapped = recorder.ensure_outermost()
    recorder.set_phase("after_startup", "")
    _marker("startup done")

    try:
        jit_monitor_active: bool | None = importlib.import_module(monitor_module).is_active()
    except ImportError:  # 0.20: no monitor at all
        jit_monitor_active = None

    vcfg = llm.llm_engine.vllm_config
    block_size = int(vcfg.cache_config.block_size or 16)
    plan = plan_phases(args.budget, block_size, args.max_tokens)
    reports = _read_plugin_reports(report_dir)
    rep0 = _pick_rank0(reports)
    startup_events = recorder.phase_events("startup")
    sched = vcfg.scheduler_config
    warnings = []
    if int(sched.max_num_batched_tokens) != args.budget:
        warnings.append(f"max_num_batched_tokens is {sched.max_num_batched_tokens}")
    if not sched.enable_chunked_prefill:
        warnings.append("chunked prefill is off")
    if not vcfg.cache_config.enable_prefix_caching:
        warnings.append("prefix caching is off")
    if plugin_on and rep0 is None:
        warnings.append("plugin on but it wrote no report (is the entry point installed?)")
    base.update(
        gpu=_gpu_name(),
        startup_s=round(startup_s, 3),
        warmup_s=rep0.get("warmup_s") if rep0 else None,
        launch_s=rep0.get("launch_s") if rep0 else None,
        plugin_report=rep0,
        plugin_reports=reports if len(reports) > 1 else None,
        block_size=block_size,
        cudagraph_mode=str(vcfg.compilation_config.cudagraph_mode),
        jit_monitor_active=jit_monitor_active,
        model_runner="v2" if vcfg.use_v2_model_runner else "v1",
        monitor_rewrapped=rewrapped,
        config_warnings=warnings,
        startup_jit=startup_summary(startup_events),
    )
    for w in warnings:
        print(f"{MARKER} WARNING {w}", file=sys.stderr, flush=True)

    sp = SamplingParams(
        max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0, detokenize=False
    )
    vocab = args.vocab_size
    long_prompts: dict[str, list[int]] = {}

    def prompts_for(phase: str, part: str) -> list[list[int]]:
        seed = 1000 * PHASES.index(phase) + (0 if part == "first" else 1)
        if phase in ("decode", "batch", "short_tail"):
            lens = plan.prompt_lens(phase)
            return make_prompts(len(lens), lens[0], seed, vocab)
        if phase == "long":
            p = make_prompts(1, plan.long_len, seed, vocab)[0]
            long_prompts[part] = p
            return [p]
        # prefix_hit: the block-aligned prefix of the same part's long prompt + a new tail
        prefix = long_prompts.get(part) or make_prompts(1, plan.long_len, seed, vocab)[0]
        tail = make_prompts(1, plan.prefix_tail, seed + 7, vocab)[0]
        return [prefix[: plan.prefix_len] + tail]

    profiled = set(parse_list(args.profile_phases, PHASES)) if args.profile_phases else set()
    profiles: dict[tuple[str, str], dict[str, float]] = {}
    leaves: dict[tuple[str, str], list[dict[str, Any]]] = {}
    if profiled:
        with _profiler():  # Kineto's one-time setup, outside the timed requests
            pass
    if args.prewarm:
        base["prewarm"] = prewarm_launches(parse_list(args.prewarm, PREWARMS), geometry)

    def timed(phase: str, part: str) -> dict[str, Any]:
        prompts = prompts_for(phase, part)
        recorder.set_phase(phase, part)
        _marker(f"phase={phase} part={part} begin")
        prof = _profiler() if phase in profiled else contextlib.nullcontext()
        t = time.perf_counter()
        res: dict[str, Any] = {"s": None, "error": None, "cached": None, "out_tokens": None}
        try:
            with prof as session:
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            if session is not None:
                profiles[phase, part] = op_cpu_times(session)
                leaves[phase, part] = slow_leaves(session)
            res["s"] = round(time.perf_counter() - t, 4)
            res["cached"] = sum(int(o.num_cached_tokens or 0) for o in outs)
            res["out_tokens"] = sum(len(o.outputs[0].token_ids) for o in outs if o.outputs)
        except Exception as e:
            res["s"] = round(time.perf_counter() - t, 4)
            res["error"] = f"{type(e).__name__}: {e}"[-2000:]
            traceback.print_exc()
            _abort_unfinished(llm)
        recorder.set_phase("between", "")
        return res

    for phase in parse_list(args.phases, PHASES) if args.phases != "all" else PHASES:
        first = timed(phase, "first")
        steady = timed(phase, "steady")
        events = recorder.phase_events(phase)
        rec = {
            **base,
            "phase": phase,
            "status": "ok" if not (first["error"] or steady["error"]) else "failed",
            "first_s": first["s"],
            "steady_s": steady["s"],
            "ratio": round(first["s"] / steady["s"], 2)
            if first["s"] and steady["s"] and not (first["error"] or steady["error"])
            else None,
            "first_error": first["error"],
            "steady_error": steady["error"],
            "prompt_lens": plan.prompt_lens(phase),
            "expected_chunks": describe_chunks(plan.expected_chunks(phase)),
            "expected_cached_tokens": plan.expected_cached(phase),
            "first_cached_tokens": first["cached"],
            "steady_cached_tokens": steady["cached"],
            "out_tokens": [first["out_tokens"], steady["out_tokens"]],
            **JitRecorder.summarize(events),
            "jit_events": events,
        }
        if phase in profiled:
            rec["profile_top_extra"] = first_request_extra(
                profiles.get((phase, "first"), {}), profiles.get((phase, "steady"), {})
            )
            rec["profile_slow_leaves"] = {
                part: leaves.get((phase, part), []) for part in ("first", "steady")
            }
        if plan.expected_cached(phase) == 0 and (first["cached"] or steady["cached"]):
            rec["phase_warning"] = "unexpected prefix-cache hit"
        prefix_missed = any(
            not part["error"] and (part["cached"] or 0) < plan.prefix_len
            for part in (first, steady)
        )
        if phase == "prefix_hit" and prefix_missed:
            rec["phase_warning"] = "prefix was not (fully) served from the cache"
        records.append(rec)
        flush()

    stray = recorder.phase_events("between") + recorder.phase_events("after_startup")
    if stray:
        for r in records:
            r["jit_outside_phases"] = [e["kernel"] for e in stray]
        flush()

    print_tables(records)
    sys.stdout.flush()
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    return 0 if all(r["status"] == "ok" for r in records) else 3


# --------------------------------------------------------------------------------------
# matrix role: one subprocess per configuration and variant
# --------------------------------------------------------------------------------------


@dataclass
class RunSpec:
    """One subprocess: a configuration in one variant."""

    preset: str
    mode: str
    geometry: Geometry
    variant: str  # on-cold | off-cold | on-warm
    cache_root: Path
    out: Path
    log: Path
    work_dir: Path
    config_id: str

    @property
    def plugin(self) -> str:
        return self.variant.split("-")[0]

    @property
    def triton_cache(self) -> str:
        return self.variant.split("-")[1]


class Matrix:
    """Runs the subprocesses, collects and saves their records."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run_id = dt.datetime.now().strftime("%Y%m%dT%H%M%S")
        self.t0 = time.monotonic()
        self.lock = threading.Lock()
        self.records: list[dict[str, Any]] = []
        self.log_dir = (
            Path(args.log_dir) if args.log_dir else (Path(args.results_dir) / "logs" / self.run_id)
        )
        self.own_work_root = not args.work_dir
        self.work_root = Path(args.work_dir or tempfile.mkdtemp(prefix="tq-bench-matrix-"))
        self.results_file: Path | None = None
        self.fallback_gpu = _nvidia_smi_name()
        self.fallback_vllm = _installed_vllm_version()
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.stopping = False

    def remaining(self) -> float | None:
        if not self.args.deadline_s:
            return None
        return float(self.args.deadline_s) - (time.monotonic() - self.t0)

    def specs(self) -> list[list[RunSpec]]:
        """Units of work: [on-cold, on-warm] chains (in order) and single off-cold runs."""
        a = self.args
        chains: list[list[RunSpec]] = []
        singles: list[list[RunSpec]] = []
        variants = parse_list(a.variants, VARIANTS)
        for preset in parse_list(a.presets, PRESETS):
            for mode in parse_list(a.modes, MODES):
                for gtext in parse_list(a.geometries):
                    geom = parse_geometry(gtext)
                    cid = config_id(preset, mode, geom, a.layers, a.budget, a.tp)
                    on_root = self.work_root / cid / "cache-on"
                    chain: list[RunSpec] = []
                    for variant in variants:
                        root = (
                            on_root
                            if variant.startswith("on")
                            else (self.work_root / cid / "cache-off")
                        )
                        spec = RunSpec(
                            preset=preset,
                            mode=mode,
                            geometry=geom,
                            variant=variant,
                            cache_root=root,
                            out=self.work_root / cid / f"{variant}.json",
                            log=self.log_dir / f"{cid}.{variant}.log",
                            work_dir=self.work_root / cid / f"work-{variant}",
                            config_id=cid,
                        )
                        if variant == "off-cold":
                            singles.append([spec])
                        else:
                            chain.append(spec)
                    if chain:
                        chains.append(chain)
        # Longer chains first so they are not the stragglers.
        return chains + singles

    def argv(self, spec: RunSpec) -> list[str]:
        a = self.args
        argv = [
            sys.executable,
            str(Path(__file__).resolve()),
            "run",
            "--preset",
            spec.preset,
            "--mode",
            spec.mode,
            "--head-size",
            str(spec.geometry.head_size),
            "--q-heads",
            str(spec.geometry.q_heads),
            "--kv-heads",
            str(spec.geometry.kv_heads),
            "--layers",
            str(a.layers),
            "--budget",
            str(a.budget),
            "--tp",
            str(a.tp),
            "--max-model-len",
            str(a.max_model_len),
            "--max-num-seqs",
            str(a.max_num_seqs),
            "--max-tokens",
            str(a.max_tokens),
            "--kv-cache-gib",
            str(a.kv_cache_gib),
            "--gpu-mem-util",
            str(a.gpu_mem_util or default_gpu_mem_util(a.jobs)),
            "--jobs",
            str(a.jobs),
            "--plugin",
            spec.plugin,
            "--triton-cache",
            spec.triton_cache,
            "--cache-root",
            str(spec.cache_root),
            "--work-dir",
            str(spec.work_dir),
            "--out",
            str(spec.out),
            "--run-id",
            self.run_id,
            "--config-id",
            spec.config_id,
        ]
        if a.cudagraph_mode:
            argv += ["--cudagraph-mode", a.cudagraph_mode]
        if a.runner != "default":
            argv += ["--runner", a.runner]
        if a.share_compile_cache:
            argv.append("--share-compile-cache")
        if spec.plugin == "on" and a.jit_monitor_mode_on:
            argv += ["--jit-monitor-mode", a.jit_monitor_mode_on]
        return argv

    def base_record(self, spec: RunSpec) -> dict[str, Any]:
        a = self.args
        return {
            "run_id": self.run_id,
            "config_id": spec.config_id,
            "date": dt.date.today().isoformat(),
            "vllm_version": self.fallback_vllm,
            "gpu": self.fallback_gpu,
            "kv_cache_dtype": spec.preset,
            "mode": spec.mode,
            "plugin": spec.plugin,
            "triton_cache": spec.triton_cache,
            "head_size": spec.geometry.head_size,
            "q_heads": spec.geometry.q_heads,
            "kv_heads": spec.geometry.kv_heads,
            "layers": a.layers,
            "budget": a.budget,
            "tp": a.tp,
            "jobs": a.jobs,
            "first_s": None,
            "steady_s": None,
            "tq_compiles_after_startup": [],
            "warmup_s": None,
            "startup_s": None,
            "log_file": str(spec.log),
        }

    def run_one(self, spec: RunSpec) -> list[dict[str, Any]]:
        base = self.base_record(spec)
        left = self.remaining()
        if self.stopping or (left is not None and left < 30):
            why = "matrix stopped" if self.stopping else "deadline reached"
            skipped = [{**base, "phase": p, "status": "skipped", "error": why} for p in PHASES]
            with self.lock:  # shown in the table, not written to the results file
                self.records.extend(skipped)
            return skipped
        if spec.triton_cache == "cold":
            shutil.rmtree(spec.cache_root, ignore_errors=True)
        elif not (spec.cache_root / "triton").is_dir():
            base["cache_warning"] = "warm run but the cold run left no Triton cache"
        spec.cache_root.mkdir(parents=True, exist_ok=True)
        spec.out.unlink(missing_ok=True)
        spec.log.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update(
            PYTHONUNBUFFERED="1",
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            TRITON_CACHE_DIR=str(spec.cache_root / "triton"),
        )
        if not self.args.share_compile_cache:
            env["VLLM_CACHE_ROOT"] = str(spec.cache_root / "vllm")
            env["TORCHINDUCTOR_CACHE_DIR"] = str(spec.cache_root / "inductor")
        timeout = float(self.args.timeout)
        if left is not None:
            timeout = max(1.0, min(timeout, left - 10))
        argv = self.argv(spec)
        print(f"[matrix] start {spec.config_id} {spec.variant} (log {spec.log})", flush=True)
        t = time.monotonic()
        timed_out = False
        with spec.log.open("wb") as logf:
            logf.write(("$ " + " ".join(argv) + "\n").encode())
            logf.flush()
            proc = subprocess.Popen(
                argv, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            with self.lock:
                self.procs[proc.pid] = proc
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc)
                rc = proc.wait()
            finally:
                with self.lock:
                    self.procs.pop(proc.pid, None)
        wall = time.monotonic() - t
        log_text = spec.log.read_text(errors="replace")
        records = load_records(spec.out)
        if rc != 0 or timed_out or len(records) < len(PHASES):
            why = "timed out" if timed_out else f"exit code {rc}"
            error = f"{why}; last log lines:\n{tail_lines(log_text)}"
            seed = {**base, **run_level_fields(records[0])} if records else base
            records = fill_missing_phases(records, seed, error)
        apply_log(records, log_text)
        for r in records:
            r.setdefault("log_file", str(spec.log))
            r["rc"] = rc
            r["timed_out"] = timed_out
            r["process_wall_s"] = round(wall, 2)
            if "cache_warning" in base:
                r["cache_warning"] = base["cache_warning"]
        status = {r.get("status") for r in records}
        print(
            f"[matrix] done  {spec.config_id} {spec.variant} in {wall:.0f}s rc={rc} "
            f"status={sorted(str(s) for s in status)}",
            flush=True,
        )
        self.save(records)
        return records

    def run_unit(self, unit: list[RunSpec]) -> None:
        for spec in unit:
            try:
                self.run_one(spec)
            except Exception as e:  # a bug here must not stop the other runs
                traceback.print_exc()
                base = self.base_record(spec)
                error = f"matrix error: {type(e).__name__}: {e}"
                self.save(fill_missing_phases([], base, error))

    def save(self, new: list[dict[str, Any]]) -> None:
        with self.lock:
            self.records.extend(new)
            if self.results_file is None:
                gpu = next((r["gpu"] for r in self.records if r.get("gpu")), None)
                ver = next((r["vllm_version"] for r in self.records if r.get("vllm_version")), None)
                self.results_file = results_path(
                    Path(self.args.results_dir),
                    dt.date.today().isoformat(),
                    gpu or self.fallback_gpu or "unknown-gpu",
                    ver or self.fallback_vllm or "unknown",
                )
            merged = merge_records(load_records(self.results_file), new)
            write_json_atomic(self.results_file, merged)

    def kill_all(self) -> None:
        self.stopping = True
        with self.lock:
            procs = list(self.procs.values())
        for p in procs:
            _kill_group(p)

    def _on_sigterm(self, signum: int, _frame: Any) -> None:
        """Killed from outside (e.g. a device-call time limit): take the children along."""
        self.kill_all()
        raise SystemExit(128 + signum)

    def run(self) -> int:
        with contextlib.suppress(ValueError):  # only possible in the main thread
            signal.signal(signal.SIGTERM, self._on_sigterm)
        units = self.specs()
        if not units:
            print("nothing to run", file=sys.stderr)
            return 2
        n_runs = sum(len(u) for u in units)
        print(
            f"[matrix] run id {self.run_id}: {n_runs} runs in {len(units)} units, "
            f"jobs={self.args.jobs}, logs in {self.log_dir}",
            flush=True,
        )
        try:
            if self.args.jobs > 1 and not self.args.no_prime:
                first, rest = units[0][0], units[0][1:]
                self.run_one(first)  # alone: pays one-time driver/PTX costs once
                units = ([rest] if rest else []) + units[1:]
            if self.args.jobs <= 1:
                for unit in units:
                    self.run_unit(unit)
            else:
                with ThreadPoolExecutor(max_workers=self.args.jobs) as pool:
                    for fut in [pool.submit(self.run_unit, u) for u in units]:
                        fut.result()
        except KeyboardInterrupt:
            self.kill_all()
            raise
        finally:
            if self.own_work_root and not self.args.keep_caches:
                shutil.rmtree(self.work_root, ignore_errors=True)
        print()
        print_tables(self.records)
        print(f"\n[matrix] results: {self.results_file}")
        return 0 if all(r.get("status") == "ok" for r in self.records) else 1


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill the process group of a subprocess we started (it and its workers)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _nvidia_smi_name() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    names = [n.strip() for n in out.splitlines() if n.strip()]
    return names[0] if names else None


def _installed_vllm_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm")
    except PackageNotFoundError:
        return None


def cmd_matrix(args: argparse.Namespace) -> int:
    parse_list(args.presets, PRESETS)
    parse_list(args.modes, MODES)
    parse_list(args.variants, VARIANTS)
    for g in parse_list(args.geometries):
        geom = parse_geometry(g)
        if geom.q_heads % args.tp or geom.kv_heads % args.tp:
            raise SystemExit(f"geometry {g}: heads must be divisible by --tp {args.tp}")
    plan_phases(args.budget, 16, args.max_tokens)  # validates the budget
    return Matrix(args).run()


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------


def cmd_collect(args: argparse.Namespace) -> int:
    """Merge ``run --out`` files (and their logs, ``X.json`` -> ``X.log``) into the
    results file, each record labelled with ``--series``."""
    new: list[dict[str, Any]] = []
    for name in args.files:
        path = Path(name)
        records = load_records(path)
        log = path.with_suffix(".log")
        if log.is_file():
            apply_log(records, log.read_text(errors="replace"))
        for r in records:
            r["series"] = args.series
        new.extend(records)
    if not new:
        print("no records", file=sys.stderr)
        return 1
    first = new[0]
    out = results_path(Path(args.results_dir), first["date"], first["gpu"], first["vllm_version"])
    merged = merge_records(load_records(out) if out.is_file() else [], new)
    write_json_atomic(out, merged)
    print_tables(new)
    print(f"{len(new)} records -> {out} ({len(merged)} in all)")
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=6, help="hidden layers (>= 6)")
    p.add_argument(
        "--budget",
        type=int,
        default=512,
        help="chunked-prefill token budget (max_num_batched_tokens), > 128",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=0,
        help="0: the smallest multiple of 1024 the phases need",
    )
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        default=2.0,
        help="fixed KV cache size instead of a share of the measured free memory "
        "(vLLM still runs its profiling forward); 0: from --gpu-mem-util",
    )
    p.add_argument(
        "--gpu-mem-util",
        type=float,
        default=0.0,
        help="gpu_memory_utilization; 0: min(0.85, 0.9/jobs - 0.03)",
    )
    p.add_argument("--jobs", type=int, default=1, help="concurrent subprocesses on the GPU")
    p.add_argument(
        "--cudagraph-mode",
        default="",
        help="cudagraph mode for --mode cudagraph (e.g. FULL_AND_PIECEWISE, "
        "PIECEWISE, FULL_DECODE_ONLY); empty: vLLM's default",
    )
    p.add_argument(
        "--runner",
        choices=RUNNERS,
        default="default",
        help="model runner: v1/v2 set VLLM_USE_V2_MODEL_RUNNER=0/1; default: vLLM's choice",
    )
    p.add_argument(
        "--share-compile-cache",
        action="store_true",
        help="do not isolate VLLM_CACHE_ROOT / TORCHINDUCTOR_CACHE_DIR per run",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="run one configuration in this process (imports vLLM)")
    r.add_argument("--preset", choices=PRESETS, default="turboquant_4bit_nc")
    r.add_argument("--mode", choices=MODES, default="eager")
    r.add_argument("--head-size", type=int, default=128)
    r.add_argument("--q-heads", type=int, default=16)
    r.add_argument("--kv-heads", type=int, default=8)
    r.add_argument("--plugin", choices=("on", "off"), required=True)
    r.add_argument(
        "--triton-cache",
        choices=("cold", "warm"),
        default="cold",
        help="label only: whether the Triton cache dir is fresh",
    )
    r.add_argument("--triton-cache-dir", default="", help="sets TRITON_CACHE_DIR")
    r.add_argument(
        "--cache-root",
        default="",
        help="sets TRITON_CACHE_DIR=<root>/triton (and vLLM/Inductor caches)",
    )
    r.add_argument(
        "--jit-monitor-mode",
        choices=("warn", "error"),
        default="",
        help="default: error with the plugin on, warn with it off",
    )
    r.add_argument(
        "--phases",
        default="all",
        help=f"comma list of {PHASES}, run in the order given (default: all, in that order)",
    )
    r.add_argument(
        "--profile-phases",
        default="",
        help="comma list of phases whose first and steady request run under torch.profiler; "
        "the records get the ops whose CPU time differs most (where a first request's "
        "extra time goes)",
    )
    r.add_argument(
        "--prewarm",
        default="",
        help="experiment: comma list of fa2,gemm16 launched once on dummy tensors after "
        "startup, before the phases (tests whether first launches explain first_s)",
    )
    r.add_argument("--vocab-size", type=int, default=1024)
    r.add_argument("--intermediate-size", type=int, default=1024)
    r.add_argument("--work-dir", default="", help="model config and plugin report go here")
    r.add_argument("--out", default="", help="write the records (JSON list) here")
    r.add_argument("--run-id", default="")
    r.add_argument("--config-id", default="")
    _common(r)
    r.set_defaults(func=cmd_run)

    m = sub.add_parser("matrix", help="one subprocess per configuration and variant")
    m.add_argument("--presets", default="all", help=f"comma list of {PRESETS} or 'all'")
    m.add_argument("--modes", default="eager,cudagraph")
    m.add_argument(
        "--geometries", default="128x16x8,64x16x2", help="comma list of HEADSIZExQHEADSxKVHEADS"
    )
    m.add_argument("--variants", default="all", help=f"comma list of {VARIANTS} or 'all'")
    m.add_argument("--timeout", type=float, default=600.0, help="seconds per subprocess")
    m.add_argument(
        "--deadline-s",
        type=float,
        default=0.0,
        help="stop starting runs / kill running ones after this many seconds",
    )
    m.add_argument(
        "--no-prime",
        action="store_true",
        help="with --jobs > 1, do not run the first run alone first",
    )
    m.add_argument(
        "--jit-monitor-mode-on",
        choices=("warn", "error"),
        default="",
        help="JIT monitor mode for plugin-on runs (default error)",
    )
    m.add_argument("--log-dir", default="", help="default: <results-dir>/logs/<run id>")
    m.add_argument("--results-dir", default=str(DEFAULT_RESULTS_DIR))
    m.add_argument(
        "--work-dir",
        default="",
        help="caches and model configs (default: a tmp dir, removed afterwards; "
        "a given dir is kept)",
    )
    m.add_argument("--keep-caches", action="store_true", help="keep the default tmp work dir")
    _common(m)
    m.set_defaults(func=cmd_matrix)

    c = sub.add_parser("collect", help="merge run/matrix JSON files into the results file")
    c.add_argument("files", nargs="+", help="JSON record lists (a sibling .log is read too)")
    c.add_argument("--series", required=True, help="label for these records")
    c.add_argument("--results-dir", default=str(DEFAULT_RESULTS_DIR))
    c.set_defaults(func=cmd_collect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
