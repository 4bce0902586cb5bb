"""The host: the plugin manager every warmer hooks into (``hookspecs``), with the built-in
warmers and, where asked, third-party ones from their entry points.

Its own module, apart from ``warmup`` that runs it, so that the compile-ahead child
(``ahead_child``, in a fork of the worker) builds the same manager without importing the
worker's startup path (``warmup`` imports ``ahead``, which forks the child).
"""

from __future__ import annotations

import pluggy

from . import hookspecs
from .warmers import (
    triton_jit,
    turboquant,
    vllm_eagle,
    vllm_fused_moe,
    vllm_logprobs,
    vllm_rejection,
    vllm_slot_mapping,
    vllm_top_k_top_p,
    vllm_unwarmed,
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
        vllm_unwarmed,
    ):
        pm.register(warmer)
    if load_entry_points:
        pm.load_setuptools_entrypoints(hookspecs.ENTRY_POINT_GROUP)
    return pm
