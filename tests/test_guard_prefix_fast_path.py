"""The prefix-cache guard (upstream #46460) on a stand-in backend: the decision, the
routing, the Guard protocol, the setting, strict mode. The real builder and impl are
``tests/contract/test_contract_prefix_cache.py``."""

from __future__ import annotations

import dataclasses
import logging
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import fakes
import pytest
from conftest import Log

from tq_warmup_plugin import compat, guards, settings
from tq_warmup_plugin.guards import prefix_fast_path as guard


@pytest.mark.parametrize(
    ("requests", "expected"),
    [
        ([(700, 0)], True),
        ([(300, 0), (700, 0), (20, 0)], True),
        ([(700, 0), (50, 640)], False),  # upstream #46460: a hit beside a longer fresh prompt
        ([(50, 640), (700, 0)], False),
        ([(6, 94), (245, 0)], False),  # chunked prefill alone: a last chunk beside a first
        ([(700, 0), (0, 0)], True),  # a padded request (0 tokens, length 0)
    ],
)
def test_first_chunks_only(requests: list[tuple[int, int]], expected: bool) -> None:
    qsl = [0]
    for q, _ in requests:
        qsl.append(qsl[-1] + q)
    seqs = [q + c for q, c in requests]
    assert guard.first_chunks_only(qsl, seqs) is expected


def test_first_chunks_only_refuses_short_host_lengths() -> None:
    """Fewer host lengths than requests (a virtual batch's real lengths): not proven."""
    assert guard.first_chunks_only([0, 5, 10], [5]) is False


class Tensor(list[int]):
    """A host tensor as far as the guard reads one: ``shape`` and ``tolist``."""

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def tolist(self) -> list[int]:
        return list(self)


@dataclass
class Meta:
    """``TurboQuantMetadata`` (0.21+) as the guard reads it: every field (``FIELDS``),
    each tensor a host list; ``block_table`` has one entry per request (its row)."""

    seq_lens: Tensor
    slot_mapping: Tensor
    block_table: Tensor
    query_start_loc: Tensor
    num_actual_tokens: int = 0
    max_query_len: int = 0
    max_seq_len: int = 0
    is_prefill: bool = True
    num_decodes: int = 0
    num_decode_tokens: int = 0
    query_start_loc_cpu: Tensor | None = None
    seq_lens_cpu: Tensor | None = None


def meta(requests: list[tuple[int, int]], host: bool = True) -> Meta:
    """A prefill batch of ``(query_len, cached_len)``: request ``i``'s block-table row is
    ``100 + i``, token ``t``'s slot ``1000 + t``."""
    qsl = [0]
    for q, _ in requests:
        qsl.append(qsl[-1] + q)
    seqs = [q + c for q, c in requests]
    return Meta(
        seq_lens=Tensor(seqs),
        slot_mapping=Tensor(range(1000, 1000 + qsl[-1])),
        block_table=Tensor(range(100, 100 + len(requests))),
        query_start_loc=Tensor(qsl),
        num_actual_tokens=qsl[-1],
        max_query_len=max(q for q, _ in requests),
        max_seq_len=max(seqs),
        query_start_loc_cpu=Tensor(qsl) if host else None,
        seq_lens_cpu=Tensor(seqs) if host else None,
    )


@pytest.fixture
def release(monkeypatch: pytest.MonkeyPatch) -> Any:
    def use(version: str) -> None:
        monkeypatch.setattr(compat, "installed_vllm_version", lambda: version)

    use("0.26.0")
    return use


def test_without_host_copies_only_one_request_keeps_the_fast_path(release: Any) -> None:
    release("0.20.0")
    assert guard.keeps_fast_path(meta([(700, 0)], host=False))
    assert not guard.keeps_fast_path(meta([(700, 0), (20, 0)], host=False))  # not provable


class Local:
    attention_chunk_size = 8192  # a chunked local layer (Llama 4)


