"""The ``shipped`` command: serve from a Triton cache built elsewhere, mounted read-only.

The proof the layered cache and its manifest (issue 13) are asked for: a layer built by
``tq-warmup precompile`` on a CPU machine is mounted read-only, and for each preset

``ref``
    an engine with a fresh Triton cache and no layer: its greedy tokens are the reference;
``shipped``
    an engine with ``TRITON_CACHE_MANAGER`` = the layered cache over the read-only layer and
    a fresh writable ``TRITON_CACHE_DIR``: the plugin's report (compiled / from the shipped
    cache / from Triton's disk cache), the TurboQuant compiles after startup (0 expected),
    the warmup time, and whether its tokens equal ``ref``'s.

For ``--corrupt PRESET``, one file of that preset's decode kernel (the ``.cubin`` of the
first ``_tq_decode_stage1`` key directory its ``ref`` engine compiled: the same key
directory as in the layer) is changed in a read-only copy of the layer, then

``corrupt``
    the layered cache over that copy: the WARNING naming the file is expected, the kernel
    compiled into the writable directory, and the tokens equal ``ref``'s;
``corrupt-unverified`` (with ``--unverified-src``)
    the same read-only corrupted layer through a plugin build without the manifest check
    (its ``src/``): what happens without the check (the bug the check exists for).

The layer is made read-only with a read-only bind mount where the process may mount
(root with CAP_SYS_ADMIN), else with ``chmod -R a-w`` (which root ignores), and every
file's sha256 is compared before and after: ``layer_unchanged``. Engines run one at a
time, eager, in-process (``spec --child``), each with its own log. The parent imports
neither vLLM nor torch; it prints a table and writes the rows as JSON Lines.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.tqbench import entry_point, phases, records, tables
from benchmarks.tqbench.children import Children, Deadline, child_pythonpath
from benchmarks.tqbench.cli import Option, add_options, new_parser
from benchmarks.tqbench.engine import REPO_ROOT
from benchmarks.tqbench.spec_child import child_argv, child_env, read_result
from benchmarks.tqbench.spec_configs import MODEL_SIZES, REFERENCE, SpecConfig, spec_prompts

__all__ = [
    "COLUMNS",
    "DECODE_KERNEL",
    "DEFAULT_OUT_DIR",
    "MANAGER",
    "SHIPPED_OPTIONS",
    "Shipped",
    "add_parser",
    "cmd_report",
    "cmd_shipped",
    "corrupt",
    "decode_cubin",
    "engine_options",
    "file_hashes",
    "layered_env",
    "markdown_report",
    "read_only",
    "table_cells",
    "text_report",
    "warnings_in",
]

DEFAULT_OUT_DIR = REPO_ROOT / "benchmarks" / "results" / "shipped"
MANAGER = "tq_warmup_plugin.layered_cache:LayeredCacheManager"
DECODE_KERNEL = "_tq_decode_stage1"


def file_hashes(root: Path) -> dict[str, str]:
    """``relative path: sha256`` of every file under ``root``."""
    out = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        out[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@contextlib.contextmanager
def read_only(src: Path, at: Path) -> Iterator[str]:
    """``src`` visible read-only at ``at``; yields how (``bind mount`` or ``chmod``)."""
    at.mkdir(parents=True, exist_ok=True)
    mounted = (
        subprocess.run(["mount", "--bind", str(src), str(at)], capture_output=True).returncode == 0
    )
    if mounted and (
        subprocess.run(["mount", "-o", "remount,bind,ro", str(at)], capture_output=True).returncode
        == 0
    ):
        try:
            yield "read-only bind mount"
        finally:
            subprocess.run(["umount", str(at)], check=False)
        return
    if mounted:
        subprocess.run(["umount", str(at)], check=False)
    at.rmdir()
    shutil.copytree(src, at)
    subprocess.run(["chmod", "-R", "a-w", str(at)], check=True)
    yield "chmod -R a-w (root can still write)"


def decode_cubin(triton_dir: Path) -> Path | None:
    """The first (sorted) ``_tq_decode_stage1.cubin`` under a Triton cache directory."""
    found = sorted(triton_dir.glob(f"*/{DECODE_KERNEL}.cubin"))
    return found[0] if found else None


def corrupt(file: Path) -> None:
    """Flip 64 bytes in the middle of ``file`` (same size, different content)."""
    data = bytearray(file.read_bytes())
    mid = len(data) // 2
    for i in range(mid, min(mid + 64, len(data))):
        data[i] ^= 0xFF
    file.write_bytes(bytes(data))


def layered_env(layer: Path) -> dict[str, str]:
    """An engine's variables for the layered cache over one read-only layer."""
    return {"TRITON_CACHE_MANAGER": MANAGER, "TQ_WARMUP_CACHE_LAYERS": str(layer)}


