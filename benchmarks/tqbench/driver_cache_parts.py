"""The driver-cache proof's pure parts: the two child scripts it runs (the startup
decision, a launch probe), the FA2 launches it probes, which step is an engine, issue
22's verdict over the shipped/warm pairs, and the table's lines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = [
    "DECISION_PROBE",
    "ENGINE_STEPS",
    "LAUNCH_PROBE",
    "PRESET",
    "candidate_launches",
    "changed_files",
    "is_engine",
    "label",
    "mib",
    "probe_out",
    "slowest_launch",
    "table_rows",
    "tree",
    "variant_launches",
    "verdict",
]

PRESET = "turboquant_4bit_nc"
ENGINE_STEPS = ("fresh", "auto", "shipped", "warm")

DECISION_PROBE = """
import json, logging, os, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stdout)
import tq_warmup_plugin
tq_warmup_plugin.register()
print(json.dumps({"CUDA_CACHE_PATH": os.environ.get("CUDA_CACHE_PATH")}))
"""

LAUNCH_PROBE = """
import json, os, sys, time
probe = json.loads(sys.argv[1])
path = probe["path"]
try:
    open(os.path.join(path, ".tq-probe"), "x").close()
    os.unlink(os.path.join(path, ".tq-probe"))
    writable = True
except OSError:
    writable = False
t0 = time.perf_counter()
import torch
if probe["late"]:  # CUDA initialised and a context made before the variable is set
    torch.cuda.init(); torch.zeros(1, device="cuda"); torch.cuda.synchronize()
