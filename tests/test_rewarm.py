"""A second warmup in the same process (elastic EP, 0.27+: ``kernel_warmup`` with
``process_local_only=True``, then again from ``warm_and_capture``) makes no first
launch twice: CUDA has already loaded those modules."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import fakes
import pytest

from tq_warmup_plugin import compat
from tq_warmup_plugin.settings import Settings
from tq_warmup_plugin.worker import keyplan, launches, warmup
from tq_warmup_plugin.worker.discovery import Discovery

torch = pytest.importorskip("torch")


@pytest.mark.parametrize(
    ("version", "cause"),
    [
        ("0.27.1", "elastic EP warms a worker more than once"),
        ("0.33.0", "elastic EP warms a worker more than once"),
        ("0.26.0", "kernel_warmup ran again in this process"),
    ],
)
def test_second_warmup_makes_no_launch_twice(
    monkeypatch: pytest.MonkeyPatch, version: str, cause: str
) -> None:
    made: list[tuple[str, launches.Launch]] = []
    device = SimpleNamespace(type="cuda", index=len(version))  # a device of its own per case
    found = Discovery(
        geometries={"l0": fakes.geometry(version=compat.parse_version(version) or (0, 0))},
        impls={"l0": object()},
        device=device,
    )
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: version)
    monkeypatch.setattr(compat, "workspace_manager", lambda feats: None)
    monkeypatch.setattr(compat, "preallocate_prefill_buffers", lambda *a: 0)
    monkeypatch.setattr(compat, "flash_attn_available", lambda: True)
    monkeypatch.setattr(warmup, "discover", lambda worker, feats: found)
    monkeypatch.setattr(keyplan, "CompileCounter", fakes.StubCounter)
    monkeypatch.setattr(launches, "_launch", lambda x, impl, dev: made.append((str(dev), x)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(launches, "_LAUNCHED", set())
    pm = fakes.manager(fakes.RecordingWarmer(None))

    first = warmup.run(object(), Settings(vllm_kernels=False), pm)
    planned = len(launches.plan(found.geometries))
    assert first.launches == planned == len(made) and first.notes == []
    second = warmup.run(
        object(), Settings(vllm_kernels=False), pm
    )  # process_local_only, then warm_and_capture
    assert second.launches == 0 and len(made) == planned
    assert second.notes == [f"{planned} first launches already made ({cause})"]
    assert cause in second.line() and second.errors == []


def test_a_failed_launch_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launches, "_LAUNCHED", set())
    monkeypatch.setattr(compat, "flash_attn_available", lambda: True)
    todo = {launches.Launch("gemm", "float32", 8, 128): "l0"}
    calls: list[int] = []

    def fail_once(x: Any, impl: Any, dev: Any) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("no kernel image")

    monkeypatch.setattr(launches, "_launch", fail_once)
    cpu = torch.device("cpu")
    assert launches.launch_all(launches.not_yet_launched(todo, cpu), {"l0": None}, cpu)[0] == 0
    assert launches.not_yet_launched(todo, cpu) == todo
    assert launches.launch_all(launches.not_yet_launched(todo, cpu), {"l0": None}, cpu)[0] == 1
    assert launches.not_yet_launched(todo, cpu) == {}
    assert launches.not_yet_launched(todo, "cuda:1") == todo  # per device
