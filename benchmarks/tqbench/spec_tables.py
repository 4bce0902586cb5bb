"""The spec benchmark's tables: one row per configuration, and the speed table of issue 23.

The first table is what a run prints: per configuration its verdict against the
reference, the CUDA-graph mode asked and the one vLLM resolved, output tokens/s and its
ratios (over the reference, over the unguarded FULL graphs of the same k), the
divergence, the TurboQuant compiles after startup and the draft acceptance. The speed
table has a row per way of running verify batches and a column per batch size and k.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from benchmarks.tqbench import tables
from benchmarks.tqbench.spec_configs import NOSPEC_FULL, kind_of
from benchmarks.tqbench.verdicts import acceptance, throughput

__all__ = ["SPEED_ROWS", "TABLE_HEADER", "speed_table", "table_rows"]

# (kind, what it is): the speed table's rows, in this order.
SPEED_ROWS: tuple[tuple[str, str], ...] = (
    (NOSPEC_FULL, "no speculative decoding, FULL graphs"),
    ("full-guard", "guard on: verify batches PIECEWISE"),
    ("full-noguard", "guard off: FULL graphs of verify batches"),
    ("full-batched", "batched verify path, FULL graphs"),
)
_RATIO_KINDS = ("full-guard", "full-batched")


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


TABLE_HEADER = (
    "config",
    "verdict",
    "cudagraph mode (asked -> vLLM's)",
    "tok/s",
    "x ref",
    "x noguard",
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
                _num(r.get("over_noguard"), ".2f"),
                _divergence_cell(cmp),
                differing,
                _num(cmp and cmp.get("max_lp_delta"), ".2e"),
                _num(cmp and cmp.get("ref_margin_at_divergence"), ".2e"),
                _compiles_cell(r),
                acceptance(r.get("spec_counters")),
                str(r.get("error_line") or "")[:80],
            )
        )
    return out


def speed_table(
    rows: Sequence[Mapping[str, Any]], default_batch: int | None = None
) -> tuple[list[str], list[list[str]]]:
    """Header and cells: a row per :data:`SPEED_ROWS` kind the run has, a column per
    batch size x k; a cell is output tokens/s, and for a guarded or batched row its
    ratio over ``full-noguard`` at the same batch and k. ``nospec-full`` has no k: its
    figure stands under every k of its batch size; a failed engine's cell is its status.
    ``default_batch``: the batch size of
    rows from before ``--batch`` (the run's prompt count)."""
    speed: dict[tuple[str, int | None], dict[str, float]] = {}
    failed: dict[tuple[str, int | None], str] = {}
    for r in rows:
        key = kind_of(str(r["name"]))
        if r.get("status") == "ok":
            speed[key] = throughput(r, default_batch)
        else:
            failed[key] = str(r.get("status"))
    ks: list[int | None] = [*sorted({k for _, k in [*speed, *failed] if k is not None})] or [None]
    batches = sorted({int(b) for by_batch in speed.values() for b in by_batch})
    cols = [(str(b), k) for b in batches for k in ks]
    header = ["configuration", *(f"b{b} k{k}" if k else f"b{b}" for b, k in cols)]
    cells = []
    for kind, label in SPEED_ROWS:
        if not any(kind == have for have, _ in [*speed, *failed]):
            continue
        line = [f"{kind} ({label})"]
        for b, k in cols:
            key = (kind, None if kind == NOSPEC_FULL else k)
            tok_s = speed.get(key, {}).get(b)
            base = speed.get(("full-noguard", k), {}).get(b)
            ratio = f" ({tok_s / base:.2f}x)" if tok_s and base and kind in _RATIO_KINDS else ""
            line.append(f"{tok_s:.0f}{ratio}" if tok_s else failed.get(key, "-"))
        cells.append(line)
    return header, cells
