"""Contract: the batched verify path against vLLM's real TurboQuant backend.

vLLM's real builder (``TurboQuantMetadataBuilder.build``, ``build_for_cudagraph_capture``)
and impl (``forward``, ``_prefill_attention``, ``_decode_attention``) run on CPU tensors.
The decode launcher the backend calls (``triton_turboquant_decode_attention``) is replaced
by a recorder of what each launch is given: per query row, the block-table row and the
causal length. vLLM's own per-request loop (the builder as vLLM ships it) is the
reference: with the batched path the same rows must be attended, the decode part in
one launch. The keys the path launches through the real launcher must be in the plan.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from realvllm import (
    MAX_NUM_SEQS,
    common_metadata,
    impl_geometry,
    layer_kv_cache,
    make_impl,
    recorded_keys,
)

from tq_warmup_plugin import compat
from tq_warmup_plugin.guards import batched_verify, spec_graphs
from tq_warmup_plugin.warmers.triton_jit import compile_key
from tq_warmup_plugin.warmers.turboquant import turboquant_contributions
from tq_warmup_plugin.worker import verify_rows
from tq_warmup_plugin.worker.verify_rows import loop_rows
from tq_warmup_plugin.worker.warmup import Plan

pytestmark = pytest.mark.real_vllm

WIDTH, BS, HQ, HK, D = 63, 16, 8, 2, 128
# (q_len, cached_len) per request, decode-like requests first as the runner orders them
# (requests of up to 1 + k tokens; ngram found fewer drafts for some), then prefill
# chunks: a short continuation (vLLM's fast path) and a first chunk.
BATCHES = {
    1: [[(2, 40), (1, 7), (2, 3)], [(2, 40), (2, 90), (20, 30), (6, 0)]],
    2: [[(3, 40), (1, 7), (2, 3), (3, 100)], [(3, 17), (2, 5), (20, 30), (40, 0)]],
    4: [[(5, 40), (1, 7), (3, 3), (5, 200), (2, 1)], [(5, 33), (4, 64), (12, 9), (7, 0)]],
}


def spec_config(
    k: int, dcp: int = 1, parallel: bool = False, v2: bool = True, slots: int = 0
) -> Any:
    """What the builder and the support level read of a VllmConfig under speculative
    decoding (a full one needs a model and a device). ``slots``: 0.34's
    ``max_num_new_slots_for_drafting``, 1 for draft_model's correction token, else 0."""
    return SimpleNamespace(
        speculative_config=SimpleNamespace(
            num_speculative_tokens=k,
            parallel_drafting=parallel,
            max_num_new_slots_for_drafting=slots,
        ),
        parallel_config=SimpleNamespace(decode_context_parallel_size=dcp),
        scheduler_config=SimpleNamespace(max_num_seqs=MAX_NUM_SEQS),
        cache_config=SimpleNamespace(cache_dtype="turboquant_4bit_nc"),
        use_v2_model_runner=v2,
    )


@pytest.fixture
def backend(vllm_env: compat.Features) -> Iterator[Any]:
    from vllm.v1.attention.backends import turboquant_attn

    if not vllm_env.spec_verify_batched:
        pytest.skip(f"vLLM {vllm_env.version}: no batched verify path")
    assert batched_verify.install(turboquant_attn)
    yield turboquant_attn
    batched_verify.remove(turboquant_attn)
    assert not spec_graphs.installed(turboquant_attn)


def make_builder(backend: Any, config: Any) -> Any:
    """The real builder, through its real ``__init__`` past the base class (which needs a
    KV-cache spec and a device): our wrapper, then vLLM's ``_init_reorder_batch_threshold``."""
    cls = backend.TurboQuantMetadataBuilder
    builder = cls.__new__(cls)
    builder.vllm_config, builder.device = config, "cpu"
    builder.reorder_batch_threshold = 1  # what vLLM's own __init__ sets
    batched_verify.serve_rows(builder)
    return builder


class Launches:
    """Records every decode launch: ``(token, table row, causal length)`` per row."""

    def __init__(self) -> None:
        self.calls: list[list[tuple[int, tuple[int, ...], int]]] = []

    def __call__(self, *, query: Any, block_table: Any, seq_lens: Any, **_: Any) -> Any:
        import torch

        rows = []
        for i in range(query.shape[0]):
            token = int(query[i, 0, 0].item())
            rows.append((token, tuple(block_table[i].tolist()), int(seq_lens[i].item())))
        self.calls.append(rows)
        return torch.zeros(query.shape[0], query.shape[1], query.shape[2], dtype=query.dtype)

    def rows(self) -> list[tuple[int, tuple[int, ...], int]]:
        return sorted(itertools.chain.from_iterable(self.calls))


