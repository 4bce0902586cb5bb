"""The ``verify-attention`` command: the batched verify path's attention output on a GPU.

vLLM's real TurboQuant builder and impl, one layer, a KV cache filled through the real
store kernel. For random batches (k in {1, 2, 4}; requests with fewer drafts than k;
mixed steps with prefill chunks after the verify requests) it compares, per query
token, the attention output of:

* ``loop``: vLLM's own builder, so every verify request goes through the per-request
  loop, eager (the reference);
* ``batched``: the plugin's builder (``guards/batched_verify``), eager;
* ``graph``: the plugin's builder under a CUDA graph captured on vLLM's capture
  metadata (``build_for_cudagraph_capture``: ``seq_lens`` 1) and replayed on the real
  step (uniform batches only, as vLLM captures them);
* ``graph-unguarded``: vLLM's builder captured the same way (the upstream bug: the
  capture bakes in attention over the new tokens only);
* ``off-by-one``: the batched rows one position short, to show the check can fail;
* ``floor``: the batched rows with the keys summed in 16 splits instead of 32, a second
  valid computation of the same attention: the noise floor.

Prints a table of max |difference| against ``loop`` and writes it as JSON to ``--out``.
Also times one layer's verify attention (median of ``--repeats`` launches) for the loop,
the batched path eager and its graph replay. Needs CUDA and vLLM 0.21+:
``python -m benchmarks.tqbench.verify_attention --out DIR``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

__all__ = ["command", "main", "max_diff", "median_us"]

PRESET, D, HQ, HK, BS, SPLITS = "turboquant_4bit_nc", 128, 32, 8, 16, 32
MAX_SEQS, MAX_LEN = 16, 4096
WIDTH = MAX_LEN // BS


def _config(k: int) -> Any:
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k, parallel_drafting=False),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        scheduler_config=SimpleNamespace(max_num_seqs=MAX_SEQS),
        cache_config=SimpleNamespace(cache_dtype=PRESET),
        attention_config=SimpleNamespace(tq_max_kv_splits_for_cuda_graph=SPLITS),
        model_config=SimpleNamespace(max_model_len=MAX_LEN),
        use_v2_model_runner=True,
    )


class Layer:
    """One TurboQuant layer on the GPU: impl, layer module, KV cache, runner buffers."""

    def __init__(self, torch: Any, backend: Any, k: int) -> None:
        self.torch, self.backend, self.k = torch, backend, k
        with mock.patch.object(backend, "get_current_vllm_config", return_value=_config(k)):
            self.impl = backend.TurboQuantAttentionImpl(
                num_heads=HQ, head_size=D, scale=D**-0.5, num_kv_heads=HK, kv_cache_dtype=PRESET
            )
        dev = torch.device("cuda")
        self.layer = torch.nn.Module()
        slot = self.impl.tq_config.slot_size_aligned
        blocks = MAX_SEQS * WIDTH + 1
        self.kv = torch.zeros(blocks, HK, BS, slot, dtype=torch.uint8, device=dev)  # 0.26
        perm = torch.randperm(blocks - 1, device=dev)[: MAX_SEQS * WIDTH] + 1
        self.table = perm.view(MAX_SEQS, WIDTH).to(torch.int32)
        self.seq_buf = torch.zeros(MAX_SEQS, dtype=torch.int32, device=dev)
        self.qsl_buf = torch.zeros(MAX_SEQS * (1 + k) + 1, dtype=torch.int32, device=dev)
        self.q_buf = torch.zeros(MAX_SEQS * (1 + k) + 512, HQ * D, dtype=torch.bfloat16, device=dev)

    def fill_cache(self) -> None:
        """Store random K/V at every position of every row, through the real store."""
        t = self.torch
        n = MAX_SEQS * WIDTH * BS
        rows = t.arange(n, device="cuda")
        slots = self.table.view(-1)[rows // BS].long() * BS + rows % BS
        for part in range(0, n, 8192):
            s = slots[part : part + 8192]
            k = t.randn(s.shape[0], HK * D, dtype=t.bfloat16, device="cuda")
            v = t.randn(s.shape[0], HK * D, dtype=t.bfloat16, device="cuda")
            self.impl.do_kv_cache_update(self.layer, k, v, self.kv, s)

    def common(self, requests: list[tuple[int, int]], capture: bool = False) -> Any:
        """vLLM's step metadata over the persistent buffers (capture: vLLM's dummy run,
        ``seq_lens = max_query_len``, ``max_seq_len = max_model_len``)."""
        t = self.torch
        from vllm.v1.attention.backend import CommonAttentionMetadata

        q_lens = [q for q, _ in requests]
        seqs = [q if capture else q + c for q, c in requests]
        n, tokens = len(requests), sum(q_lens)
        qsl = [0]
        for q in q_lens:
            qsl.append(qsl[-1] + q)
        self.seq_buf[:n].copy_(t.tensor(seqs, dtype=t.int32))
        self.qsl_buf[: n + 1].copy_(t.tensor(qsl, dtype=t.int32))
        return CommonAttentionMetadata(
            query_start_loc=self.qsl_buf[: n + 1],
            query_start_loc_cpu=t.tensor(qsl, dtype=t.int32),
            seq_lens=self.seq_buf[:n],
            num_reqs=n,
            num_actual_tokens=tokens,
            max_query_len=max(q_lens),
            max_seq_len=MAX_LEN if capture else max(seqs),
            block_table_tensor=self.table[:n],
            slot_mapping=t.full((tokens,), -1, dtype=t.int64, device="cuda"),
            seq_lens_cpu_upper_bound=t.tensor(seqs, dtype=t.int32),
        )

    def builder(self, batched: bool) -> Any:
        from tq_warmup_plugin.guards import batched_verify

        cls = self.backend.TurboQuantMetadataBuilder
        b = cls.__new__(cls)
        b.vllm_config, b.device = _config(self.k), self.torch.device("cuda")
        b.reorder_batch_threshold = 1
        if batched:
            batched_verify.serve_rows(b)
        return b

    def forward(self, meta: Any, tokens: int) -> Any:
        q = self.q_buf[:tokens]
        out = self.torch.zeros(tokens, HQ * D, dtype=q.dtype, device="cuda")
        kv = q[:, : HK * D]
        return self.impl.forward(self.layer, q, kv, kv, self.kv, meta, output=out)


def _batch(rng: random.Random, k: int, mixed: bool, uniform: bool) -> list[tuple[int, int]]:
    n = rng.randint(2, 8) if not uniform else rng.choice([1, 4, 8])
    reqs = [(1 + k if uniform else rng.randint(1, 1 + k), rng.randint(1, 3000)) for _ in range(n)]
    reqs.sort(key=lambda r: r[0] != 1 + k)  # the V2 order: full verify requests first
    if mixed:
        reqs += [(rng.randint(10, 60), rng.randint(1, 2000)), (rng.randint(8, 40), 0)]
    return reqs


def max_diff(a: Any, b: Any) -> float:
    """The largest absolute difference of two outputs, in float32."""
    return float((a.float() - b.float()).abs().max().item())


def median_us(torch: Any, fn: Callable[[], Any], repeats: int) -> float:
    """The median of ``repeats`` synchronized runs of ``fn``, in microseconds."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _timings(
    torch: Any, L: Layer, builders: tuple[Any, Any], graph: Any, reqs: Any, repeats: int
) -> dict[str, float]:
    """One layer's verify attention, metadata build included, in microseconds."""
    plain, ours = builders
    tokens = sum(q for q, _ in reqs)

    def loop() -> None:
        L.forward(plain.build(0, L.common(reqs)), tokens)

    def batched() -> None:
        L.forward(ours.build(0, L.common(reqs)), tokens)

    def replay() -> None:
        ours.build(0, L.common(reqs))
        graph.replay()

    return {
        f"us_{n}": median_us(torch, f, repeats)
        for n, f in (("loop", loop), ("batched", batched), ("graph", replay))
    }