def test_a_local_layer_keeps_vllms_choice_where_its_host_lengths_are_the_real_ones(
    release: Any, log: Log
) -> None:
    hit = meta([(700, 0), (50, 640)])
    release("0.29.0")  # Features.local_prefill_real_lens: the loop is the broken side
    assert guard.keeps_fast_path(hit, Local())
    assert guard.keeps_fast_path(hit, Local())
    warnings = [m for level, m in log() if "chunked local layer" in m]
    assert len(warnings) == 1 and "vLLM 0.29" in warnings[0]
    release("0.30.0")  # the virtual lengths: decided like any other layer
    assert not guard.keeps_fast_path(hit, Local())
    assert not guard.keeps_fast_path(hit, None)
    guard.remove(types.ModuleType("empty"))  # the message is said again after a remove


def fake_backend() -> tuple[types.ModuleType, list[Any]]:
    """A module shaped like ``turboquant_attn`` (FlashAttention present): the impl's
    ``_prefill_attention`` records the metadata it is given and answers, per query row,
    which path vLLM's test takes and the row's token."""
    seen: list[Any] = []

    class TurboQuantAttentionImpl:
        def _prefill_attention(
            self, query: Any, key: Any, value: Any, kv_cache: Any, attn_metadata: Any,
            Pi: Any, centroids: Any, PiT: Any = None, layer: Any = None,
        ) -> list[tuple[str, int]]:  # fmt: skip
            seen.append(attn_metadata)
            fast = attn_metadata.max_query_len == attn_metadata.max_seq_len
            assert len(query) == len(key) == len(value) == attn_metadata.num_actual_tokens
            return [("fast" if fast else "loop", t) for t in query]

    module = types.ModuleType(compat.BACKEND_MODULE)
    module.TurboQuantAttentionImpl = TurboQuantAttentionImpl  # type: ignore[attr-defined]
    module._HAS_FLASH_ATTN = True  # type: ignore[attr-defined]
    return module, seen


@pytest.fixture
def host_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """The split's two torch calls, on host lists."""
    monkeypatch.setattr(guard, "_cat", lambda parts: Tensor(x for p in parts for x in p))
    monkeypatch.setattr(guard, "_tensor_like", lambda values, like: Tensor(values))


@pytest.fixture
def backend(release: Any, host_tensors: None) -> Iterator[tuple[types.ModuleType, list[Any]]]:
    module, seen = fake_backend()
    yield module, seen
    guard.remove(module)


def call(module: types.ModuleType, m: Meta) -> str:
    """The path every row took: ``fast``, ``loop``, or ``split`` where the rows differ."""
    paths = {path for path, _ in rows(module, m)}
    return paths.pop() if len(paths) == 1 else "split"


def rows(module: types.ModuleType, m: Meta) -> list[tuple[str, int]]:
    tokens = list(range(m.query_start_loc[-1]))
    impl = module.TurboQuantAttentionImpl()
    out = impl._prefill_attention(tokens, tokens, tokens, None, m, None, None, None, layer=None)
    return list(out)


def test_routing(backend: tuple[types.ModuleType, list[Any]], log: Log) -> None:
    module, seen = backend
    hit = meta([(700, 0), (50, 640)])
    assert call(module, hit) == "fast"  # vLLM's own: the hit loses its prefix
    assert guard.install(module) and guard.installed(module)
    assert call(module, hit) == "loop"
    assert seen[-1] is not hit and seen[-1].max_seq_len == 701  # still an upper bound
    assert hit.max_seq_len == 700  # the caller's metadata untouched
    fresh = meta([(300, 0), (700, 0)])
    assert call(module, fresh) == "fast" and seen[-1] is fresh
    mixed = meta([(50, 640), (100, 0)])  # maxima differ: vLLM's loop already
    assert call(module, mixed) == "loop" and seen[-1] is mixed
    assert [m for _, m in log()].count(next(m for _, m in log() if "guard on" in m)) == 1