def attend(
    backend: Any, builder: Any, requests: list[tuple[int, int]], monkeypatch: Any
) -> Launches:
    """One step through the builder and the impl's ``forward``; each query token's
    vector carries its index, each request's table row its own block numbers."""
    import torch

    impl = make_impl("turboquant_4bit_nc", D, HQ, HK, 32, WIDTH * BS)
    feats = compat.release_features(compat.installed_vllm_version())
    kv = layer_kv_cache(feats, 64, BS, HK, impl.tq_config.slot_size_aligned)
    from realvllm import _layer_and_buffers

    layer, table, seq_buf, slot_buf = _layer_and_buffers(impl, WIDTH)
    table.copy_(torch.arange(MAX_NUM_SEQS * WIDTH, dtype=torch.int32).view(MAX_NUM_SEQS, -1) % 64)
    common = common_metadata(requests, table, seq_buf, slot_buf)
    n = common.num_actual_tokens
    q = torch.arange(n, dtype=torch.float32)[:, None].expand(n, HQ * D).to(torch.bfloat16)
    k = torch.zeros(n, HK * D, dtype=torch.bfloat16)
    launches = Launches()
    monkeypatch.setattr(backend, "triton_turboquant_decode_attention", launches)
    meta = builder.build(0, common)
    with recorded_keys():  # the long-continuation dequant kernel: recorded, not run
        impl.forward(layer, q, k, k, kv, meta, output=torch.zeros(n, HQ * D, dtype=q.dtype))
    return launches


@pytest.mark.parametrize("k", sorted(BATCHES))
@pytest.mark.parametrize("step", [0, 1])
def test_rows_equal_the_per_request_loop(backend: Any, monkeypatch: Any, k: int, step: int) -> None:
    """Mixed batches and short drafts: every decode-part token attends the same table
    row over the same causal length as in vLLM's loop, in one launch."""
    requests = BATCHES[k][step]
    plain = backend.TurboQuantMetadataBuilder.__new__(backend.TurboQuantMetadataBuilder)
    plain.reorder_batch_threshold = 1  # vLLM's builder: every verify request is a prefill
    reference = attend(backend, plain, requests, monkeypatch)
    builder = make_builder(backend, spec_config(k))
    assert builder.reorder_batch_threshold == 1 + k == compat.spec_decode_threshold(spec_config(k))
    batched = attend(backend, builder, requests, monkeypatch)
    assert batched.rows() == reference.rows()
    decodes = next(i for i, (q, _) in enumerate([*requests, (k + 2, 0)]) if q > 1 + k)
    decode_tokens = sum(q for q, _ in requests[:decodes])
    assert len(batched.calls[0]) == decode_tokens  # the decode part: one launch
    continuing = [r for r in requests[decodes:] if r[1] > 0]
    assert len(batched.calls) == 1 + len(continuing)  # the prefill part: vLLM's loop
    # The lengths are the loop's own arithmetic (the pure reference) too.
    qsl = [0, *itertools.accumulate(q for q, _ in requests)]
    seqs = [q + c for q, c in requests]
    assert [length for _, _, length in batched.calls[0]] == [
        length for _, length in loop_rows(qsl, seqs, decodes)
    ]


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("v2", [False, True])
@pytest.mark.parametrize("slots", [0, 1])
def test_the_rows_serve_vllms_own_spec_as_decode_threshold(
    backend: Any, k: int, parallel: bool, v2: bool, slots: int
) -> None:
    """The support level exempts what ``serves`` names, so the rows must cover vLLM's own
    spec-as-decode threshold in every case: parallel drafting (V1 doubles the drafts,
    0.21-0.33), the V2 runner (0.33 does not), draft_model's correction token (0.34 counts
    it), decode context parallel (threshold 1: no rows, the PIECEWISE cap)."""
    config = spec_config(k, parallel=parallel, v2=v2, slots=slots)
    vllms = backend.TurboQuantMetadataBuilder.__new__(backend.TurboQuantMetadataBuilder)
    vllms.vllm_config = config
    vllms._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
    builder = make_builder(backend, config)
    rows = verify_rows.rows_of(builder)
    assert rows is not None
    assert builder.reorder_batch_threshold == vllms.reorder_batch_threshold == rows.query_len
    assert compat.spec_decode_threshold(config) == vllms.reorder_batch_threshold
    assert rows.capacity == MAX_NUM_SEQS * rows.query_len
    split = make_builder(backend, spec_config(k, dcp=2, parallel=parallel, v2=v2))
    assert verify_rows.rows_of(split) is None and split.reorder_batch_threshold == 1
    assert not batched_verify.serves(spec_config(k, dcp=2, parallel=parallel, v2=v2))


