"""The reservation comes after KV-cache sizing: when the device has no room, one
WARNING line says what will fail and what avoids it; strict mode fails startup."""

from __future__ import annotations

import logging
from typing import Any

import fakes
import pytest

from tq_warmup_plugin import compat, install
from tq_warmup_plugin.settings import Settings
from tq_warmup_plugin.worker import keyplan, warmup, workspace

torch = pytest.importorskip("torch")


class OomManager:
    """Grows like vLLM's manager (dropping the slot's buffer first) and runs out of
    memory for requests over ``limit`` bytes in slot ``oom_slot``."""

    def __init__(self, limit: int, oom_slot: tuple[int, int] = (0, 0), held: int = 0) -> None:
        self._num_ubatches, self._num_lanes = 2, 1
        self._current_workspaces: list[Any] = [None, None]
        if held:
            self._current_workspaces[oom_slot[0]] = torch.empty(held, dtype=torch.uint8)
        self.limit, self.oom_slot, self.slot = limit, oom_slot, (0, 0)
        self.sizes: list[tuple[tuple[int, int], int]] = []

    def get_simultaneous(self, *views: tuple) -> None:
        size = sum(-(-(torch.Size(s).numel() * d.itemsize) // 256) * 256 for s, d in views)
        index = self.slot[0]
        held = self._current_workspaces[index]
        if held is not None and held.numel() >= size:
            return
        self._current_workspaces[index] = None  # vLLM drops the old buffer first
        if self.slot == self.oom_slot and size > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB")
        self._current_workspaces[index] = torch.empty(size, dtype=torch.uint8)
        self.sizes.append((self.slot, size))


@pytest.fixture
def slots(monkeypatch: pytest.MonkeyPatch) -> None:
    import contextlib

    @contextlib.contextmanager
    def slot(ubatch: int, lane: int) -> Any:
        manager = compat.workspace_manager(compat.features((0, 26)))
        manager.slot = (ubatch, lane)
        yield
        manager.slot = (0, 0)

    monkeypatch.setattr(compat, "workspace_slot", slot)


@pytest.mark.usefixtures("slots")
def test_oom_in_ubatch_1_puts_vllms_buffer_back(monkeypatch: pytest.MonkeyPatch) -> None:
    manager = OomManager(limit=4096, oom_slot=(1, 0), held=1024)
    monkeypatch.setattr(compat, "workspace_manager", lambda feats: manager)
    groups = workspace.plan_reservation([fakes.geometry()])
    size = workspace.request_bytes(groups[0])
    with pytest.raises(workspace.ReservationError) as caught:
        workspace.reserve(groups, compat.features((0, 26)))
    err = caught.value
    assert (err.needed, err.slot, err.reserved) == (size, (1, 0), size)
    assert "CUDA out of memory" in str(err)
    # slot 0 reserved; slot 1 got back the 1024 bytes vLLM had put there
    assert manager.sizes == [((0, 0), size), ((1, 0), 1024)]
    assert compat.workspace_slot_bytes(manager, 1, 0) == 1024


def test_oom_warning_is_one_line_naming_the_settings() -> None:
    g = fakes.geometry(max_model_len=131072, max_num_seqs=256, num_kv_heads=8)
    exc = workspace.ReservationError(512 * 2**20, (0, 0), 0, "CUDA out of memory")
    line = workspace.oom_warning(exc, [g])
    assert "\n" not in line and "512.0 MiB" in line
    assert "--max-model-len" in line and "--gpu-memory-utilization" in line
    assert "131071 tokens" in line and "256 sequences" in line


def worker() -> Any:
    return fakes.worker(
        {"tq": fakes.layer(compat.features((0, 26)))}, [fakes.table(64)], max_model_len=1024
    )


@pytest.fixture
def oom_run(monkeypatch: pytest.MonkeyPatch) -> OomManager:
    manager = OomManager(limit=0)
    monkeypatch.setattr(compat, "turboquant_impl_class", lambda: fakes.TurboQuantAttentionImpl)
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "0.26.0")
    monkeypatch.setattr(compat, "workspace_manager", lambda feats: manager)
    monkeypatch.setattr(compat, "preallocate_prefill_buffers", lambda *a: 0)
    monkeypatch.setattr(keyplan, "CompileCounter", fakes.StubCounter)
    pm = fakes.manager(fakes.RecordingWarmer(None))
    real_run = warmup.run
    monkeypatch.setattr(warmup, "run", lambda w, s, pm_=None: real_run(w, s, pm))
    return manager


@pytest.mark.usefixtures("oom_run")
def test_oom_is_one_warning_and_an_error(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="vllm.tq_warmup_plugin"):
        report = warmup.run(worker(), Settings(launch=False, vllm_kernels=False))
    assert report.status == "ok" and report.workspace_bytes == 0
    assert report.errors == [report.errors[0]] and report.errors[0].startswith("workspace: ")
    assert report.failed == 1
    oom = [r.getMessage() for r in caplog.records if "out of device memory" in r.getMessage()]
    assert len(oom) == 1 and "--max-model-len" in oom[0]


@pytest.mark.usefixtures("oom_run")
def test_strict_mode_fails_startup_on_oom(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(RuntimeError, match="workspace: out of memory"):
        install.warm_worker(worker(), Settings(strict=True, launch=False, vllm_kernels=False))
    install.warm_worker(
        worker(), Settings(launch=False, vllm_kernels=False)
    )  # not strict: starts anyway