def warnings_in(log: str) -> list[str]:
    """The plugin's WARNING lines of a child's log."""
    return [
        line.strip()[:400] for line in log.splitlines() if re.search(r"WARNING.*tq-warmup", line)
    ]


def engine_options(
    a: argparse.Namespace,
    preset: str,
    weight_scale: float = 1.0,
    max_tokens: int = 8,
    logprobs: int = 0,
) -> dict[str, Any]:
    """A spec child's options for the small dummy model in the engine shape of
    :data:`SHIPPED_OPTIONS` (``--geometry``, ``--max-model-len``, ``--budget``, ...):
    eager engines share the GPU, so a fixed KV cache and 30% of the memory each."""
    size = {**asdict(MODEL_SIZES["small"]), "geometry": a.geometry, "layers": a.layers}
    return {
        "preset": preset,
        "geometry": a.geometry,
        "layers": a.layers,
        "model_size": size,
        "max_model_len": a.max_model_len,
        "max_num_seqs": a.max_num_seqs,
        "budget": a.budget,
        "kv_cache_gib": a.kv_cache_gib,
        "gpu_mem_util": 0.3,
        "jit_monitor_mode": "warn",
        "weight_scale": weight_scale,
        "max_tokens": max_tokens,
        "logprobs": logprobs,
    }


