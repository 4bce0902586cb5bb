"""Contract: the EAGLE-helper warmer compiles every key vLLM's own proposer launches.

The serving side is vLLM's real ``SpecDecodeBaseProposer`` methods
(``prepare_next_token_ids_padded``, ``prepare_inputs_padded``, ``set_inputs_first_pass``,
``_update_positions_dependent_metadata``), run on CPU tensors under a compile-only sm90
driver with Triton's ``jit_cache_hook`` recording each launch's key, over the batches a
V1 runner with a draft model gives them: prefill steps, verify steps with full and short
drafts, batches of 1 to 20 requests and queries of 1 to 700 tokens. Only the proposer's
state is a stand-in: its buffers and constants set as its ``__init__`` and
``initialize_attn_backend`` set them.
"""

from __future__ import annotations

import functools
import itertools
from types import SimpleNamespace
from typing import Any

import fakes
import pytest
from realvllm import (
    V1_RUNNER_ONLY,
    activate_compile_only_driver,
    block_table,
    has_v1_runner,
    recorded_keys,
)

from tq_warmup_plugin import compat
from tq_warmup_plugin.vllm_kernels.jobs import Engine
from tq_warmup_plugin.warmers import vllm_eagle
from tq_warmup_plugin.worker.warmup import plugin_manager

pytestmark = [
    pytest.mark.real_vllm,
    pytest.mark.skipif(not has_v1_runner(), reason=V1_RUNNER_ONLY),
]

VOCAB = 1000
MAX_LEN = 4096
TOKENS = 2048
BLOCK = 32  # TurboQuant's bf16 block size on 0.26


@pytest.fixture(autouse=True)
def _driver() -> None:
    activate_compile_only_driver()


@functools.cache
def TABLE() -> Any:
    """The target's V1 block table at TurboQuant's block size, 32 requests."""
    return block_table(BLOCK, MAX_LEN, TOKENS, reqs=32)


def feats() -> compat.Features:
    return compat.release_features(compat.installed_vllm_version())


def drafter(extra_slots: bool, block_size: int = BLOCK) -> Any:
    """A proposer whose state is a draft model's (``extra_slots``: one new slot per
    request, no hidden states passed) or EAGLE's (hidden states, no extra slot)."""
    import torch
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.utils import CpuGpuBuffer

    cpu = torch.device("cpu")
    p = object.__new__(SpecDecodeBaseProposer)
    p.__dict__.update(
        device=cpu,
        method="draft_model" if extra_slots else "eagle",
        block_size=block_size,
        max_model_len=MAX_LEN,
        max_batch_size=32,
        uses_mrope=False,
        vllm_config=SimpleNamespace(model_config=SimpleNamespace(uses_mrope=False)),
        uses_xdrope_dim=0,
        draft_uses_xdrope_dim=0,
        use_heterogeneous_vocab=False,
        pass_hidden_states_to_model=not extra_slots,
        parallel_drafting=False,
        parallel_drafting_token_id=0,
        extra_slots_per_request=1,
        net_num_new_slots_per_request=1 if extra_slots else 0,
        needs_extra_input_slots=extra_slots,
        input_ids=torch.zeros(TOKENS + 64, dtype=torch.int32),
        positions=torch.zeros(TOKENS + 64, dtype=torch.int64),
        hidden_states=torch.zeros(TOKENS + 64, 8, dtype=torch.bfloat16),
        _slot_mapping_buffer=torch.zeros(TOKENS + 64, dtype=torch.int64),
        arange=torch.arange(TOKENS + 64, dtype=torch.int32),
        is_rejected_token_mask=torch.zeros(TOKENS + 64, dtype=torch.bool),
        is_masked_token_mask=torch.zeros(TOKENS + 64, dtype=torch.bool),
        backup_next_token_ids=CpuGpuBuffer(32, dtype=torch.int32, device=cpu, pin_memory=False),
    )
    return p


def cad(lens: list[int], table: Any = None) -> Any:
    """vLLM's ``CommonAttentionMetadata`` for one step of queries ``lens`` long, over the
    target's block ``table`` (default: ``TABLE()``)."""
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata

    starts = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    seq_lens = torch.tensor([n + 64 for n in lens], dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=starts,
        query_start_loc_cpu=starts.clone(),
        seq_lens=seq_lens,
        num_reqs=len(lens),
        num_actual_tokens=sum(lens),
        max_query_len=max(lens),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=(table or TABLE()).block_table.gpu[: len(lens)],
        slot_mapping=torch.zeros(sum(lens), dtype=torch.int64),
    )


def serve(
    p: Any, steps: list[tuple[list[int], int]], k: int, table: Any = None
) -> set[tuple[str, str]]:
    """What the proposer launches for each ``(query lens, sampled width)`` step: the
    V1 runner's padded-batch path (``propose_draft_token_ids``, 0.26) and then the
    draft loop's ``k - 1`` position updates."""
    import torch
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    with recorded_keys() as seen:
        for lens, width in steps:
            n = len(lens)
            batch = SimpleNamespace(
                num_reqs=n, req_ids=[str(i) for i in range(n)], vocab_size=VOCAB,
                num_tokens_no_spec=[8] * n,
            )  # fmt: skip
            requests = {str(i): SimpleNamespace(get_token_id=lambda _: 5) for i in range(n)}
            sampled = torch.zeros(n, width, dtype=torch.int32)
            next_ids, valid = p.prepare_next_token_ids_padded(
                sampled, requests, batch, torch.zeros(n, dtype=torch.bool)
            )
            next_ids.zero_(), valid.fill_(1)  # the compile-only kernels wrote nothing
            meta, rejected, indices = cad(lens, table), None, None
            if width > 1:
                spec = SpecDecodeMetadata.make_dummy([[0] * (width - 1)] * n, torch.device("cpu"))
                meta, indices, rejected = p.prepare_inputs_padded(meta, spec, valid)
                indices.copy_(meta.query_start_loc[1:] - 1), rejected.zero_()
            tokens = meta.num_actual_tokens
            hidden = torch.zeros(tokens, 8, dtype=torch.bfloat16)
            _, indices, meta = p.set_inputs_first_pass(
                torch.zeros(tokens, dtype=torch.int32), next_ids,
                torch.zeros(tokens, dtype=torch.int64), hidden, indices, meta, rejected,
            )  # fmt: skip
            positions = p.positions[: meta.num_reqs]
            for _ in range(k - 1):
                positions = p._update_positions_dependent_metadata(
                    positions, meta, meta.num_reqs, meta.num_reqs, p.block_size
                )
    return seen


