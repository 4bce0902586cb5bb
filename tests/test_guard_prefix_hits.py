"""The prefix-cache guard's shared launch for short cache hits: which hits, how they are
grouped, and what each row is given (pure); the launcher it takes (module stand-ins)."""

from __future__ import annotations

import itertools
from types import ModuleType, SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from tq_warmup_plugin import compat
from tq_warmup_plugin.guards import prefix_hits
from tq_warmup_plugin.guards.prefix_hits import Hit


def test_short_hits_are_those_the_loop_serves_with_the_decode_launcher() -> None:
    qsl = [0, 200, 250, 378, 507, 511]  # 200 fresh, then hits of 50, 128, 129 and 4
    seqs = [200, 700, 500, 129 + 40, 4 + 9]
    short, others = prefix_hits.short_hits(qsl, seqs, [1, 2, 3, 4])
    assert short == [Hit(1, 200, 250, 700), Hit(2, 250, 378, 500), Hit(4, 507, 511, 13)]
    assert others == [3]  # 129 new tokens: the loop dequantizes
    assert compat.CONTINUATION_DECODE_THRESHOLD == prefix_hits.ROWS_PER_CALL == 128


@given(st.lists(st.integers(1, 128), max_size=40))
def test_groups_keep_the_order_and_never_pass_the_cap(rows: list[int]) -> None:
    at = 0
    hits = []
    for i, n in enumerate(rows):
        hits.append(Hit(i, at, at + n, n + 7))
        at += n
    got = prefix_hits.groups(hits)
    assert [h for g in got for h in g] == hits
    assert all(sum(h.rows for h in g) <= 128 for g in got)
    # greedy: a group ends only where the next hit would not fit
    for a, b in itertools.pairwise(got):
        assert sum(h.rows for h in a) + b[0].rows > 128


def test_each_row_gets_its_causal_prefix_and_its_request() -> None:
    group = [Hit(4, 10, 13, 50), Hit(7, 20, 21, 9)]
    assert prefix_hits.row_lengths(group) == [48, 49, 50, 9]
    assert prefix_hits.row_requests(group) == [4, 4, 4, 7]


def test_adjacent_hits_are_written_back_in_one_copy() -> None:
    group = [Hit(0, 0, 5, 9), Hit(1, 5, 7, 9), Hit(3, 30, 31, 9), Hit(4, 31, 40, 9)]
    assert prefix_hits.runs(group) == [(0, 7), (30, 40)]


def test_the_launcher_is_the_backends_unless_the_cache_is_soa() -> None:
    backend = ModuleType("turboquant_attn")

    def launch(**_: object) -> None:
        return None

    assert prefix_hits.launcher(backend, SimpleNamespace(_soa_store=False)) is None
    setattr(backend, compat.DECODE_LAUNCHER, launch)
    assert prefix_hits.launcher(backend, SimpleNamespace(_soa_store=False)) is launch
    assert prefix_hits.launcher(backend, SimpleNamespace()) is launch  # 0.21-0.29: no SoA
    assert prefix_hits.launcher(backend, SimpleNamespace(_soa_store=True)) is None


def test_prefill_args_name_the_positions_vllm_passes() -> None:
    named = prefix_hits.prefill_args(("pi", "c", "pit"), {"layer": "L"})
    assert named == {"Pi": "pi", "centroids": "c", "PiT": "pit", "layer": "L"}
    assert prefix_hits.prefill_args(("pi", "c"), {"PiT": None}) == {
        "Pi": "pi",
        "centroids": "c",
        "PiT": None,
    }
