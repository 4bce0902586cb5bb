"""The ``register-cost`` command: what ``register()`` costs a vLLM process, in fresh interpreters.

vLLM calls every general plugin's entry function in each process it starts, so the
function must stay cheap. Each sample is a new interpreter that first imports
``vllm.plugins`` (what is loaded when vLLM calls plugins), then times
``import tq_warmup_plugin; register()`` and a second ``register()`` call.

    CUDA_VISIBLE_DEVICES="" python -m benchmarks.tqbench register-cost [--samples 15]

Prints a table and writes JSON (default ``benchmarks/results/raw/register-cost.json``,
git-ignored: a documented run never changes the committed summary unless ``--out`` names it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.tqbench.children import Children
from benchmarks.tqbench.cli import new_parser
from benchmarks.tqbench.matrix import DEFAULT_RESULTS_DIR

__all__ = ["add_parser", "cmd_register_cost", "sample", "write_summary"]

_PROBE = """
import json, sys, time
import vllm.plugins
before = set(sys.modules)
t0 = time.perf_counter()
import tq_warmup_plugin
tq_warmup_plugin.register()
t1 = time.perf_counter()
tq_warmup_plugin.register()
t2 = time.perf_counter()
heavy = sorted(m for m in set(sys.modules) - before if m.split(".")[0] in ("torch", "triton"))
print(json.dumps({"first_ms": 1e3 * (t1 - t0), "again_us": 1e6 * (t2 - t1), "heavy": heavy,
                  "module": tq_warmup_plugin.__file__}))
"""


def sample(probe: str = _PROBE, *argv: str) -> dict[str, Any]:
    """One fresh interpreter's measurement: the JSON last line of ``probe``'s output."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "")}
    out = Children().capture([sys.executable, "-c", probe, *argv], env, 600).check()
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def cmd_register_cost(args: argparse.Namespace) -> int:
    """Take the samples, print the table, write the JSON summary."""
    runs = [sample() for _ in range(args.samples)]
    first = [float(r["first_ms"]) for r in runs]
    again = [float(r["again_us"]) for r in runs]
    from importlib.metadata import version

    heavy = sorted({str(m) for r in runs for m in r["heavy"]})
    summary = {
        "vllm": version("vllm"),
        "python": sys.version.split()[0],
        "samples": args.samples,
        # An editable install resolves through setuptools' finder and costs ~2 ms more.
        "module": runs[0]["module"],
        "first_call_ms_median": statistics.median(first),
        "first_call_ms_max": max(first),
        "repeat_call_us_median": statistics.median(again),
        "heavy_modules_imported": heavy,
    }
    print(f"{'measure':<28}{'value':>12}")
    print(f"{'first register(), median':<28}{statistics.median(first):>10.2f} ms")
    print(f"{'first register(), max':<28}{max(first):>10.2f} ms")
    print(f"{'repeat register(), median':<28}{statistics.median(again):>10.1f} us")
    print(f"{'torch/triton imported':<28}{len(heavy):>12}")
    write_summary(args.out, summary)
    return 0


def write_summary(path: str, summary: dict[str, Any]) -> None:
    """The JSON summary a cost command leaves under ``benchmarks/results``."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")


def add_parser(subparsers: Any) -> None:
    """The ``register-cost`` subcommand."""
    summary_line = "what register() costs a process that imported vllm.plugins (CPU is enough)"
    p = new_parser(subparsers, "register-cost", summary_line, __doc__)
    p.add_argument("--samples", type=int, default=15)
    p.add_argument(
        "--out",
        default=str(DEFAULT_RESULTS_DIR / "raw" / "register-cost.json"),
        help="the JSON summary (default under benchmarks/results/raw/, git-ignored; the "
        "committed benchmarks/results/register-cost.json is written only when named here)",
    )
    p.set_defaults(func=cmd_register_cost)