class Shipped:
    """Runs the children and keeps one row per engine."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run_id = dt.datetime.now().strftime("%Y%m%dT%H%M%S")
        self.work = Path(args.work_dir or tempfile.mkdtemp(prefix="tq-shipped-")).resolve()
        self.log_dir = Path(args.log_dir or self.work / "logs").resolve()
        self.out = Path(args.out or DEFAULT_OUT_DIR / f"{self.run_id}{records.RAW_SUFFIX}")
        self.prompts = spec_prompts(args.prompts, 0)
        self.stub: list[str] = []
        if args.entry_point_stub and not entry_point.found():
            self.stub = [str(entry_point.write_stub(self.work / "entry-point"))]
        self.rows: list[dict[str, Any]] = []
        self.deadline = Deadline(args.deadline_s)
        self.children = Children()

    def options(self, preset: str) -> dict[str, Any]:
        a = self.args
        return engine_options(a, preset, a.weight_scale, a.max_tokens, logprobs=2)

    def child(
        self, preset: str, variant: str, env_extra: dict[str, str], src: str = ""
    ) -> dict[str, Any]:
        """One engine; its row (the child's result plus what its log shows). ``src``: a
        plugin source tree imported before the caller's (the build without the check)."""
        name = f"{preset}.{variant}"
        if min(self.args.timeout, self.deadline.left()) < 30:  # not worth starting one
            skipped = {"preset": preset, "variant": variant, "status": "skipped", "tokens": None}
            self.rows.append(
                {**skipped, "warnings": [], "triton_cache_dir": "", "error": "deadline"}
            )
            return self.rows[-1]
        work = self.work / name
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        cfg = SpecConfig(REFERENCE)
        records.write_json_atomic(
            work / "spec.json",
            {
                "config": asdict(cfg),
                "options": self.options(preset),
                "prompts": self.prompts,
                "work": str(work),
                "result": str(work / "result.json"),
            },
        )
        # vLLM's and Inductor's caches are shared (startup ~45 s -> ~15 s per engine on the
        # H200, 0.26.0); each engine keeps its own fresh TRITON_CACHE_DIR.
        env = {**child_env(cfg, work, True, os.environ), **env_extra}
        env.setdefault("VLLM_CACHE_ROOT", str(self.work / "vllm-cache"))
        env["PYTHONPATH"] = child_pythonpath([*self.stub, *filter(None, [src])], env)
        log = self.log_dir / f"{name}.log"
        print(f"[shipped] start {name} (log {log})", flush=True)
        ended = self.children.run(
            child_argv(work / "spec.json"), log, env, self.deadline.limit(self.args.timeout)
        )
        rc = None if ended.timed_out else ended.rc
        result = read_result(work)
        report = result.get("plugin_report") or {}
        row: dict[str, Any] = {
            "preset": preset,
            "variant": variant,
            "rc": rc,
            "status": result.get("status", "no result"),
            "error": result.get("error"),
            "startup_s": result.get("startup_s"),
            "warmup_s": report.get("warmup_s"),
            "compiled": report.get("compiled"),
            "shipped": report.get("shipped"),
            "disk": report.get("loaded"),
            "plugin_status": report.get("status"),
            "tq_compiles_after_startup": result.get("tq_compiles_after_startup"),
            "tokens": result.get("tokens"),
            "warnings": warnings_in(log.read_text(errors="replace")),
            "triton_cache_dir": env["TRITON_CACHE_DIR"],
            "log": str(log),
            "vllm_version": result.get("vllm_version"),
            "triton_version": result.get("triton_version"),
            "gpu": result.get("gpu"),
        }
        self.rows.append(row)
        records.write_run(self.out, self.run_fields(), self.rows)  # a killed run keeps these
        print(f"[shipped] done  {name}: {row['status']} rc={rc}", flush=True)
        return row

    def run(self) -> int:
        a = self.args
        layer = Path(a.layer).resolve()
        before = file_hashes(layer)
        presets = phases.parse_list(a.presets, phases.TQ_PRESETS)
        self.children.stop_on_sigterm()
        with read_only(layer, self.work / "layer-ro") as how:
            for preset in presets:
                ref = self.child(preset, "ref", {})
                self.child(preset, "shipped", layered_env(self.work / "layer-ro"))
                if preset == a.corrupt:
                    self.corrupted(layer, preset, ref)
            after = file_hashes(self.work / "layer-ro")  # what the engines could write to
        for row in self.rows:
            row.update(layer_mode=how, layer_files=len(before), layer_unchanged=before == after)
            ref_tokens = next(
                (
                    r["tokens"]
                    for r in self.rows
                    if r["preset"] == row["preset"] and r["variant"] == "ref"
                ),
                None,
            )
            row["tokens_equal_ref"] = (
                None
                if row["variant"] == "ref"
                else (row["tokens"] is not None and row["tokens"] == ref_tokens)
            )
        self.save()
        return (
            0
            if all(r["status"] == "ok" for r in self.rows if r["variant"] != "corrupt-unverified")
            else 1
        )

    def corrupted(self, layer: Path, preset: str, ref: dict[str, Any]) -> None:
        if ref["status"] != "ok":
            print(f"[shipped] {preset}: no reference engine, no corrupted-layer runs", flush=True)
            return
        cubin = decode_cubin(Path(ref["triton_cache_dir"]))
        if cubin is None:
            print(f"[shipped] {preset}: its ref engine compiled no {DECODE_KERNEL}", flush=True)
            return
        relative = cubin.relative_to(Path(ref["triton_cache_dir"]))
        bad = self.work / "layer-corrupt"
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(layer, bad)
        if not (bad / relative).is_file():
            print(f"[shipped] {relative} is not in the layer: keys differ", flush=True)
            return
        corrupt(bad / relative)
        view = self.work / "layer-corrupt-ro"
        with read_only(bad, view):
            row = self.child(preset, "corrupt", layered_env(view))
            if self.args.unverified_src:  # the same layer, read by a build without the check
                src = str(Path(self.args.unverified_src).resolve())
                unverified = self.child(preset, "corrupt-unverified", layered_env(view), src)
                unverified["corrupted_file"] = str(relative)
        rebuilt = Path(row["triton_cache_dir"]) / relative
        row["corrupted_file"] = str(relative)
        row["rebuilt_in_writable_dir"] = rebuilt.is_file()
        row["rebuilt_equals_ref"] = rebuilt.is_file() and rebuilt.read_bytes() == cubin.read_bytes()

    def run_fields(self) -> dict[str, Any]:
        keep = ("layer", "geometry", "layers", "max_model_len", "max_num_seqs", "budget")
        return {
            "run_id": self.run_id,
            "series": self.args.series,
            **{k: getattr(self.args, k) for k in (*keep, "weight_scale")},
        }

    def save(self) -> None:
        records.write_run(self.out, self.run_fields(), self.rows)
        print(text_report(self.rows, str(self.out)), flush=True)
        records.write_text_atomic(
            self.out.with_suffix(".md"), markdown_report(self.run_fields(), self.rows)
        )


COLUMNS = (
    "preset",
    "variant",
    "status",
    "startup_s",
    "warmup_s",
    "compiled",
    "shipped",
    "disk",
    "tq jit after startup",
    "tokens = ref",
    "warnings",
)


def table_cells(rows: list[dict[str, Any]]) -> list[list[str]]:
    """One row of :data:`COLUMNS` per engine."""
    table = [
        [
            tables.short_preset(r.get("preset")),
            r.get("variant"),
            r.get("status"),
            r.get("startup_s"),
            round(r["warmup_s"], 2) if isinstance(r.get("warmup_s"), float) else None,
            r.get("compiled"),
            r.get("shipped"),
            r.get("disk"),
            ",".join(r.get("tq_compiles_after_startup") or []) or "0",
            r.get("tokens_equal_ref"),
            len(r.get("warnings") or []),
        ]
        for r in rows
    ]
    return [["-" if c is None else str(c) for c in row] for row in table]


def _layer_line(rows: list[dict[str, Any]]) -> str:
    first = rows[0] if rows else {}
    mode, same = first.get("layer_mode", "-"), first.get("layer_unchanged", "-")
    return f"layer: {mode}, {first.get('layer_files', '-')} files, unchanged: {same}"


def text_report(rows: list[dict[str, Any]], where: str) -> str:
    """What a run prints: the table, each WARNING, the layer's state."""
    lines = [tables.render(COLUMNS, table_cells(rows))]
    lines += [f"  {r['preset']}.{r['variant']}: {w}" for r in rows for w in r["warnings"]]
    lines.append(f"[shipped] {_layer_line(rows)}; rows in {where}")
    return "\n".join(lines)


def markdown_report(run: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """A raw run as a reviewer reads it: settings, table, WARNINGs, corrupted file."""
    first = next((r for r in rows if r.get("vllm_version")), {})
    lines = [
        f"# {run.get('series', 'shipped cache')} ({run.get('run_id', '-')})",
        "",
        f"vLLM {first.get('vllm_version', '-')}, Triton {first.get('triton_version', '-')}, "
        f"{first.get('gpu', '-')}; geometry {run.get('geometry')}, {run.get('layers')} layers, "
        f"max_model_len {run.get('max_model_len')}, max_num_seqs {run.get('max_num_seqs')}, "
        f"budget {run.get('budget')}; {_layer_line(rows)}.",
        "",
        tables.render_markdown(COLUMNS, table_cells(rows)),
        "",
    ]
    for r in rows:
        if r.get("corrupted_file"):
            rebuilt = r.get("rebuilt_in_writable_dir")
            lines.append(
                f"- {r['preset']}.{r['variant']}: corrupted `{r['corrupted_file']}`"
                + ("" if rebuilt is None else f"; rebuilt in the writable dir: {rebuilt}")
                + (
                    ""
                    if "rebuilt_equals_ref" not in r
                    else f", equal to ref's: {r['rebuilt_equals_ref']}"
                )
            )
        lines += [f"- {r['preset']}.{r['variant']} WARNING: `{w}`" for w in r["warnings"]]
    return "\n".join(lines) + "\n"


def cmd_report(paths: list[str]) -> int:
    """``--report``: each raw run's Markdown beside it, and its table printed."""
    for name in paths:
        run, rows = records.read_run(Path(name))
        print(text_report(rows, name))
        records.write_text_atomic(Path(name).with_suffix(".md"), markdown_report(run, rows))
    return 0


def cmd_shipped(args: argparse.Namespace) -> int:
    if args.report:
        return cmd_report(args.report)
    if not Path(args.layer).is_dir():
        raise SystemExit(f"shipped: --layer {args.layer}: not a directory")
    if args.corrupt and args.corrupt not in phases.parse_list(args.presets, phases.TQ_PRESETS):
        raise SystemExit(f"shipped: --corrupt {args.corrupt} is not among --presets")
    return Shipped(args).run()


SHIPPED_OPTIONS: tuple[Option, ...] = (
    ("--layer", "", "the Triton cache directory tq-warmup precompile built (required)"),
    ("--presets", "all", f"comma list of {phases.TQ_PRESETS} or 'all'"),
    ("--corrupt", "", "corrupt one decode kernel file of this preset's keys in a copy"),
    ("--unverified-src", "", "a plugin src/ without the manifest check, for the corrupt layer"),
    ("--geometry", "128x16x8", "HEADSIZExQHEADSxKVHEADS (as precompile was given)"),
    ("--layers", 6, "hidden layers"),
    ("--max-model-len", 4096, "as precompile was given"),
    ("--max-num-seqs", 32, "as precompile was given"),
    ("--budget", 512, "max_num_batched_tokens, as precompile was given"),
    ("--kv-cache-gib", 2.0, "KV cache size of each engine"),
    ("--weight-scale", 200.0, "scale vLLM's dummy weights so greedy tokens are decided"),
    ("--max-tokens", 32, "tokens generated per prompt"),
    ("--prompts", 8, "prompts"),
    ("--timeout", 600.0, "seconds per engine"),
    ("--deadline-s", 0.0, "start no engine after this many seconds, kill one still running"),
    ("--work-dir", "", "default: a tmp dir"),
    ("--log-dir", "", "default: <work-dir>/logs"),
    ("--out", "", "raw rows (JSON Lines); default benchmarks/results/shipped/<run id>.jsonl"),
    ("--series", "shipped cache", "a name for this run"),
    ("--entry-point-stub", False, "declare the plugin's entry point if it is not installed"),
)


def add_parser(subparsers: Any) -> None:
    """The ``shipped`` subcommand."""
    p = new_parser(subparsers, "shipped", "serve from a shipped read-only Triton cache", __doc__)
    add_options(p, SHIPPED_OPTIONS)
    p.add_argument(
        "--report",
        nargs="+",
        metavar="RAW",
        help="write each raw run's Markdown (<raw>.md) and print its table; runs nothing",
    )
    p.set_defaults(func=cmd_shipped)
