"""The reservation against the real WorkspaceManager: every (ubatch, lane) slot the
worker configures survives the lock (dual-batch overlap's ubatch 1, 0.21+; the
DSpark drafter's lane 1, 0.28+)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from realvllm import (
    MAX_NUM_SEQS,
    impl_geometry,
    layer_kv_cache,
    make_impl,
    recorded_keys,
    run_backend,
)

from tq_warmup_plugin import compat
from tq_warmup_plugin.geometry import Geometry, request_bytes
from tq_warmup_plugin.worker import workspace

pytestmark = pytest.mark.real_vllm

WIDTH, BS = 64, 16


@contextlib.contextmanager
def in_slot(ubatch: int, lane: int) -> Iterator[None]:
    """The slot as vLLM itself selects it: a running DBO ubatch context registers its
    thread (``UBatchContext.__enter__``), a lane is entered with ``use_workspace_lane``."""
    from vllm.v1.worker import ubatching
    from vllm.v1.worker import workspace as ws

    with contextlib.ExitStack() as stack:
        if ubatch:
            tid = threading.get_ident()
            ubatching._THREAD_ID_TO_CONTEXT[tid] = ubatch
            stack.callback(ubatching._THREAD_ID_TO_CONTEXT.pop, tid)
        if lane:
            stack.enter_context(ws.use_workspace_lane(lane))
        yield


def geometry(impl: Any, feats: compat.Features) -> Geometry:
    return impl_geometry(feats, impl, WIDTH, BS)


@pytest.mark.parametrize("mode", ["every slot", "slot 0 only", "none"])
def test_every_slot_survives_the_workspace_lock(vllm_env: compat.Features, mode: str) -> None:
    import torch
    from vllm.v1.worker import workspace as ws

    if not vllm_env.uses_workspace:
        pytest.skip("0.20 does not use the workspace")
    lanes = 2 if hasattr(ws, "use_workspace_lane") else 1  # 0.28+
    impl = make_impl("turboquant_4bit_nc", 128, 8, 2, 32, WIDTH * BS)
    ws.reset_workspace_manager()
    ws.init_workspace_manager(torch.device("cpu"), 2, *([lanes] if lanes > 1 else []))
    try:
        manager = ws.current_workspace_manager()
        slots = [(u, lane) for u in range(2) for lane in range(lanes)]
        assert compat.workspace_slots(manager) == slots
        groups = workspace.plan_reservation([geometry(impl, vllm_env)])
        if mode == "every slot":
            per_slot = request_bytes(groups[0])
            assert workspace.reserve(groups, vllm_env) == per_slot * len(slots)
        elif mode == "slot 0 only":  # what the plugin reserved before
            manager.get_simultaneous(*[(s, getattr(torch, d)) for s, d in groups[0]])
        ws.lock_workspace()
        kv = layer_kv_cache(vllm_env, WIDTH, BS, 2, impl.tq_config.slot_size_aligned)
        longest = [(200, WIDTH * BS - 200 - 1)]
        decode_all = [(1, 40)] * MAX_NUM_SEQS
        for slot in slots:
            fits = mode == "every slot" or (mode == "slot 0 only" and slot == (0, 0))
            with recorded_keys(), in_slot(*slot):  # recorded, not launched
                batches = [(decode_all, MAX_NUM_SEQS), (longest, 0)]
                if fits:
                    run_backend(impl, kv, WIDTH, torch.bfloat16, batches)
                else:
                    with pytest.raises(AssertionError, match="Workspace is locked"):
                        run_backend(impl, kv, WIDTH, torch.bfloat16, batches)
        # The slot helper puts the ubatch lookup back.
        assert ws.dbo_current_ubatch_id() == 0
    finally:
        ws.reset_workspace_manager()
        ws.init_workspace_manager(torch.device("cpu"))


def test_the_slot_helper_selects_the_managers_slot(vllm_env: compat.Features) -> None:
    import torch
    from vllm.v1.worker import workspace as ws

    if not vllm_env.uses_workspace:
        pytest.skip("0.20 does not use the workspace")
    lanes = 2 if hasattr(ws, "use_workspace_lane") else 1
    ws.reset_workspace_manager()
    ws.init_workspace_manager(torch.device("cpu"), 2, *([lanes] if lanes > 1 else []))
    try:
        manager = ws.current_workspace_manager()
        for n, (ubatch, lane) in enumerate(compat.workspace_slots(manager), start=1):
            with compat.workspace_slot(ubatch, lane):
                manager.get_simultaneous(((n * 256,), torch.uint8))
        sizes = [0 if t is None else t.numel() for t in manager._current_workspaces]
        assert sizes == [n * 256 for n in range(1, 2 * lanes + 1)]
        assert ws.dbo_current_ubatch_id() == 0
    finally:
        ws.reset_workspace_manager()
        ws.init_workspace_manager(torch.device("cpu"))