def engine(p: Any, k: int) -> Engine:
    # 0.30+ take the registry's path before reading tables (0.33's BlockTable differs)
    tables = SimpleNamespace(block_tables=[] if feats().registry_warms_eagle_helpers else [TABLE()])
    runner = SimpleNamespace(
        drafter=p, input_batch=SimpleNamespace(vocab_size=VOCAB, block_table=tables)
    )
    return Engine(
        features=feats(),
        runner_v2=False,
        pooling=False,
        spec_method=p.method,
        spec_tokens=k,
        draft_probs=False,
        max_logprobs=20,
        device=p.device,
        runner=runner,
    )


def warmed(eng: Engine) -> set[tuple[str, str]]:
    jobs, _ = fakes.jobs_of(plugin_manager(load_entry_points=False), eng)
    with recorded_keys() as seen:
        for job in jobs:
            if job.family == vllm_eagle.FAMILY:
                with compat.compile_only_launches(load=False):
                    job.run()
    return seen


STEPS = [
    ([700, 5, 17], 1),  # a prefill step: one sampled token per request
    ([1], 1),
    ([4] * 16, 4),  # verify steps: k + 1 = 4 sampled
    ([4, 4, 4], 4),
    ([4] * 20, 4),
    ([2, 4, 3], 4),  # short drafts
    ([300, 4], 4),  # a chunk beside a verify
    ([1] * 17, 2),
    ([64, 100, 33], 1),
]


@pytest.mark.parametrize("extra_slots", [True, False], ids=["draft_model", "eagle"])
@pytest.mark.parametrize("k", [1, 3])
def test_eagle_helper_warmer_covers_serving(extra_slots: bool, k: int) -> None:
    p = drafter(extra_slots)
    eng = engine(p, k)
    if feats().registry_warms_eagle_helpers:
        _, declined = fakes.jobs_of(plugin_manager(load_entry_points=False), eng)
        assert any(d.family == vllm_eagle.FAMILY and "registry" in d.why for d in declined)
        return
    steps = [(lens, min(width, k + 1)) for lens, width in STEPS]
    served = serve(p, steps, k)
    names = {name for name, _ in served}
    expected = {"eagle_prepare_next_token_padded_kernel", "eagle_prepare_inputs_padded_kernel"}
    if extra_slots:
        expected.add("copy_and_expand_eagle_inputs_kernel")
    if k > 1:
        expected.add("eagle_step_slot_mapping_metadata_kernel")
    assert names == expected
    ours = warmed(eng)
    assert served <= ours, sorted(served - ours)


def test_eagle_helper_keys_follow_the_batch() -> None:
    """The check can fail: a warmer of one batch size misses the others' keys."""
    if feats().registry_warms_eagle_helpers:
        pytest.skip("vLLM's registry warms them (0.30+)")
    p = drafter(True)
    one = serve(p, [([4], 4)], 3)
    many = serve(p, [([4] * 16, 4), ([300, 4, 4], 4)], 3)
    assert not many <= one


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
@pytest.mark.parametrize("k", [1, 3])
def test_the_offline_drafter_builds_what_serving_launches(method: str, k: int) -> None:
    """``precompile`` and the compile-ahead child rebuild the drafter from the engine
    arguments (``engine_plan.offline_drafter``): its helper jobs, on meta tensors, cover
    every key the proposer above launches (its state as vLLM sets it) over served batches.
    Before, the CPU engine had no drafter and the helpers compiled in the worker: 15 of a
    hybrid Qwen3-Next worker's 17 compiles (H200, 0.26.0, serve-jit run V)."""
    from tq_warmup_plugin.vllm_kernels import offline as engine_plan

    if feats().registry_warms_eagle_helpers:
        pytest.skip("vLLM's registry warms them (0.30+)")
    request = engine_plan.EngineRequest(
        features=feats(), runner_v2=False, vocab_size=VOCAB, model_dtype="bfloat16",
        block_size=BLOCK, max_model_len=MAX_LEN, max_num_seqs=32,
        max_num_batched_tokens=TOKENS, spec_method=method, spec_tokens=k,
    )  # fmt: skip
    offline = engine_plan.cpu_engine(request)
    todo, declined, errors = engine_plan.jobs(plugin_manager(load_entry_points=False), offline)
    assert errors == [] and not [d for d in declined if d.family == vllm_eagle.FAMILY]
    steps = [(lens, min(width, k + 1)) for lens, width in STEPS]
    served = serve(drafter(method == "draft_model"), steps, k)
    built = warmed(offline)
    assert served <= built, sorted(served - built)
    assert any(job.family == vllm_eagle.FAMILY for job in todo)
