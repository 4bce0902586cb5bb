"""The plugin's settings on other nodes: ask vLLM's Ray paths to copy them.

Processes that vLLM starts on other nodes through Ray get only some of the head's
environment variables (``RAY_EXTRA_PREFIXES_VAR``), and ``TQ_WARMUP*`` and
``TRITON_CACHE_MANAGER`` are not among them. ``register()`` runs in the head's
processes before vLLM makes that copy (vLLM's argument parsing and ``EngineCore``
load the general plugins before they start an executor or engine-core actors), so
adding the names to vLLM's own lists there is enough. The remote node needs the
plugin installed too: its worker runs ``register()`` and Triton imports the cache
manager by name.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# The environment vLLM's Ray paths give processes on other nodes, read in the wheels of
# all releases (the same function in every one):
# ``vllm.ray.ray_env.get_env_vars_to_copy`` picks the head's variables that a remote
# process gets: the names ``vllm.envs`` registers, those starting with a prefix of
# ``DEFAULT_ENV_VAR_PREFIXES`` (VLLM_, LMCACHE_, NCCL_, UCX_, HF_, HUGGING_FACE_;
# FLASH_ATTENTION_ from 0.27.1) or of the comma-separated RAY_EXTRA_PREFIXES_VAR, and
# the names in RAY_EXTRA_VARS_VAR. Both lists add to vLLM's defaults and are read when
# the copy is made. Its callers: ``RayDistributedExecutor``'s workers
# (``v1/executor/ray_executor.py``, 0.20-0.32: the default Ray executor in 0.20, chosen
# by VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0 in 0.21-0.32, gone in 0.33) and the engine
# cores that ``--data-parallel-backend ray`` starts as Ray actors (``v1/engine/utils.py``,
# all releases). ``RayExecutorV2`` (VLLM_USE_RAY_V2_EXECUTOR_BACKEND=1, the default from
# 0.21; 0.33's only Ray executor) gives its workers the head's whole environment
# instead, never replacing a value the worker's node has (``get_driver_env_vars``,
# ``v1/executor/ray_env_utils.py``, all releases).
RAY_EXTRA_PREFIXES_VAR = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"
RAY_EXTRA_VARS_VAR = "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"


def with_csv_items(value: str, items: tuple[str, ...]) -> str:
    """vLLM's comma-separated ``value`` with the ``items`` it lacks appended; the
    user's own entries stay as they are (``_parse_csv`` in ``ray_env``, all releases)."""
    present = {tok.strip() for tok in value.split(",") if tok.strip()}
    missing = [item for item in items if item not in present]
    if not missing:
        return value
    return ",".join([*([value.rstrip(", ")] if present else []), *missing])


# TQ_WARMUP itself and every TQ_WARMUP_* (TQ_WARMUP_CACHE_LAYERS included).
PREFIXES = ("TQ_WARMUP",)
# Triton's extension point for the layered cache (layered_cache.py). TRITON_CACHE_DIR
# is not copied: the writable cache directory is the node's own.
NAMES = ("TRITON_CACHE_MANAGER",)


def forward_to_ray_workers(env: MutableMapping[str, str] | None = None) -> None:
    """Add ``PREFIXES`` and ``NAMES`` to vLLM's lists of what Ray copies."""
    env = os.environ if env is None else env
    for var, items in (
        (RAY_EXTRA_PREFIXES_VAR, PREFIXES),
        (RAY_EXTRA_VARS_VAR, NAMES),
    ):
        current = env.get(var, "")
        updated = with_csv_items(current, items)
        if updated != current:
            env[var] = updated


__all__ = [
    "NAMES",
    "PREFIXES",
    "RAY_EXTRA_PREFIXES_VAR",
    "RAY_EXTRA_VARS_VAR",
    "forward_to_ray_workers",
    "with_csv_items",
]
