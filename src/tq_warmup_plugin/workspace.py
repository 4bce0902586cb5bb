"""Workspace the TurboQuant paths will request at runtime, reserved before the lock.

After CUDA-graph capture vLLM locks its WorkspaceManager; a TurboQuant request
larger than the buffer then raises "Workspace is locked ...". 0.21-0.23 reserve
nothing for TurboQuant, and 0.24+ skip the continuation buffers when chunked
prefill is off (prefix-cache hits still take that path). The manager keeps one
buffer that grows to the largest single request, so reserving the largest
request of every path is enough and costs no more than the largest one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from . import compat
from .compat import Features
from .geometry import DTYPE_BYTES, Geometry

Request = tuple[tuple[int, ...], str]
"""(shape, dtype name) as ``get_simultaneous`` takes it."""

_ALIGN = 256  # get_simultaneous rounds every view up to 256 bytes


def runtime_requests(g: Geometry) -> list[tuple[Request, ...]]:
    """The largest ``get_simultaneous`` call of each TurboQuant path for one layer."""
    if not g.features.uses_workspace:
        return []
    b, hq, hk, d, s = g.max_num_seqs, g.num_heads, g.num_kv_heads, g.head_size, g.num_kv_splits
    groups: list[tuple[Request, ...]] = [
        (((b, hq, s, d + 1), "float32"), ((b, hq, d), g.model_dtype), ((b, hq), "float32")),
    ]
    if g.max_num_batched_tokens > compat.CONTINUATION_DECODE_THRESHOLD:
        # _continuation_prefill: cached prefix <= max_model_len - 1 tokens, in blocks.
        pair = ((1, hk, g.dequant_rows, d), "float16")
        groups.append((pair, pair))
    return groups


def request_bytes(group: Iterable[Request]) -> int:
    """Bytes one ``get_simultaneous`` call needs, as vLLM computes it."""
    total = 0
    for shape, dtype in group:
        raw = math.prod(shape) * DTYPE_BYTES[dtype]
        total += -(-raw // _ALIGN) * _ALIGN
    return total


def plan_reservation(geometries: Iterable[Geometry]) -> list[tuple[Request, ...]]:
    """Distinct requests over all layers, largest first."""
    distinct = {group for g in geometries for group in runtime_requests(g)}
    return sorted(distinct, key=request_bytes, reverse=True)


def reserve(groups: list[tuple[Request, ...]], feats: Features) -> int:
    """Grow the workspace to the largest request; returns the bytes reserved (0 if
    the release does not use it or it is absent or already locked)."""
    manager: Any = compat.workspace_manager(feats)
    if manager is None or not groups:
        return 0
    import torch

    largest = groups[0]
    manager.get_simultaneous(*[(shape, getattr(torch, dtype)) for shape, dtype in largest])
    return request_bytes(largest)
