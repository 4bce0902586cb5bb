"""The plugin's settings on other nodes: ask vLLM's Ray paths to copy them.

Processes that vLLM starts on other nodes through Ray get only some of the head's
environment variables (``compat``: RAY_EXTRA_PREFIXES_VAR), and ``TQ_WARMUP*`` and
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

from . import compat

# TQ_WARMUP itself and every TQ_WARMUP_* (TQ_WARMUP_CACHE_LAYERS included).
PREFIXES = ("TQ_WARMUP",)
# Triton's extension point for the layered cache (layered_cache.py). TRITON_CACHE_DIR
# is not copied: the writable cache directory is the node's own.
NAMES = ("TRITON_CACHE_MANAGER",)


def forward_to_ray_workers(env: MutableMapping[str, str] | None = None) -> None:
    """Add ``PREFIXES`` and ``NAMES`` to vLLM's lists of what Ray copies."""
    env = os.environ if env is None else env
    for var, items in (
        (compat.RAY_EXTRA_PREFIXES_VAR, PREFIXES),
        (compat.RAY_EXTRA_VARS_VAR, NAMES),
    ):
        current = env.get(var, "")
        updated = compat.with_csv_items(current, items)
        if updated != current:
            env[var] = updated


__all__ = ["NAMES", "PREFIXES", "forward_to_ray_workers"]