os.environ["CUDA_CACHE_PATH"] = path
from tq_warmup_plugin.driver.build import run_launches
from tq_warmup_plugin.worker.launches import Launch
out = run_launches([Launch(**x) for x in probe["launches"]], probe["scale"])
print(json.dumps({**out, "writable": writable, "total_s": time.perf_counter() - t0}))
"""


def candidate_launches(
    head: int, q: int, kv: int, budget: int, max_len: int
) -> list[dict[str, Any]]:
    """The FA2 launches ``launches.driver_plan`` makes for the proof's dense model (the
    parent does not import the plugin's planning, which needs vLLM's config)."""
    tokens = min(budget, max_len, 2048)
    shape = {"q_heads": q, "kv_heads": kv, "head_size": head, "dtype": "bfloat16"}
    out = [{"kind": "attention", "rows": tokens, "cols": tokens, **shape}]
    out.append({"kind": "attention", "rows": tokens, "cols": 2 * tokens, **shape})
    out.append({"kind": "paged_decode", "rows": 1, "cols": min(max_len, 2048), **shape})
    out.append({"kind": "paged_prefill", "rows": tokens, "cols": tokens, **shape})
    return out


def variant_launches(head: int, q: int, kv: int) -> list[dict[str, Any]]:
    """FA2 calls a startup can make that :func:`candidate_launches` does not: a one-token
    prompt (FA2 runs a call with one query token non-causal: another module, untested),
    vLLM's V2 ``warmup_kernels`` steps (prompts of 2 tokens, then a decode over 3, which
    FA2 does not split), each timed over a copy of the entry by the ``variants`` step."""
    shape = {"q_heads": q, "kv_heads": kv, "head_size": head, "dtype": "bfloat16"}
    sizes = (("attention", 1, 1), ("attention", 2, 2), ("paged_prefill", 2, 2))
    return [
        {"kind": k, "rows": r, "cols": c, **shape} for k, r, c in (*sizes, ("paged_decode", 1, 3))
    ]


def label(x: dict[str, Any]) -> str:
    return f"{x['kind']} {x['dtype']} {x['rows']}x{x['cols']}"


def slowest_launch(
    seconds: dict[str, float], candidates: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """The candidate the build spent the most seconds on (its module's JIT)."""
    known = [c for c in candidates if label(c) in seconds]
    return max(known, key=lambda c: seconds[label(c)], default=None)


def is_engine(step: str) -> bool:
    """An engine's row: ``fresh``, ``auto``, or a ``--pairs`` one (``shipped-2``, ...)."""
    return step.split("-")[0] in ENGINE_STEPS


def verdict(
    rows: list[dict[str, Any]], gap_s: float = 5.0, launches_ms: int = 1000
) -> dict[str, Any]:
    """Issue 22's target over each ``shipped[-X]`` / ``warm[-X]`` pair that started: the
    shipped engine's first launches under ``launches_ms`` and its startup within ``gap_s``
    of the warm engine's (the warm one runs second, over the copy the shipped one grew)."""
    by = {r["step"]: r for r in rows if r.get("status") == "ok" and r.get("startup_s") is not None}
    pairs = []
    for name, row in by.items():
        warm = by.get("warm" + name[len("shipped") :]) if name.startswith("shipped") else None
        if warm is None:
            continue
        gap = round(row["startup_s"] - warm["startup_s"], 2)
        ms = row.get("first_launches_ms")
        pairs.append(
            {
                "pair": name,
                "shipped_s": row["startup_s"],
                "warm_s": warm["startup_s"],
                "gap_s": gap,
                "first_launches_ms": ms,
                "met": gap <= gap_s and ms is not None and ms < launches_ms,
            }
        )
    gaps = [x["gap_s"] for x in pairs]
    return {
        "pairs": pairs,
        "mean_gap_s": round(sum(gaps) / len(gaps), 2) if gaps else None,
        "met": bool(pairs) and all(x["met"] for x in pairs),
    }


def table_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    """One line per step: what it shows."""
    out = []
    for r in rows:
        step = r["step"]
        if step == "build":
            done = (
                f"reused {r['reused']}"
                if r.get("reused")
                else f"rc {r.get('rc')}, {r.get('wall_s')} s"
            )
            text = (
                f"{done}; {r.get('files')} files, {r.get('du')} "
                f"({r.get('mib')} MiB); launches {r.get('launch_s')}"
                + (f"; engine {r['engine_s']}" if r.get("engine_s") else "")
            )
        elif is_engine(step):
            text = (
                f"{r.get('preset', PRESET)}: {r.get('status')}, startup {r.get('startup_s')} s, "
                f"first launches {r.get('first_launches')} in {r.get('first_launches_ms')} ms, "
                f"driver cache in HOME {r.get('home_driver_cache_mib')} MiB; "
                f"{r.get('error') or ''}"
            )
        elif step.startswith("decision"):
            text = (
                f"{len(r.get('warnings') or [])} WARNING, "
                f"CUDA_CACHE_PATH={r.get('cuda_cache_path')}; "
                f"{(r.get('warnings') or r.get('info') or [''])[0][:300]}"
            )
        elif step == "variants":
            text = (
                f"rc {r.get('rc')}: seconds {r.get('seconds')}, files added/changed "
                f"{r.get('files_added_or_changed')}; {(r.get('errors') or [''])[0][:200]}"
            )
        elif step == "verify":
            text = f"rc {r.get('rc')}: {' / '.join(r.get('lines') or [])[:300]}"
        else:
            text = (
                f"{r.get('launch')}: {r.get('probe_s')} s (build {r.get('build_s')} s), "
                f"cache dir writable {r.get('writable')}, rc {r.get('rc')}"
                + (
                    f", files added/changed {r['files_added_or_changed']}"
                    if "files_added_or_changed" in r
                    else ""
                )
                + (f"; {r['skipped']}" if r.get("skipped") else "")
            )
        out.append([step, text])
    return out


def changed_files(root: Path, before: dict[str, int]) -> int:
    """Files under ``root`` added or resized since ``before`` (its :func:`_tree`)."""
    return sum(1 for k, v in tree(root).items() if before.get(k) != v)


def probe_out(got: dict[str, Any]) -> dict[str, Any]:
    """A launch probe's JSON (its last line) when it exited 0, else nothing."""
    if got["rc"] != 0:
        return {}
    out: dict[str, Any] = json.loads(got["text"].strip().splitlines()[-1])
    return out


def mib(root: Path) -> float:
    return round(sum(tree(root).values()) / 2**20, 1) if root.is_dir() else 0.0


def tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}
