"""The plugin manager: the built-in warmers, and third-party ones from their entry points.

Its own module, apart from ``warmup`` (which runs what it holds), so that a process that
only plans vLLM's kernels, the compile-ahead child forked from a worker, takes the warmers
without the worker's warmup path (``ahead`` -> ``ahead_child`` -> here, no cycle back).
"""

from __future__ import annotations

import pluggy

from .. import hookspecs
from ..warmers import (
    triton_jit,
    turboquant,
    vllm_async_spec,
    vllm_draft_prefill,
    vllm_eagle,
    vllm_fused_moe,
    vllm_logprobs,
    vllm_rejection,
    vllm_slot_mapping,
    vllm_top_k_top_p,
    vllm_unwarmed,
    vllm_zero_blocks,
)

__all__ = ["plugin_manager"]


def plugin_manager(load_entry_points: bool = True) -> pluggy.PluginManager:
    """A manager with the built-in warmers and, optionally, third-party ones."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(turboquant)
    pm.register(triton_jit)
    for warmer in (
        vllm_slot_mapping,
        vllm_rejection,
        vllm_logprobs,
        vllm_top_k_top_p,
        vllm_eagle,
        vllm_fused_moe,
        vllm_zero_blocks,
        vllm_async_spec,
        vllm_draft_prefill,
        vllm_unwarmed,
    ):
        pm.register(warmer)
    if load_entry_points:
        pm.load_setuptools_entrypoints(hookspecs.ENTRY_POINT_GROUP)
    return pm
