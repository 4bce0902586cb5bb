"""Text and Markdown tables: the per-phase and startup tables a run or matrix prints."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks.tqbench.phases import PHASES

__all__ = [
    "CONFIG_COLUMNS",
    "PHASE_COLUMNS",
    "STARTUP_COLUMNS",
    "fmt_s",
    "format_startup_table",
    "format_table",
    "geometry_label",
    "kernel_summary",
    "print_tables",
    "ratio_of",
    "render",
    "render_markdown",
    "short_preset",
]

CONFIG_COLUMNS = ("preset", "mode", "geom", "tp", "plugin", "cache")
PHASE_COLUMNS: tuple[str, ...] = (
    *("phase", "status", "first_s", "steady_s", "ratio"),
    "tq jit after startup (c=compiled, l=disk load)",
)
STARTUP_COLUMNS: tuple[str, ...] = (
    *("startup_s", "warmup_s", "launch_s", "plugin status", "compiled/loaded"),
    "failed phases",
)


def render(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table: columns padded to their widest cell, a dashed rule under the header."""
    widths = [len(h) for h in header]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines.extend(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )
    return "\n".join(lines)


def render_markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub Markdown table (``|`` in a cell is escaped)."""

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(header), line(["---"] * len(header)), *(line(r) for r in rows)])


def fmt_s(x: Any) -> str:
    """Seconds with three decimals; anything else ``-``."""
    return f"{x:.3f}" if isinstance(x, (int, float)) else "-"


def short_preset(preset: Any) -> str:
    """``turboquant_4bit_nc`` -> ``4bit_nc``."""
    return str(preset).removeprefix("turboquant_")


def geometry_label(r: dict[str, Any]) -> str:
    """``HEADSIZExQHEADSxKVHEADS`` of a record."""
    return f"{r.get('head_size')}x{r.get('q_heads')}x{r.get('kv_heads')}"


def ratio_of(r: dict[str, Any]) -> float | None:
    """``first_s / steady_s`` of a record, or None when either is missing."""
    first, steady = r.get("first_s"), r.get("steady_s")
    if isinstance(first, (int, float)) and isinstance(steady, (int, float)) and steady:
        return float(first) / float(steady)
    return None


def kernel_summary(rec: dict[str, Any]) -> str:
    """``2c+1l _tq_decode_stage1,...``: TurboQuant kernels compiled (c) / loaded (l)."""
    compiled = rec.get("tq_compiles_after_startup") or []
    loaded = rec.get("tq_loads_after_startup") or []
    if not compiled and not loaded:
        return "-"
    parts = [n.removeprefix("_") for n in sorted(set(compiled))]
    text = f"{len(compiled)}c"
    if loaded:
        text += f"+{len(loaded)}l"
    return f"{text} {','.join(parts)}" if parts else text


def _config_cells(r: dict[str, Any]) -> tuple[str, ...]:
    """The cells under ``CONFIG_COLUMNS`` that say which run a row belongs to."""
    return (
        short_preset(r.get("kv_cache_dtype")),
        str(r.get("mode")),
        geometry_label(r),
        str(r.get("tp")),
        str(r.get("plugin")),
        str(r.get("triton_cache")),
    )


def format_table(records: Sequence[dict[str, Any]]) -> str:
    """One row per (config, variant, phase): first_s, steady_s, ratio, TQ compiles."""
    header = (*CONFIG_COLUMNS, *PHASE_COLUMNS)
    order = {p: i for i, p in enumerate(("startup", *PHASES))}
    rows = []
    for r in sorted(
        records,
        key=lambda r: (
            str(r.get("config_id")),
            str(r.get("plugin")) != "on",
            str(r.get("triton_cache")),
            order.get(str(r.get("phase")), 99),
        ),
    ):
        ratio = ratio_of(r)
        rows.append(
            (
                *_config_cells(r),
                str(r.get("phase")),
                str(r.get("status")),
                fmt_s(r.get("first_s")),
                fmt_s(r.get("steady_s")),
                "-" if ratio is None else f"{ratio:.1f}x",
                kernel_summary(r),
            )
        )
    return render(header, rows)


def format_startup_table(records: Sequence[dict[str, Any]]) -> str:
    """One row per (config, variant): engine startup time and the plugin's own time."""
    header = (*CONFIG_COLUMNS, *STARTUP_COLUMNS)
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
                fmt_s(r.get("startup_s")),
                fmt_s(r.get("warmup_s")),
                fmt_s(rep.get("launch_s")),
                str(rep.get("status", "-")),
                f"{rep.get('compiled', '-')}/{rep.get('loaded', '-')}",
                str(failed[k]),
            )
        )
    return render(header, rows)


def print_tables(records: Sequence[dict[str, Any]]) -> None:
    """The per-phase table, a blank line, the startup table."""
    print(format_table(records))
    print()
    print(format_startup_table(records))
