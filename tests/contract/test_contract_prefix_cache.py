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

The split (two or more fresh prompts beside cache hits) is checked on values: the stand-ins
compute (FlashAttention: torch's SDPA per varlen segment; the decode kernel and the long
continuation: attention over the request's K/V from a side table, as the cache holds it),
forward's output must equal a dense float64 reference of every token over its whole causal
prefix, and the launches are counted: the fresh prompts of a step share one FlashAttention
call, each hit reads its cache once.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
from realvllm import _layer_and_buffers, common_metadata, layer_kv_cache, make_impl

from tq_warmup_plugin import compat
from tq_warmup_plugin.geometry import PRESETS
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


# The split (several first chunks beside cache hits): reference stand-ins that compute.
SPLIT = {
    "fresh-hit-fresh": [(120, 0), (20, 160), (200, 0)],
    "two-hit-runs": [(20, 160), (30, 160), (80, 0), (12, 160), (200, 0), (20, 0)],
    # 180 rows of short hits: two decode calls of at most 128 rows (60 + 60, then 60).
    "three-hits-two-calls": [(60, 160), (60, 161), (120, 0), (60, 163), (240, 0)],
    "long-hit": [(100, 0), (150, 40), (200, 0)],  # a hit over 128 tokens: the long one
    "decodes-fresh-hits": [(1, 30), (1, 300), (120, 0), (20, 160), (200, 0), (30, 160)],
    "one-fresh": [(200, 0), (20, 160)],  # MIN_FRESH: vLLM's loop, one call for the fresh
    "fresh-only": [(120, 0), (200, 0)],
    "hits-only": [(20, 160), (150, 40)],  # vLLM's loop (its maxima differ): no FA call
}
TOL = {"atol": 1e-5, "rtol": 1e-5}  # float32 stand-ins against a float64 dense reference


def attend(q: Any, k: Any, v: Any, scale: float, seen: Any = None) -> Any:
    """Attention of each query token ``t`` over the first ``seen[t]`` keys (by default
    causal, aligned at the bottom right: ``len(k) - len(q) + t + 1``), GQA heads grouped
    as vLLM's: one explicit softmax per head, in ``q``'s dtype."""
    import torch

    n, m, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    if seen is None:
        seen = torch.arange(n) + (m - n + 1)
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    scores = scores.masked_fill(torch.arange(m)[None, :] >= seen[:, None], float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v)


class Reference:
    """FlashAttention, the decode kernel and the long continuation as computing
    references, recording each launch. The cache is a side table: a request's whole
    sequence of K/V (cached prefix and this step's tokens, as ``do_kv_cache_update``
    leaves it), found by the first block of its block-table row."""

    def __init__(self, scale: float, cached: dict[int, tuple[Any, Any]]) -> None:
        self.scale, self.cached = scale, cached
        self.fa_calls: list[list[int]] = []
        self.cache_reads: list[tuple[str, int]] = []  # (entry, request's first block)
        self.decode_rows: list[int] = []  # rows per decode launch

    def flash(self, *, q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any,
              **_: Any) -> Any:  # fmt: skip
        """The varlen call: ``torch``'s SDPA per segment, causal at the bottom right."""
        import torch
        import torch.nn.functional as F

        cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        self.fa_calls.append(cu_q)
        out = torch.zeros_like(q)
        for i in range(len(cu_q) - 1):
            qs, ks = q[cu_q[i] : cu_q[i + 1]], k[cu_k[i] : cu_k[i + 1]]
            vs = v[cu_k[i] : cu_k[i + 1]]
            n, m = qs.shape[0], ks.shape[0]
            mask = torch.arange(m)[None, :] <= torch.arange(n)[:, None] + (m - n)
            out[cu_q[i] : cu_q[i + 1]] = F.scaled_dot_product_attention(
                qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), attn_mask=mask,
                scale=self.scale, enable_gqa=True,
            ).transpose(0, 1)  # fmt: skip
        return out

    def decode(self, *, query: Any, block_table: Any, seq_lens: Any, **_: Any) -> Any:
        """Row ``i`` attends the first ``seq_lens[i]`` positions of its request."""
        import torch

        out = torch.zeros_like(query)
        self.decode_rows.append(query.shape[0])
        firsts = block_table[:, 0]
        for first in firsts.unique().tolist():
            rows = firsts == first
            k, v = self.cached[first]
            out[rows] = attend(query[rows], k, v, self.scale, seq_lens[rows].long())
            self.cache_reads.append(("decode", first))
        return out

    def continuation(self, layer: Any, query: Any, key: Any, value: Any, kv_cache: Any,
                     block_table: Any, cached_len: int, seq_len: int, *_: Any) -> Any:  # fmt: skip
        """The cached prefix from the side table, this chunk's K/V as given."""
        import torch

        first = int(block_table[0, 0])
        self.cache_reads.append(("continuation", first))
        k, v = self.cached[first]
        assert query.shape[0] == seq_len - cached_len
        keys = torch.cat([k[:cached_len], key])
        return attend(query, keys, torch.cat([v[:cached_len], value]), self.scale)


