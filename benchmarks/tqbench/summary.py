"""Summarises raw runs into rows per series/release/configuration/variant/phase, and renders them.

A phase row holds, over the runs of its group, each run's ``first_s``, ``steady_s`` and
their ratio, the TurboQuant kernels compiled after startup (blank for ``auto``), and
the ratio of the ``auto`` baseline (vLLM's own KV cache) of the same series, release,
mode, geometry, tp and phase. A startup row holds each run's engine startup time and
the plugin's own times. Rows are plain JSON (``summary.json``); :func:`markdown`
renders them (``SUMMARY.md``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from benchmarks.tqbench import tables
from benchmarks.tqbench.phases import AUTO, PHASES
from benchmarks.tqbench.records import record_key

__all__ = [
    "GROUP_FIELDS",
    "PHASE_HEADER",
    "PHASE_ORDER",
    "STARTUP_HEADER",
    "group_of",
    "keep_previous",
    "markdown",
    "median",
    "sort_rows",
    "span",
    "summarize",
    "variant_of",
]

GROUP_FIELDS = ("series", "release", "gpu", "preset", "mode", "geometry", "tp", "variant")
PHASE_ORDER = {p: i for i, p in enumerate(("startup", *PHASES))}


def variant_of(r: dict[str, Any]) -> str:
    """``on-cold``, ``off-cold``, ``on-warm``; ``+ prewarm X`` for the retired experiment."""
    text = f"{r.get('plugin')}-{r.get('triton_cache')}"
    prewarm = r.get("prewarm")
    return f"{text} + prewarm {','.join(sorted(prewarm))}" if prewarm else text


def group_of(r: dict[str, Any]) -> dict[str, Any]:
    """The group fields of a record."""
    return {
        "series": r.get("series") or "",
        "release": r.get("vllm_version") or "unknown",
        "gpu": r.get("gpu") or "unknown-gpu",
        "preset": tables.short_preset(r.get("kv_cache_dtype")),
        "mode": r.get("mode"),
        "geometry": tables.geometry_label(r),
        "tp": r.get("tp"),
        "variant": variant_of(r),
    }


def _nums(records: Iterable[dict[str, Any]], get: Callable[[dict[str, Any]], Any]) -> list[float]:
    return [round(float(v), 4) for v in map(get, records) if isinstance(v, (int, float))]


def _phase_row(group: dict[str, Any], phase: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if r.get("status") == "ok"]
    is_auto = group["preset"] == AUTO
    compiled = sorted({k for r in runs for k in r.get("tq_compiles_after_startup") or []})
    errors = {str(r.get("error") or r.get("first_error") or "").strip() for r in runs}
    return {
        **group,
        "phase": phase,
        "runs": len(runs),
        "ok": len(ok),
        "run_ids": sorted({str(r.get("run_id")) for r in runs}),
        "first_s": _nums(ok, lambda r: r.get("first_s")),
        "steady_s": _nums(ok, lambda r: r.get("steady_s")),
        "ratio": sorted(round(x, 2) for x in _nums(ok, tables.ratio_of)),
        "tq_compiles_after_startup": None if is_auto else compiled,
        "errors": sorted(e.splitlines()[0][:300] for e in errors if e),
        "auto_ratio": None,
        "over_auto_median": None,
    }


def _startup_row(group: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    reports = [r.get("plugin_report") or {} for r in runs]
    return {
        **group,
        "runs": len(runs),
        "startup_s": _nums(runs, lambda r: r.get("startup_s")),
        "warmup_s": _nums(runs, lambda r: r.get("warmup_s")),
        "launch_s": _nums(runs, lambda r: r.get("launch_s")),
        "plugin_status": sorted({str(rep.get("status", "-")) for rep in reports}),
    }


def _key(row: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(str(row.get(f)) for f in GROUP_FIELDS)


def _baseline_key(row: dict[str, Any], variant: str) -> tuple[Any, ...]:
    fields = ("series", "release", "mode", "geometry", "tp", "phase")
    return (*(row[f] for f in fields), variant)


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """``{"phases": [...], "startup": [...]}`` rows of the records (one record per run+phase)."""
    by_phase: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    by_run: dict[tuple[Any, ...], dict[tuple[Any, ...], dict[str, Any]]] = {}
    for r in records:
        group = group_of(r)
        gkey = tuple(group.items())
        by_phase.setdefault((*gkey, r.get("phase")), []).append(r)
        # One startup entry per run (its records share the run-level fields).
        run = record_key(r)[1:-1]  # run id, config, plugin, cache, repeat
        by_run.setdefault(gkey, {}).setdefault(run, r)
    phase_rows = [_phase_row(dict(k[:-1]), str(k[-1]), v) for k, v in by_phase.items()]
    auto = {_baseline_key(row, row["variant"]): row for row in phase_rows if row["preset"] == AUTO}
    for row in phase_rows:
        # The auto run in the same Triton-cache state (warm beside warm), else its cold run.
        cache = "warm" if row["variant"].endswith("-warm") else "cold"
        base = auto.get(_baseline_key(row, f"on-{cache}")) or auto.get(
            _baseline_key(row, "on-cold")
        )
        if base is not None and row["preset"] != AUTO:
            row["auto_ratio"] = base["ratio"]
            mine, theirs = median(row["ratio"]), median(base["ratio"])
            if mine is not None and theirs is not None:
                row["over_auto_median"] = round(mine - theirs, 2)
    startup_rows = [_startup_row(dict(k), list(v.values())) for k, v in by_run.items()]
    return {"phases": sort_rows(phase_rows), "startup": sort_rows(startup_rows)}


def sort_rows(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Series by release and name; inside, configuration, plugin on first, then phase order."""
    return sorted(
        rows,
        key=lambda r: (
            str(r.get("release")),
            str(r.get("series")),
            str(r.get("preset")) != AUTO,
            str(r.get("preset")),
            str(r.get("mode")),
            str(r.get("geometry")),
            str(r.get("tp")),
            not str(r.get("variant")).startswith("on"),
            str(r.get("variant")),
            PHASE_ORDER.get(str(r.get("phase", "startup")), 99),
        ),
    )


