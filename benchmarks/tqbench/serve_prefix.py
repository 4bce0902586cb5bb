"""``serve-prefix``: prefix caching through ``vllm serve``, over HTTP (issue 28).

One ``vllm serve`` per guard state (``TQ_WARMUP_PREFIX_GUARD`` unset, then ``0``), each
with vLLM's defaults (prefix caching on, chunked prefill, its own engine-core process),
a dummy-weight model whose weights vLLM's loader scales (``dummy_scale``, so greedy
tokens are decided) and ``--jit-monitor-mode warn`` (0.25+). The workload, token ids
in and out (``return_token_ids``), greedy:

* a shared system prompt P is cached (one request), then each burst is one HTTP request
  holding a new long prompt and four hits on P (``prompt``: a list of token-id lists,
  so they arrive together and share their first step), beside four more hits sent at
  the same time as single requests;
* every request of every burst is then served alone: the prefix cache reset
  (``/reset_prefix_cache``, ``VLLM_SERVER_DEV_MODE=1``), P cached again, the request.

A request is right when its tokens equal its own alone. The JIT monitor's lines after
startup are counted from the server's log. Writes ``result.json`` and ``SUMMARY.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.tqbench import entry_point, records
from benchmarks.tqbench.children import Children, child_pythonpath
from benchmarks.tqbench.cli import Option, add_options, new_parser
from benchmarks.tqbench.dummy_scale import ENV as SCALE_ENV
from benchmarks.tqbench.engine import REPO_ROOT
from benchmarks.tqbench.spec_child import write_models
from benchmarks.tqbench.spec_configs import MODEL_SIZES, SpecConfig
from benchmarks.tqbench.tokens_workload import PREFIX_LEN, prompts

__all__ = [
    "Server",
    "add_parser",
    "bursts",
    "engine_flags",
    "jit_lines",
    "judge",
    "plugin_lines",
    "serve_argv",
    "serve_env",
    "served_row",
    "server_options",
]

# vLLM's JIT monitor (0.25+): "Triton kernel JIT compilation during inference: NAME" in
# warn mode, the same words in error mode's RuntimeError.
_JIT_LINE = re.compile(r"JIT compilation during inference: (\S+?)[.\s(]")


def jit_lines(log_text: str) -> list[str]:
    """Kernel names of the JIT monitor's lines (warn) or errors (error) in a log."""
    return _JIT_LINE.findall(log_text)


def bursts(seed: int, vocab: int, n: int) -> tuple[list[int], list[dict[str, list[list[int]]]]]:
    """P, and ``n`` bursts: a long fresh prompt with four hits (one HTTP request) and
    four more hits (single requests)."""
    prefix = prompts(seed, vocab, [PREFIX_LEN])[0]
    out = []
    for b in range(n):
        tails = prompts(seed + 10 + b, vocab, [20, 36, 52, 68, 28, 44, 60, 76])
        fresh = prompts(seed + 30 + b, vocab, [PREFIX_LEN + 100])[0]
        hits = [prefix + t for t in tails]
        out.append({"batched": [fresh, *hits[:4]], "single": hits[4:]})
    return prefix, out


def judge(served: dict[str, list[int]], alone: dict[str, list[int]]) -> dict[str, Any]:
    """Per request: its tokens equal its own alone, and where not, the first index."""
    first = {}
    for name, want in alone.items():
        got = served.get(name) or []
        diff = [i for i in range(max(len(want), len(got))) if i >= len(got) or i >= len(want)
                or got[i] != want[i]]  # fmt: skip
        if diff:
            first[name] = diff[0]
    return {"requests": len(alone), "differing": len(first), "first_divergence": first}


class Server:
    """One ``vllm serve`` of the run, in its own process group (``Children``)."""

    def __init__(self, port: int, timeout: float) -> None:
        self.base, self.timeout = f"http://127.0.0.1:{port}", timeout

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(self.base + path, data=data,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            text = resp.read().decode()
        return json.loads(text) if text.strip().startswith(("{", "[")) else text

    def wait_ready(self, proc: subprocess.Popen[bytes], limit: float) -> bool:
        end = time.monotonic() + limit
        while time.monotonic() < end and proc.poll() is None:
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5):
                    return True
            except OSError:
                time.sleep(2)
        return False

    def start(self, children: Children, argv: list[str], log: Path, env: dict[str, str],
              limit: float) -> tuple[subprocess.Popen[bytes], float | None]:  # fmt: skip
        """Spawn the server; its process and seconds to ``/health``, None if never."""
        t = time.monotonic()
        proc = children.spawn(argv, log, env)
        ready = self.wait_ready(proc, limit)
        return proc, round(time.monotonic() - t, 1) if ready else None

    def complete(self, model: str, prompt: Any, max_tokens: int) -> list[list[int]]:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        choices = sorted(self.post("/v1/completions", body)["choices"], key=lambda c: c["index"])
        return [list(c["token_ids"]) for c in choices]


