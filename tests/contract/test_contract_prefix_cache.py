"""Contract: the prefix-cache guard against vLLM's real TurboQuant builder and impl
(upstream #46460: the first-chunk fast path drops a cache hit's prefix).

vLLM's real ``TurboQuantMetadataBuilder.build`` and ``TurboQuantAttentionImpl.forward``
(and its ``_prefill_attention``) run on CPU tensors. What stands in is what a CPU cannot
run: FlashAttention (``_HAS_FLASH_ATTN`` on, ``_flash_attn_varlen`` a recorder), the
decode launcher and the long continuation (recorders). Each query token's vector
carries its index, so every record says which tokens attended how many positions.

The check: the last token of every request must attend its request's *whole* sequence
(a cache hit's cached prefix included). With the guard off it fails on each mixed batch
of a fresh prompt and cache hits (the bug, on every release in CI); with it on it holds,
and a batch of fresh prompts alone keeps vLLM's one-call fast path.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
from realvllm import _layer_and_buffers, common_metadata, layer_kv_cache, make_impl

from tq_warmup_plugin import compat
from tq_warmup_plugin.guards import prefix_fast_path as guard

pytestmark = pytest.mark.real_vllm

WIDTH, BS, HQ, HK, D = 63, 16, 4, 2, 128
P = 640  # the cached prefix
# (query_len, cached_len) per request, decodes first as the runner orders them.
MIXED = {
    # A fresh prompt C at least as long as every hit's sequence: the maxima are equal.
    "fresh-and-hits": [(700, 0), (50, P), (60, P)],
    "hit-first": [(50, P), (700, 0), (12, P)],
    "long-hit": [(200, 480), (700, 0)],  # a hit over 128 tokens: the long continuation
    # vLLM's mixed branch: the prefill part gets the batch's max query, its own max seq.
    "decodes-fresh-hit": [(1, 30), (1, 500), (700, 0), (50, P)],
}
FRESH = {
    "fresh-only": [(300, 0), (700, 0), (20, 0)],
    "decodes-fresh-only": [(1, 30), (300, 0), (700, 0)],
    "one-fresh": [(700, 0)],
}
CONTROL = {"hit-longest": [(50, P), (100, 0)]}  # maxima differ: vLLM's loop already


class Recorder:
    """What each stand-in launch attended: ``{token: positions}`` and the FA calls."""

    def __init__(self) -> None:
        self.attended: dict[int, int] = {}
        self.fa_calls: list[list[int]] = []

    def flash(self, *, q: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, **_: Any) -> Any:
        import torch

        cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        self.fa_calls.append(cu_k)
        for i in range(len(cu_q) - 1):
            # causal, aligned at the bottom right as FlashAttention's varlen call is
            keys, queries = cu_k[i + 1] - cu_k[i], cu_q[i + 1] - cu_q[i]
            for t in range(cu_q[i], cu_q[i + 1]):
                self.attended[int(q[t, 0, 0].item())] = keys - queries + t - cu_q[i] + 1
        return torch.zeros_like(q)

    def decode(self, *, query: Any, seq_lens: Any, **_: Any) -> Any:
        import torch

        for i in range(query.shape[0]):
            self.attended[int(query[i, 0, 0].item())] = int(seq_lens[i].item())
        return torch.zeros_like(query)

    def continuation(self, layer: Any, query: Any, *args: Any) -> Any:
        import torch

        cached_len = int(args[4])  # (key, value, kv_cache, block_table, cached_len, ...)
        for t in range(query.shape[0]):
            self.attended[int(query[t, 0, 0].item())] = cached_len + t + 1
        return torch.zeros_like(query)


@pytest.fixture
def backend(vllm_env: compat.Features, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from vllm.v1.attention.backends import turboquant_attn

    assert vllm_env.prefix_fast_path_unsafe
    monkeypatch.setattr(turboquant_attn, "_HAS_FLASH_ATTN", True)  # as on a GPU
    guard.remove(turboquant_attn)  # vLLM's plugin loading may have installed it
    yield turboquant_attn
    guard.remove(turboquant_attn)


def step(backend: Any, requests: list[tuple[int, int]], monkeypatch: Any) -> Recorder:
    """One step of ``requests`` through vLLM's builder and ``forward``."""
    import torch

    impl = make_impl("turboquant_4bit_nc", D, HQ, HK, 32, WIDTH * BS)
    feats = compat.release_features(compat.installed_vllm_version())
    kv = layer_kv_cache(feats, 64, BS, HK, impl.tq_config.slot_size_aligned)
    layer, table, seq_buf, slot_buf = _layer_and_buffers(impl, WIDTH)
    builder = backend.TurboQuantMetadataBuilder.__new__(backend.TurboQuantMetadataBuilder)
    builder.reorder_batch_threshold = 1  # what vLLM's own __init__ sets
    meta = builder.build(0, common_metadata(requests, table, seq_buf, slot_buf))
    n = meta.num_actual_tokens
    q = torch.arange(n, dtype=torch.float32)[:, None].expand(n, HQ * D).contiguous()
    k = torch.zeros(n, HK * D)
    rec = Recorder()
    monkeypatch.setattr(impl, "_flash_attn_varlen", rec.flash)
    monkeypatch.setattr(impl, "_continuation_prefill", rec.continuation)
    monkeypatch.setattr(backend, "triton_turboquant_decode_attention", rec.decode)
    impl.forward(layer, q, k, k, kv, meta, output=torch.zeros(n, HQ * D))
    return rec


