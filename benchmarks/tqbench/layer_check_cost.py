"""The ``layer-check-cost`` command: what the shipped cache's startup check costs a process.

The layered cache checks a layer's manifests against the running stack on the first
lookup of each process (every vLLM worker), and a key directory's files on the first
lookup of that key, which also copies them into the process's private directory (what
is served is what was hashed: ``layer_trust``); a later lookup is a dictionary hit.
Each sample is a new interpreter with Triton's compile-only sm90
driver, that first computes ``triton_key()`` (Triton computes it before any cache
lookup, so a worker's check finds it cached), then times the manifest check of
``--cache-dir`` and the file check of every key directory it lists.

    CUDA_VISIBLE_DEVICES="" python -m benchmarks.tqbench layer-check-cost --cache-dir D

Prints a table and writes JSON (default ``benchmarks/results/raw/layer-check-cost.json``,
git-ignored: a documented run never changes the committed summary unless ``--out`` names it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.tqbench.cli import new_parser
from benchmarks.tqbench.matrix import DEFAULT_RESULTS_DIR
from benchmarks.tqbench.register_cost import sample, write_summary

__all__ = ["add_parser", "cmd_layer_check_cost"]

_PROBE = """
import json, sys, time
from pathlib import Path
from triton.runtime.cache import triton_key
from tq_warmup_plugin.shipped import trust as layer_trust, layered_cache
from tq_warmup_plugin.shipped.precompile import use_compile_only_target
triton_key()
use_compile_only_target(90)
root = sys.argv[1]
t0 = time.perf_counter()
trust = layer_trust.layer_trust(root)
assert trust is not None  # the compile-only driver is up
t1 = time.perf_counter()
keys = sorted(trust.listed or {})
first = []
for key in keys:
    start = time.perf_counter()
    assert trust.serves(key), key
    first.append(time.perf_counter() - start)
t2 = time.perf_counter()
files = [p for key in keys for p in Path(root, key).iterdir()]
later = [layered_cache._Layer(root, key) for key in keys for _ in range(100)]
t3 = time.perf_counter()
for layer in later:
    assert layer.get_file(Path(next(iter(trust.listed[layer.key][0][1]))).name)
t4 = time.perf_counter()
print(json.dumps({"manifests_ms": 1e3 * (t1 - t0), "keys": len(keys), "files": len(files),
                  "bytes": sum(p.stat().st_size for p in files),
                  "key_ms_median": 1e3 * sorted(first)[len(first) // 2] if first else 0.0,
                  "all_keys_ms": 1e3 * (t2 - t1),
                  "later_lookup_us": 1e6 * (t4 - t3) / max(len(later), 1)}))
"""


def cmd_layer_check_cost(args: argparse.Namespace) -> int:
    """Take the samples, print the table, write the JSON summary."""
    runs = [sample(_PROBE, args.cache_dir) for _ in range(args.samples)]
    manifests = len(list(Path(args.cache_dir).glob("tq-warmup-manifest-*.json")))
    from importlib.metadata import version

    summary: dict[str, Any] = {
        "vllm": version("vllm"),
        "triton": version("triton"),
        "python": sys.version.split()[0],
        "samples": args.samples,
        "manifests": manifests,
        "keys": runs[0]["keys"],
        "files": runs[0]["files"],
        "bytes": runs[0]["bytes"],
    }
    for name in ("manifests_ms", "key_ms_median", "all_keys_ms", "later_lookup_us"):
        summary[f"{name}_median"] = statistics.median(float(r[name]) for r in runs)
        summary[f"{name}_max"] = max(float(r[name]) for r in runs)
    print(
        f"{manifests} manifests, {summary['keys']} key directories, {summary['files']} files, "
        f"{summary['bytes'] / 2**20:.1f} MiB; {args.samples} processes"
    )
    print(f"{'measure':<44}{'median':>10}{'max':>10}")
    rows = [
        ("manifests read and stack checked", "manifests_ms", "ms"),
        ("one key dir hashed, copied (first lookup)", "key_ms_median", "ms"),
        ("every key dir hashed, copied", "all_keys_ms", "ms"),
        ("a later lookup of a served file", "later_lookup_us", "us"),
    ]
    for text, name, unit in rows:
        med, top = summary[f"{name}_median"], summary[f"{name}_max"]
        print(f"{text:<44}{med:>8.2f}{unit}{top:>8.2f}{unit}")
    write_summary(args.out, summary)
    return 0


def add_parser(subparsers: Any) -> None:
    """The ``layer-check-cost`` subcommand."""
    summary_line = "what the shipped cache's startup check costs a process (CPU is enough)"
    p = new_parser(subparsers, "layer-check-cost", summary_line, __doc__)
    p.add_argument("--cache-dir", required=True, help="a directory tq-warmup precompile built")
    p.add_argument("--samples", type=int, default=10)
    p.add_argument(
        "--out",
        default=str(DEFAULT_RESULTS_DIR / "raw" / "layer-check-cost.json"),
        help="the JSON summary (default under benchmarks/results/raw/, git-ignored; the "
        "committed benchmarks/results/layer-check-cost.json is written only when named here)",
    )
    p.set_defaults(func=cmd_layer_check_cost)
