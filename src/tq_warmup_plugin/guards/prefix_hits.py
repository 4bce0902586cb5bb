"""Short cache hits of a split prefill batch, served together by the prefix-cache guard.

Why: vLLM's prefill loop serves each cache hit of up to ``CONTINUATION_DECODE_THRESHOLD``
new tokens with a call of its own to the decode launcher: every query row a decode request
whose ``seq_lens`` entry is its causal prefix (the cached tokens and its own position) and
whose block-table row is its request's (``_prefill_attention``, 0.21-0.34, the AoS store).
A step with many hits then pays, per hit and per layer, a rotation GEMM, a stage-1 and a
stage-2 launch, their allocations, a copy into the output and the loop's host work.

What: the rows of several hits go to one call of the same launcher with the same arguments:
their queries packed, each row's sequence length, each row its request's block-table row.
The launcher computes every (row, head, split) on its own with its default 32 splits, so a
row gets what the loop gives it (the rotation GEMM is the same product over more rows). A
call takes at most ``CONTINUATION_DECODE_THRESHOLD`` rows, so none allocates more than the
loop's largest. Its Triton keys are the planned short-continuation keys
(``keys.short_continuation_keys``): the packed tensors are fresh, 16-byte aligned as the
loop's first row and aligned offsets are, and the packed table's row stride is padded to
a multiple of 16, the class of the loop's stride 0 (its row expanded).

Not here: a layer whose cache is in the SoA layout (FlyDSL, ROCm: that decode takes the
batch's longest sequence), or a backend module without the launcher: its hits take vLLM's
loop, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from .. import compat

__all__ = [
    "ROWS_PER_CALL",
    "Hit",
    "groups",
    "launcher",
    "prefill_args",
    "row_lengths",
    "row_requests",
    "runs",
    "serve",
    "short_hits",
    "write_back",
]

ROWS_PER_CALL = compat.CONTINUATION_DECODE_THRESHOLD
"""The most rows one call takes: the loop's largest call, so no new allocation peak."""

_PREFILL_ARGS = ("Pi", "centroids", "PiT", "layer")
"""``_prefill_attention``'s parameters after the metadata, in order (0.21-0.34)."""


@dataclass(frozen=True)
class Hit:
    """A cache hit of the batch: its request, its token rows ``[start, stop)``, its
    sequence length (cached tokens and new ones)."""

    request: int
    start: int
    stop: int
    seq_len: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


def short_hits(
    query_start_loc: Sequence[int], seq_lens: Sequence[int], hits: Sequence[int]
) -> tuple[list[Hit], list[int]]:
    """``hits`` (request indices) parted: those of at most ``ROWS_PER_CALL`` new tokens,
    which the loop serves with the decode launcher, and the others (longer ones, which it
    dequantizes)."""
    short: list[Hit] = []
    others: list[int] = []
    for i in hits:
        hit = Hit(i, query_start_loc[i], query_start_loc[i + 1], seq_lens[i])
        if hit.rows <= ROWS_PER_CALL:
            short.append(hit)
        else:
            others.append(i)
    return short, others


def groups(hits: Sequence[Hit], cap: int = ROWS_PER_CALL) -> list[list[Hit]]:
    """``hits`` in order, in groups of at most ``cap`` rows (each hit has at most ``cap``)."""
    out: list[list[Hit]] = []
    rows = 0
    for hit in hits:
        if not out or rows + hit.rows > cap:
            out.append([])
            rows = 0
        out[-1].append(hit)
        rows += hit.rows
    return out


def row_lengths(group: Sequence[Hit]) -> list[int]:
    """Each row's causal prefix: a hit's rows end at ``seq_len``, one position apart."""
    return [n for h in group for n in range(h.seq_len - h.rows + 1, h.seq_len + 1)]


def row_requests(group: Sequence[Hit]) -> list[int]:
    """Each row's request: the block-table row it reads."""
    return [h.request for h in group for _ in range(h.rows)]


def launcher(backend: ModuleType, impl: Any) -> Callable[..., Any] | None:
    """The backend's decode launcher where this impl's loop calls it for a short hit
    (an AoS cache); None where the loop does something else."""
    if getattr(impl, "_soa_store", False):
        return None
    found = getattr(backend, compat.DECODE_LAUNCHER, None)
    return found if callable(found) else None


def prefill_args(args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``_prefill_attention``'s arguments after the metadata, by name."""
    return {**dict(zip(_PREFILL_ARGS, args, strict=False)), **kwargs}


def serve(
    launch: Callable[..., Any],
    impl: Any,
    tensors: tuple[Any, Any, Any],
    group: Sequence[Hit],
    named: dict[str, Any],
    out: Any,
) -> None:
    """One launcher call for ``group``'s rows, written into ``out``'s rows. ``tensors``:
    the batch's query, the layer's cache, the metadata's block table."""
    import torch

    query, kv_cache, block_table = tensors
    rows = sum(h.rows for h in group)
    # One host-to-device copy: the rows' lengths first (the launcher's seq_lens, at the
    # copy's aligned start), then their block-table rows.
    host = torch.tensor(row_lengths(group) + row_requests(group), dtype=block_table.dtype)
    both = host.to(block_table.device, non_blocking=True)
    width = block_table.shape[1]
    table = block_table.index_select(0, both[rows:])
    if width % 16:
        table = torch.nn.functional.pad(table, (0, 16 - width % 16))
    pieces = [query[h.start : h.stop] for h in group]
    packed = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    cfg = impl.tq_config
    result = launch(
        query=packed,
        kv_cache=kv_cache,
        block_table=table,
        seq_lens=both[:rows],
        Pi=named["Pi"],
        centroids=named["centroids"],
        scale=impl.scale,
        mse_bits=cfg.key_mse_bits,
        key_packed_size=cfg.key_packed_size,
        value_quant_bits=cfg.effective_value_quant_bits,
        key_fp8=cfg.key_fp8,
        norm_correction=cfg.norm_correction,
        PiT=named.get("PiT"),
    )
    write_back(out, result, runs(group))


def write_back(out: Any, packed: Any, rows: Sequence[tuple[int, int]]) -> None:
    """``packed``'s rows, in order, over ``out``'s row ranges ``[(start, stop), ...]``:
    one copy per range (it casts to ``out``'s dtype)."""
    at = 0
    for start, stop in rows:
        out[start:stop] = packed[at : at + stop - start]
        at += stop - start


def runs(group: Sequence[Hit]) -> list[tuple[int, int]]:
    """The token rows of ``group``, adjacent hits merged: ``[(start, stop), ...]``."""
    merged: list[tuple[int, int]] = []
    for h in group:
        if merged and merged[-1][1] == h.start:
            merged[-1] = (merged[-1][0], h.stop)
        else:
            merged.append((h.start, h.stop))
    return merged
