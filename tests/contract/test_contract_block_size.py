"""Contract: the block size an offline plan assumes is the one vLLM's platform picks.

A dense model's TurboQuant layers share the block pool with the boundary layers vLLM keeps
in the model dtype, and ``Platform._align_heterogeneous_kv_block_size`` (0.25+) grows the
block until a TurboQuant page covers theirs. ``inspect``, ``precompile`` and the
compile-ahead child plan keys at that size (``BLOCK_SIZE`` is a constexpr of every
TurboQuant kernel), so a wrong size ships keys no server runs: from 0.28 vLLM sizes the
TurboQuant page by its packed slot, and a 0.34 server on the H100 ran 64-token blocks for
``turboquant_4bit_nc`` where the plan said 32 (``benchmarks/results/serve-jit``).

The serving side is vLLM's own function on its own ``CacheConfig`` and TurboQuant backend;
only the model config around them is a stand-in (heads, head size, dtype).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tq_warmup_plugin import compat
from tq_warmup_plugin.geometry import preset
from tq_warmup_plugin.plan.rules import effective_block_size

pytestmark = pytest.mark.real_vllm

PRESETS = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")


def vllms_block(cache_dtype: str, head_size: int, requested: int, dtype_name: str) -> int:
    """The block vLLM's platform settles on for a dense model with boundary layers."""
    import torch
    from vllm.config import CacheConfig
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionBackend

    cache = CacheConfig(block_size=requested, cache_dtype=cache_dtype)
    cache.kv_cache_dtype_skip_layers = ["0", "1"]  # TurboQuant's boundary layers
    model = SimpleNamespace(
        dtype=getattr(torch, dtype_name),
        get_num_kv_heads=lambda parallel: 8,
        get_head_size=lambda: head_size,
    )
    config = SimpleNamespace(cache_config=cache, model_config=model, parallel_config=None)
    Platform._align_heterogeneous_kv_block_size(config, TurboQuantAttentionBackend)
    return int(cache.block_size)


@pytest.mark.parametrize("cache_dtype", PRESETS)
def test_the_planned_block_is_vllms(cache_dtype: str) -> None:
    feats = compat.release_features(compat.installed_vllm_version())
    if not feats.tq_block_aligned:
        pytest.skip("0.20-0.24 keep the requested block")
    for head_size in (64, 128, 256):
        slot = preset(cache_dtype, head_size).slot_size_aligned
        for requested in (16, 32, 64):
            for dtype_name, size in (("bfloat16", 2), ("float32", 4)):
                served = vllms_block(cache_dtype, head_size, requested, dtype_name)
                planned = effective_block_size(feats, requested, size, head_size, slot)
                assert planned == served, (head_size, requested, dtype_name)