@pytest.mark.parametrize(
    ("requests", "fresh", "hits"),
    [
        ([(300, 0), (700, 0)], [0, 1], []),
        ([(700, 0), (50, 640), (300, 0)], [0, 2], [1]),
        ([(50, 640), (6, 94)], [], [0, 1]),  # a hit and a last chunk
        ([(700, 0), (0, 0), (0, 5), (20, 0)], [0, 3], []),  # padding: in neither
    ],
)
def test_split_batch(requests: list[tuple[int, int]], fresh: list[int], hits: list[int]) -> None:
    m = meta(requests)
    assert guard.split_batch(m.query_start_loc_cpu, m.seq_lens_cpu) == (fresh, hits)


# Hits 0, 1 and 3 (two runs), first chunks 2, 4 and 5.
RUNS = [(50, 640), (60, 640), (200, 0), (12, 640), (700, 0), (20, 0)]


def test_pack_keeps_runs_of_hits_whole() -> None:
    m = meta(RUNS)
    sub = guard.pack(m.query_start_loc_cpu, m.seq_lens_cpu, [0, 1, 3])
    assert sub.runs == [(0, 2), (3, 4)]
    assert sub.rows == [(0, 110), (310, 322)]  # the runs' token rows in the batch
    assert sub.query_start_loc == [0, 50, 110, 122]
    assert sub.seq_lens == [690, 700, 652]


def test_the_hits_metadata(host_tensors: None) -> None:
    m = meta(RUNS)
    before = dict(vars(m))
    sub = guard.sub_metadata(m, guard.pack(m.query_start_loc_cpu, m.seq_lens_cpu, [0, 1, 3]))
    assert {f.name for f in dataclasses.fields(Meta)} == guard.FIELDS
    assert sub.seq_lens == sub.seq_lens_cpu == [690, 700, 652]
    assert sub.block_table == [100, 101, 103]
    assert sub.slot_mapping == [*range(1000, 1110), *range(1310, 1322)]
    assert sub.query_start_loc == sub.query_start_loc_cpu == [0, 50, 110, 122]
    assert (sub.num_actual_tokens, sub.max_query_len, sub.max_seq_len) == (122, 60, 700)
    assert (sub.is_prefill, sub.num_decodes, sub.num_decode_tokens) == (True, 0, 0)
    assert vars(m) == before  # the batch's own metadata untouched


def test_a_mixed_batch_is_split(backend: tuple[types.ModuleType, list[Any]]) -> None:
    """Two calls of vLLM's method: the whole batch as it is (its fast path: the first
    chunks' rows), then the hits packed (its loop: their rows, in their places)."""
    module, seen = backend
    assert guard.install(module)
    m = meta(RUNS)
    out = rows(module, m)
    assert [x is m for x in seen] == [True, False]
    assert seen[1].max_seq_len > seen[1].max_query_len  # vLLM's loop
    hit_rows = {*range(0, 110), *range(310, 322)}
    assert out == [("loop" if t in hit_rows else "fast", t) for t in range(m.num_actual_tokens)]


@pytest.mark.parametrize(
    ("requests", "path"),
    [
        ([(300, 0), (700, 0)], "fast"),  # first chunks only: vLLM's fast path
        ([(700, 0), (50, 640)], "loop"),  # one first chunk: the loop gives it its one call
        ([(700, 0), (0, 0), (50, 640)], "loop"),  # padding is no first chunk
        ([(700, 0), (50, 640), (300, 0)], "split"),
    ],
)
def test_one_call_unless_split(
    backend: tuple[types.ModuleType, list[Any]], requests: list[tuple[int, int]], path: str
) -> None:
    module, seen = backend
    assert guard.install(module)
    assert call(module, meta(requests)) == path
    assert len(seen) == (2 if path == "split" else 1)