def _workload(srv: Server, model: str, args: argparse.Namespace) -> dict[str, Any]:
    vocab = MODEL_SIZES["small"].vocab_size
    prefix, plan = bursts(args.seed, vocab, args.bursts)
    served: dict[str, list[int]] = {}
    prompts_by_name: dict[str, list[int]] = {}
    for b, burst in enumerate(plan):
        srv.post("/reset_prefix_cache")
        srv.complete(model, prefix, 1)
        names = [f"b{b}-fresh", *[f"b{b}-hit{j}" for j in range(4)]]
        singles = [f"b{b}-hit{j}" for j in range(4, 8)]
        with ThreadPoolExecutor(max_workers=5) as pool:
            batched = pool.submit(srv.complete, model, burst["batched"], args.max_tokens)
            single = [pool.submit(srv.complete, model, p, args.max_tokens)
                      for p in burst["single"]]  # fmt: skip
            served.update(zip(names, batched.result(), strict=True))
            served.update((n, f.result()[0]) for n, f in zip(singles, single, strict=True))
        prompts_by_name.update(
            zip(names + singles, burst["batched"] + burst["single"], strict=True)
        )
    alone = {}
    for name, p in prompts_by_name.items():
        srv.post("/reset_prefix_cache")
        srv.complete(model, prefix, 1)
        alone[name] = srv.complete(model, p, args.max_tokens)[0]
    return {**judge(served, alone), "served": served, "alone": alone}


def run_server(args: argparse.Namespace, guard: str, port: int, work: Path, out: Path,
               children: Children) -> dict[str, Any]:  # fmt: skip
    opts = {"model_size": asdict(MODEL_SIZES["small"]), "max_model_len": args.max_model_len}
    model_dir, _ = write_models(SpecConfig("serve"), opts, work / guard)
    stub = entry_point.write_stub(work / "entry-point", plugin=not entry_point.found(),
                                  weight_scale=True)  # fmt: skip
    env = serve_env(args, work / guard / "triton", stub)
    env.pop("TQ_WARMUP_PREFIX_GUARD", None)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    if guard == "off":
        env["TQ_WARMUP_PREFIX_GUARD"] = "0"
    argv = serve_argv(args, model_dir, port, args.preset, "warn")
    log = out / f"serve-guard-{guard}.log"
    srv = Server(port, args.request_timeout)
    row: dict[str, Any] = {"guard": guard, "argv": argv}

    def workload() -> dict[str, Any]:
        return {**_workload(srv, str(model_dir), args), "status": "ok"}

    return served_row(srv, children, (argv, log, env, args.startup_timeout), row, workload)


def served_row(srv: Server, children: Children, start: tuple[list[str], Path, dict[str, str],
               float], row: dict[str, Any], workload: Callable[[], dict[str, Any]],
               ) -> dict[str, Any]:  # fmt: skip
    """One server's row: ``Server.start`` with ``start`` (argv, log, env, timeout), then
    ``workload`` (its dict gives ``status``), the JIT monitor's lines after startup and
    the plugin's log lines; the server is stopped whatever happens, and a failed
    startup or request is the row's status, so the other rows still run."""
    argv, log, env, timeout = start
    proc, row["startup_s"] = srv.start(children, argv, log, env, timeout)
    try:
        if row["startup_s"] is None:
            row["status"] = "startup-failed"
            return row
        mark = log.stat().st_size
        row.update(workload())
        row["jit_after_startup"] = jit_lines(log.read_bytes()[mark:].decode(errors="replace"))
    except Exception as e:
        row.update(status="failed", error=f"{type(e).__name__}: {e}"[-500:])
    finally:
        children.stop(proc)
        text = log.read_text(errors="replace") if log.exists() else ""
        row["plugin_lines"] = plugin_lines(text)
    return row


def plugin_lines(text: str, most: int = 12, chars: int = 2000) -> list[str]:
    """The plugin's first ``most`` lines of a server log, each from ``tq-warmup:`` on, at
    most ``chars`` long: whole, so a report line's start (its first launches, its total)
    is kept (the last 400 characters of each were kept, which lost both in a hybrid
    worker's 1,100-character line, serve-jit run V)."""
    found = [ln[ln.find("tq-warmup:") :] for ln in text.splitlines() if "tq-warmup:" in ln]
    return [ln[:chars] for ln in found[:most]]


