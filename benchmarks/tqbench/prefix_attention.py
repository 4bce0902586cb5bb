"""The ``prefix-attention`` check: the prefix-cache guard's attention output and cost on a GPU.

vLLM's real TurboQuant builder and impl, one layer of Llama-3-8B's heads (32 query, 8 KV,
128 wide), the cache filled through the real store kernel. For random mixed prefill
batches that meet vLLM's fast-path test (upstream #46460: fresh prompts at least as long as
every cache hit's sequence, beside hits of 8-128 new tokens and one of 129-400) it compares,
per query token, the attention output against ``loop``, vLLM's own per-request loop (the
reference: the same metadata with ``max_seq_len`` one above ``max_query_len``):

* ``guarded``: the plugin's guard (one FlashAttention call for the batch, the short hits in
  shared launches of the decode kernels, the long hit through vLLM's loop);
* ``floor``: vLLM's loop with every hit dequantized and served by FlashAttention (its long
  path), a second valid computation of the same attention: the noise floor;
* ``unguarded``: vLLM's fast path, where the hits attend their new tokens only: the size
  of the error the guard prevents.

It also times one layer's prefill attention (median of ``--repeats``, metadata built
before) for the loop, the guard and the unguarded fast path. Prints a table and writes
``prefix-attention.json`` and ``.md`` to ``--out``. Needs CUDA and vLLM 0.21+:
``python -m benchmarks.tqbench.prefix_attention --out DIR``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import statistics
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

from benchmarks.tqbench.verify_attention import command, max_diff, median_us

__all__ = ["batch", "main", "measure", "summary", "table"]

PRESET, D, HQ, HK, BS = "turboquant_4bit_nc", 128, 32, 8, 16
MAX_SEQS, MAX_LEN = 24, 8192
WIDTH = MAX_LEN // BS


def batch(rng: random.Random) -> list[tuple[int, int]]:
    """(new tokens, cached tokens) per request: short hits, a long one, and fresh prompts
    at least as long as every hit's sequence (vLLM's fast-path test then holds)."""
    hits = [(rng.randint(8, 128), rng.randint(16, 3000)) for _ in range(rng.randint(2, 16))]
    hits.append((rng.randint(129, 400), rng.randint(16, 2000)))
    longest = max(q + c for q, c in hits)
    fresh = [(longest + rng.randint(0, 500), 0) for _ in range(rng.randint(2, 4))]
    reqs = hits + fresh
    rng.shuffle(reqs)
    return reqs


class Layer:
    """One TurboQuant layer on the GPU: impl, KV cache as the release lays it out, table."""

    def __init__(self, torch: Any, backend: Any, feats: Any) -> None:
        self.torch, self.backend = torch, backend
        config = SimpleNamespace(
            attention_config=SimpleNamespace(tq_max_kv_splits_for_cuda_graph=32),
            model_config=SimpleNamespace(max_model_len=MAX_LEN),
        )
        with mock.patch.object(backend, "get_current_vllm_config", return_value=config):
            self.impl = backend.TurboQuantAttentionImpl(
                num_heads=HQ, head_size=D, scale=D**-0.5, num_kv_heads=HK, kv_cache_dtype=PRESET
            )
        self.module = torch.nn.Module()
        slot = self.impl.tq_config.slot_size_aligned
        blocks = MAX_SEQS * WIDTH + 1
        shape = (blocks, HK, BS, slot) if feats.kv_head_major else (blocks, BS, HK, slot)
        kv = torch.zeros(shape, dtype=torch.uint8, device="cuda")
        self.kv = kv.transpose(1, 2) if feats.kv_view_transposed and not feats.kv_head_major else kv
        perm = torch.randperm(blocks - 1, device="cuda")[: MAX_SEQS * WIDTH] + 1
        self.table = perm.view(MAX_SEQS, WIDTH).to(torch.int32)

    def slots(self, requests: list[tuple[int, int]], cached: bool) -> Any:
        """The slots of every request's cached prefix (``cached``) or of its new tokens."""
        t = self.torch
        rows = [
            (r, p)
            for r, (q, c) in enumerate(requests)
            for p in (range(c) if cached else range(c, c + q))
        ]
        r = t.tensor([x for x, _ in rows], device="cuda")
        p = t.tensor([y for _, y in rows], device="cuda")
        return self.table[r, p // BS].long() * BS + p % BS

    def store(self, slots: Any) -> tuple[Any, Any]:
        """Random K/V stored at ``slots`` through the real store kernel; returns them."""
        t = self.torch
        k = t.randn(slots.shape[0], HK * D, dtype=t.bfloat16, device="cuda")
        v = t.randn(slots.shape[0], HK * D, dtype=t.bfloat16, device="cuda")
        for at in range(0, slots.shape[0], 8192):
            part = slice(at, at + 8192)
            self.impl.do_kv_cache_update(self.module, k[part], v[part], self.kv, slots[part])
        return k, v

    def metadata(self, requests: list[tuple[int, int]]) -> Any:
        """vLLM's builder over this step (its own ``build``)."""
        t = self.torch
        from vllm.v1.attention.backend import CommonAttentionMetadata

        qsl = [0]
        for q, _ in requests:
            qsl.append(qsl[-1] + q)
        seqs = [q + c for q, c in requests]
        fields = {
            "query_start_loc": t.tensor(qsl, dtype=t.int32, device="cuda"),
            "query_start_loc_cpu": t.tensor(qsl, dtype=t.int32),
            "seq_lens": t.tensor(seqs, dtype=t.int32, device="cuda"),
            "num_reqs": len(requests),
            "num_actual_tokens": qsl[-1],
            "max_query_len": max(q for q, _ in requests),
            "max_seq_len": max(seqs),
            "block_table_tensor": self.table[: len(requests)],
            "slot_mapping": self.slots(requests, cached=False),
            "seq_lens_cpu_upper_bound": t.tensor(seqs, dtype=t.int32),
            "_seq_lens_cpu": t.tensor(seqs, dtype=t.int32),
            "_num_computed_tokens_cpu": t.tensor([c for _, c in requests], dtype=t.int32),
        }
        names = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
        common = CommonAttentionMetadata(**{k: v for k, v in fields.items() if k in names})
        cls = self.backend.TurboQuantMetadataBuilder
        builder = cls.__new__(cls)
        builder.reorder_batch_threshold = 1
        return builder.build(0, common)

    def forward(self, meta: Any, q: Any, k: Any, v: Any) -> Any:
        out = self.torch.zeros_like(q)
        return self.impl.forward(self.module, q, k, v, self.kv, meta, output=out)


def measure(
    torch: Any, layer: Layer, guard: Any, reqs: list[tuple[int, int]], repeats: int
) -> dict[str, Any]:
    """One batch: each way's largest difference from vLLM's loop, and its time."""
    backend = layer.backend
    layer.store(layer.slots(reqs, cached=True))  # the hits' cached prefixes
    k, v = layer.store(layer.slots(reqs, cached=False))  # this step's tokens
    q = torch.randn(k.shape[0], HQ * D, dtype=torch.bfloat16, device="cuda")
    meta = layer.metadata(reqs)
    assert meta.max_query_len == meta.max_seq_len, "the batch must meet the fast-path test"
    looped = copy.copy(meta)
    looped.max_seq_len = meta.max_query_len + 1

    def loop() -> Any:
        return layer.forward(looped, q, k, v)

    def fast() -> Any:  # vLLM's fast path, or the guard where it is installed
        return layer.forward(meta, q, k, v)

    guard.remove(backend)
    ref = loop().clone()
    row: dict[str, Any] = {"requests": reqs, "tokens": int(k.shape[0])}
    row["unguarded"] = max_diff(fast(), ref)
    with mock.patch.object(backend, "_CONTINUATION_DECODE_THRESHOLD", 0):
        row["floor"] = max_diff(loop(), ref)  # every hit dequantized: FlashAttention
    row["us_loop"], row["us_unguarded"] = (
        median_us(torch, loop, repeats),
        median_us(torch, fast, repeats),
    )
    assert guard.install(backend)
    try:
        row["guarded"] = max_diff(fast(), ref)
        row["us_guarded"] = median_us(torch, fast, repeats)
    finally:
        guard.remove(backend)
    return row


def run(out: Path, seed: int, cases: int, repeats: int) -> dict[str, Any]:
    import torch
    from vllm.v1.attention.backends import turboquant_attn as backend
    from vllm.v1.worker import workspace

    from tq_warmup_plugin import compat
    from tq_warmup_plugin.guards import prefix_fast_path as guard

    feats = compat.release_features(compat.installed_vllm_version())
    rng = random.Random(seed)
    torch.manual_seed(seed)
    workspace.init_workspace_manager(torch.device("cuda"))
    layer = Layer(torch, backend, feats)
    rows: list[dict[str, Any]] = []
    for case in range(cases):
        row = measure(torch, layer, guard, batch(rng), repeats)
        rows.append({"case": case, **row})
        print(json.dumps({k: v for k, v in row.items() if k != "requests"}), flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "vllm": compat.installed_vllm_version()}
    result["summary"] = summary(rows)
    result["rows"] = rows
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefix-attention.json").write_text(json.dumps(result, indent=1))
    text = table(result["summary"])
    (out / "prefix-attention.md").write_text(text)
    print(text)
    return result


COLUMNS = ("guarded", "floor", "unguarded")
TIMES = ("us_loop", "us_guarded", "us_unguarded")


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The largest difference of each column over the cases, the median of each time and
    the guard's time over the unguarded fast path's, case by case (pure)."""
    got: dict[str, Any] = {c: max((r[c] for r in rows), default=None) for c in COLUMNS}
    got.update({t: statistics.median(r[t] for r in rows) if rows else None for t in TIMES})
    ratios = [r["us_guarded"] / r["us_unguarded"] for r in rows if r.get("us_unguarded")]
    got["guarded_over_unguarded"] = statistics.median(ratios) if ratios else None
    got["cases"] = len(rows)
    return got


def table(s: dict[str, Any]) -> str:
    def cell(v: Any) -> str:
        return "-" if v is None else f"{v:.3g}"

    lines = ["| cases | guarded | floor | unguarded |", "|---|---|---|---|"]
    lines.append(f"| {s['cases']} | " + " | ".join(cell(s[c]) for c in COLUMNS) + " |")
    lines += ["", "| loop us | guarded us | unguarded us | guarded / unguarded |"]
    lines += ["|---|---|---|---|"]
    times = [("-" if s[t] is None else f"{s[t]:.0f}") for t in TIMES]
    ratio = s["guarded_over_unguarded"]
    times.append("-" if ratio is None else f"{ratio:.3f}")
    lines.append("| " + " | ".join(times) + " |")
    return "\n".join(lines) + "\n"


main = command("prefix-attention", __doc__, run, "mixed batches", 30)


if __name__ == "__main__":
    raise SystemExit(main(None))