def keep_previous(
    previous: Sequence[dict[str, Any]], new: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """``new`` plus the ``previous`` rows of every (series, release) ``new`` does not have."""
    fresh = {(r.get("series"), r.get("release")) for r in new}
    kept = [r for r in previous if (r.get("series"), r.get("release")) not in fresh]
    return sort_rows([*kept, *new])


def median(values: Sequence[float] | None) -> float | None:
    """The median of the values, None for none: the number a comparison of noisy single
    requests can rest on (one request's first/steady ratio moves by about 0.3 between runs)."""
    return round(statistics.median(values), 2) if values else None


def span(values: Sequence[float] | None, fmt: str) -> str:
    """``1.0-1.2`` (min-max) of the values, one value alone, ``-`` for none."""
    if not values:
        return "-"
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _compiles(row: dict[str, Any]) -> str:
    kernels = row.get("tq_compiles_after_startup")
    if kernels is None:
        return ""
    return ", ".join(kernels) if kernels else "0"


def _status(row: dict[str, Any]) -> str:
    runs, ok = int(row.get("runs", 0)), int(row.get("ok", 0))
    return "ok" if runs == ok else f"{runs - ok}/{runs} failed"


PHASE_HEADER: tuple[str, ...] = (
    *("preset", "mode", "geom", "tp", "variant", "phase", "runs", "status", "first_s"),
    *("steady_s", "first/steady", "median", "auto first/steady", "over auto (medians)"),
    "TurboQuant compiles after startup",
)
STARTUP_HEADER: tuple[str, ...] = (
    *("preset", "mode", "geom", "tp", "variant", "runs", "startup_s", "warmup_s"),
    *("launch_s", "plugin status"),
)


def _config_cells(row: dict[str, Any]) -> list[str]:
    keys = ("preset", "mode", "geometry", "tp", "variant")
    return [str(row.get(k)) for k in keys]


def markdown(summary: dict[str, list[dict[str, Any]]]) -> str:
    """``SUMMARY.md``: per (release, series), the phase table and the startup table."""
    out = [
        "# First-request benchmark: summary",
        "",
        "Generated by `python -m benchmarks.tqbench collect` from the raw runs (git-ignored,",
        "`benchmarks/results/raw/`) and the rows of `summary.json` whose series has no raw run",
        "here; do not edit. `first/steady`: first request / next request of the same shape,",
        "min-max over the runs, and its median; `auto first/steady`: the same phase with",
        "vLLM's own KV cache (`--kv-cache-dtype auto`) in the same series; `over auto`: the",
        "median ratio minus auto's median ratio; compiles: TurboQuant kernels Triton",
        "compiled after startup (blank for `auto`). Variant: plugin on/off, Triton cache",
        "cold/warm. Per-run values, run ids and errors are in `summary.json`.",
    ]
    sections: dict[tuple[str, str, str], dict[str, list[list[str]]]] = {}
    for row in summary.get("phases", []):
        sec = sections.setdefault((row["release"], row["series"], row["gpu"]), {})
        sec.setdefault("phases", []).append(
            [
                *_config_cells(row),
                str(row.get("phase")),
                str(row.get("runs")),
                _status(row),
                span(row.get("first_s"), "{:.3f}"),
                span(row.get("steady_s"), "{:.3f}"),
                span(row.get("ratio"), "{:.1f}"),
                _num(median(row.get("ratio")), "{:.2f}"),
                span(row.get("auto_ratio"), "{:.1f}"),
                _num(row.get("over_auto_median"), "{:+.2f}"),
                _compiles(row),
            ]
        )
    for row in summary.get("startup", []):
        sec = sections.setdefault((row["release"], row["series"], row["gpu"]), {})
        sec.setdefault("startup", []).append(
            [
                *_config_cells(row),
                str(row.get("runs")),
                span(row.get("startup_s"), "{:.1f}"),
                span(row.get("warmup_s"), "{:.2f}"),
                span(row.get("launch_s"), "{:.2f}"),
                ", ".join(row.get("plugin_status") or []),
            ]
        )
    for (release, series, gpu), sec in sections.items():
        out += ["", f"## vLLM {release}: {series}", "", f"{gpu}.", ""]
        out.append(tables.render_markdown(PHASE_HEADER, sec.get("phases", [])))
        out += ["", tables.render_markdown(STARTUP_HEADER, sec.get("startup", []))]
    return "\n".join(out) + "\n"
