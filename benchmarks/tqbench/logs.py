"""Reads a run's log: vLLM's JIT-monitor lines by phase, the plugin's own lines, the error.

With tp > 1 the model runs in worker processes the in-process hooks cannot see: the
kernel lists then come from vLLM's JIT-monitor log lines ("Triton kernel JIT
compilation during inference: NAME"), attributed to phases by the marker lines the
``run`` command prints before each request.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks.tqbench.recorder import is_tq_kernel

__all__ = [
    "ERROR_RES",
    "MARKER",
    "MARKER_RE",
    "MONITOR_RE",
    "PLUGIN_LOG_PREFIX",
    "apply_log",
    "last_error_line",
    "marker",
    "parse_monitor_log",
    "plugin_log_lines",
    "tail_lines",
]

MARKER = "[tq-bench]"
PLUGIN_LOG_PREFIX = "tq-warmup:"
MONITOR_RE = re.compile(r"Triton kernel JIT compilation during inference: (\S+?)(?:\s\(|\.\s|\.?$)")
MARKER_RE = re.compile(re.escape(MARKER) + r" (?:phase=(\S+) part=(\S+) begin|(startup done))")
ERROR_RES = (
    re.compile(r"^\s*[\w.]*(Error|Exception|Interrupt)\b:?"),  # a traceback's last line
    re.compile(r"CUDA error|ERROR|Fatal|Aborted|Segmentation fault|core dumped"),
)


def marker(text: str) -> None:
    """Print a marker line (stderr, flushed) that :func:`parse_monitor_log` attributes by."""
    print(f"{MARKER} {text}", file=sys.stderr, flush=True)


def parse_monitor_log(text: str) -> dict[str, list[str]]:
    """Kernel names from vLLM JIT-monitor lines, keyed by ``phase/part`` (or ``startup``).

    Attribution uses the marker lines the ``run`` command prints before each request
    (needs unbuffered output, which the ``matrix`` command arranges).
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


def plugin_log_lines(text: str) -> list[str]:
    """The plugin's ``tq-warmup:`` log lines (one per rank), from the message onwards."""
    lines = []
    for line in text.splitlines():
        idx = line.find(PLUGIN_LOG_PREFIX)
        if idx >= 0:
            lines.append(line[idx:].strip())
    return lines


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


def tail_lines(text: str, n: int = 25) -> str:
    """The last ``n`` lines of a log."""
    return "\n".join(text.rstrip().splitlines()[-n:])


def last_error_line(text: str) -> str | None:
    """The line of a child's log that best says why it failed: the last exception line
    (``RuntimeError: CUDA error: ...``), else the last ERROR / CUDA error / fatal line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for pattern in ERROR_RES:
        hit = next((ln for ln in reversed(lines) if pattern.search(ln)), None)
        if hit is not None:
            return hit[-500:]
    return None
