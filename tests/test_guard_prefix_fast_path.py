"""The prefix-cache guard (upstream #46460) on a stand-in backend: the decision, the
routing, the Guard protocol, the setting, strict mode. The real builder and impl are
``tests/contract/test_contract_prefix_cache.py``."""

from __future__ import annotations

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
    """The fields of ``TurboQuantMetadata`` the guard and vLLM's fast-path test read."""

    query_start_loc: Tensor
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: Tensor | None
    seq_lens_cpu: Tensor | None


def meta(requests: list[tuple[int, int]], host: bool = True) -> Meta:
    qsl = [0]
    for q, _ in requests:
        qsl.append(qsl[-1] + q)
    seqs = [q + c for q, c in requests]
    return Meta(
        Tensor(qsl),
        max(q for q, _ in requests),
        max(seqs),
        Tensor(qsl) if host else None,
        Tensor(seqs) if host else None,
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
    """A module shaped like ``turboquant_attn``: the impl's ``_prefill_attention`` records
    the metadata it is given and whether vLLM's test would take the fast path."""
    seen: list[Any] = []

    class TurboQuantAttentionImpl:
        def _prefill_attention(
            self, query: Any, key: Any, value: Any, kv_cache: Any, attn_metadata: Any,
            Pi: Any, centroids: Any, PiT: Any = None, layer: Any = None,
        ) -> str:  # fmt: skip
            seen.append(attn_metadata)
            return "fast" if attn_metadata.max_query_len == attn_metadata.max_seq_len else "loop"

    module = types.ModuleType(compat.BACKEND_MODULE)
    module.TurboQuantAttentionImpl = TurboQuantAttentionImpl  # type: ignore[attr-defined]
    return module, seen


@pytest.fixture
def backend(release: Any) -> Iterator[tuple[types.ModuleType, list[Any]]]:
    module, seen = fake_backend()
    yield module, seen
    guard.remove(module)


def call(module: types.ModuleType, m: Meta) -> str:
    impl = module.TurboQuantAttentionImpl()
    return str(impl._prefill_attention(None, None, None, None, m, None, None, None, layer=None))


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