def reference_step(
    backend: Any, requests: list[tuple[int, int]], monkeypatch: Any
) -> tuple[Any, Any, Reference]:
    """One step of ``requests`` through vLLM's builder and ``forward`` with random
    Q/K/V: (forward's output, the dense reference, the launches)."""
    import torch

    impl = make_impl("turboquant_4bit_nc", D, HQ, HK, 32, WIDTH * BS)
    feats = compat.release_features(compat.installed_vllm_version())
    kv = layer_kv_cache(feats, 64, BS, HK, impl.tq_config.slot_size_aligned)
    layer, table, seq_buf, slot_buf = _layer_and_buffers(impl, WIDTH)
    gen = torch.Generator().manual_seed(46460)
    cached: dict[int, tuple[Any, Any]] = {}
    qs, ks, vs, dense = [], [], [], []
    for r, (q, c) in enumerate(requests):
        table[r, 0] = r + 1  # the request's key in the side table
        k, v = (torch.randn(q + c, HK, D, generator=gen) for _ in range(2))
        cached[r + 1] = (k, v)
        qs.append(torch.randn(q, HQ, D, generator=gen))
        ks.append(k[c:])
        vs.append(v[c:])
        dense.append(attend(qs[-1].double(), k.double(), v.double(), impl.scale))
    builder = backend.TurboQuantMetadataBuilder.__new__(backend.TurboQuantMetadataBuilder)
    builder.reorder_batch_threshold = 1
    meta = builder.build(0, common_metadata(requests, table, seq_buf, slot_buf))
    ref = Reference(impl.scale, cached)
    monkeypatch.setattr(impl, "_flash_attn_varlen", ref.flash)
    monkeypatch.setattr(impl, "_continuation_prefill", ref.continuation)
    monkeypatch.setattr(impl, "_dispatch_decode_soa", ref.decode, raising=False)
    monkeypatch.setattr(backend, "triton_turboquant_decode_attention", ref.decode)
    n = meta.num_actual_tokens
    output = torch.zeros(n, HQ * D)
    flat = [torch.cat(x).reshape(n, -1) for x in (qs, ks, vs)]
    impl.forward(layer, *flat, kv, meta, output=output)
    return output.view(n, HQ, D), torch.cat(dense), ref


