"""The ``collect`` command: file raw runs and regenerate ``SUMMARY.md`` / ``summary.json``.

``collect FILE... --series NAME`` files ``run --out`` files (a sibling ``X.log`` is read
too) as raw runs labelled NAME; ``--legacy FILE`` files the records of a results file of
the old single-script benchmark (one JSON list; their series are inside). Then every raw
run under ``<results-dir>/raw/`` is summarised; rows of the previous ``summary.json``
whose (series, release) no raw run has are kept, so the committed summary outlives the
git-ignored raw runs.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.tqbench import logs, records, summary
from benchmarks.tqbench.cli import new_parser
from benchmarks.tqbench.matrix import DEFAULT_RESULTS_DIR

__all__ = [
    "SUMMARY_JSON",
    "SUMMARY_MD",
    "add_parser",
    "cmd_collect",
    "file_runs",
    "load_raw",
    "load_summary",
    "regenerate",
]

SUMMARY_MD = "SUMMARY.md"
SUMMARY_JSON = "summary.json"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")[:80] or "unnamed"


def file_runs(raw_dir: Path, recs: Sequence[dict[str, Any]], folder: str = "") -> int:
    """Write the records as raw runs (one file per run) under ``raw_dir``; how many runs."""
    runs = records.group_runs(recs)
    for run in runs:
        first = run[0]
        where = [_slug(str(first.get(k))) for k in ("series", "run_id")]
        path = raw_dir.joinpath(folder, *where, records.run_file_name(first))
        records.write_records(path, run)
    return len(runs)


def load_raw(raw_dir: Path) -> list[dict[str, Any]]:
    """Every record of every raw run under ``raw_dir`` (a later duplicate replaces one)."""
    merged: list[dict[str, Any]] = []
    for path in sorted(raw_dir.rglob(f"*{records.RAW_SUFFIX}")):
        merged = records.merge_records(merged, records.read_records(path))
    return merged


def load_summary(path: Path) -> dict[str, list[dict[str, Any]]]:
    """The rows of a ``summary.json`` (none if it is missing)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: list(data.get(k, [])) for k in ("phases", "startup")}


def regenerate(results_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Summarise the raw runs, keep the previous rows they do not replace, write both files
    (``summary.json``: one row a line, so a diff shows which rows changed)."""
    new = summary.summarize(load_raw(results_dir / "raw"))
    old = load_summary(results_dir / SUMMARY_JSON)
    merged = {k: summary.keep_previous(old.get(k, []), new[k]) for k in ("phases", "startup")}
    lines = [
        f'"{name}": [\n' + ",\n".join(json.dumps(r, sort_keys=True) for r in rows) + "\n]"
        for name, rows in merged.items()
    ]
    records.write_text_atomic(results_dir / SUMMARY_JSON, "{\n" + ",\n".join(lines) + "\n}\n")
    (results_dir / SUMMARY_MD).write_text(summary.markdown(merged))
    return merged


def cmd_collect(args: argparse.Namespace) -> int:
    """File the given runs, then regenerate the summary."""
    results_dir = Path(args.results_dir)
    raw_dir = results_dir / "raw"
    if args.files and not args.series:
        print("collect FILE... needs --series NAME", file=sys.stderr)
        return 2
    for name in args.files:
        path = Path(name)
        recs = records.read_records(path)
        log = path.with_suffix(".log")
        if log.is_file():
            logs.apply_log(recs, log.read_text(errors="replace"))
        for r in recs:
            r["series"] = args.series
        print(f"{path}: {file_runs(raw_dir, recs)} run(s), {len(recs)} records")
    for name in args.legacy:
        recs = records.read_legacy(Path(name))
        n = file_runs(raw_dir, recs, folder=f"legacy/{_slug(Path(name).stem)}")
        print(f"{name}: {n} run(s), {len(recs)} records")
    merged = regenerate(results_dir)
    if not merged["phases"]:
        print("no records", file=sys.stderr)
        return 1
    n_series = len({(r["series"], r["release"]) for r in merged["phases"]})
    print(
        f"{len(merged['phases'])} phase rows of {n_series} series -> "
        f"{results_dir / SUMMARY_MD}, {results_dir / SUMMARY_JSON}"
    )
    return 0


def add_parser(subparsers: Any) -> None:
    """The ``collect`` subcommand."""
    summary_line = "file run outputs as raw runs and regenerate SUMMARY.md / summary.json"
    c = new_parser(subparsers, "collect", summary_line, __doc__)
    c.add_argument("files", nargs="*", help="raw run files of `run --out` (a sibling .log too)")
    c.add_argument("--series", default="", help="label for FILEs' records (which code/machine)")
    c.add_argument(
        "--legacy",
        action="append",
        default=[],
        metavar="FILE",
        help="a JSON-list results file of the old benchmark script (repeatable)",
    )
    c.add_argument("--results-dir", default=str(DEFAULT_RESULTS_DIR))
    c.set_defaults(func=cmd_collect)
