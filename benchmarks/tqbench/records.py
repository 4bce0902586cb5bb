"""Raw run files: record keys, merging, and atomic JSON / JSON Lines writes.

A record is one phase of one run (a flat dict). A raw run file is JSON Lines: a first
line ``{"run": {...}}`` with the fields every record of the run shares, stored once,
then one line per record with the rest (:func:`write_run`, :func:`read_run`).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.tqbench.phases import PHASES

__all__ = [
    "PHASE_KEYS",
    "RAW_SUFFIX",
    "fill_missing_phases",
    "group_runs",
    "join_run",
    "merge_records",
    "read_legacy",
    "read_records",
    "read_run",
    "record_key",
    "run_file_name",
    "run_level_fields",
    "split_records",
    "write_json_atomic",
    "write_records",
    "write_run",
    "write_text_atomic",
]

RAW_SUFFIX = ".jsonl"

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
        "monitor_log_kernels",
        "phase_warning",
        "profile_top_extra",
        "profile_slow_leaves",
    }
)


def run_level_fields(rec: dict[str, Any]) -> dict[str, Any]:
    """A record without its phase fields (what all phases of one run share)."""
    return {k: v for k, v in rec.items() if k not in PHASE_KEYS}


def record_key(rec: dict[str, Any]) -> tuple[Any, ...]:
    """Identity of a record among all runs."""
    return (
        rec.get("series"),
        rec.get("run_id"),
        rec.get("config_id"),
        rec.get("plugin"),
        rec.get("triton_cache"),
        rec.get("repeat") or 0,
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


def split_records(records: Sequence[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(fields all records share, outside :data:`PHASE_KEYS`; each record's other fields)."""
    if not records:
        return {}, []
    run = run_level_fields(records[0])
    for r in records[1:]:
        run = {k: v for k, v in run.items() if k in r and r[k] == v}
    return run, [{k: v for k, v in r.items() if k not in run} for r in records]


def join_run(run: dict[str, Any], rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The flat records of a run: its shared fields, then each row's own."""
    return [{**run, **r} for r in rows]


def _json_text(data: Any, indent: int | None) -> str:
    return json.dumps(data, indent=indent, sort_keys=True, default=str)


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` through a temporary file in the same folder and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON through a temporary file and a rename."""
    write_text_atomic(path, _json_text(data, 1) + "\n")


def write_run(path: Path, run: dict[str, Any], rows: Sequence[dict[str, Any]]) -> None:
    """Write one raw run (JSON Lines: ``{"run": run}``, then one line per row), atomically."""
    lines = [_json_text({"run": run}, None), *(_json_text(r, None) for r in rows)]
    write_text_atomic(path, "\n".join(lines) + "\n")


def write_records(path: Path, records: Sequence[dict[str, Any]]) -> None:
    """Write flat records as a raw run, their shared fields stored once."""
    write_run(path, *split_records(records))


def read_run(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A raw run file's run-level fields and rows (see :func:`write_run`)."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not lines or not isinstance(lines[0], dict) or not isinstance(lines[0].get("run"), dict):
        raise ValueError(f"{path}: not a raw run file (no leading {{'run': ...}} line)")
    return lines[0]["run"], [r for r in lines[1:] if isinstance(r, dict)]


def read_records(path: Path) -> list[dict[str, Any]]:
    """The flat records of a raw run file; missing or unreadable: none."""
    try:
        return join_run(*read_run(path))
    except (OSError, ValueError):
        return []


def read_legacy(path: Path) -> list[dict[str, Any]]:
    """Records of a results file of the single-script benchmark (one JSON list)."""
    data = json.loads(path.read_text())
    return [r for r in data if isinstance(r, dict)] if isinstance(data, list) else []


def group_runs(records: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Records grouped by run (every key of :func:`record_key` but the phase), in order."""
    runs: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in records:
        runs.setdefault(record_key(r)[:-1], []).append(r)
    return list(runs.values())


def run_file_name(rec: dict[str, Any]) -> str:
    """``<config id>.<plugin>-<cache>[.r<repeat>]<suffix>``: one run's file in its run-id
    folder (a warm run made again, ``matrix --repeats``, gets its repeat number)."""
    again = f".r{rec['repeat']}" if rec.get("repeat") else ""
    name = f"{rec.get('config_id')}.{rec.get('plugin')}-{rec.get('triton_cache')}"
    return f"{name}{again}{RAW_SUFFIX}"
