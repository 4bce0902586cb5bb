"""The ``kv-reserve`` command: the KV cache vLLM sizes with the plugin's warmup and without.

From 0.34 vLLM sizes an extensible KV cache (on by default on CUDA) from the memory left
after its warmup, keeping free the allocator peak that warmup reached. Scratch the
plugin allocates once (first launches, the engine warmers' inputs) would be kept free
for the server's lifetime unless it runs outside that window. Each engine here starts
with vLLM's defaults (no ``kv_cache_memory_bytes``: that turns the extensible cache off),
one at a time, in its own child process, in these modes:

* ``off``: ``TQ_WARMUP=0``, the baseline;
* ``unwrapped``: the plugin, its warmup inside vLLM's transient window (as before the
  plugin kept it out);
* ``on``: the plugin as shipped;
* ``no-launch``, ``no-vllm-kernels``, ``no-ahead``, ``no-guards``: the plugin less one
  part (``PARTS_OFF``), to find which part the blocks ``on`` loses go to.

Each child also prints torch's allocated and reserved memory and the device's free
memory once serving, so a difference between modes splits into torch's and the rest's.

Plugin modes need vLLM to find the plugin's entry point (installed, or
``--entry-point-stub``); an engine of a plugin mode that logged no plugin report is
marked ``(no plugin)`` and given no ratio, since its blocks are the baseline's.

The KV block count is vLLM's own log line ("N KV cache blocks ... fit", 0.34), read
from each child's log; a release without that line reports vLLM's "GPU KV cache size".

    python -m benchmarks.tqbench kv-reserve --max-model-len 4096 65536 \\
        --out benchmarks/results/kv-reserve

Prints a table and writes ``summary.json`` under ``--out``; the children's logs go to
``--work-dir`` (git-ignored by default).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.tqbench import entry_point
from benchmarks.tqbench.children import Children, child_pythonpath
from benchmarks.tqbench.cli import add_options, new_parser
from benchmarks.tqbench.engine import REPO_ROOT, installed_vllm_version, nvidia_smi_name

__all__ = [
    "MODES",
    "PARTS_OFF",
    "add_parser",
    "child",
    "mode_env",
    "parse_log",
    "ratios",
    "table",
    "without_plugin",
]

MODES = ("off", "unwrapped", "on")
PARTS_OFF: dict[str, dict[str, str]] = {
    "no-launch": {"TQ_WARMUP_LAUNCH": "0"},
    "no-vllm-kernels": {"TQ_WARMUP_VLLM_KERNELS": "0"},
    "no-ahead": {"TQ_WARMUP_AHEAD": "0"},
    "no-guards": {"TQ_WARMUP_PREFIX_GUARD": "0", "TQ_WARMUP_SPEC_GUARD": "0"},
}
"""The plugin as shipped less one part: where the blocks it costs go (``--modes``)."""


def mode_env(mode: str) -> dict[str, str]:
    """The plugin's variables of one mode (every mode but ``off`` runs the plugin)."""
    return {"TQ_WARMUP": "0" if mode == "off" else "1", **PARTS_OFF.get(mode, {})}


_BLOCKS = re.compile(
    r"([\d.]+) GiB kept for transient activations \(([\d.]+) GiB allocated at peak.*?"
    r"(\d+) KV cache blocks \(([\d.]+) GiB\) fit"
)
_TOKENS = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
_PLUGIN = re.compile(r"tq-warmup: \d+ TurboQuant layers.*")  # the report line

# A Llama-3-8B-shaped attention (32 query heads, 8 KV heads, head size 128) on 16 layers:
# TurboQuant compresses 12 of them (the first and last two stay full precision).
MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "head_dim": 128,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 16,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}


def parse_log(text: str) -> dict[str, Any]:
    """vLLM's sizing line and the plugin's line, from one engine's log."""
    out: dict[str, Any] = {}
    sized = _BLOCKS.findall(text)
    if sized:
        kept, peak, blocks, gib = sized[-1]
        out.update(
            kv_blocks=int(blocks), kv_gib=float(gib), kept_gib=float(kept), peak_gib=float(peak)
        )
    tokens = _TOKENS.findall(text)
    if tokens:
        out["kv_tokens"] = int(tokens[-1].replace(",", ""))
    workspace = re.findall(r'"workspace_mib": ([\d.]+)', text)
    if workspace:
        out["workspace_mib"] = float(workspace[-1])
    memory = re.findall(r'^\{"torch_allocated_mib".*\}$', text, re.MULTILINE)
    if memory:
        out.update(json.loads(memory[-1]))
    phases = re.findall(r'"phase": "([\w.]+)", "delta_mib": (\{[^}]*\})', text)
    if phases:
        out["phases_mib"] = {name: json.loads(held) for name, held in phases}
    plugin = _PLUGIN.findall(text)
    if plugin:
        out["plugin_line"] = plugin[-1][:400]
    return out


