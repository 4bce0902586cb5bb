"""The rows of a batched verify launch: one decode row per query token, built on the device.

TurboQuant's per-request prefill loop serves a speculative verify request of ``q`` query
tokens over ``seq`` cached-plus-new positions with one decode launch per request and
layer: token ``t`` attends to the first ``seq - q + 1 + t`` positions of the request's
block-table row (``_prefill_attention``'s continuation fast path, 0.21-0.33). A decode
launch takes rows independently (``triton_turboquant_decode_attention``: query
``[B, Hq, D]``, ``block_table [B, W]``, ``seq_lens [B]``), so every verify token of the
batch can be one row of a single launch.

``VerifyRows`` rewrites a ``TurboQuantMetadata`` so that vLLM's own ``forward`` does
exactly that: the decode part (the leading requests of at most ``1 + k`` tokens) becomes
``num_decode_tokens`` single-token rows, each with its causal length and its request's
block-table row; the prefill part after it keeps its requests, shifted behind the rows.
The rows come from the metadata's device tensors (the exact ``seq_lens``, never the CPU
upper bound that async scheduling makes optimistic) with fixed-shape ops into buffers
that live as long as the builder, so a CUDA graph captured over them reads each step's
rows: no ``.tolist()``, no host length, nothing allocated that a graph keeps.

The buffers are made on the first rewrite, which vLLM runs before any capture (a
builder builds for the profile and warmup runs first), at the block table's own row
stride so the decode kernel's keys are those of the runner's table. A batch that does
not fit them (more rows than ``capacity``, a wider table) is handed to the loop whole:
every request, decodes included, as vLLM's prefill path (correct, unbatched).
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["ROWS_ATTR", "VerifyRows", "causal_lengths", "loop_rows", "rows_of"]

logger = logging.getLogger("vllm.tq_warmup_plugin")

ROWS_ATTR = "_tq_warmup_verify_rows"
"""The metadata builder attribute holding its ``VerifyRows`` while the batched verify
path serves it (``guards.batched_verify`` sets it; discovery reads it)."""


def causal_lengths(query_start_loc: Any, seq_lens: Any, num_decodes: int, tokens: Any) -> Any:
    """Request index and causal length of each token in ``tokens`` (positions of the
    flattened batch, as a tensor): ``seq - end + 1 + token`` (``= seq - q + 1 + t`` for
    token ``t`` of a request of ``q`` tokens ending at ``end``), clamped into ``[1, seq]``
    and at least 1 for padding (a CUDA graph's padded requests have 0 tokens and length
    0; capture's dummy metadata has ``seq == 1 < q``: 0.26's
    ``build_for_cudagraph_capture``). Tokens past the last decode request (a graph's
    padded tokens) take the last request's row. Works on any device (CPU for the host
    copy, tests)."""
    import torch

    ends = query_start_loc[1 : num_decodes + 1]
    req = torch.searchsorted(ends, tokens, right=True).clamp_(max=num_decodes - 1)
    seq = seq_lens.index_select(0, req)
    end = ends.index_select(0, req)
    length = torch.minimum(seq - end + 1 + tokens, seq).clamp_(min=1)
    return req, length


def loop_rows(
    query_start_loc: list[int], seq_lens: list[int], num_decodes: int
) -> list[tuple[int, int]]:
    """``(request, causal length)`` of every decode-part token, as the per-request loop
    computes them (``_arange_cache[cached + 1 : seq + 1]`` for a request of ``q`` tokens,
    ``cached = seq - q``): the reference the rows are tested against."""
    rows = []
    for r in range(num_decodes):
        q = query_start_loc[r + 1] - query_start_loc[r]
        cached = seq_lens[r] - q
        rows += [(r, length) for length in range(cached + 1, seq_lens[r] + 1)]
    return rows


class VerifyRows:
    """One metadata builder's row buffers (each ubatch builder has its own)."""

    def __init__(self, capacity: int, query_len: int, device: Any) -> None:
        self.capacity = capacity
        """Most rows a step can need: ``max_num_seqs * (1 + k)`` (every decode request
        holds at most ``query_len`` tokens, every prefill request at least one; a FULL
        graph pads a uniform batch to at most that many tokens)."""
        self.query_len = query_len
        """``1 + k``: the builder's decode threshold (``reorder_batch_threshold``)."""
        self.device = device
        self.seq_lens: Any = None
        self.table: Any = None
        self.query_start_loc: Any = None
        self._arange: Any = None
        self._refused = False

    def allocate(self, block_table: Any, seq_dtype: Any, qsl_dtype: Any) -> bool:
        """Make the buffers for this table, once; False if an existing set cannot hold
        its rows (a graph may have captured the old addresses: never reallocated)."""
        import torch

        stride, width = int(block_table.stride(0)), int(block_table.shape[1])
        if self.table is not None:
            return bool(width <= self.table.shape[1] and stride == self.table.stride(0))
        n, dev = self.capacity, self.device
        self.table = torch.zeros(n, stride, dtype=block_table.dtype, device=dev)[:, :width]
        self.seq_lens = torch.ones(n, dtype=seq_dtype, device=dev)
        self._arange = torch.arange(n + 1, dtype=qsl_dtype, device=dev)
        self.query_start_loc = self._arange.clone()
        return True

    def rewrite(self, meta: Any) -> None:
        """Turn ``meta``'s decode part into single-token rows, in place. A batch with no
        decode request is left as it is; one that does not fit goes to the loop whole."""
        d, t = int(meta.num_decodes), int(meta.num_decode_tokens)
        if d == 0:
            return
        qsl, seq, table = meta.query_start_loc, meta.seq_lens, meta.block_table
        p = int(qsl.shape[0]) - 1 - d
        if t + p > self.capacity or not self.allocate(table, seq.dtype, qsl.dtype):
            self._to_loop(meta, t + p, table)
            return
        req, length = causal_lengths(qsl, seq, d, self._arange[:t])
        self.seq_lens[:t].copy_(length)
        self.table[:t].copy_(table.index_select(0, req))
        if p:
            self.seq_lens[t : t + p].copy_(seq[d:])
            self.table[t : t + p].copy_(table[d:])
            self.query_start_loc[: t + 1].copy_(self._arange[: t + 1])
            self.query_start_loc[t + 1 : t + p + 1].copy_(qsl[d + 1 :])
            meta.query_start_loc = self.query_start_loc[: t + p + 1]
            self._host_rewrite(meta, d, t)
        else:  # rows only: the pure decode path, which reads no query offsets
            meta.query_start_loc = self._arange[: t + 1]
            meta.is_prefill = False
            meta.max_query_len = 1
        meta.seq_lens = self.seq_lens[: t + p]
        meta.block_table = self.table[: t + p]
        meta.num_decodes = t
        meta.num_decode_tokens = t

    @staticmethod
    def _host_rewrite(meta: Any, d: int, t: int) -> None:
        """The host copies (0.21+) in the same row layout: the prefill part reads its
        lengths and query offsets from them; the rows' host lengths are the upper
        bound's causal lengths, which nothing reads."""
        import torch

        qsl_cpu = getattr(meta, "query_start_loc_cpu", None)
        seq_cpu = getattr(meta, "seq_lens_cpu", None)
        if qsl_cpu is None or seq_cpu is None:
            return
        tokens = torch.arange(t + 1, dtype=qsl_cpu.dtype)
        _, rows = causal_lengths(qsl_cpu, seq_cpu, d, tokens[:t])
        meta.query_start_loc_cpu = torch.cat([tokens, qsl_cpu[d + 1 :]])
        meta.seq_lens_cpu = torch.cat([rows, seq_cpu[d:]])

    def _to_loop(self, meta: Any, rows: int, table: Any) -> None:
        if not self._refused:
            self._refused = True
            logger.warning(
                "tq-warmup: a batch needs %d verify rows of a %d-column block table, more "
                "than the %d rows reserved: such batches run TurboQuant's per-request loop",
                rows,
                int(table.shape[1]),
                self.capacity,
            )
        meta.num_decodes = 0
        meta.num_decode_tokens = 0
        meta.is_prefill = True


def rows_of(builder: Any) -> VerifyRows | None:
    """The builder's rows while the batched verify path serves it, else None."""
    rows = getattr(builder, ROWS_ATTR, None)
    return rows if isinstance(rows, VerifyRows) else None