def run(out: Path, seed: int, cases: int, repeats: int) -> dict[str, Any]:
    import torch
    from vllm.v1.attention.backends import turboquant_attn as backend
    from vllm.v1.worker import workspace

    from tq_warmup_plugin.guards import batched_verify

    assert batched_verify.install(backend)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    workspace.init_workspace_manager(torch.device("cuda"))
    rows: list[dict[str, Any]] = []
    for k in (1, 2, 4):
        L = Layer(torch, backend, k)
        L.fill_cache()
        L.impl.max_num_kv_splits = SPLITS
        workspace.current_workspace_manager().get_simultaneous(
            ((MAX_SEQS * (1 + k), HQ, SPLITS, D + 1), torch.float32),
            ((MAX_SEQS * (1 + k), HQ, D), torch.bfloat16),
            ((MAX_SEQS * (1 + k), HQ), torch.float32),
        )
        plain, ours = L.builder(False), L.builder(True)
        for case in range(cases):
            kind = ("uniform", "short-drafts", "mixed")[case % 3]
            reqs = _batch(rng, k, mixed=kind == "mixed", uniform=kind == "uniform")
            tokens = sum(q for q, _ in reqs)
            L.q_buf[:tokens].normal_()
            ref = L.forward(plain.build(0, L.common(reqs)), tokens).clone()
            row: dict[str, Any] = {"k": k, "kind": kind, "requests": len(reqs), "tokens": tokens}
            row["batched"] = max_diff(L.forward(ours.build(0, L.common(reqs)), tokens), ref)
            meta = ours.build(0, L.common(reqs))
            meta.seq_lens.sub_(1).clamp_(min=1)
            row["off-by-one"] = max_diff(L.forward(meta, tokens), ref)
            L.impl.max_num_kv_splits = SPLITS // 2  # the same attention, summed in 16 splits
            row["floor"] = max_diff(L.forward(ours.build(0, L.common(reqs)), tokens), ref)
            L.impl.max_num_kv_splits = SPLITS
            if kind == "uniform":
                for name, builder in (("graph", ours), ("graph-unguarded", plain)):
                    dummy = builder.build_for_cudagraph_capture(L.common(reqs, capture=True))
                    L.forward(dummy, tokens)  # warm, as vLLM's capture does
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        got = L.forward(dummy, tokens)
                    builder.build(0, L.common(reqs))  # the step's metadata, as at replay
                    graph.replay()
                    torch.cuda.synchronize()
                    row[name] = max_diff(got, ref)
                    if name == "graph" and case == 0:
                        row.update(_timings(torch, L, (plain, ours), graph, reqs, repeats))
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = _summary(rows)
    result = {"gpu": torch.cuda.get_device_name(), "rows": rows, "summary": summary}
    out.mkdir(parents=True, exist_ok=True)
    (out / "verify-attention.json").write_text(json.dumps(result, indent=1))
    table = _table(summary)
    (out / "verify-attention.md").write_text(table)
    print(table)
    return result