def without_plugin(row: dict[str, Any]) -> bool:
    """A plugin mode's engine that logged no plugin report: vLLM started it without the
    plugin (not installed, no stub), so its blocks are the baseline's, not the plugin's."""
    return row["mode"] != "off" and not row.get("plugin_line")


def ratios(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per ``max_model_len``: each plugin mode's KV blocks over the ``off`` engine's; an
    engine that ran without the plugin (``without_plugin``) has none."""
    result: dict[str, dict[str, float]] = {}
    for row in rows:
        if without_plugin(row):
            continue
        base = next(
            (
                r.get("kv_blocks")
                for r in rows
                if r["mode"] == "off" and r["max_model_len"] == row["max_model_len"]
            ),
            None,
        )
        if row["mode"] != "off" and base and row.get("kv_blocks"):
            result.setdefault(str(row["max_model_len"]), {})[row["mode"]] = row["kv_blocks"] / base
    return result


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a text table."""
    head = (
        f"{'max_model_len':>13} {'mode':<16}{'KV blocks':>10}{'kept GiB':>10}{'peak GiB':>10}"
        f"{'workspace MiB':>15}{'torch MiB':>11}{'free MiB':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        torch_mib = r.get("torch_reserved_mib")
        free_mib = r.get("free_mib")
        mode = f"{r['mode']} (no plugin)" if without_plugin(r) else r["mode"]
        lines.append(
            f"{r['max_model_len']:>13} {mode:<16}{r.get('kv_blocks', '-')!s:>10}"
            f"{r.get('kept_gib', '-')!s:>10}{r.get('peak_gib', '-')!s:>10}"
            f"{r.get('workspace_mib', '-')!s:>15}"
            f"{'-' if torch_mib is None else f'{torch_mib:.0f}':>11}"
            f"{'-' if free_mib is None else f'{free_mib:.0f}':>10}"
        )
    return "\n".join(lines)


def child(args: argparse.Namespace) -> int:
    """One engine: start with vLLM's defaults, serve one long prompt, exit."""
    if args.child == "unwrapped":
        import contextlib

        from tq_warmup_plugin import compat

        compat.kv_warmup_window = lambda worker, feats: contextlib.nullcontext()
    if args.child != "off":
        _trace_phases()
    from vllm import LLM, SamplingParams

    length = args.max_model_len[0]
    llm = LLM(
        model=args.model_dir,
        skip_tokenizer_init=True,
        load_format="dummy",
        dtype="bfloat16",
        kv_cache_dtype=args.preset,
        max_model_len=length,
        seed=0,
    )
    ids = [(7 * i) % 1000 + 3 for i in range(min(3000, length // 2))]
    prompt = {"prompt_token_ids": ids}
    out = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))
    print(json.dumps({"served_tokens": len(out[0].outputs[0].token_ids)}), flush=True)
    print(json.dumps({"workspace_mib": _workspace_bytes() / 2**20}), flush=True)
    print(json.dumps(_memory()), flush=True)
    return 0


# The plugin's phases whose memory the trace reads: (module, attribute) of each.
_PHASES = (
    ("tq_warmup_plugin.worker.warmup", "run"),
    ("tq_warmup_plugin.worker.workspace", "reserve"),
    ("tq_warmup_plugin.worker.warmup", "compile_into"),
    ("tq_warmup_plugin.worker.launches", "launch_all"),
    ("tq_warmup_plugin.worker.warmup", "_load_compiled"),
    ("tq_warmup_plugin.worker.warmup", "_warm_vllm_kernels"),
)


def _trace_phases() -> None:
    """Wrap each of the plugin's phases (``_PHASES``) to print what it left held: torch's
    reserved memory and the device's free memory, after a sync, before and after it. The
    engine runs in this process, so the worker calls the wrapped functions."""
    import functools
    import importlib

    import torch
    from triton.compiler.compiler import CompiledKernel

    loads = [0]
    init_handles = CompiledKernel._init_handles

    def counted(self: Any) -> None:
        fresh = getattr(self, "module", None) is None
        init_handles(self)
        loads[0] += fresh and getattr(self, "module", None) is not None

    CompiledKernel._init_handles = counted

    def wrap(name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def traced(*a: Any, **kw: Any) -> Any:
            torch.cuda.synchronize()
            before, loaded = _memory(), loads[0]
            try:
                return fn(*a, **kw)
            finally:
                torch.cuda.synchronize()
                after = _memory()
                held = {k: round(after[k] - before[k], 1) for k in after}
                held["modules_loaded"] = loads[0] - loaded
                print(json.dumps({"phase": name, "delta_mib": held}), flush=True)

        return traced

    for module_name, attr in _PHASES:
        module = importlib.import_module(module_name)
        setattr(
            module, attr, wrap(f"{module_name.rsplit('.', 1)[1]}.{attr}", getattr(module, attr))
        )


def _memory() -> dict[str, float]:
    """The device's memory once serving, in MiB: what torch holds (allocated, reserved)
    and what is free, so two modes' difference splits into torch's and the rest's."""
    import torch

    free, _ = torch.cuda.mem_get_info()
    mib = 2**20
    return {
        "torch_allocated_mib": torch.cuda.memory_allocated() / mib,
        "torch_reserved_mib": torch.cuda.memory_reserved() / mib,
        "free_mib": free / mib,
    }


def _workspace_bytes() -> int:
    """Bytes the worker's workspace holds over all its slots once serving: what vLLM's own
    steps grew it to, with the plugin's reservation or without."""
    from tq_warmup_plugin import compat

    feats = compat.release_features(compat.installed_vllm_version())
    manager = compat.workspace_manager(feats, locked_too=True)
    if manager is None:
        return 0
    return sum(
        compat.workspace_slot_bytes(manager, ubatch, lane)
        for ubatch, lane in compat.workspace_slots(manager)
    )


def cmd_kv_reserve(args: argparse.Namespace) -> int:
    """Run every (max_model_len, mode) engine one at a time; table and summary."""
    if args.child:
        return child(args)
    work = Path(args.work_dir)
    model = work / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(MODEL, indent=1))
    modes = args.modes.split(",")
    if modes != ["off"]:
        entry_point.require("kv-reserve", args.entry_point_stub)
    stub = entry_point.stub_path(work / "entry-point", args.entry_point_stub)
    children = Children()
    children.stop_on_sigterm()
    rows: list[dict[str, Any]] = []
    for length in args.max_model_len:
        for mode in modes:
            env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
            env["PYTHONPATH"] = child_pythonpath([*stub, str(REPO_ROOT / "src")], env)
            env.update(mode_env(mode))
            log = work / f"{length}-{mode}.log"
            argv = [sys.executable, "-m", "benchmarks.tqbench", "kv-reserve", "--child", mode]
            argv += ["--model-dir", str(model), "--preset", args.preset]
            argv += ["--max-model-len", str(length)]
            ended = children.run(argv, log, env, args.timeout, echo_argv=True)
            text = log.read_text(errors="replace")
            row = {"max_model_len": length, "mode": mode, "rc": ended.rc, "wall_s": ended.wall_s}
            row.update(parse_log(text))
            row["served"] = '"served_tokens": 8' in text
            rows.append(row)
            print(table(rows[-1:]).splitlines()[-1], flush=True)
            _write(args, rows)  # after every engine: a run cut short keeps what it measured
    summary = _write(args, rows)
    print(table(rows))
    print(json.dumps(summary["kv_blocks_ratio"], indent=1))
    return 0 if all(r["rc"] == 0 and r["served"] and not without_plugin(r) for r in rows) else 1


def _write(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary of the rows so far, written to ``--out``/summary.json."""
    summary = {
        "vllm": installed_vllm_version(),
        "gpu": nvidia_smi_name(),
        "preset": args.preset,
        "model": "Llama-3-8B attention, 16 layers, dummy weights",
        "command": "python -m benchmarks.tqbench " + " ".join(sys.argv[1:]),
        "rows": rows,
        "kv_blocks_ratio": ratios(rows),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def add_parser(sub: Any) -> None:
    p = new_parser(sub, "kv-reserve", "KV blocks vLLM sizes with and without the plugin", __doc__)
    add_options(
        p,
        [
            ("--preset", "turboquant_4bit_nc", "the KV cache dtype"),
            ("--modes", ",".join(MODES), "comma-separated modes to run"),
            ("--work-dir", "benchmarks/results/raw/kv-reserve", "model and logs"),
            ("--out", "benchmarks/results/raw/kv-reserve", "where summary.json goes"),
            ("--timeout", 900.0, "seconds per engine"),
            (
                "--entry-point-stub",
                False,
                "if the plugin's entry point is not installed, declare it "
                "in a dist-info put on the children's PYTHONPATH",
            ),
            ("--child", "", "internal: run one engine in this mode"),
            ("--model-dir", "", "internal: the child's model"),
        ],
    )
    p.add_argument("--max-model-len", type=int, nargs="+", default=[4096, 65536])
    p.set_defaults(func=cmd_kv_reserve)
