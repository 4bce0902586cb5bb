"""Workspace the TurboQuant paths will request at runtime, reserved before the lock.

After CUDA-graph capture vLLM locks its WorkspaceManager; a TurboQuant request
larger than the buffer then raises "Workspace is locked ...". 0.21-0.23 reserve
nothing for TurboQuant, and 0.24+ skip the continuation buffers when chunked
prefill is off (prefix-cache hits still take that path). The manager keeps one
buffer per ``(ubatch, lane)`` slot that grows to the largest single request, so
reserving the largest request of every path in every slot is enough and costs no
more than the largest one per slot.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

from .. import compat
from ..compat import Features
from ..geometry import Geometry, Request, request_bytes, runtime_requests

__all__ = [
    "ReservationError",
    "buffer_sizes",
    "oom_warning",
    "plan_reservation",
    "reserve",
]


def plan_reservation(geometries: Iterable[Geometry]) -> list[tuple[Request, ...]]:
    """Distinct requests over all layers, largest first."""
    distinct = {group for g in geometries for group in runtime_requests(g)}
    return sorted(distinct, key=request_bytes, reverse=True)


class ReservationError(RuntimeError):
    """The device had no room for the reservation (it comes after vLLM sized the KV
    cache, so vLLM's memory profile never counted it)."""

    def __init__(self, needed: int, slot: tuple[int, int], reserved: int, cause: str) -> None:
        super().__init__(cause)
        self.needed = needed
        """Bytes of the request that did not fit, in one slot."""
        self.slot = slot
        self.reserved = reserved
        """Bytes reserved in the slots before it."""


def reserve(groups: list[tuple[Request, ...]], feats: Features) -> int:
    """Grow the workspace of every ``(ubatch, lane)`` slot the manager keeps to the
    largest request (each slot has its own buffer: dual-batch overlap runs attention
    in ubatch 1 too, DSpark drafts in lane 1); returns the bytes reserved over all
    slots (0 if the release does not use it or it is absent or already locked)."""
    manager: Any = compat.workspace_manager(feats)
    if manager is None or not groups:
        return 0
    import torch

    largest = groups[0]
    views = [(shape, getattr(torch, dtype)) for shape, dtype in largest]
    size = request_bytes(largest)
    slots = compat.workspace_slots(manager)
    for n, (ubatch, lane) in enumerate(slots):
        with compat.workspace_slot(ubatch, lane):
            before = compat.workspace_slot_bytes(manager, ubatch, lane)
            try:
                manager.get_simultaneous(*views)
            except torch.OutOfMemoryError as exc:
                if before:  # the manager dropped what the slot held: put it back
                    with contextlib.suppress(torch.OutOfMemoryError):
                        manager.get_simultaneous(((before,), torch.uint8))
                cause = str(exc).splitlines()[0] if str(exc) else "out of memory"
                raise ReservationError(size, (ubatch, lane), size * n, cause) from exc
    return size * len(slots)


def buffer_sizes(feats: Features) -> tuple[int, ...]:
    """Distinct byte sizes of the workspace buffers every ``(ubatch, lane)`` slot holds
    now (0.21-0.33), the storages decode and dequantization views come from (locked
    ones too: elastic EP warms again after the lock); empty where there are none."""
    manager = compat.workspace_manager(feats, locked_too=True)
    if manager is None:
        return ()
    slots = compat.workspace_slots(manager)
    return tuple(sorted({compat.workspace_slot_bytes(manager, u, lane) for u, lane in slots}))


def oom_warning(exc: ReservationError, geometries: Iterable[Geometry]) -> str:
    """One WARNING line: what the missing reservation breaks and what avoids it."""
    gs = list(geometries)
    max_len = max((g.max_model_len for g in gs), default=0)
    seqs = max((g.max_num_seqs for g in gs), default=0)
    continuation = any(g.max_num_batched_tokens > compat.CONTINUATION_DECODE_THRESHOLD for g in gs)
    paths = f"decode batches of up to {seqs} sequences"
    if continuation:
        paths += f" and prompts continuing over a cached prefix of up to {max_len - 1} tokens"
    return (
        f"tq-warmup: out of device memory reserving {exc.needed / 2**20:.1f} MiB of "
        f"TurboQuant workspace (ubatch {exc.slot[0]}, lane {exc.slot[1]}) after vLLM sized "
        f"the KV cache, which does not count it: {paths} may fail with 'Workspace is "
        "locked' once CUDA graphs are captured; lower --max-model-len (the continuation "
        "scratch grows with it) or --max-num-seqs, or lower --gpu-memory-utilization to "
        f"leave that much free ({exc})"
    )