def lost(requests: list[tuple[int, int]], rec: Recorder) -> dict[int, int]:
    """Request -> positions its last token missed (0 for none)."""
    ends = list(itertools.accumulate(q for q, _ in requests))
    return {r: q + c - rec.attended[ends[r] - 1] for r, (q, c) in enumerate(requests)}


@pytest.mark.parametrize("case", sorted(MIXED))
def test_upstream_46460_a_hit_beside_a_long_fresh_prompt_loses_its_prefix_unguarded(
    backend: Any, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """The bug as vLLM ships it: every cache hit of the batch attends its query only."""
    requests = MIXED[case]
    missed = lost(requests, step(backend, requests, monkeypatch))
    assert {r: m for r, m in missed.items() if m} == {
        r: c for r, (q, c) in enumerate(requests) if c and q > 1
    }


@pytest.mark.parametrize("case", sorted(MIXED) + sorted(CONTROL))
def test_upstream_46460_every_hit_reads_its_cached_prefix_guarded(
    backend: Any, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    requests = (MIXED | CONTROL)[case]
    assert guard.install(backend) and guard.installed(backend)
    rec = step(backend, requests, monkeypatch)
    assert lost(requests, rec) == dict.fromkeys(range(len(requests)), 0)
    # every token of every request attended its full causal prefix
    starts = [0, *itertools.accumulate(q for q, _ in requests)]
    for r, (q, c) in enumerate(requests):
        assert [rec.attended[starts[r] + t] for t in range(q)] == list(range(c + 1, c + q + 1))


@pytest.mark.parametrize("case", sorted(FRESH))
def test_fresh_prompts_alone_keep_the_one_call_fast_path(
    backend: Any, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    requests = FRESH[case]
    unguarded = step(backend, requests, monkeypatch)
    assert guard.install(backend)
    guarded = step(backend, requests, monkeypatch)
    assert guarded.fa_calls == unguarded.fa_calls
    prefill = [q for q, c in requests if q > 1]
    assert guarded.fa_calls == [[0, *itertools.accumulate(prefill)]]  # one batch call
    assert lost(requests, guarded) == dict.fromkeys(range(len(requests)), 0)


def test_remove_gives_vllm_its_own_method_back(backend: Any) -> None:
    original = backend.TurboQuantAttentionImpl.__dict__["_prefill_attention"]
    assert guard.install(backend) and guard.install(backend)  # idempotent
    assert backend.TurboQuantAttentionImpl.__dict__["_prefill_attention"] is not original
    guard.remove(backend)
    assert backend.TurboQuantAttentionImpl.__dict__["_prefill_attention"] is original
    assert not guard.installed(backend)
