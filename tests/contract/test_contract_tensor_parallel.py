"""Contract (issue 32, on the CPU): at ``-tp 2`` and ``-tp 4`` each rank's TurboQuant
geometry and workspace are the rank's own.

A rank of a ``-tp N`` server holds ``N``-th of the query heads and of the KV heads
(at least one): vLLM's Llama attention splits them so, and ``tq-warmup precompile -tp N``
plans them from vLLM's own ``ModelConfig`` for that ``ParallelConfig``. Here the plan for
Llama-3-8B's shape (32 query and 8 KV heads of 128) at ``-tp`` 1, 2 and 4 meets vLLM's
real TurboQuant impl built with that rank's heads and its real ``WorkspaceManager``: the
rank's planned reservation lets the real backend serve every path (all rows decoding, the
longest continuation) after vLLM locks the workspace. The reservation a plan for twice the
ranks makes (half the heads) is refused by the lock, so the check can fail. The keys of each
rank's heads are held to the real backend in ``test_contract_keys`` (per-rank head counts).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from realvllm import MAX_NUM_SEQS, layer_kv_cache, make_impl, recorded_keys, run_backend

from tq_warmup_plugin import compat
from tq_warmup_plugin.geometry import Geometry
from tq_warmup_plugin.plan import request as plan_request
from tq_warmup_plugin.worker import workspace

pytestmark = pytest.mark.real_vllm

MODEL = Path(__file__).parents[1] / "data" / "models" / "llama-3-8b"
MAX_LEN = 2048
PRESET = "turboquant_4bit_nc"


def planned(feats: compat.Features, tp: int) -> Geometry:
    """What ``tq-warmup precompile --model llama-3-8b -tp N`` plans for one rank."""
    request = plan_request.PlanRequest(
        kv_cache_dtype=PRESET, model=str(MODEL), vllm_version=".".join(map(str, feats.version)),
        tensor_parallel_size=tp, max_model_len=MAX_LEN, max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=2048, runner="v1" if feats.v1_runner else "v2",
    )  # fmt: skip
    return plan_request.plan_geometry(request, str(MODEL)).geometry


def serves_after_lock(feats: compat.Features, reserved_for: Geometry, rank: Geometry) -> bool:
    """Reserve ``reserved_for``'s workspace, lock it as vLLM does after capture, and drive
    the real backend with ``rank``'s heads over every path; False where the lock refused
    a request."""
    import torch
    from vllm.v1.worker import workspace as ws

    impl = make_impl(PRESET, rank.head_size, rank.num_heads, rank.num_kv_heads,
                     rank.num_kv_splits, MAX_LEN)  # fmt: skip
    width = MAX_LEN // rank.block_size
    kv = layer_kv_cache(feats, width, rank.block_size, rank.num_kv_heads,
                        impl.tq_config.slot_size_aligned)  # fmt: skip
    ws.reset_workspace_manager()
    ws.init_workspace_manager(torch.device("cpu"))
    try:
        assert workspace.reserve(workspace.plan_reservation([reserved_for]), feats) > 0
        ws.lock_workspace()
        batches = [([(1, 40)] * MAX_NUM_SEQS, MAX_NUM_SEQS), ([(200, MAX_LEN - 200 - 1)], 0)]
        with recorded_keys():  # keys recorded, kernels not launched; the workspace is asked
            try:
                run_backend(impl, kv, width, torch.bfloat16, batches)
            except AssertionError as exc:
                if "Workspace is locked" not in str(exc):
                    raise
                return False
        return True
    finally:
        ws.reset_workspace_manager()
        ws.init_workspace_manager(torch.device("cpu"))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_each_rank_plans_its_own_heads(vllm_env: compat.Features, tp: int) -> None:
    g = planned(vllm_env, tp)
    # LlamaAttention: total_num_heads // tp, max(1, total_num_kv_heads // tp)
    assert (g.num_heads, g.num_kv_heads, g.head_size) == (32 // tp, max(1, 8 // tp), 128)


@pytest.mark.parametrize("tp", [1, 2])
def test_each_ranks_reservation_serves_it_after_the_lock(
    vllm_env: compat.Features, tp: int
) -> None:
    if not vllm_env.uses_workspace:
        pytest.skip("0.20 does not use the workspace")
    rank = planned(vllm_env, tp)
    assert serves_after_lock(vllm_env, rank, rank)
    # The check can fail: a reservation for twice the ranks is half this rank's need.
    assert not serves_after_lock(vllm_env, planned(vllm_env, 2 * tp), rank)
