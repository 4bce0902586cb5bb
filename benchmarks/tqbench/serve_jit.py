"""``serve-jit``: ``vllm serve --jit-monitor-mode error`` over an HTTP mix (issue 29).

One ``vllm serve`` per row, one after another (each its own engine-core process,
vLLM's defaults: prefix caching, chunked prefill), a dummy-weight Llama whose weights
vLLM's loader scales (``dummy_scale``). A row names the KV cache dtype, the
speculative decoding and whether the plugin's engine warmers run
(``TQ_WARMUP_VLLM_KERNELS``). The mix: short prompts, a 3000-token one, shared
prefixes sent together, a burst of 16, greedy and random batches, ``logprobs`` 1, 5
and 20, ``prompt_logprobs``, ``n=2`` and stop token ids (the server has no tokenizer,
so stop *strings* cannot be asked for). Prompts repeat a pattern, so ngram drafts.

Counted per row: requests served, requests failed (HTTP 500 once the engine core is
dead), and the JIT monitor's lines after startup (``Triton kernel JIT compilation
during inference: NAME``). Writes ``result.json`` and ``SUMMARY.md``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.tqbench import entry_point, records, tables
from benchmarks.tqbench.children import Children
from benchmarks.tqbench.cli import Option, add_options, new_parser
from benchmarks.tqbench.engine import REPO_ROOT
from benchmarks.tqbench.serve_prefix import (
    Server,
    serve_argv,
    serve_env,
    served_row,
    server_options,
)
from benchmarks.tqbench.spec_child import write_models
from benchmarks.tqbench.spec_configs import MODEL_SIZES, SpecConfig

__all__ = ["ROWS", "Row", "add_parser", "mix"]


@dataclass(frozen=True)
class Row:
    """One server: its KV cache dtype, speculation and engine warmers."""

    kv: str
    spec: SpecConfig
    warmers: bool = True


_NGRAM = SpecConfig("ngram", "ngram", 3)
ROWS: dict[str, Row] = {
    "tq-ngram": Row("tq", _NGRAM),
    "tq-ngram-off": Row("tq", _NGRAM, warmers=False),
    "auto-ngram": Row("auto", _NGRAM),
    "tq": Row("tq", SpecConfig("plain")),
    "tq-off": Row("tq", SpecConfig("plain"), warmers=False),
    "auto": Row("auto", SpecConfig("plain")),
    "tq-draft": Row("tq", SpecConfig("draft", "draft_model", 3)),
    "tq-draft-off": Row("tq", SpecConfig("draft", "draft_model", 3), warmers=False),
    "tq-eagle": Row("tq", SpecConfig("eagle", "eagle", 3)),
    "tq-eagle-off": Row("tq", SpecConfig("eagle", "eagle", 3), warmers=False),
}


def _pattern_prompt(rng: random.Random, vocab: int, length: int) -> list[int]:
    """A prompt that repeats an 8-token pattern with a few changes: ngram finds it."""
    pattern = [rng.randrange(10, vocab) for _ in range(8)]
    out = [pattern[i % 8] for i in range(length)]
    for i in rng.sample(range(length), max(1, length // 20)):
        out[i] = rng.randrange(10, vocab)
    return out


def mix(seed: int, vocab: int) -> list[list[dict[str, Any]]]:
    """The requests, in waves sent together (each a ``/v1/completions`` body less the
    model): the order is the one a server meets them in."""
    rng = random.Random(seed)

    def p(n: int) -> list[int]:
        return _pattern_prompt(rng, vocab, n)

    greedy = {"temperature": 0}
    rand = {"temperature": 0.8, "top_p": 0.9, "seed": 1}
    ids = {"return_tokens_as_token_ids": True}  # logprobs without the tokenizer
    prefix = p(640)
    return [
        [{"prompt": p(16), "max_tokens": 16, **greedy}],
        [{"prompt": p(3000), "max_tokens": 8, **greedy}],
        [{"prompt": prefix + p(24 + 16 * i), "max_tokens": 16, **greedy} for i in range(4)],
        [
            {"prompt": p(40 + 7 * i), "max_tokens": 24, **(greedy if i % 2 else rand)}
            for i in range(16)
        ],
        [{"prompt": p(64), "max_tokens": 16, "logprobs": n, **ids, **greedy} for n in (1, 5, 20)],
        [{"prompt": p(48), "max_tokens": 8, "prompt_logprobs": 2, **ids, **greedy}],
        [{"prompt": p(48), "max_tokens": 16, "n": 2, **rand}],
        [{"prompt": p(48), "max_tokens": 32, "stop_token_ids": [3, 5, 7], **greedy}],
        [{"prompt": p(200), "max_tokens": 48, **rand} for _ in range(4)],
        [{"prompt": prefix + p(100), "max_tokens": 16, "logprobs": 2, **ids, **rand}],
    ]


def _send(srv: Server, model: str, body: dict[str, Any]) -> str:
    try:
        srv.post("/v1/completions", {"model": model, "ignore_eos": True, **body})
    except Exception as e:  # HTTP 500 after the engine died, a timeout, a refused connection
        return f"{type(e).__name__}: {e}"[:200]
    return ""


def _workload(srv: Server, model: str, args: argparse.Namespace) -> dict[str, Any]:
    vocab = MODEL_SIZES["small"].vocab_size
    served, failures = 0, []
    for wave in mix(args.seed, vocab):
        with ThreadPoolExecutor(max_workers=len(wave)) as pool:
            for err in pool.map(lambda b: _send(srv, model, b), wave):
                if err:
                    failures.append(err)
                else:
                    served += 1
    return {"served": served, "failed": len(failures), "first_failure": failures[:1]}


def run_row(args: argparse.Namespace, name: str, port: int, work: Path, out: Path,
            children: Children) -> dict[str, Any]:  # fmt: skip
    row = ROWS[name]
    opts = {"model_size": asdict(MODEL_SIZES["small"]), "max_model_len": args.max_model_len}
    model_dir, head_dir = write_models(row.spec, opts, work / name)
    stub = entry_point.write_stub(work / "entry-point", plugin=not entry_point.found(),
                                  weight_scale=True)  # fmt: skip
    env = serve_env(args, work / name / "triton", stub)
    env["TQ_WARMUP_VLLM_KERNELS"] = "1" if row.warmers else "0"
    kv = args.preset if row.kv == "tq" else "auto"
    argv = serve_argv(args, model_dir, port, kv, args.jit_mode)
    spec = row.spec.speculative_config(str(model_dir), head_dir)
    if spec is not None:
        argv += ["--speculative-config", json.dumps(spec)]
    log = out / f"serve-{name}.log"
    srv = Server(port, args.request_timeout)
    result: dict[str, Any] = {"row": name, "kv": kv, "spec": spec, "warmers": row.warmers}

    def workload() -> dict[str, Any]:
        done = _workload(srv, str(model_dir), args)
        return {**done, "status": "ok" if done["failed"] == 0 else "requests-failed"}

    return served_row(srv, children, (argv, log, env, args.startup_timeout), result, workload)


def _table(rows: list[dict[str, Any]]) -> str:
    header = ["row", "kv", "speculation", "engine warmers", "status", "served", "failed",
              "JIT after startup"]  # fmt: skip
    cells = [
        [r["row"], r["kv"], (r.get("spec") or {}).get("method", "-"),
         "on" if r["warmers"] else "off", str(r.get("status")), str(r.get("served", "-")),
         str(r.get("failed", "-")), ", ".join(sorted(set(r.get("jit_after_startup") or []))) or "0"]
        for r in rows
    ]  # fmt: skip
    return tables.render_markdown(header, cells)


def cmd_serve_jit(args: argparse.Namespace) -> int:
    out = Path(args.out or REPO_ROOT / "benchmarks" / "results" / "raw" / "serve-jit")
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="tq-serve-jit-")).resolve()
    names = [n for n in args.rows.split(",") if n]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        print(f"serve-jit: unknown rows {unknown}; known: {', '.join(ROWS)}", file=sys.stderr)
        return 2
    children = Children()
    children.stop_on_sigterm()
    rows = []
    for i, name in enumerate(names):
        rows.append(run_row(args, name, args.port + i, work, out, children))
        records.write_json_atomic(out / "result.json", {"options": vars(args), "rows": rows})
    table = _table(rows)
    (out / "SUMMARY.md").write_text(table)
    print(table, flush=True)
    return 0


OPTIONS: tuple[Option, ...] = (
    ("--rows", "tq-ngram,tq-ngram-off", "servers to run, in order (serve_jit.ROWS)"),
    ("--jit-mode", "error", "--jit-monitor-mode (0.25+): error or warn"),
    *server_options("serve-jit", 4096, 4.0, 8031),
)


def add_parser(subparsers: Any) -> None:
    """The ``serve-jit`` subcommand."""
    p = new_parser(subparsers, "serve-jit", "JIT-monitor error mode through vllm serve", __doc__)
    add_options(p, OPTIONS)
    p.add_argument("--preset", default="turboquant_4bit_nc")
    p.set_defaults(func=cmd_serve_jit)
