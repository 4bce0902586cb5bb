"""Contract: with microbatching (``--enable-dbo``) the plan holds every key vLLM's real
TurboQuant backend launches on the metadata vLLM's real V1 slicing gives each
microbatch; without it, it does not (the test can fail).

vLLM's ``maybe_create_ubatch_slices`` and ``split_attn_metadata`` cut a step's
metadata over the runner's buffers, its ``TurboQuantMetadataBuilder`` builds each
microbatch's, and its real ``do_kv_cache_update`` and ``forward`` run on CPU tensors
under the compile-only sm90 driver, recording each launch's Triton cache key.
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType, SimpleNamespace

import pytest
from realvllm import impl_geometry, layer_kv_cache, make_impl, recorded_keys, run_ubatches

from tq_warmup_plugin import compat
from tq_warmup_plugin.warmers.triton_jit import compile_key
from tq_warmup_plugin.warmers.turboquant import turboquant_contributions
from tq_warmup_plugin.worker.warmup import Plan

pytestmark = pytest.mark.real_vllm

# Decodes first, as TurboQuant's reorder threshold makes the runner put them. Split at
# half the tokens, microbatch 1 starts at request 3 (6 decodes: seq_lens at 12 bytes,
# slot mapping at 24), 2 (4 decodes), 4 (8 decodes: both aligned) or inside the long
# prompt (mixed: microbatch 0's last request is cut, its seq_lens cloned).
BATCHES = [
    [(1, 40)] * 6,
    [(1, 40)] * 4,
    [(1, 40)] * 8,
    [(1, 40), (1, 41), (1, 42), (5, 3), (130, 20)],
    [(1, 40), (3, 40), (3, 41), (3, 42), (4, 43)],
]


def v1_ubatch_utils() -> ModuleType:
    try:
        module = importlib.import_module("vllm.v1.worker.ubatch_utils")
    except ImportError:
        pytest.skip("this vLLM has no V1 microbatch slicing (vllm/v1/worker/ubatch_utils.py)")
    if not hasattr(module, "split_attn_metadata"):
        pytest.skip("this vLLM's ubatch_utils has no split_attn_metadata")
    return module


def dbo_config() -> SimpleNamespace:
    """A config holding vLLM's real ``ParallelConfig`` with ``--enable-dbo``."""
    from vllm.config import ParallelConfig

    return SimpleNamespace(parallel_config=ParallelConfig(enable_dbo=True))


S1, S2 = "_tq_decode_stage1", "_fwd_kernel_stage2"
MSE, FP8 = "_tq_fused_store_mse", "_tq_fused_store_fp8"


@pytest.mark.parametrize(
    ("preset", "bs", "width", "splits", "missed"),
    [
        # Odd width: rows alternate alignment. Stage 2 with an unaligned seq_lens and
        # the default 32 splits is a short continuation's key, planned anyway.
        ("turboquant_4bit_nc", 16, 63, 32, {S1, MSE}),
        ("turboquant_k8v4", 16, 62, 32, {S1, FP8}),  # row 2 aligned, seq_lens[2:] not
        # Width 32: the decode's block-table stride is in the class of the continuation's
        # 0, so only the slot mapping is new; with 16 splits both decode stages are.
        ("turboquant_3bit_nc", 32, 32, 32, {MSE}),
        ("turboquant_4bit_nc", 32, 32, 16, {S1, S2, MSE}),
    ],
)
def test_microbatch_keys_are_planned_only_with_dbo(
    vllm_env: compat.Features, preset: str, bs: int, width: int, splits: int, missed: set[str]
) -> None:
    import torch

    v1_ubatch_utils()
    impl = make_impl(preset, 128, 8, 2, splits, width * bs)
    kv = layer_kv_cache(vllm_env, 4, bs, 2, impl.tq_config.slot_size_aligned)
    with recorded_keys() as launched:
        run_ubatches(impl, kv, width, torch.bfloat16, BATCHES)
    view = compat.kv_view(kv, vllm_env)
    plain = impl_geometry(vllm_env, impl, width, bs, tuple(view.stride()[:3]))  # type: ignore[arg-type]
    sliced = compat.ubatch_sliced(vllm_env, compat.ubatching(dbo_config()), runner_v2=False)
    assert sliced == ("block_table", "seq_lens", "slot_mapping")
    planned = {}
    for name, g in (("off", plain), ("on", dataclasses.replace(plain, ubatch_sliced=sliced))):
        with recorded_keys() as ours:
            for key in Plan.of(turboquant_contributions({"layer": g})).keys:
                compile_key(key)
        planned[name] = ours
    assert {name for name, _ in launched} >= {S1, S2}
    assert launched <= planned["on"], sorted(launched - planned["on"])
    assert {name for name, _ in launched - planned["off"]} == missed


def test_v2_microbatches_copy_seq_lens(vllm_env: compat.Features) -> None:
    """The V2 runner's ``_slice_seq_lens`` (0.30+) writes a microbatch's lengths into
    the buffer it is given, so only V1 hands the kernels a ``seq_lens`` view."""
    import torch

    try:
        v2 = importlib.import_module("vllm.v1.worker.gpu.ubatch_utils")
    except ImportError:
        assert not vllm_env.v2_ubatches
        assert compat.ubatch_sliced(vllm_env, True, runner_v2=True) == ()
        pytest.skip("this vLLM's V2 runner has no microbatching (0.30+)")
    assert vllm_env.v2_ubatches
    seq_lens = torch.arange(10, 18, dtype=torch.int32)
    qsl = torch.arange(0, 9, dtype=torch.int32)
    out = torch.zeros(8, dtype=torch.int32)
    result = v2._slice_seq_lens(seq_lens, out[:5], qsl, 3, 8, 8)
    assert result.data_ptr() == out.data_ptr() and result.tolist() == [13, 14, 15, 16, 17]
    assert compat.ubatch_sliced(vllm_env, True, runner_v2=True) == ("block_table", "slot_mapping")