def test_rows_stay_valid_on_capture_and_padding(backend: Any) -> None:
    """vLLM's capture metadata (``build_for_cudagraph_capture`` sets ``seq_lens`` to 1,
    shorter than the 1 + k tokens) and a graph's padded requests (0 tokens, length 0)
    give rows of length >= 1 within their request's table row."""
    from realvllm import _layer_and_buffers

    k = 2
    builder = make_builder(backend, spec_config(k))
    impl = make_impl("turboquant_4bit_nc", D, HQ, HK, 32, WIDTH * BS)
    _, table, seq_buf, slot_buf = _layer_and_buffers(impl, WIDTH)
    common = common_metadata([(1 + k, 0)] * 4, table, seq_buf, slot_buf)
    meta = builder.build_for_cudagraph_capture(common)
    assert not meta.is_prefill and meta.num_decodes == meta.num_decode_tokens == 4 * (1 + k)
    assert meta.seq_lens.tolist() == [1] * 12 and meta.block_table.shape == (12, WIDTH)
    # A uniform batch of 2 requests padded to 4 (2 requests of 0 tokens, 6 pad tokens).
    padded = common_metadata([(3, 10), (3, 20), (0, 0), (0, 0)], table, seq_buf, slot_buf)
    padded.num_actual_tokens = 12
    meta = builder.build(0, padded)
    lengths = meta.seq_lens.tolist()
    assert lengths[:6] == [11, 12, 13, 21, 22, 23] and min(lengths) == 1
    assert bool((meta.block_table[6:] == table[1]).all())  # the last request's row
    before = meta.seq_lens.data_ptr(), meta.block_table.data_ptr()
    again = builder.build(0, common_metadata([(3, 5)] * 2, table, seq_buf, slot_buf))
    assert (again.seq_lens.data_ptr(), again.block_table.data_ptr()) == before  # graph-safe


def test_vllms_mode_resolution_follows_the_path(backend: Any) -> None:
    """FULL_AND_PIECEWISE where the rows serve; PIECEWISE where they cannot (decode
    context parallelism keeps the threshold at 1) and without the path."""
    from test_guard_spec_graphs import resolve
    from vllm.v1.attention.backend import AttentionCGSupport

    builder = backend.TurboQuantMetadataBuilder
    for k in (1, 2, 4):
        support = builder.get_cudagraph_support(spec_config(k), None)
        assert support is AttentionCGSupport.UNIFORM_BATCH
        assert resolve(support, 1 + k) == "FULL_AND_PIECEWISE"
        capped = builder.get_cudagraph_support(spec_config(k, dcp=2), None)
        assert resolve(capped, 1 + k) == "PIECEWISE"
    batched_verify.remove(backend)
    assert spec_graphs.install(backend)  # TQ_WARMUP_SPEC_GUARD=piecewise
    assert resolve(builder.get_cudagraph_support(spec_config(2), None), 3) == "PIECEWISE"
    spec_graphs.remove(backend)
    assert batched_verify.install(backend)


@pytest.mark.parametrize("k", [1, 4])
def test_keys_of_the_rows_are_in_the_plan(backend: Any, k: int) -> None:
    """Through the real launcher: the decode part's launch over the rows (and the mixed
    step's prefill part) asks Triton only for keys the warmup plans."""
    import torch
    from realvllm import _layer_and_buffers

    feats = compat.release_features(compat.installed_vllm_version())
    impl = make_impl("turboquant_4bit_nc", D, HQ, HK, 32, WIDTH * BS)
    kv = layer_kv_cache(feats, 64, BS, HK, impl.tq_config.slot_size_aligned)
    layer, table, seq_buf, slot_buf = _layer_and_buffers(impl, WIDTH)
    builder = make_builder(backend, spec_config(k))
    with recorded_keys() as launched:
        for requests in BATCHES[k]:
            common = common_metadata(requests, table, seq_buf, slot_buf)
            n = common.num_actual_tokens
            q = torch.randn(n, HQ * D, dtype=torch.bfloat16)
            meta = builder.build(0, common)
            out = torch.zeros(n, HQ * D, dtype=q.dtype)
            impl.forward(layer, q, q[:, : HK * D], q[:, : HK * D], kv, meta, output=out)
    view = compat.kv_view(kv, feats)
    g = impl_geometry(feats, impl, WIDTH, BS, tuple(view.stride()[:3]))  # type: ignore[arg-type]
    g = g.__class__(**{**g.__dict__, "verify_len": 1 + k})
    with recorded_keys() as ours:
        for key in Plan.of(turboquant_contributions({"layer": g})).keys:
            compile_key(key)
    assert {name for name, _ in launched} >= {"_tq_decode_stage1", "_fwd_kernel_stage2"}
    assert launched <= ours, sorted(launched - ours)
