"""Contract: the keys our pure functions derive are exactly the keys vLLM's real
TurboQuant backend launches, path by path, for every preset and a grid of shapes.

The real ``TurboQuantAttentionImpl`` runs its real ``forward`` and
``do_kv_cache_update`` on CPU tensors; a compile-only Triton driver for sm90 and
Triton's ``jit_cache_hook`` record each launch's cache key without compiling.
Our warmer then runs for the same geometry under the same recorder.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from realvllm import (
    impl_geometry,
    layer_kv_cache,
    make_impl,
    recorded_keys,
    run_backend,
)

from tq_warmup_plugin import compat, keys
from tq_warmup_plugin.geometry import PRESETS as ALL_PRESETS
from tq_warmup_plugin.geometry import Geometry
from tq_warmup_plugin.plan import rules as plan_rules
from tq_warmup_plugin.warmers.triton_jit import compile_key
from tq_warmup_plugin.warmers.turboquant import turboquant_contributions
from tq_warmup_plugin.worker.warmup import Plan

pytestmark = pytest.mark.real_vllm

PRESETS = sorted(ALL_PRESETS)
BATCHED_TOKENS = 2048


def geometry(feats: compat.Features, impl: Any, kv_view: Any, width: int, dtype: str) -> Geometry:
    strides = tuple(kv_view.stride()[:3])
    return impl_geometry(
        feats,
        impl,
        width,
        kv_view.shape[1],
        strides,
        dtype,
        BATCHED_TOKENS,  # type: ignore[arg-type]
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
    feats: compat.Features,
    preset: str,
    d: int,
    hq: int,
    hk: int,
    bs: int,
    dtype: str,
    splits: int = 32,
) -> None:
    import torch

    # An odd width makes consecutive block-table rows alternate 16-byte alignment.
    width = 63 if bs == 16 else 32
    impl = make_impl(preset, d, hq, hk, splits, width * bs)
    kv = layer_kv_cache(feats, 4, bs, hk, impl.tq_config.slot_size_aligned)
    view = compat.kv_view(kv, feats)
    assert tuple(view.stride()[:3]) == plan_rules.kv_view_strides(
        feats, bs, hk, impl.tq_config.slot_size_aligned
    )
    with recorded_keys() as launched:
        run_backend(impl, kv, width, getattr(torch, dtype))
    g = geometry(feats, impl, view, width, dtype)
    assert g.preset.slot_size_aligned == impl.tq_config.slot_size_aligned
    assert g.preset.key_packed_size == impl.tq_config.key_packed_size
    with recorded_keys() as ours:
        for key in Plan.of(turboquant_contributions({"layer": g})).keys:
            compile_key(key)
    assert {name for name, _ in launched} >= {"_tq_decode_stage1", "_fwd_kernel_stage2"}
    assert ours == launched, (sorted(launched - ours), sorted(ours - launched))


@pytest.mark.parametrize(("preset", "d", "gqa", "bs", "dtype"), CASES)
def test_keys_match_real_backend(
    vllm_env: compat.Features, preset: str, d: int, gqa: int, bs: int, dtype: str
) -> None:
    check_case(vllm_env, preset, d, 2 * gqa, 2, bs, dtype)


@pytest.mark.parametrize(("hq", "hk"), [(8, 4), (16, 8), (32, 8), (4, 4)])
@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k8v4"])
def test_keys_match_tensor_parallel_head_counts(
    vllm_env: compat.Features, preset: str, hq: int, hk: int
) -> None:
    # Per-rank head counts of 16/8 and 32/8 models at tensor-parallel 1, 2 and 4.
    check_case(vllm_env, preset, 128, hq, hk, 32, "bfloat16")


@pytest.mark.parametrize("preset", PRESETS)
def test_keys_match_single_query_head_and_custom_splits(
    vllm_env: compat.Features, preset: str
) -> None:
    # One query head makes stride_lse_bs == 1 a constexpr; 16 splits separate plain
    # decode from the continuation path's fixed 32.
    check_case(vllm_env, preset, 128, 1, 1, 16, "bfloat16", splits=16)


def test_long_continuation_path_is_covered(vllm_env: compat.Features) -> None:
    g_keys = keys.long_continuation_keys(
        Geometry(
            "turboquant_4bit_nc",
            128,
            8,
            2,
            16,
            128**-0.5,
            (4288, 268, 134),
            "bfloat16",
            63,
            8,
            1008,
            BATCHED_TOKENS,
            32,
            0,
            vllm_env,
        )
    )
    assert {k.kernel for k in g_keys} == {"_tq_full_dequant_kv"}
    assert math.isclose(dict(g_keys[0].args)["HEAD_DIM"].value, 128)  # type: ignore[union-attr]


def verify_batches(k: int) -> list[tuple[list[tuple[int, int]], int]]:
    """Speculative-decoding verify batches as TurboQuant sees them under the guard:
    1+k tokens per request over cached contexts of both arange alignments, alone and
    behind one-token decodes (requests ngram found no draft for)."""
    verify = [(1 + k, cached) for cached in (40, 41, 42, 43)]
    return [(verify, 0), ([(1, 40), (1, 41), *verify], 2)]


@pytest.mark.parametrize("k", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("preset", PRESETS)
def test_verify_batch_keys_are_planned(vllm_env: compat.Features, preset: str, k: int) -> None:
    import torch

    width, bs = 63, 16
    impl = make_impl(preset, 128, 16, 8, 32, width * bs)
    kv = layer_kv_cache(vllm_env, 4, bs, 8, impl.tq_config.slot_size_aligned)
    with recorded_keys() as launched:
        run_backend(impl, kv, width, torch.bfloat16, verify_batches(k))
    g = geometry(vllm_env, impl, compat.kv_view(kv, vllm_env), width, "bfloat16")
    with recorded_keys() as ours:
        for key in Plan.of(turboquant_contributions({"layer": g})).keys:
            compile_key(key)
    assert {name for name, _ in launched} >= {"_tq_decode_stage1", "_fwd_kernel_stage2"}
    assert launched <= ours, sorted(launched - ours)
