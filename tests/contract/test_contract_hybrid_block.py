"""Contract: a hybrid model's vLLM kernels are planned offline at its kernel block size.

vLLM sizes a hybrid model's attention pages to its Mamba state, so its KV manager block is
large (2160 tokens for the serve-jit Qwen3-Next on 0.26, "Setting attention block size to
2160 tokens"), and the V1 runner splits it into the kernel blocks TurboQuant's backend
takes (``prepare_kernel_block_sizes``: 16, 135 to a block). The slot-mapping kernel and
the drafter's EAGLE helpers are keyed by the kernel block (``BLOCKS_PER_KV_BLOCK``, the
drafter's ``block_size``, the table's row stride). The compile-ahead child planned them at
2160 and the worker compiled ``eagle_step_slot_mapping_metadata_kernel`` x3 and
``_compute_slot_mapping_kernel`` again (H200, vLLM 0.26.0, serve-jit run Z).

The serving side here is vLLM's own: the kernel block from its runner's
``prepare_kernel_block_sizes`` over TurboQuant's backend, a block table of that split, and
the proposer's real methods over served batches (``test_contract_eagle_helpers``); the
planned side is what ``precompile`` and the child build (``engine_plan.cpu_engine``).
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
from realvllm import recorded_keys
from test_contract_eagle_helpers import STEPS, drafter, feats, serve
from test_contract_eagle_helpers import _driver as _driver  # autouse: compile-only sm90
from test_contract_vllm_kernels import serve_slot_mapping

from tq_warmup_plugin import compat
from tq_warmup_plugin.vllm_kernels import offline as engine_plan
from tq_warmup_plugin.warmers import vllm_eagle, vllm_slot_mapping
from tq_warmup_plugin.worker.warmup import plugin_manager

pytestmark = pytest.mark.real_vllm

HYBRID_BLOCK = 2160
"""The serve-jit Qwen3-Next's attention block on 0.26 (run Z's log)."""
MAX_LEN, TOKENS, REQS, K = 4096, 2048, 32, 2


def families() -> set[str]:
    """The families whose warmers run here (the registry warms them on 0.29+ / 0.30+)."""
    out = set()
    if not feats().registry_warms_slot_mapping:
        out.add(vllm_slot_mapping.FAMILY)
    if not feats().registry_warms_eagle_helpers:
        out.add(vllm_eagle.FAMILY)
    return out


def vllm_kernel_block(block_size: int) -> int:
    """The kernel block vLLM's V1 runner gives one attention group of TurboQuant layers."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.utils import prepare_kernel_block_sizes

    module = importlib.import_module(compat.BACKEND_MODULE)
    backend = getattr(module, compat.BACKEND_CLASS)
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=128,
                             dtype=torch.uint8)  # fmt: skip
    # 0.34 also reads the group's layers and the packed tensors (none packed here).
    group = SimpleNamespace(kv_cache_spec=spec, layer_names=["l"])
    config = SimpleNamespace(kv_cache_groups=[group], kv_cache_tensors=[])
    attn = SimpleNamespace(backend=backend, kv_cache_spec=spec)
    return int(prepare_kernel_block_sizes(config, [[attn]])[0])


def served() -> set[tuple[str, str]]:
    """What the worker launches: slot mapping on its table, the MTP drafter's helpers."""
    kernel = vllm_kernel_block(HYBRID_BLOCK)
    table = compat.cpu_block_tables(HYBRID_BLOCK, MAX_LEN, REQS, TOKENS, kernel_block=kernel)[0]
    keys: set[tuple[str, str]] = set()
    if vllm_slot_mapping.FAMILY in families():
        keys |= serve_slot_mapping(table)
    if vllm_eagle.FAMILY in families():
        steps = [(lens, min(width, K + 1)) for lens, width in STEPS]
        keys |= serve(drafter(False, block_size=kernel), steps, K, table)
    return keys


def planned() -> set[tuple[str, str]]:
    """What ``precompile`` and the child build for the same engine arguments."""
    request = engine_plan.EngineRequest(
        features=feats(), runner_v2=False, vocab_size=1000, model_dtype="bfloat16",
        block_size=HYBRID_BLOCK, max_model_len=MAX_LEN, max_num_seqs=REQS,
        max_num_batched_tokens=TOKENS, spec_method="mtp", spec_tokens=K,
    )  # fmt: skip
    jobs, _, errors = engine_plan.jobs(
        plugin_manager(load_entry_points=False), engine_plan.cpu_engine(request)
    )
    assert errors == []
    with recorded_keys() as seen, compat.compile_only_launches(load=False):
        for job in jobs:
            if job.family in families():
                job.run()
    return seen


@pytest.fixture
def warmed_here() -> None:
    if not families():
        pytest.skip("vLLM's JIT warmup registry warms slot mapping and the helpers (0.30+)")


@pytest.mark.usefixtures("warmed_here")
def test_a_hybrids_kernel_block_is_vllms_own() -> None:
    assert vllm_kernel_block(HYBRID_BLOCK) == compat.kernel_block_size(HYBRID_BLOCK) == 16
    assert compat.kernel_block_size(32) == vllm_kernel_block(32) == 32  # a dense model's


@pytest.mark.usefixtures("warmed_here")
def test_the_plan_covers_what_a_hybrid_worker_launches() -> None:
    serving = served()
    assert serving
    built = planned()
    assert serving <= built, sorted(serving - built)


@pytest.mark.usefixtures("warmed_here")
def test_the_check_fails_at_the_managers_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan before: kernels at the manager's block of 2160 miss the served keys of
    the kernels keyed by the split: the helpers' ``block_size`` (0.22-0.29), and slot
    mapping where its key holds ``BLOCKS_PER_KV_BLOCK`` as a constexpr (0.26-0.28; 0.22's
    takes the block size as an integer, whose class 2160 and 16 share)."""
    from vllm.v1.worker import block_table

    serving = served()
    for where in (compat, compat.vllm_kernels):  # engine_plan's name, cpu_block_tables'
        monkeypatch.setattr(where, "kernel_block_size", lambda block_size: block_size)
    missed = {name for name, _ in serving - planned()}
    expected = set()
    split_keyed = "BLOCKS_PER_KV_BLOCK" in block_table._compute_slot_mapping_kernel.arg_names
    if vllm_slot_mapping.FAMILY in families() and split_keyed:
        expected.add("_compute_slot_mapping_kernel")
    if vllm_eagle.FAMILY in families():
        expected.add("eagle_step_slot_mapping_metadata_kernel")
    assert expected and expected <= missed, missed