def _table(rows: list[dict[str, Any]]) -> str:
    lines = ["| guard | status | startup s | requests | differing from alone | first divergence "
             "| JIT after startup |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['guard']} | {r.get('status')} | {r.get('startup_s', '-')} "
            f"| {r.get('requests', '-')} | {r.get('differing', '-')} "
            f"| {r.get('first_divergence', '-')} | {len(r.get('jit_after_startup') or [])} |"
        )
    return "\n".join(lines) + "\n"


def cmd_serve_prefix(args: argparse.Namespace) -> int:
    out = Path(args.out or REPO_ROOT / "benchmarks" / "results" / "raw" / "serve-prefix")
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="tq-serve-")).resolve()
    children = Children()
    children.stop_on_sigterm()
    rows = [run_server(args, g, args.port + i, work, out, children)
            for i, g in enumerate(args.guards.split(","))]  # fmt: skip
    records.write_json_atomic(out / "result.json", {"options": vars(args), "servers": rows})
    table = _table(rows)
    (out / "SUMMARY.md").write_text(table)
    print(table, flush=True)
    return 0 if all(r.get("status") == "ok" for r in rows) else 1


def server_options(raw: str, max_model_len: int, kv_gib: float, port: int) -> tuple[Option, ...]:
    """The options every ``vllm serve`` benchmark takes (``serve-prefix``, ``serve-jit``)."""
    return (
        ("--weight-scale", 100.0, "dummy weights times this, in vLLM's loader (dummy_scale)"),
        ("--seed", 0, "seed of the prompts"),
        ("--max-model-len", max_model_len, "--max-model-len"),
        ("--kv-cache-gib", kv_gib, "--kv-cache-memory-bytes, in GiB (0: vLLM sizes it)"),
        ("--port", port, "the first server's port (the next one +1)"),
        ("--startup-timeout", 400.0, "seconds for /health"),
        ("--request-timeout", 120.0, "seconds per HTTP request"),
        ("--out", "", f"output directory (default: benchmarks/results/raw/{raw})"),
        ("--work-dir", "", "model configs and caches (default: a temporary directory)"),
    )


def serve_env(args: argparse.Namespace, triton_dir: Path, stub: Path) -> dict[str, str]:
    """A server's environment: the plugin and the weight scaler on its path, its own
    Triton cache (a fresh one shows every compile)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TQ_WARMUP="1", TRITON_CACHE_DIR=str(triton_dir))
    env[SCALE_ENV] = str(args.weight_scale)
    env["PYTHONPATH"] = child_pythonpath([str(stub), str(REPO_ROOT / "src")], env)
    return env


def engine_flags(args: argparse.Namespace, kv: str, jit: str) -> list[str]:
    """The engine's flags, less the model, of a dummy-weight model with token ids in and
    out: what ``vllm serve`` and vLLM's own ``EngineArgs`` parser both take
    (``serve-jit --in-process`` gives them to the latter). ``--kv-cache-gib 0`` leaves the
    KV cache's size to vLLM: on 0.34 that is its default, the extensible cache."""
    kv_bytes = int(args.kv_cache_gib * 2**30)
    sized = ["--kv-cache-memory-bytes", str(kv_bytes)] if kv_bytes > 0 else []
    return ["--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "bfloat16",
            "--kv-cache-dtype", kv, "--max-model-len", str(args.max_model_len),
            *sized, "--seed", "0", "--jit-monitor-mode", jit]  # fmt: skip


def serve_argv(
    args: argparse.Namespace, model_dir: Path, port: int, kv: str, jit: str
) -> list[str]:
    """``vllm serve`` of a dummy-weight model with token ids in and out."""
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir),
            "--port", str(port), *engine_flags(args, kv, jit)]  # fmt: skip


OPTIONS: tuple[Option, ...] = (
    (
        "--guards",
        "on,off",
        "servers to run, in order: on (the default), off (TQ_WARMUP_PREFIX_GUARD=0)",
    ),
    ("--bursts", 3, "bursts of a long fresh prompt and eight hits"),
    ("--max-tokens", 32, "tokens generated per request"),
    *server_options("serve-prefix", 2048, 2.0, 8011),
)


def add_parser(subparsers: Any) -> None:
    """The ``serve-prefix`` subcommand."""
    p = new_parser(subparsers, "serve-prefix", "prefix caching through vllm serve (HTTP)", __doc__)
    add_options(p, OPTIONS)
    p.add_argument("--preset", default="turboquant_4bit_nc")
    p.set_defaults(func=cmd_serve_prefix)
