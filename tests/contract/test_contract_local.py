"""Contract: for a chunked local attention layer (Llama 4) the plan holds every key
vLLM's real TurboQuant backend launches on the virtual batch vLLM's real
``ChunkedLocalAttention`` builder makes of a step; the runner's table alone does not
give them (the test can fail).

vLLM's ``create_chunked_local_attention_backend`` builder runs its
``make_local_attention_virtual_batches`` over the runner's buffers and TurboQuant's
builder on the result; the real ``do_kv_cache_update`` and ``forward`` run on CPU
tensors under the compile-only sm90 driver, recording each launch's Triton cache key.
The geometry is the one discovery reads from such a layer (``layer_geometry``).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
from realvllm import (
    MAX_NUM_SEQS,
    build_virtual,
    common_metadata,
    layer_kv_cache,
    local_builder,
    make_impl,
    recorded_keys,
    run_local,
)

from tq_warmup_plugin import compat
from tq_warmup_plugin.geometry import Geometry
from tq_warmup_plugin.warmers.triton_jit import compile_key
from tq_warmup_plugin.warmers.turboquant import turboquant_contributions
from tq_warmup_plugin.worker.discovery import layer_geometry
from tq_warmup_plugin.worker.warmup import Plan

pytestmark = pytest.mark.real_vllm

S1, DQ = "_tq_decode_stage1", "_tq_full_dequant_kv"
TOKENS = 2048


def batches(chunk: int) -> list[list[tuple[int, int]]]:
    """``(q_len, cached_len)`` per request, each within one chunk (as many virtual
    requests as real ones): decodes, one of them a 2-token query split into two
    1-token virtual decodes at a chunk boundary; a mixed batch whose continuations sit
    on virtual rows 1-3 (a 3-column table puts rows 1 and 2 off 16 bytes), the longest
    over 128 tokens where the chunk allows it."""
    long = min(200, chunk - 5)
    return [
        [(1, 40), (1, chunk + 5), (2, chunk - 1)],
        [(1, 40), (5, 3), (long, 5), (10, chunk + 6)],
    ]


def spanning(chunk: int) -> list[list[tuple[int, int]]]:
    """Prompts that continue a cached prefix over more than one chunk: several virtual
    requests per real one, the first continuing (0.21-0.29 raise IndexError here,
    ``compat.Features.local_prefill_real_lens``)."""
    return [[(1, 40), (chunk + 40, 30)], [(3, 5), (chunk + 40, 30), (7, 9)]]


def discovered(feats: compat.Features, impl: Any, kv: Any, width: int, chunk: int) -> Geometry:
    """What discovery reads from a ``ChunkedLocalAttention`` layer on this runner."""
    import torch

    layer = SimpleNamespace(impl=impl, kv_cache=kv, attention_chunk_size=chunk)
    bs = compat.kv_view(kv, feats).shape[1]
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=TOKENS),
        model_config=SimpleNamespace(dtype=torch.bfloat16, max_model_len=width * bs),
    )
    table = torch.zeros(MAX_NUM_SEQS, width, dtype=torch.int32)
    return layer_geometry(layer, table, config, feats)


def planned(g: Geometry) -> set[tuple[str, str]]:
    with recorded_keys() as ours:
        for key in Plan.of(turboquant_contributions({"layer": g})).keys:
            compile_key(key)
    return ours


@pytest.mark.parametrize(
    ("preset", "bs", "width", "chunk", "splits", "missed"),
    [
        # The shape: a runner width off 16 (i32) beside a 16-column local table:
        # the dequant's stride class differs; so does decode's with splits other than 32
        # (with 32, the continuation's stride-0 key is the same binary).
        ("turboquant_4bit_nc", 16, 40, 256, 32, {DQ}),
        ("turboquant_3bit_nc", 32, 24, 512, 8, {S1, DQ}),
        # A 3-column table: decode's stride is off 16, continuation rows off 16 bytes.
        ("turboquant_k8v4", 16, 32, 48, 32, {S1}),
        # 9 columns: both, and a dequant over an unaligned row.
        ("turboquant_4bit_nc", 16, 48, 144, 16, {S1, DQ}),
    ],
)
def test_virtual_batch_keys_are_planned(
    vllm_env: compat.Features,
    preset: str,
    bs: int,
    width: int,
    chunk: int,
    splits: int,
    missed: set[str],
) -> None:
    import torch

    impl = make_impl(preset, 128, 8, 2, splits, width * bs)
    kv = layer_kv_cache(vllm_env, 4, bs, 2, impl.tq_config.slot_size_aligned)
    runs = batches(chunk) + ([] if vllm_env.local_prefill_real_lens else spanning(chunk))
    with recorded_keys() as launched:
        run_local(impl, kv, width, chunk, bs, torch.bfloat16, runs)
    g = discovered(vllm_env, impl, kv, width, chunk)
    ours = planned(g)
    assert {name for name, _ in launched} >= {S1}
    assert launched <= ours, sorted(launched - ours)
    assert g.attention_chunk == chunk and g.local_width == chunk // bs
    # The runner's table alone (the plan before local layers were derived) misses them.
    runner_only = planned(dataclasses.replace(g, attention_chunk=0))
    assert {name for name, _ in launched - runner_only} == missed


def test_virtual_decodes_reach_decode_rows(vllm_env: compat.Features) -> None:
    """Every request a 2-token query ending on a chunk boundary: twice as many virtual
    decodes as requests, in one pure-decode launch (``Geometry.decode_rows``)."""
    import torch

    chunk, bs, width = 64, 16, 16
    requests = [(2, chunk - 1)] * MAX_NUM_SEQS
    table = torch.zeros(MAX_NUM_SEQS, width, dtype=torch.int32)
    common = common_metadata(
        requests, table, torch.zeros(MAX_NUM_SEQS, dtype=torch.int32), torch.zeros(64)
    )
    meta = build_virtual(local_builder(chunk, bs), common)
    impl = make_impl("turboquant_4bit_nc", 128, 8, 2, 32, width * bs)
    kv = layer_kv_cache(vllm_env, 4, bs, 2, impl.tq_config.slot_size_aligned)
    g = discovered(vllm_env, impl, kv, width, chunk)
    assert not meta.is_prefill and meta.num_decodes == 2 * MAX_NUM_SEQS == g.decode_rows
    assert meta.block_table.stride(0) == g.local_width and meta.block_table.dtype == torch.int32


def test_spanning_continuations_fail_where_real_lengths_are_read(
    vllm_env: compat.Features,
) -> None:
    """0.21-0.29 hand TurboQuant's prefill loop the real batch's lengths for the virtual
    requests (``local_prefill_real_lens``): a prompt continuing over two chunks runs past
    them. 0.20 and 0.30+ run it."""
    import torch

    chunk, bs, width = 64, 16, 16
    impl = make_impl("turboquant_4bit_nc", 128, 8, 2, 32, width * bs)
    kv = layer_kv_cache(vllm_env, 4, bs, 2, impl.tq_config.slot_size_aligned)
    with recorded_keys():
        if vllm_env.local_prefill_real_lens:
            with pytest.raises(IndexError):
                run_local(impl, kv, width, chunk, bs, torch.bfloat16, spanning(chunk)[:1])
        else:
            run_local(impl, kv, width, chunk, bs, torch.bfloat16, spanning(chunk)[:1])
