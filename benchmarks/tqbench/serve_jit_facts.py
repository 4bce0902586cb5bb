"""What ``serve-jit`` reads off a row: the plugin's lines in its log (:func:`row_facts`),
every engine family's job time from the plugin's JSON report (:func:`job_times`), and the
rows' table."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from benchmarks.tqbench import tables

__all__ = ["job_times", "row_facts", "rows_table"]


def job_times(report: Path) -> dict[str, Any]:
    """From the plugin's JSON report (``TQ_WARMUP_REPORT``): its engine warmers' job
    seconds per family, in ms, which the INFO line names only the largest of; nothing
    where it is missing. Triton's part of them the line gives (``row_facts``)."""
    try:
        data = json.loads(report.read_text())
        seconds = data["vllm"]["family_seconds"]
        families = {k: round(float(v) * 1000) for k, v in seconds.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}
    return {"family_job_ms": families}


def row_facts(plugin_lines: list[str]) -> dict[str, Any]:
    """What the plugin's lines say of one server: its first launches' time (the report
    line), its driver-cache decision and its engine warmers' line."""
    facts: dict[str, Any] = {}
    for line in plugin_lines:
        m = re.search(r"(\d+) first launches (\d+) ms", line)
        if m and "first_launches_ms" not in facts:
            facts.update(first_launches=int(m[1]), first_launches_ms=int(m[2]))
            shipped_keys = re.search(r"(\d+) from the shipped cache", line)
            total = re.search(r"; (\d+) ms; \d+ first launches", line)
            if shipped_keys and total:
                facts.update(from_layer=int(shipped_keys[1]), warmup_ms=int(total[1]))
        if "driver cache" in line or "CUDA_CACHE_PATH" in line:
            facts.setdefault("driver_cache_line", line[line.find("tq-warmup:") :])
        m = re.search(r"vLLM kernels: (.*)", line)
        if m:
            facts.setdefault("vllm_kernels", m[1][:500])
            took = re.search(
                r"\d+ compiled[^()]*?, (\d+) ms(?:, most job time: ([^()]*?) (\d+) ms)?"
                r"(?:, in Triton: lookups (\d+) ms, loads (\d+) ms)?\)",
                m[1],
            )
            if took and "vllm_kernels_ms" not in facts:
                facts["vllm_kernels_ms"] = int(took[1])
                if took[2]:
                    facts["vllm_most_time"] = f"{took[2]} {took[3]} ms"
                if took[4]:
                    facts.update(triton_lookup_ms=int(took[4]), triton_load_ms=int(took[5]))
        m = re.search(
            r"torch\.compile artifacts of \S+: (\d+) loaded \((\d+) KiB\) in (\d+) ms", line
        )
        if m and "compiled_ms" not in facts:
            facts.update(compiled_loaded=int(m[1]), compiled_kib=int(m[2]), compiled_ms=int(m[3]))
        elif "torch.compile artifacts of" in line:
            facts.setdefault("compiled_line", line[line.find("torch.compile artifacts") :][:300])
    if "warmup_ms" in facts and "vllm_kernels_ms" in facts:
        # what the plugin adds to a worker's startup: the vLLM-kernel time holds its
        # warmup forwards (engine_warmup.run), so the two are not added again; the
        # shipped torch.compile artifacts' load is apart from both
        facts["plugin_ms"] = (
            facts["warmup_ms"] + facts["vllm_kernels_ms"] + facts.get("compiled_ms", 0)
        )
    return facts


def _start(row: dict[str, Any]) -> str:
    """How a row's server started: over an empty Triton cache, the cache its row's first
    start filled, or a shipped layer."""
    if row.get("layer"):
        return "shipped layer"
    return "cold" if row.get("start", 1) == 1 else "warm Triton cache"


def rows_table(rows: list[dict[str, Any]]) -> str:
    header = ["row", "start", "kv", "speculation", "engine warmers", "status", "served",
              "failed", "JIT after startup", "TurboQuant warmup ms", "first launches ms",
              "plugin ms", "artifacts loaded (ms)", "vLLM kernels"]  # fmt: skip
    cells = [
        [r["row"], _start(r), r["kv"],
         (r.get("spec") or {}).get("method", "-"),
         "on" if r["warmers"] else "off", str(r.get("status")), str(r.get("served", "-")),
         str(r.get("failed", "-")), ", ".join(sorted(set(r.get("jit_after_startup") or []))) or "0",
         str(r.get("warmup_ms", "-")), str(r.get("first_launches_ms", "-")),
         str(r.get("plugin_ms", "-")),
         f"{r['compiled_loaded']} ({r['compiled_ms']})" if "compiled_ms" in r else "-",
         str(r.get("vllm_kernels", "-"))]
        for r in rows
    ]  # fmt: skip
    return tables.render_markdown(header, cells)
