"""The ``gemm-shapes`` command: what a cuBLAS GEMM's first call at a new shape costs.

TurboQuant runs fp32 GEMMs outside CUDA graphs at shapes that follow each step: the key
rotation of the store (``tokens x KV heads`` rows, every step's token count) and the query
rotation of decode and short continuations (``n x query heads`` rows). On the H200 (vLLM
0.26.0, CUDA graphs, warm caches) the first short-tail request spent +5.9 ms in
``aten::mm`` over the next one. Whether that is paid per exact shape (heuristics) or per
kernel (CUDA's lazy module loading, shared by a size class) decides how many shapes a
warmup must launch; this measures it without vLLM.

In one fresh process (``--warm`` first launches a set of shapes, as the plugin would), for
each ``rows`` in ``--rows``: the first call's and the second call's wall time of
``(rows x cols) @ (cols x cols)`` in ``--dtype``, synchronised. Prints a table and writes
JSON: ``first_ms``, ``second_ms`` and their difference per shape, and the totals.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from benchmarks.tqbench import records, tables
from benchmarks.tqbench.cli import Option, add_options, new_parser

__all__ = ["add_parser", "parse_rows", "summary_markdown", "time_shapes"]

SLOW_MS = 0.5  # a first call this much over the second: a kernel's module was loaded


def parse_rows(text: str) -> list[int]:
    """``"8,16,100-104,1024"``: numbers and inclusive ranges, in order, without repeats."""
    out: list[int] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi or lo)
        if first < 1 or last < first:
            raise ValueError(f"bad rows {part!r}: need 1 <= first <= last")
        out.extend(r for r in range(first, last + 1) if r not in out)
    return out


def time_shapes(
    rows: list[int], cols: int, dtype: str, device: str, warm: list[int]
) -> list[dict[str, Any]]:
    """First and second call per shape, after launching ``warm`` once each."""
    import torch

    dt = getattr(torch, dtype)
    top = max([*rows, *warm])
    a = torch.zeros(top, cols, dtype=dt, device=device)
    b = torch.zeros(cols, cols, dtype=dt, device=device)

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    for r in warm:
        a[:r] @ b
    sync()
    out = []
    for r in rows:
        times = []
        for _ in range(2):
            t = time.perf_counter()
            a[:r] @ b
            sync()
            times.append((time.perf_counter() - t) * 1000)
        out.append(
            {
                "rows": r,
                "first_ms": round(times[0], 4),
                "second_ms": round(times[1], 4),
                "extra_ms": round(times[0] - times[1], 4),
            }
        )
    return out


def _span(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({text.count(',') + 1} items)"


def summary_markdown(runs: dict[str, dict[str, Any]]) -> str:
    """One row per run file: what was launched first, and what the timed shapes' first
    calls paid over their second (in all, the median, and the shapes over ``SLOW_MS``)."""
    header = ("run", "device", "dtype", "warm", "shapes", "extra ms", "median ms", "slow", "worst")
    rows = []
    for name, doc in sorted(runs.items()):
        shapes = doc["shapes"]
        extra = sorted(r["extra_ms"] for r in shapes)
        slow = [r for r in shapes if r["extra_ms"] > SLOW_MS]
        worst = max(shapes, key=lambda r: r["extra_ms"])
        rows.append(
            [
                name,
                f"{doc['device']} (torch {doc['torch']})",
                doc["dtype"],
                _span(doc["warm"] or "-"),
                str(len(shapes)),
                f"{doc['extra_ms']:.1f}",
                f"{extra[len(extra) // 2]:.3f}",
                str(len(slow)),
                f"{worst['rows']} rows +{worst['extra_ms']:.2f} ms",
            ]
        )
    return tables.render_markdown(header, rows) + "\n"


def cmd_summarize(folder: Path) -> int:
    """``--summarize``: ``SUMMARY.md`` of every run file in ``folder``."""
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}
    if not runs:
        raise SystemExit(f"gemm-shapes: --summarize {folder}: no run files (*.json)")
    text = summary_markdown(runs)
    records.write_text_atomic(folder / "SUMMARY.md", text)
    print(text, end="")
    return 0


def cmd_gemm_shapes(args: argparse.Namespace) -> int:
    if args.summarize:
        return cmd_summarize(Path(args.summarize))
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rows, warm = parse_rows(args.rows), parse_rows(args.warm) if args.warm else []
    result = time_shapes(rows, args.cols, args.dtype, device, warm)
    header = ("rows", "first_ms", "second_ms", "extra_ms")
    print(tables.render(header, [[str(r[h]) for h in header] for r in result]))
    extra = sum(r["extra_ms"] for r in result)
    print(f"{len(result)} shapes, first calls +{extra:.1f} ms in all over second calls ({device})")
    if args.out:
        doc = {
            "device": device if device == "cpu" else torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            **{k: getattr(args, k) for k in ("rows", "warm", "cols", "dtype")},
            "shapes": result,
            "extra_ms": round(extra, 3),
        }
        records.write_json_atomic(Path(args.out), doc)
    return 0


GEMM_OPTIONS: tuple[Option, ...] = (
    ("--rows", "8-1024", "rows to time: numbers and ranges, e.g. 8,100-120,4096"),
    ("--warm", "", "rows launched once before timing (the warmup's plan), same syntax"),
    ("--cols", 128, "inner size (the head size)"),
    ("--dtype", "float32", "torch dtype"),
    ("--device", "", "default: cuda when available"),
    ("--out", "", "JSON file"),
    ("--summarize", "", "a folder of run files: write its SUMMARY.md; runs nothing"),
)


def add_parser(subparsers: Any) -> None:
    """The ``gemm-shapes`` subcommand."""
    p = new_parser(subparsers, "gemm-shapes", "first-call cost of GEMMs by shape", __doc__)
    add_options(p, GEMM_OPTIONS)
    p.set_defaults(func=cmd_gemm_shapes)
