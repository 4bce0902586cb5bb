"""Contract: on a release with the extensible KV cache (0.34) the plugin's one-off warmup runs
inside vLLM's own ``_outside_kv_cache_transient_window``, so its scratch is not kept free for
the server's lifetime; on earlier releases, and on a cache that is not extensible, nothing
changes.

vLLM's real context manager runs as shipped. The worker is a namespace whose runner holds an
extensible-cache stand-in that records ``record_transient_peak`` (the window entered); the
allocator calls vLLM makes on the way out are recorded on ``torch.accelerator`` (this CPU has
no accelerator to reset). The plugin's work between them is the real ``warm_worker`` ->
``warmup.run`` path, its steps after the release check replaced by a recorder.
"""

from __future__ import annotations

import contextlib
import importlib
from types import SimpleNamespace
from typing import Any

import pytest

from tq_warmup_plugin import compat, install
from tq_warmup_plugin.settings import Settings
from tq_warmup_plugin.worker import warmup
from tq_warmup_plugin.worker.report import Report

pytestmark = pytest.mark.real_vllm


def _feats() -> compat.Features:
    return compat.release_features(compat.installed_vllm_version())


class _Cache:
    """``ExtensibleKVCache`` as the window reads it: the peak folded into the reserve."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def record_transient_peak(self) -> dict[str, Any]:
        self.events.append("peak recorded")
        return {}


def _run(monkeypatch: pytest.MonkeyPatch, extensible: bool) -> list[str]:
    events: list[str] = []
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a: None)
    monkeypatch.setattr(
        torch.accelerator, "reset_peak_memory_stats", lambda *a: events.append("peak reset")
    )

    def warm(*args: Any) -> Report:
        events.append("plugin work")
        return Report(status="ok")

    monkeypatch.setattr(warmup, "_warm", warm)
    runner = SimpleNamespace(extensible_kv_cache=_Cache(events) if extensible else None)
    worker = SimpleNamespace(model_runner=runner, device="cpu", rank=0)
    install.warm_worker(worker, Settings())
    return events


def test_the_plugin_runs_inside_vllms_window(monkeypatch: pytest.MonkeyPatch) -> None:
    if not _feats().kv_transient_window:
        pytest.skip("no extensible KV cache before 0.34")
    module = importlib.import_module(compat.WARMUP_MODULE)
    assert callable(getattr(module, compat.KV_WARMUP_WINDOW))  # vLLM's own helper is used
    assert _run(monkeypatch, extensible=True) == ["peak recorded", "plugin work", "peak reset"]


def test_without_the_wrapping_the_scratch_would_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above fails where the wrapping is removed: the work runs unbracketed."""
    if not _feats().kv_transient_window:
        pytest.skip("no extensible KV cache before 0.34")
    monkeypatch.setattr(compat, "kv_warmup_window", lambda worker, feats: contextlib.nullcontext())
    assert _run(monkeypatch, extensible=True) == ["plugin work"]


def test_a_fixed_kv_cache_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """``kv_cache_memory_bytes`` (or any release before 0.34) has no extensible cache."""
    assert _run(monkeypatch, extensible=False) == ["plugin work"]


def test_releases_before_034_have_no_window() -> None:
    module = importlib.import_module(compat.WARMUP_MODULE)
    has = callable(getattr(module, compat.KV_WARMUP_WINDOW, None))
    assert has == _feats().kv_transient_window