def test_no_split_without_flash_attention_host_lengths_or_a_known_metadata(
    backend: tuple[types.ModuleType, list[Any]], release: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's loop, as before the split: a release without FlashAttention (its fast path
    is the loop as well), without host copies (0.20), or a metadata class with a field
    the split does not know."""
    module, seen = backend
    assert guard.install(module)
    mixed = [(700, 0), (50, 640), (300, 0)]
    monkeypatch.setattr(module, "_HAS_FLASH_ATTN", False)
    assert call(module, meta(mixed)) == "loop" and len(seen) == 1
    monkeypatch.setattr(module, "_HAS_FLASH_ATTN", True)
    release("0.20.0")
    assert call(module, meta(mixed, host=False)) == "loop" and len(seen) == 2
    release("0.26.0")

    @dataclass
    class Newer(Meta):
        new_field: int = 0

    newer = Newer(**vars(meta(mixed)))
    assert call(module, newer) == "loop" and len(seen) == 3
    assert call(module, meta(mixed)) == "split" and len(seen) == 5


def test_the_guard_keeps_its_protocol(backend: tuple[types.ModuleType, list[Any]], log: Log
                                      ) -> None:  # fmt: skip
    """Install, announce once, remove (vLLM's method back), install and announce again."""
    module, _ = backend
    original = module.TurboQuantAttentionImpl.__dict__["_prefill_attention"]
    for _ in range(2):
        assert guard.install(module) and guard.install(module)
        call(module, meta([(5, 0)]))
        call(module, meta([(5, 0)]))
        guard.remove(module)
        assert module.TurboQuantAttentionImpl.__dict__["_prefill_attention"] is original
        assert not guard.installed(module)
    assert sum("prefix-cache guard on" in m for _, m in log()) == 2


def test_under_capture_vllms_choice_stands(
    backend: tuple[types.ModuleType, list[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    module, _ = backend
    assert guard.install(module)
    monkeypatch.setattr(guard, "_capturing", lambda: True)
    assert call(module, meta([(700, 0), (50, 640)])) == "fast"
    assert call(module, meta([(700, 0), (50, 640), (300, 0)])) == "fast"


def test_an_unsupported_release_installs_nothing(
    backend: tuple[types.ModuleType, list[Any]], release: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A release newer than the plugin knows: unguarded, and its one WARNING says what
    that risks and how an operator avoids it."""
    module, _ = backend
    release(fakes.BEYOND_RELEASE)
    with caplog.at_level(logging.WARNING, logger="vllm.tq_warmup_plugin"):
        assert not guard.install(module)
    assert not guard.installed(module)
    assert [r.getMessage() for r in caplog.records] == [
        f"tq-warmup: prefix-cache guard not installed: {fakes.OUTSIDE}; {guard.RISK}"
    ]
    assert "#46460" in guard.RISK and "--no-enable-prefix-caching" in guard.RISK


def test_the_setting_and_the_guard_list() -> None:
    on, problems = settings.parse({})
    off, _ = settings.parse({"TQ_WARMUP_PREFIX_GUARD": "0"})
    bad, bad_problems = settings.parse({"TQ_WARMUP_PREFIX_GUARD": "maybe"})
    assert on.prefix_guard and not off.prefix_guard and bad.prefix_guard and not problems
    assert len(bad_problems) == 1 and "TQ_WARMUP_PREFIX_GUARD='maybe'" in bad_problems[0]
    assert guard in guards.every()
    assert guard in guards.active(on) and guard not in guards.active(off)
    no_spec = settings.parse({"TQ_WARMUP_SPEC_GUARD": "0"})[0]
    assert guard in guards.active(no_spec)  # independent of the speculative guards


def test_strict_mode_is_told_where_the_install_failed(
    backend: tuple[types.ModuleType, list[Any]], log: Log
) -> None:
    module, _ = backend
    feats = compat.features((0, 26))
    assert guard.missing(feats, wanted=True) is None  # never installed: nothing failed
    broken = types.ModuleType(compat.BACKEND_MODULE)  # a layout without the impl class
    assert not guard.install(broken)
    assert any("prefix-cache guard not installed" in m for _, m in log())  # the WARNING
    assert guard.missing(feats, wanted=True) is not None  # strict mode fails startup
    assert guard.missing(feats, wanted=False) is None  # TQ_WARMUP_PREFIX_GUARD=0
    assert guard.install(module)
    assert guard.missing(feats, wanted=True) is None