@pytest.mark.parametrize("case", sorted(SPLIT))
def test_every_token_attends_its_full_causal_prefix_and_fresh_prompts_share_one_call(
    backend: Any, vllm_env: compat.Features, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """Guarded, through vLLM's real ``_prefill_attention``: forward's output is the dense
    causal attention of every token over its request's whole sequence (cached prefix
    included); the first chunks of the step take ONE FlashAttention call between them
    (vLLM's fast path over the whole prefill part, or its loop's one call where there is
    one), and every other request reads its cache once (one continuation launch)."""
    import torch

    requests = SPLIT[case]
    assert guard.install(backend)
    out, dense, ref = reference_step(backend, requests, monkeypatch)
    torch.testing.assert_close(out.double(), dense, **TOL)
    fresh = [q for q, c in requests if c == 0]
    if vllm_env.prefill_host_copies or len(fresh) < 2:
        assert len(ref.fa_calls) == (1 if fresh else 0)
    prefill = [(q, c) for q, c in requests if q > 1]
    if len(fresh) >= 2 and vllm_env.prefill_host_copies:  # the split: the fast path
        assert ref.fa_calls == [[0, *itertools.accumulate(q for q, _ in prefill)]]
    hits = {r + 1 for r, (q, c) in enumerate(requests) if c and q > 1}
    reads = [first for entry, first in ref.cache_reads if first in hits]
    assert sorted(reads) == sorted(hits)  # each hit once
    short = [q for q, c in requests if c and 1 < q <= compat.CONTINUATION_DECODE_THRESHOLD]
    if len(fresh) >= 2 and vllm_env.prefill_host_copies and short:  # together, 128 at most
        decodes = int(any(q == 1 for q, _ in requests))  # forward's decode part: one call
        assert ref.decode_rows[decodes:] == [sum(g) for g in _packed(short)], ref.decode_rows


def _packed(rows: list[int], cap: int = compat.CONTINUATION_DECODE_THRESHOLD) -> list[list[int]]:
    """``rows`` in order, in groups of at most ``cap``: the launches the hits should take."""
    out: list[list[int]] = []
    for n in rows:
        if out and sum(out[-1]) + n <= cap:
            out[-1].append(n)
        else:
            out.append([n])
    return out


def test_unguarded_the_reference_check_sees_the_lost_prefix(
    backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check above is not blind: vLLM's own fast path fails it."""
    import torch

    out, dense, ref = reference_step(backend, SPLIT["fresh-hit-fresh"], monkeypatch)
    assert len(ref.fa_calls) == 1 and not ref.cache_reads
    fresh_rows = [*range(0, 120), *range(140, 340)]
    torch.testing.assert_close(out[fresh_rows].double(), dense[fresh_rows], **TOL)
    assert not torch.allclose(out[120:140].double(), dense[120:140], **TOL)


def test_the_hits_batch_has_every_field_of_the_real_metadata(vllm_env: compat.Features) -> None:
    """``guard.FIELDS`` is the real ``TurboQuantMetadata``'s field list (0.21+), so the
    hits' packed batch sets or keeps each field knowingly; a release that adds one is not
    split until it is judged here."""
    import dataclasses

    from vllm.v1.attention.backends.turboquant_attn import TurboQuantMetadata

    names = {f.name for f in dataclasses.fields(TurboQuantMetadata)}
    if vllm_env.prefill_host_copies:
        assert names == guard.FIELDS
    else:
        assert not {"query_start_loc_cpu", "seq_lens_cpu"} & names


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_the_hits_launch_compiles_only_planned_keys(
    backend: Any, vllm_env: compat.Features, monkeypatch: pytest.MonkeyPatch, preset: str
) -> None:
    """The short hits' shared launch of vLLM's real decode launcher asks Triton only for
    keys the warmup plan holds (its packed table's rows padded from 63 blocks to 64, as a
    row stride of 0 is divisible; cached lengths of both arange alignments), so a
    guarded step compiles nothing."""
    import torch
    from realvllm import impl_geometry, recorded_keys

    from tq_warmup_plugin.warmers.triton_jit import compile_key
    from tq_warmup_plugin.warmers.turboquant import turboquant_contributions
    from tq_warmup_plugin.worker.warmup import Plan

    requests = [(20, 160), (30, 161), (120, 0), (12, 162), (7, 163), (240, 0)]
    width, bs, hq, hk, d = 63, 16, 16, 8, 128
    # 16 splits for plain decode: its keys (table stride 63) are then none of the
    # continuation's (the launcher's 32 splits), so an unpadded table would show.
    impl = make_impl(preset, d, hq, hk, 16, width * bs)
    kv = layer_kv_cache(vllm_env, 64, bs, hk, impl.tq_config.slot_size_aligned)
    layer, table, seq_buf, slot_buf = _layer_and_buffers(impl, width)
    builder = backend.TurboQuantMetadataBuilder.__new__(backend.TurboQuantMetadataBuilder)
    builder.reorder_batch_threshold = 1
    meta = builder.build(0, common_metadata(requests, table, seq_buf, slot_buf))
    rows: list[int] = []
    launch = backend.triton_turboquant_decode_attention

    def counted(**kwargs: Any) -> Any:
        rows.append(kwargs["query"].shape[0])
        return launch(**kwargs)

    monkeypatch.setattr(impl, "_flash_attn_varlen", lambda *, q, **_: torch.zeros_like(q))
    monkeypatch.setattr(backend, "triton_turboquant_decode_attention", counted)
    n = meta.num_actual_tokens
    assert guard.install(backend)
    with recorded_keys() as launched:
        x = torch.randn(n, hq * d, dtype=torch.bfloat16)
        kv_x = torch.randn(n, hk * d, dtype=torch.bfloat16)
        impl.forward(layer, x, kv_x, kv_x, kv, meta, output=torch.zeros_like(x))
    assert rows == [69], rows  # the four hits, one launch
    view = compat.kv_view(kv, vllm_env)
    g = impl_geometry(vllm_env, impl, width, bs, tuple(view.stride()[:3]), "bfloat16")
    with recorded_keys() as ours:
        for key in Plan.of(turboquant_contributions({"layer": g})).keys:
            compile_key(key)
    assert {name for name, _ in launched} >= {"_tq_decode_stage1", "_fwd_kernel_stage2"}
    assert launched <= ours, sorted(launched - ours)