def _summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    cols = ("batched", "graph", "floor", "graph-unguarded", "off-by-one")
    out = []
    for k in sorted({r["k"] for r in rows}):
        for kind in ("uniform", "short-drafts", "mixed"):
            sel = [r for r in rows if r["k"] == k and r["kind"] == kind]
            if not sel:
                continue
            entry: dict[str, Any] = {"k": k, "kind": kind, "cases": len(sel)}
            for c in cols:
                vals = [r[c] for r in sel if c in r]
                entry[c] = max(vals) if vals else None
            for c in ("us_loop", "us_batched", "us_graph"):
                vals = [r[c] for r in sel if c in r]
                entry[c] = vals[0] if vals else None
            out.append(entry)
    return out


def _table(summary: list[dict[str, Any]]) -> str:
    def cell(v: Any) -> str:
        return "-" if v is None else f"{v:.3g}"

    head = "| k | batch | cases | batched | graph | floor | graph-unguarded | off-by-one |"
    lines = [head, "|" + "---|" * 8]
    for e in summary:
        vals = [e[c] for c in ("batched", "graph", "floor", "graph-unguarded", "off-by-one")]
        lines.append(
            f"| {e['k']} | {e['kind']} | {e['cases']} | " + " | ".join(map(cell, vals)) + " |"
        )
    lines += ["", "| k | loop us | batched us | graph us |", "|---|---|---|---|"]
    for e in summary:
        if e["us_loop"] is not None:
            lines.append(
                f"| {e['k']} | {e['us_loop']:.0f} | {e['us_batched']:.0f} | {e['us_graph']:.0f} |"
            )
    return "\n".join(lines) + "\n"


def command(
    prog: str, doc: str | None, run: Callable[[Path, int, int, int], Any], cases: str, repeats: int
) -> Callable[[list[str] | None], int]:
    """A GPU check's ``main``: ``--out``, ``--seed``, ``--cases``, ``--repeats`` to ``run``."""

    def main(argv: list[str] | None = None) -> int:
        parser = argparse.ArgumentParser(prog=prog, description=doc)
        parser.add_argument("--out", type=Path, required=True)
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--cases", type=int, default=12, help=cases)
        parser.add_argument("--repeats", type=int, default=repeats)
        args = parser.parse_args(argv)
        run(args.out, args.seed, args.cases, args.repeats)
        return 0

    return main


main = command("verify-attention", __doc__, run, "batches per k", 50)


if __name__ == "__main__":
    raise SystemExit(main(None))
