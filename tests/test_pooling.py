"""Pooling models: warmed and reserved for like generative ones whenever a request
can reuse its own cached prefix (chunked prefill, prefix caching), else store and
prefill only."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import fakes
import pytest

from tq_warmup_plugin import compat
from tq_warmup_plugin.settings import Settings
from tq_warmup_plugin.worker import keyplan, launches, warmup
from tq_warmup_plugin.worker.discovery import PREFILL_ONLY_PATHS, discover

FEATS = compat.features((0, 26))


def config(runner: str, chunked: bool | None, cached: bool | None) -> Any:
    scheduler = (
        SimpleNamespace() if chunked is None else SimpleNamespace(enable_chunked_prefill=chunked)
    )
    cache = SimpleNamespace() if cached is None else SimpleNamespace(enable_prefix_caching=cached)
    return SimpleNamespace(
        model_config=SimpleNamespace(runner_type=runner),
        scheduler_config=scheduler,
        cache_config=cache,
    )


@pytest.mark.parametrize(
    ("runner", "chunked", "cached", "reused"),
    [
        ("generate", False, False, True),  # decode reuses the prefix
        ("pooling", True, True, True),  # LAST/ALL pooling: vLLM's defaults
        ("pooling", True, False, True),
        ("pooling", False, True, True),  # 0.24+ builder reserves nothing: we must
        ("pooling", False, False, False),  # MEAN/CLS/STEP pooling: vLLM's defaults
        ("pooling", None, None, True),  # unreadable: warm everything
    ],
)
def test_prefix_reused(
    runner: str, chunked: bool | None, cached: bool | None, reused: bool
) -> None:
    assert compat.prefix_reused(config(runner, chunked, cached)) is reused


def pooling_worker(chunked: bool, cached: bool) -> Any:
    worker = fakes.worker({"tq": fakes.layer(FEATS)}, [fakes.table(64)], runner_type="pooling")
    worker.vllm_config.scheduler_config.enable_chunked_prefill = chunked
    worker.vllm_config.cache_config = SimpleNamespace(enable_prefix_caching=cached)
    return worker


@pytest.fixture
def tq_class(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    monkeypatch.setattr(compat, "turboquant_impl_class", lambda: fakes.TurboQuantAttentionImpl)


@pytest.mark.usefixtures("tq_class")
@pytest.mark.parametrize(("chunked", "cached"), [(True, True), (True, False), (False, True)])
def test_pooling_with_prefix_reuse_warms_every_path(chunked: bool, cached: bool) -> None:
    found = discover(pooling_worker(chunked, cached), FEATS)
    assert list(found.geometries) == ["tq"] and found.paths is None and found.note == ""


@pytest.mark.usefixtures("tq_class")
def test_pooling_without_prefix_reuse_stores_and_prefills_only() -> None:
    found = discover(pooling_worker(False, False), FEATS)
    assert list(found.geometries) == ["tq"] and found.paths == PREFILL_ONLY_PATHS
    assert "pooling model" in found.note


def test_prefill_only_launches_are_fresh_prompt_attention() -> None:
    g = fakes.geometry(max_model_len=8192, batched=2048)
    full = launches.plan({"l": g}, {"b": (8, 2, 128)})
    only = launches.plan({"l": g}, {"b": (8, 2, 128)}, prefill_only=True)
    assert {x.kind for x in full} == {"gemm", "attention", "paged_decode"}
    assert list(only) == [x for x in full if x.kind == "attention" and x.rows == x.cols]
    assert len(only) == 1


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def get_simultaneous(self, *views: tuple) -> None:
        self.calls.append(views)


@pytest.mark.usefixtures("tq_class")
@pytest.mark.parametrize(("chunked", "cached"), [(False, False), (False, True)])
def test_run_on_a_pooling_worker(
    monkeypatch: pytest.MonkeyPatch, chunked: bool, cached: bool
) -> None:
    manager = Recorder()
    warmer = fakes.RecordingWarmer(None)
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "0.26.0")
    monkeypatch.setattr(compat, "workspace_manager", lambda *a, **k: manager)
    monkeypatch.setattr(compat, "preallocate_prefill_buffers", lambda *a: 0)
    monkeypatch.setattr(keyplan, "CompileCounter", fakes.StubCounter)
    report = warmup.run(
        pooling_worker(chunked, cached),
        Settings(launch=False, vllm_kernels=False),
        fakes.manager(warmer),
    )
    compiled = [key.kernel for key in warmer.seen]
    assert report.status == "ok" and report.errors == [], report.line()
    if cached:  # a prefix-cache hit continues: decode kernels, dequant, workspace
        assert set(report.keys) == {"decode", "continuation", "dequant", "store"}
        assert report.workspace_bytes > 0 and manager.calls
    else:
        assert set(report.keys) == {"store"} and set(compiled) == {"_tq_fused_store_mse"}
        assert report.workspace_bytes == 0 and manager.calls == []
        assert "pooling model without chunked prefill or prefix caching" in report.line()
