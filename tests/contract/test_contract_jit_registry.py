"""Contract: on 0.29+ the plugin's warmup runs inside vLLM's own JIT warmup phase, as one
registration of the runner's real ``JitWarmupRegistry``, called by vLLM's real
``kernel_warmup``; where vLLM will not compile registrations (0.20-0.28, or
``enable_jit_warmup`` off) it runs before ``kernel_warmup`` as on every release before.

The worker is a namespace with what ``kernel_warmup(process_local_only=True)`` reads (elastic
EP's call, 0.27+, which stops before vLLM's dummy runs); the plugin's warmup is a recorder,
so each test says where it ran: inside the registry's ``warmup`` or before it. (0.22 and 0.26
have no registry and skip; ``test_install`` holds the path they take, before
``kernel_warmup``, which 0.27-0.28 and vLLM's JIT warmup turned off take too.)
"""

from __future__ import annotations

import importlib
import logging
import sys
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from tq_warmup_plugin import compat, install
from tq_warmup_plugin.settings import Settings

pytestmark = pytest.mark.real_vllm

MINIMAX = "vllm.model_executor.warmup.minimax_m3_msa_warmup"
"""The one module ``kernel_warmup`` imports (0.30+) that cannot import on this CPU: it loads
the MiniMax-M3 model, whose processor needs torchvision (no CPU wheel of it for torch 2.13
here); a stand-in whose warmup does nothing replaces it where it fails."""
MODEL_WARMUPS = (
    "qwen_triton_warmup",
    "qwen_vl_triton_warmup",
    "mamba_triton_warmup",
    "replayssm_lifecycle_warmup",
    "kimi_k3_triton_warmup",
    "watermark_sample_warmup",
    "qwen4_exp_qsa_triton_warmup",
)
"""The model-specific warmups ``kernel_warmup`` calls after its registry (0.30, 0.33, 0.34,
where ``replayssm_lifecycle_warmup`` replaced ``mamba_triton_warmup``): each
looks for its model's layers, and two import vision models that need torchvision. Recorded
instead ("model warmups"), which also shows that the plugin ran before them."""


def feats() -> compat.Features:
    return compat.release_features(compat.installed_vllm_version())


def _worker(enabled: bool) -> tuple[Any, list[str]]:
    """A worker with the runner's real registry; ``events`` records the registry's warmup."""
    try:
        registry_class = importlib.import_module(compat.JIT_WARMUP_MODULE).JitWarmupRegistry
    except ImportError:
        pytest.skip("no JIT warmup registry (0.20-0.26): the unit tests hold the path before it")
    events: list[str] = []

    class Recorded(registry_class):  # type: ignore[misc, valid-type]
        def warmup(self) -> None:
            events.append("registry warmup starts")
            super().warmup()
            events.append("registry warmup ends")

    config = SimpleNamespace(
        kernel_config=SimpleNamespace(enable_jit_warmup=enabled, enable_cutedsl_warmup=False),
        model_config=SimpleNamespace(
            hf_text_config=SimpleNamespace(model_type="llama"),
            hf_config=SimpleNamespace(model_type="llama"),
        ),
        compilation_config=SimpleNamespace(cudagraph_capture_sizes=[]),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=2048),
    )
    runner = SimpleNamespace(
        jit_warmup_registry=Recorded(config),
        device=SimpleNamespace(type="cpu"),
        get_model=lambda: None,
    )
    worker = SimpleNamespace(vllm_config=config, model_runner=runner, use_v2_model_runner=True)
    worker.scheduler_config = config.scheduler_config
    worker.get_model = lambda: None
    return worker, events


def _collecting_worker() -> tuple[Any, list[str]]:
    """``_worker`` with vLLM's JIT warmup on, where the runner collects registrations."""
    if not feats().jit_registry_collects:
        pytest.skip("this vLLM's runner collects no JIT warmup registrations (0.20-0.28)")
    return _worker(enabled=True)


def _kernel_warmup(monkeypatch: pytest.MonkeyPatch, events: list[str], fail: bool = False) -> Any:
    """vLLM's real ``kernel_warmup`` wrapped by the plugin, its warmup a recorder."""

    def warm(worker: Any, settings: Settings) -> None:
        events.append("plugin warmup")
        if fail:
            raise RuntimeError("tq-warmup strict mode: 1 failed")

    monkeypatch.setattr(install, "warm_worker", warm)
    try:
        importlib.import_module(MINIMAX)
    except ImportError:  # 0.30+: the MiniMax-M3 model's warmup, which imports torchvision
        stand_in = ModuleType(MINIMAX)
        stand_in.minimax_m3_msa_warmup = lambda worker: None  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, MINIMAX, stand_in)
    module = importlib.import_module(compat.WARMUP_MODULE)
    for name in MODEL_WARMUPS:
        if hasattr(module, name):
            monkeypatch.setattr(module, name, lambda *a, **k: events.append("model warmups"))
    return install.wrap(module.kernel_warmup, Settings())


def test_the_warmup_runs_inside_vllms_jit_warmup_phase(monkeypatch: pytest.MonkeyPatch) -> None:
    worker, events = _collecting_worker()
    _kernel_warmup(monkeypatch, events)(worker, process_local_only=True)
    assert events[:3] == ["registry warmup starts", "plugin warmup", "registry warmup ends"]
    assert set(events[3:]) == {"model warmups"}
    # kernel_warmup again (elastic EP): its own registration runs; the first one stays quiet
    events.clear()
    _kernel_warmup(monkeypatch, events)(worker, process_local_only=True)
    assert events[:3] == ["registry warmup starts", "plugin warmup", "registry warmup ends"]


def test_with_vllms_jit_warmup_off_it_runs_before_kernel_warmup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    worker, events = _worker(enabled=False)
    _kernel_warmup(monkeypatch, events)(worker, process_local_only=True)
    assert events[0] == "plugin warmup" and "registry warmup starts" not in events  # it is off


def test_a_strict_failure_in_the_registry_fails_startup_as_before(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    worker, events = _collecting_worker()
    with caplog.at_level(logging.ERROR), pytest.raises(RuntimeError, match="strict mode"):
        _kernel_warmup(monkeypatch, events, fail=True)(worker, process_local_only=True)
    assert events == ["registry warmup starts", "plugin warmup"]


def test_a_registry_that_refuses_the_registration_costs_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    worker, events = _collecting_worker()

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise TypeError("register() got an unexpected keyword argument")

    registry_class = importlib.import_module(compat.JIT_WARMUP_MODULE).JitWarmupRegistry
    monkeypatch.setattr(registry_class, "register", classmethod(refuse))
    with caplog.at_level(logging.WARNING, logger="vllm.tq_warmup_plugin"):
        _kernel_warmup(monkeypatch, events)(worker, process_local_only=True)
    assert events[0] == "plugin warmup"  # before kernel_warmup, as on 0.20-0.28
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.tq_warmup_plugin"]
    assert len(lines) == 1 and "cannot register with vLLM's JIT warmup registry" in lines[0]
