"""Contract: the keys our pure functions derive are exactly the keys vLLM's real
TurboQuant backend launches, path by path, for every preset and a grid of shapes.

The real ``TurboQuantAttentionImpl`` runs its real ``forward`` and
``do_kv_cache_update`` on CPU tensors; a compile-only Triton driver for sm90 and
Triton's ``jit_cache_hook`` record each launch's cache key without compiling.
Our warmer then runs for the same geometry under the same recorder.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import pytest

from tq_warmup_plugin import compat, keys
from tq_warmup_plugin.warmers.triton_jit import compile_key

pytestmark = pytest.mark.real_vllm

PRESETS = sorted(keys.PRESETS)
MAX_NUM_SEQS = 8
BATCHED_TOKENS = 2048
# (q_len, cached_len) per request. Rows 0..4 of an odd-width table cover both row
# alignments; cached 3 vs 4 gives arange slices at aligned (4) and unaligned (5)
# offsets; 130 tokens exceed the 128-token fast-path threshold.
PREFILL_BATCHES = [[(5, 3), (6, 4), (130, 20), (3, 3), (4, 4)], [(130, 16)]]


@pytest.fixture(scope="module")
def vllm_env() -> Any:
    from realvllm import activate_compile_only_driver

    activate_compile_only_driver()
    import torch
    from vllm.v1.worker import workspace

    # A workspace resize frees cached accelerator memory, which a CPU host lacks.
    torch.accelerator.empty_cache = lambda: None

    feats = compat.features(compat.parse_version(compat.installed_vllm_version()))  # type: ignore[arg-type]
    if not workspace.is_workspace_manager_initialized():
        workspace.init_workspace_manager(torch.device("cpu"))
    return feats


def make_impl(cache_dtype: str, d: int, hq: int, hk: int, splits: int, max_len: int) -> Any:
    """The real impl; only the config it reads in ``__init__`` is a stand-in (a full
    VllmConfig needs a model and a device)."""
    from types import SimpleNamespace
    from unittest import mock

    from vllm.v1.attention.backends import turboquant_attn

    config = SimpleNamespace(
        attention_config=SimpleNamespace(tq_max_kv_splits_for_cuda_graph=splits),
        model_config=SimpleNamespace(max_model_len=max_len),  # read by 0.28+
    )
    with mock.patch.object(turboquant_attn, "get_current_vllm_config", return_value=config):
        return turboquant_attn.TurboQuantAttentionImpl(
            num_heads=hq, head_size=d, scale=d**-0.5, num_kv_heads=hk, kv_cache_dtype=cache_dtype
        )


def layer_kv_cache(feats: compat.Features, blocks: int, bs: int, hk: int, slot: int) -> Any:
    """The layer's KV tensor as the release allocates it (see compat.kv_view_strides)."""
    import torch

    if feats.kv_head_major:
        return torch.zeros(blocks, hk, bs, slot, dtype=torch.uint8)
    token_major = torch.zeros(blocks, bs, hk, slot, dtype=torch.uint8)
    return token_major.transpose(1, 2) if feats.kv_view_transposed else token_major


def metadata(requests: list[tuple[int, int]], num_decodes: int, table: Any, seq_buf: Any) -> Any:
    """TurboQuantMetadata as the builder makes it, over the runner's persistent buffers."""
    import torch
    from vllm.v1.attention.backends.turboquant_attn import TurboQuantMetadata

    q_lens = [q for q, _ in requests]
    seq_lens = [q + c for q, c in requests]
    n = len(requests)
    seq_buf[:n] = torch.tensor(seq_lens, dtype=torch.int32)
    qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    fields = {
        "seq_lens": seq_buf[:n],
        "slot_mapping": torch.full((sum(q_lens),), -1, dtype=torch.int64),
        "block_table": table[:n],
        "query_start_loc": qsl,
        "num_actual_tokens": sum(q_lens),
        "max_query_len": max(q_lens),
        "max_seq_len": max(seq_lens),
        "is_prefill": max(q_lens) > 1,
        "num_decodes": num_decodes,
        "num_decode_tokens": num_decodes,
        "query_start_loc_cpu": qsl,
        "seq_lens_cpu": torch.tensor(seq_lens, dtype=torch.int32),
    }
    names = {f.name for f in dataclasses.fields(TurboQuantMetadata)}  # 0.20 lacks the _cpu ones
    return TurboQuantMetadata(**{k: v for k, v in fields.items() if k in names})


