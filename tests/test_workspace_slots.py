"""Every (ubatch, lane) workspace slot is reserved: the unit side (a fake manager)."""

from __future__ import annotations

from typing import Any

import fakes
import pytest

from tq_warmup_plugin import compat, geometry
from tq_warmup_plugin.worker import workspace


class SlotManager:
    """Records which slot each request was made in."""

    def __init__(self, ubatches: int | None, lanes: int | None) -> None:
        if ubatches is not None:
            self._num_ubatches = ubatches
        if lanes is not None:
            self._num_lanes = lanes
        self.calls: list[tuple[tuple[int, int], tuple]] = []
        self.slot = (0, 0)

    def get_simultaneous(self, *views: tuple) -> None:
        self.calls.append((self.slot, views))


@pytest.mark.parametrize(
    ("ubatches", "lanes", "slots"),
    [
        (None, None, [(0, 0)]),
        (1, None, [(0, 0)]),  # 0.21-0.27: no lanes
        (2, None, [(0, 0), (1, 0)]),  # --enable-dbo
        (1, 2, [(0, 0), (0, 1)]),  # 0.28+ V2 runner with DSpark drafting
        (2, 2, [(0, 0), (0, 1), (1, 0), (1, 1)]),
    ],
)
def test_workspace_slots(ubatches: int | None, lanes: int | None, slots: list) -> None:
    assert compat.workspace_slots(SlotManager(ubatches, lanes)) == slots


def test_slot_zero_needs_no_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slot (0, 0) is what every caller gets already: it must not import the workspace
    module, which a missing module name shows whether vLLM is installed or not."""
    monkeypatch.setattr(compat.vllm_paths, "WORKSPACE_MODULE", "tq_warmup_plugin._no_such")
    with compat.workspace_slot(0, 0):
        pass
    for ubatch, lane in ((1, 0), (0, 1)):  # any other slot does import it
        with pytest.raises(ModuleNotFoundError), compat.workspace_slot(ubatch, lane):
            pass


def test_reserve_fills_every_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    manager = SlotManager(2, 2)
    import contextlib

    @contextlib.contextmanager
    def slot(ubatch: int, lane: int) -> Any:
        manager.slot = (ubatch, lane)
        yield
        manager.slot = (0, 0)

    monkeypatch.setattr(compat, "workspace_manager", lambda feats: manager)
    monkeypatch.setattr(compat, "workspace_slot", slot)
    groups = workspace.plan_reservation([fakes.geometry()])
    reserved = workspace.reserve(groups, compat.features((0, 30)))
    assert reserved == 4 * geometry.request_bytes(groups[0])
    assert [s for s, _ in manager.calls] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len({views for _, views in manager.calls}) == 1
