"""The workspace the TurboQuant paths request, and its reservation."""

from __future__ import annotations

import dataclasses

import fakes
import pytest

from tq_warmup_plugin import compat, geometry
from tq_warmup_plugin.worker import workspace


def test_decode_and_continuation_requests() -> None:
    g = fakes.geometry(
        max_num_seqs=8,
        num_heads=8,
        num_kv_heads=2,
        head_size=128,
        splits=16,
        block_size=16,
        max_model_len=1000,
        model_dtype="float16",
    )
    decode, continuation = geometry.runtime_requests(g)
    assert decode == (((8, 8, 16, 129), "float32"), ((8, 8, 128), "float16"), ((8, 8), "float32"))
    # 999 cached tokens round up to 63 blocks of 16
    assert continuation == (((1, 2, 1008, 128), "float16"),) * 2


@pytest.mark.parametrize(("seqs", "batched", "rows"), [(8, 2048, 16), (8, 10, 13), (1, 1, 1)])
def test_a_local_layers_decode_takes_its_virtual_rows(seqs: int, batched: int, rows: int) -> None:
    """Chunked local attention: up to two 1-token virtual decodes per request, no more
    than ``max_num_seqs`` plus half the token budget (``Geometry.decode_rows``)."""
    g = dataclasses.replace(
        fakes.geometry(max_num_seqs=seqs, batched=batched, splits=16), attention_chunk=8192
    )
    decode = geometry.runtime_requests(g)[0]
    assert [shape[0] for shape, _ in decode] == [rows] * 3
    plain = geometry.runtime_requests(dataclasses.replace(g, attention_chunk=0))[0]
    assert [shape[0] for shape, _ in plain] == [seqs] * 3


def test_release_0_20_requests_nothing() -> None:
    assert geometry.runtime_requests(fakes.geometry(version=(0, 20))) == []


@pytest.mark.parametrize(("batched", "groups"), [(128, 1), (129, 2)])
def test_continuation_only_past_the_fast_path(batched: int, groups: int) -> None:
    assert len(geometry.runtime_requests(fakes.geometry(batched=batched))) == groups


@pytest.mark.parametrize(
    ("group", "size"),
    [
        ([((1,), "float32")], 256),
        ([((64,), "float32")], 256),
        ([((65,), "float32")], 512),
        ([((1,), "float32"), ((1,), "bfloat16")], 512),
        ([((2, 3, 64), "float16")], 768),
        ([], 0),
    ],
)
def test_request_bytes_rounds_each_view(group: list[geometry.Request], size: int) -> None:
    assert geometry.request_bytes(group) == size


def test_plan_reservation_dedupes_largest_first() -> None:
    small, big = fakes.geometry(max_num_seqs=2), fakes.geometry(max_num_seqs=64)
    groups = workspace.plan_reservation([small, big, small])
    assert len(groups) == len(set(groups)) == 3  # the continuation request is shared
    assert set(groups) == {*geometry.runtime_requests(small), *geometry.runtime_requests(big)}
    sizes = [geometry.request_bytes(g) for g in groups]
    assert sizes == sorted(sizes, reverse=True)


class FakeManager:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def get_simultaneous(self, *views: tuple) -> None:
        self.calls.append(views)


def test_reserve_requests_the_largest_group_once(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    manager = FakeManager()
    monkeypatch.setattr(compat, "workspace_manager", lambda feats: manager)
    groups = workspace.plan_reservation([fakes.geometry(max_num_seqs=64, model_dtype="float16")])
    reserved = workspace.reserve(groups, compat.features((0, 26)))
    assert reserved == geometry.request_bytes(groups[0]) > geometry.request_bytes(groups[1])
    assert manager.calls == [tuple((shape, getattr(torch, dt)) for shape, dt in groups[0])]


@pytest.mark.parametrize(
    ("manager", "groups"), [(None, [(((1,), "float32"),)]), (FakeManager(), [])]
)
def test_reserve_without_manager_or_requests(
    monkeypatch: pytest.MonkeyPatch, manager: FakeManager | None, groups: list
) -> None:
    monkeypatch.setattr(compat, "workspace_manager", lambda feats: manager)
    assert workspace.reserve(groups, compat.features((0, 26))) == 0
    assert manager is None or manager.calls == []


@pytest.mark.parametrize(("seqs", "verify_len", "chunk"), [(8, 3, 0), (16, 5, 0), (8, 2, 8192)])
def test_the_batched_verify_path_reserves_a_row_per_query_token(
    seqs: int, verify_len: int, chunk: int
) -> None:
    """Served by the batched verify path, a decode launch takes one row per token of
    requests of up to ``1 + k`` tokens (``guards/batched_verify``): ``max_num_seqs x
    (1 + k)`` rows, a chunked local layer's virtual batch included."""
    g = dataclasses.replace(
        fakes.geometry(max_num_seqs=seqs, splits=16),
        verify_len=verify_len,
        attention_chunk=chunk,
    )
    decode = geometry.runtime_requests(g)[0]
    assert [shape[0] for shape, _ in decode] == [seqs * verify_len] * 3