def run_backend(impl: Any, kv: Any, width: int, dtype: Any) -> None:
    """Drive every TurboQuant path of the real backend once."""
    import torch

    hq, hk, d = impl.num_heads, impl.num_kv_heads, impl.head_size
    layer = torch.nn.Module()
    table = torch.zeros(MAX_NUM_SEQS, width, dtype=torch.int32)
    seq_buf = torch.zeros(MAX_NUM_SEQS, dtype=torch.int32)
    batches = [([(1, 40)] * 3, 3), ([(1, 40), (5, 3)], 1)]
    batches += [(requests, 0) for requests in PREFILL_BATCHES]
    for requests, num_decodes in batches:
        n = sum(q for q, _ in requests)
        q = torch.randn(n, hq * d, dtype=dtype)
        k = torch.randn(n, hk * d, dtype=dtype)
        v = torch.randn(n, hk * d, dtype=dtype)
        meta = metadata(requests, num_decodes, table, seq_buf)
        impl.do_kv_cache_update(layer, k, v, kv, meta.slot_mapping)
        impl.forward(layer, q, k, v, kv, meta, output=torch.zeros(n, hq * d, dtype=dtype))


def geometry(
    feats: compat.Features, impl: Any, kv_view: Any, width: int, dtype: str
) -> keys.Geometry:
    return keys.Geometry(
        cache_dtype=impl.kv_cache_dtype,
        head_size=impl.head_size,
        num_heads=impl.num_heads,
        num_kv_heads=impl.num_kv_heads,
        block_size=kv_view.shape[1],
        scale=impl.scale,
        kv_strides=tuple(kv_view.stride()[:3]),  # type: ignore[arg-type]
        model_dtype=dtype,
        block_table_width=width,
        max_num_seqs=MAX_NUM_SEQS,
        max_model_len=width * kv_view.shape[1],
        max_num_batched_tokens=BATCHED_TOKENS,
        num_kv_splits=impl.max_num_kv_splits,
        fp8_e4b15=0,
        features=feats,
    )


CASES = [
    (preset, d, gqa, bs, dtype)
    for preset in PRESETS
    for d in (64, 128, 256)
    for gqa in (1, 2, 4, 8)
    for bs in (16, 32)
    for dtype in ("bfloat16", "float16")
]


def check_case(
    feats: compat.Features, preset: str, d: int, hq: int, hk: int, bs: int, dtype: str,
    splits: int = 32,
) -> None:
    import torch
    from realvllm import recorded_keys

    # An odd width makes consecutive block-table rows alternate 16-byte alignment.
    width = 63 if bs == 16 else 32
    impl = make_impl(preset, d, hq, hk, splits, width * bs)
    kv = layer_kv_cache(feats, 4, bs, hk, impl.tq_config.slot_size_aligned)
    view = compat.kv_view(kv, feats)
    assert tuple(view.stride()[:3]) == compat.kv_view_strides(
        feats, bs, hk, impl.tq_config.slot_size_aligned
    )
    with recorded_keys() as launched:
        run_backend(impl, kv, width, getattr(torch, dtype))
    g = geometry(feats, impl, view, width, dtype)
    assert g.preset.slot_size_aligned == impl.tq_config.slot_size_aligned
    assert g.preset.key_packed_size == impl.tq_config.key_packed_size
    with recorded_keys() as ours:
        for key in keys.plan(keys.turboquant_contributions({"layer": g})).keys:
            compile_key(key)  # type: ignore[arg-type]
    assert {name for name, _ in launched} >= {"_tq_decode_stage1", "_fwd_kernel_stage2"}
    assert ours == launched, (sorted(launched - ours), sorted(ours - launched))


@pytest.mark.parametrize(("preset", "d", "gqa", "bs", "dtype"), CASES)
def test_keys_match_real_backend(
    vllm_env: compat.Features, preset: str, d: int, gqa: int, bs: int, dtype: str
) -> None:
    check_case(vllm_env, preset, d, 2 * gqa, 2, bs, dtype)


@pytest.mark.parametrize("preset", PRESETS)
def test_keys_match_single_query_head_and_custom_splits(
    vllm_env: compat.Features, preset: str
) -> None:
    # One query head makes stride_lse_bs == 1 a constexpr; 16 splits separate plain
    # decode from the continuation path's fixed 32.
    check_case(vllm_env, preset, 128, 1, 1, 16, "bfloat16", splits=16)


def test_long_continuation_path_is_covered(vllm_env: compat.Features) -> None:
    g_keys = keys.long_continuation_keys(
        keys.Geometry("turboquant_4bit_nc", 128, 8, 2, 16, 128**-0.5, (4288, 268, 134),
                      "bfloat16", 63, 8, 1008, BATCHED_TOKENS, 32, 0, vllm_env)
    )
    assert {k.kernel for k in g_keys} == {"_tq_full_dequant_kv"}
    assert math.isclose(dict(g_keys[0].args)["HEAD_DIM"].value, 128)  # type: ignore[union-attr]
