"""Contract: the compile-ahead child plans a starting worker's TurboQuant layers from its
config (``plan.request.worker_plan``) as discovery later reads them, and the keys it builds are
the ones the worker's warmup then finds on disk.

The worker's side here is discovery's own ``layer_geometry`` over vLLM's real
``TurboQuantAttentionImpl`` (heads, scale and KV splits as the config gives them), the V1
runner's block table as vLLM's own ``MultiGroupBlockTable`` builds it (its row rounding and a
hybrid's kernel split, at vLLM's ``prepare_kernel_block_sizes`` block) and a KV tensor of the
release's layout. The model is vLLM's ``ModelConfig`` of a checked-in ``config.json`` on one
tensor-parallel rank; the rest of the config is what the plan reads of it. Cases: Llama 3 at
an odd 900 tokens (vLLM 0.21-0.26 round its table's row, which the plan did not until
session 24: 57 blocks of 16 planned, 64 built), at ``-tp 2`` with ngram (the batched verify
path's rows), and a hybrid at a manager block of 2160 tokens, which runs kernel blocks of 16
(Qwen3-Next's on the H200, 0.26.0, serve-jit run Z; Jamba's config here, whose model class
vLLM inspects without the extra dependencies Qwen3-Next's imports).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from realvllm import forget_compiled, has_v1_runner, layer_kv_cache, make_impl
from test_contract_ahead import RUNNER, request
from test_contract_block_size import vllms_block
from test_contract_hybrid_block import vllm_kernel_block
from test_contract_vllm_kernels import _driver as _driver  # autouse: sm90, the SM count
from test_contract_vllm_kernels import feats

from tq_warmup_plugin import compat
from tq_warmup_plugin.geometry import Geometry
from tq_warmup_plugin.plan import request as plan_request
from tq_warmup_plugin.plan import rules as plan_rules
from tq_warmup_plugin.vllm_kernels import ahead, ahead_child
from tq_warmup_plugin.worker import discovery, keyplan
from tq_warmup_plugin.worker.report import CompileCounter, Report
from tq_warmup_plugin.worker.warmup import plugin_manager

pytestmark = pytest.mark.real_vllm

MODELS = Path(__file__).parents[1] / "data" / "models"
PRESET = "turboquant_4bit_nc"
SPLITS, REQS, TOKENS = 16, 8, 2048
"""KV splits other than vLLM's default (32), so a plan that ignored the config's would show."""


@dataclasses.dataclass(frozen=True)
class Case:
    model: str
    tp: int
    max_len: int
    block: int
    """The manager block the worker's ``CacheConfig`` holds; 0: TurboQuant's own for a bf16
    model (vLLM's alignment, 0.25+: 32 on 0.25-0.27, 64 for this preset on 0.28+; else 16)."""
    k: int = 0


CASES = {
    "llama odd length": Case("llama-3-8b", 1, 900, 0),
    "llama tp2 ngram": Case("llama-3-8b", 2, 4096, 0, k=3),
    "hybrid": Case("jamba-v0.1", 1, 4096, 2160),
}


def kernel_of(block: int) -> int:
    """vLLM's kernel block for a TurboQuant group of ``block``-token manager blocks: its V1
    runner's ``prepare_kernel_block_sizes`` (0.22-0.31); 0.32+ take an attention group's
    spec there, and its ``select_common_block_size`` (``compat.kernel_block_size``) says it."""
    try:
        return vllm_kernel_block(block)
    except (AttributeError, TypeError):
        return compat.kernel_block_size(block)


def block_of(case: Case) -> int:
    """The manager block a worker of ``case`` holds: vLLM's own alignment of the default 16
    for the model's head size (``test_contract_block_size``), or the case's."""
    if case.block or not feats().tq_block_aligned:
        return case.block or 16
    from vllm.config import ModelConfig

    head = ModelConfig(model=str(MODELS / case.model), skip_tokenizer_init=True).get_head_size()
    return vllms_block(PRESET, head, 16, "bfloat16")


def worker_config(case: Case) -> Any:
    """A worker's config as the plan reads it: vLLM's own ``ModelConfig`` and
    ``ParallelConfig``, the engine arguments beside them."""
    from vllm.config import ModelConfig, ParallelConfig

    model = ModelConfig(model=str(MODELS / case.model), skip_tokenizer_init=True,
                        max_model_len=case.max_len, dtype="bfloat16")  # fmt: skip
    spec = (
        SimpleNamespace(
            method="ngram",
            num_speculative_tokens=case.k,
            parallel_drafting=False,
            max_num_new_slots_for_drafting=0,
        )  # ngram's (0.34's SpeculativeConfig)
        if case.k
        else None
    )
    return SimpleNamespace(
        model_config=model,
        parallel_config=ParallelConfig(tensor_parallel_size=case.tp),
        cache_config=SimpleNamespace(cache_dtype=PRESET, block_size=block_of(case)),
        scheduler_config=SimpleNamespace(max_num_seqs=REQS, max_num_batched_tokens=TOKENS),
        attention_config=SimpleNamespace(tq_max_kv_splits_for_cuda_graph=SPLITS),
        speculative_config=spec,
    )


def discovered(case: Case, config: Any) -> Geometry:
    """What the worker's discovery reads off one of its TurboQuant layers."""
    _v1_table_here()
    model, parallel = config.model_config, config.parallel_config
    hk = model.get_num_kv_heads(parallel)
    impl = make_impl(PRESET, model.get_head_size(), model.get_num_attention_heads(parallel), hk,
                     SPLITS, case.max_len)  # fmt: skip
    block = block_of(case)
    kernel = kernel_of(block)
    table = compat.cpu_block_tables(block, case.max_len, REQS, TOKENS, kernel_block=kernel)[0]
    rows = getattr(table.block_table, "gpu", table.block_table)  # the V1 runner's tensor
    kv = layer_kv_cache(feats(), 4, kernel, hk, impl.tq_config.slot_size_aligned)
    layer = SimpleNamespace(impl=impl, kv_cache=kv)
    verify = compat.spec_decode_threshold(config) if feats().spec_verify_batched else 0
    return discovery.layer_geometry(layer, rows, config, feats(), verify_len=verify)


def planned(config: Any) -> Geometry:
    """What the child plans for the same worker (``ahead_child.worker_plan``' geometry)."""
    plan = plan_request.worker_plan(config, feats(), 90, runner_v2=RUNNER == "V2", verify_rows=True)
    return plan_request.named_geometries(plan)["geometry0"]


def _v1_table_here() -> None:
    if not has_v1_runner():
        pytest.skip("the worker's side is the V1 runner's block table, which 0.34 removed")


def _split_here(case: Case) -> None:
    _v1_table_here()
    split = bool(case.block) and kernel_of(case.block) != case.block
    table = compat.cpu_block_tables(case.block or 16, 64, 1, 64)[0]
    if split and not hasattr(table, "blocks_per_kv_block"):
        pytest.skip("0.32+: a hybrid's kernel rows are the attention group's own table")


@pytest.mark.parametrize("name", list(CASES))
def test_the_child_plans_the_layers_the_worker_discovers(name: str) -> None:
    case = CASES[name]
    _split_here(case)
    config = worker_config(case)
    assert planned(config) == discovered(case, config)


def test_the_check_can_fail_on_the_plan_before() -> None:
    """Without the row rounding (0.21-0.26) and the kernel split, the plan of session 23
    missed the width of the served table: a key of every path that reads it."""
    case = CASES["llama odd length"]
    served = discovered(case, worker_config(case))
    unrounded = -(-case.max_len // block_of(case))
    if feats().v1_block_table_aligned:
        assert served.block_table_width != unrounded
    hybrid = CASES["hybrid"]
    _split_here(hybrid)
    split = discovered(hybrid, worker_config(hybrid))
    assert split.block_size == 16 != hybrid.block  # the plan used the manager's block
    assert split.block_table_width % (hybrid.block // 16) == 0  # whole manager blocks


def test_the_cli_plans_the_childs_verify_rows() -> None:
    """``precompile --speculative-config`` gives the layers the batched verify path's rows,
    as the worker's guard does (``compat.spec_decode_threshold``, vLLM's own on 0.33)."""
    config = worker_config(CASES["llama tp2 ngram"])
    expected = compat.spec_decode_threshold(config) if feats().spec_verify_batched else 0
    assert plan_rules.verify_len(feats(), 3) == expected
    assert plan_rules.verify_len(feats(), 0) == 0


def test_the_childs_keys_are_found_by_the_workers_warmup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real child, forked from this process as from a worker with its config, builds the
    TurboQuant keys; the worker's warmup over the layer it discovers then compiles none.
    Over an empty cache the first of those keys compiles, so the count can fail."""
    case = CASES["llama tp2 ngram"]
    config = worker_config(case)
    pm = plugin_manager(load_entry_points=False)
    keys = keyplan.plan_keys(pm, {"layer": discovered(case, config)}).keys
    given = {"request": request(32, 3).to_dict(), "arch": 90, "processes": 2, "verify": True}
    jobs = ahead_child.key_jobs(pm, ahead_child.worker_plan(config, given, feats()))
    assert [job.what for job in jobs] == [keyplan.describe(key) for key in keys]

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    ahead.spawn(given, config)
    line = ahead.wait(300)
    assert f"({len(keys)} TurboQuant keys)" in line and "failed" not in line, line
    forget_compiled(compat.kernel_function(key.kernel) for key in keys)
    warm = Report()
    keyplan.compile_into(warm, pm, keys, threads=1)
    assert (warm.compiled, warm.loaded, warm.failed) == (0, len(keys), 0)

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "empty"))
    forget_compiled(compat.kernel_function(key.kernel) for key in keys)
    with CompileCounter() as cold:
        assert keyplan.compile_all(pm, keys[:1], threads=1) == []
    assert cold.compiled == 1


def test_precompile_plans_a_hybrid_at_vllms_block() -> None:
    """``precompile --model`` of a hybrid plans at the block vLLM gives its attention for the
    Mamba state (``compat.hybrid_block_size`` from the default 16: 304 tokens for Jamba, run
    as kernel blocks of 16, on 0.22-0.30), where it planned TurboQuant's own 32 before
    session 24; the worker that runs at that block discovers the planned geometry."""
    request = plan_request.PlanRequest(
        kv_cache_dtype=PRESET, model="jamba-v0.1", tensor_parallel_size=1, dtype="bfloat16",
        max_model_len=4096, runner=RUNNER.lower(), max_num_seqs=REQS, max_num_batched_tokens=TOKENS,
        kv_splits=SPLITS,
    )  # fmt: skip
    plan = plan_request.plan_geometry(request, str(MODELS / "jamba-v0.1"))
    block = compat.hybrid_block_size(plan_model("jamba-v0.1"), 1, PRESET, 16, 0)
    assert block > 32 and f"attention block {block} tokens" in plan.note
    # its 4 attention layers (every 8th of 32) beside 28 Mamba layers write 4 KV tensors
    # of vLLM's grouping, each page that block's kernel blocks (the zeroing kernel's key)
    page = plan.geometry.kv_strides[0]
    assert plan.zeroing == compat.KvZeroing(4, page * (block // plan.geometry.block_size), page)
    case = Case("jamba-v0.1", 1, 4096, block)
    _split_here(case)
    # the compile-ahead child plans the same from the worker's config, for its own build
    child = plan_request.worker_plan(worker_config(case), feats(), 90, RUNNER == "V2", True)
    assert child.zeroing == plan.zeroing
    assert plan.geometry == discovered(case, worker_config(case))


def test_the_childs_zeroing_counts_the_workers_mtp_layers_whichever_path_verifies() -> None:
    """A Qwen3-Next worker drafting with its own MTP layer zeroes one more KV tensor than
    its 12 attention layers (13 of 36 GDN layers, vLLM's grouping): the child plans that
    from the worker's drafter, with or without the verify guard's rows, as ``precompile
    --speculative-config`` does. Before session 29 it took the drafter only where the guard
    served (12 tensors without it)."""
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    block = 1088  # vLLM's for it on 0.26 (run AX); its model class needs a GPU to size it
    request = plan_request.PlanRequest(
        kv_cache_dtype=PRESET, model="qwen3-next-80b-a3b", tensor_parallel_size=1,
        dtype="bfloat16", max_model_len=4096, runner=RUNNER.lower(), max_num_seqs=REQS,
        max_num_batched_tokens=TOKENS, kv_splits=SPLITS, speculative_config=spec,
        block_size=block,
    )  # fmt: skip
    plan = plan_request.plan_geometry(request, str(MODELS / "qwen3-next-80b-a3b"))
    assert plan.zeroing is not None and plan.zeroing.segments == 13
    config = worker_config(Case("qwen3-next-80b-a3b", 1, 4096, block))
    config.speculative_config = SimpleNamespace(
        **spec, parallel_drafting=False, max_num_new_slots_for_drafting=0
    )  # 0.34 reads the slots
    for verify in (True, False):
        child = plan_request.worker_plan(config, feats(), 90, RUNNER == "V2", verify_rows=verify)
        assert child.zeroing == plan.zeroing, verify


def test_precompile_plans_a_hybrid_with_prefix_caching_at_vllms_block() -> None:
    """``--enable-prefix-caching`` (opt-in for hybrids): vLLM picks the Mamba cache mode
    (``all`` for Jamba on 0.22-0.26, ``align`` on 0.30+) and ``all`` aligns the block to
    the model's Mamba chunk (2048 tokens for Jamba, against 304 without). The plan with the
    flag is what a worker at vLLM's block discovers; the plan without it is not, wherever
    the two blocks differ (before session 25 ``precompile`` had no such flag)."""
    base = dict(kv_cache_dtype=PRESET, model="jamba-v0.1", tensor_parallel_size=1,
                dtype="bfloat16", max_model_len=4096, runner=RUNNER.lower(), max_num_seqs=REQS,
                max_num_batched_tokens=TOKENS, kv_splits=SPLITS)  # fmt: skip
    model = plan_model("jamba-v0.1")
    off = compat.hybrid_block_size(model, 1, PRESET, 16, 0)
    on = compat.hybrid_block_size(model, 1, PRESET, 16, 0, prefix_caching=True)
    chunk = model.get_mamba_chunk_size()
    assert on == off or (on > off and on % chunk == 0), (off, on, chunk)
    plan = plan_request.plan_geometry(
        plan_request.PlanRequest(**base, enable_prefix_caching=True), str(MODELS / "jamba-v0.1")
    )
    assert f"attention block {on} tokens" in plan.note
    case = Case("jamba-v0.1", 1, 4096, on)
    _split_here(case)
    worker = discovered(case, worker_config(case))
    assert plan.geometry == worker
    unflagged = plan_request.plan_geometry(
        plan_request.PlanRequest(**base), str(MODELS / "jamba-v0.1")
    )
    assert (unflagged.geometry == worker) == (on == off)


def plan_model(name: str, directory: Path | None = None) -> Any:
    from vllm.config import ModelConfig

    return ModelConfig(model=str(directory or MODELS / name), skip_tokenizer_init=True,
                       max_model_len=4096, dtype="bfloat16")  # fmt: skip
