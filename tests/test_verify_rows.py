"""``verify_rows``: the rows of a batched verify launch, against the per-request loop's
arithmetic (``loop_rows``), on CPU tensors (the contract tests run vLLM's real loop)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tq_warmup_plugin.worker.verify_rows import VerifyRows, causal_lengths, loop_rows

torch = pytest.importorskip("torch")

batches = st.lists(
    st.tuples(st.integers(1, 5), st.integers(0, 300)), min_size=1, max_size=8
)  # (q_len <= 1 + k for k = 4, cached_len)


@settings(max_examples=200, deadline=None)
@given(batches)
def test_causal_lengths_are_the_loops(requests: list[tuple[int, int]]) -> None:
    qsl = [0, *itertools.accumulate(q for q, _ in requests)]
    seqs = [q + c for q, c in requests]
    req, length = causal_lengths(
        torch.tensor(qsl, dtype=torch.int32),
        torch.tensor(seqs, dtype=torch.int32),
        len(requests),
        torch.arange(qsl[-1], dtype=torch.int32),
    )
    assert list(zip(req.tolist(), length.tolist(), strict=True)) == loop_rows(
        qsl, seqs, len(requests)
    )


def meta(requests: list[tuple[int, int]], decodes: int, width: int = 5) -> SimpleNamespace:
    qsl = torch.tensor([0, *itertools.accumulate(q for q, _ in requests)], dtype=torch.int32)
    seqs = torch.tensor([q + c for q, c in requests], dtype=torch.int32)
    table = torch.arange(len(requests) * width, dtype=torch.int32).view(len(requests), width)
    return SimpleNamespace(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=seqs,
        seq_lens_cpu=seqs.clone(),
        block_table=table,
        num_decodes=decodes,
        num_decode_tokens=int(qsl[decodes]),
        num_actual_tokens=int(qsl[-1]),
        max_query_len=max(q for q, _ in requests),
        is_prefill=True,
    )


def test_a_mixed_step_keeps_its_prefill_requests_behind_the_rows() -> None:
    m = meta([(3, 10), (1, 4), (20, 30)], decodes=2)
    prefill_table = m.block_table[2].clone()
    VerifyRows(16, 3, "cpu").rewrite(m)
    assert m.num_decodes == m.num_decode_tokens == 4 and m.is_prefill
    assert m.seq_lens.tolist() == [11, 12, 13, 5, 50]
    assert m.query_start_loc.tolist() == [0, 1, 2, 3, 4, 24]
    assert m.query_start_loc_cpu.tolist() == [0, 1, 2, 3, 4, 24]
    assert m.seq_lens_cpu[4:].tolist() == [50]
    assert bool((m.block_table[4] == prefill_table).all())


def test_rows_that_do_not_fit_go_to_the_loop_whole() -> None:
    m = meta([(3, 10), (3, 4)], decodes=2)
    VerifyRows(5, 3, "cpu").rewrite(m)  # 6 rows needed
    assert (m.num_decodes, m.num_decode_tokens, m.is_prefill) == (0, 0, True)
    assert m.seq_lens.tolist() == [13, 7]  # vLLM's own metadata, untouched


def test_the_buffers_are_never_reallocated() -> None:
    rows = VerifyRows(16, 3, "cpu")
    rows.rewrite(meta([(3, 10)], decodes=1))
    first = rows.table.data_ptr(), rows.seq_lens.data_ptr()
    wide = meta([(3, 10)], decodes=1, width=9)  # a wider table than the buffers hold
    rows.rewrite(wide)
    assert (rows.table.data_ptr(), rows.seq_lens.data_ptr()) == first
    assert wide.num_decodes == 0  # to the loop
