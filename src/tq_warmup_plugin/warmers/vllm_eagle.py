"""vLLM's EAGLE drafter helpers at every key the V1 runner's draft steps reach.

An EAGLE-style drafter (``eagle``, ``eagle3``, MTP, ``draft_model``) launches four small
Triton kernels of its own around the target's steps (``v1/spec_decode/utils.py``, the
same signatures in 0.22 and 0.26-0.29): ``eagle_prepare_next_token_padded_kernel`` and
``eagle_prepare_inputs_padded_kernel`` after the verify step,
``copy_and_expand_eagle_inputs_kernel`` when the drafter needs extra input slots (a draft
model, parallel drafting), and ``eagle_step_slot_mapping_metadata_kernel`` before each
draft step past the first. vLLM's startup does not compile them before 0.30, where its
JIT warmup registry takes them over (``compat.Features.registry_warms_eagle_helpers``):
on 0.26.0 all four compiled on the first requests of a TurboQuant ``vllm serve`` with
``draft_model`` (``benchmarks/results/serve-jit``), which a JIT monitor in ``error`` mode
turns into a dead engine core.

Their keys: the integer arguments' Triton classes (1, a multiple of 16, other: the
batch, the token count, the sampled width), the drafter's own constexprs (its block
size, ``max_model_len``, the block table's width), and a ``BLOCK_SIZE_TOKENS`` power of
two (of the sampled width; of the longest query plus the new slots, capped at 256). Each
job launches one kernel through vLLM's kernel object with the live drafter's buffers and
constants, under ``compat.compile_only_launches``: nothing runs and nothing is written.
``tests/contract/test_contract_eagle_helpers.py`` runs vLLM's own proposer methods over
served batches and checks that these jobs compiled every key they asked for.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import Any

from .. import compat
from ..hookspecs import hookimpl
from ..keys import Int, next_pow2
from ..vllm_kernels.jobs import Declined, Engine, Job

__all__ = [
    "BATCHES",
    "EAGLE_STYLE",
    "FAMILY",
    "TOKEN_BLOCK_CAP",
    "eagle_style",
    "expand_shapes",
    "sampled_widths",
    "tq_warmup_engine_jobs",
]

FAMILY = "EAGLE helpers"
EAGLE_STYLE = frozenset({"eagle", "eagle3", "mtp", "draft_model"})
"""``speculative_config.method`` values whose drafter is vLLM's model-based proposer
(``llm_base_proposer``); a model's own MTP method name (``deepseek_mtp``, ...) ends in
``mtp``. ngram and suffix decoding draft on the CPU."""
BATCHES = (1, 16, 17)
"""A batch (requests or tokens) in each of Triton's integer classes."""
TOKEN_BLOCK_CAP = 256
"""``set_inputs_first_pass`` caps ``BLOCK_SIZE_TOKENS`` at 256 slots (0.22-0.29)."""


def eagle_style(method: str) -> bool:
    return method in EAGLE_STYLE or method.endswith("_mtp")


def sampled_widths(k: int) -> list[int]:
    """One sampled-tokens width per key of ``eagle_prepare_next_token_padded_kernel``:
    a step samples 1 token per request without drafts, up to ``k + 1`` with them; the
    key is the width's class and its power of two (the row stride is the width)."""
    seen: dict[tuple[Int, int], int] = {}
    for width in range(1, k + 2):
        seen.setdefault((Int.of(width), next_pow2(width)), width)
    return sorted(seen.values())


def expand_shapes(new_slots: int) -> list[tuple[int, int]]:
    """``(longest query, total tokens)`` per key of ``copy_and_expand_eagle_inputs_kernel``:
    ``BLOCK_SIZE_TOKENS`` is the power of two of the longest query plus ``new_slots`` up
    to the cap, ``total_input_tokens`` an integer class; a total of 1 token has a
    longest query of 1."""
    shapes = [(1, 1)]
    block = next_pow2(1 + new_slots)
    while True:
        query = max(1, block - new_slots)  # the longest query whose block this is
        tiled = -(-query // 16) * 16  # the fewest tokens >= query that are a multiple of 16
        shapes += [(query, tiled), (query, tiled + 1)]
        if block >= TOKEN_BLOCK_CAP:
            return sorted(set(shapes))
        block *= 2


def _helper(name: str) -> Any:
    found = compat.eagle_helper(name)
    if found is None:
        raise compat.CompatError(f"this release's v1/spec_decode/utils.py has no {name}")
    return found


def _tensor(n: int, dtype: Any, device: Any) -> Any:
    import torch

    return torch.zeros(n, dtype=dtype, device=device)


def warm_step(drafter: Any, width: int, batch: int) -> None:
    """A draft step's slot mapping, as ``_update_positions_dependent_metadata`` calls
    vLLM's launcher: positions and slots in the drafter's int64 buffers, the target's
    int32 block table of ``width`` blocks per request."""
    import torch

    table = torch.zeros(batch, width, dtype=torch.int32, device=drafter.positions.device)
    _helper("eagle_step_update_slot_mapping_and_metadata")(
        positions_1d=drafter.positions[:batch],
        block_table_tensor=table,
        seq_lens=_tensor(batch, torch.int32, table.device),
        block_size=drafter.block_size,
        max_model_len=drafter.max_model_len,
        out_clamped_positions=drafter.positions[:batch],
        out_slot_mapping=drafter._slot_mapping_buffer[:batch],
        input_batch_size=batch,
    )


def warm_prepare_inputs(device: Any, reqs: int) -> None:
    """``prepare_inputs_padded``: int32 counts and offsets, ``num_reqs`` requests."""
    import torch

    i32 = [_tensor(reqs + (i == 2), torch.int32, device) for i in range(5)]
    _helper("eagle_prepare_inputs_padded_kernel")[(reqs,)](*i32, reqs)


def warm_next_token(drafter: Any, vocab: int, width: int, reqs: int) -> None:
    """``prepare_next_token_ids_padded``: the sampler's int32 ``[reqs, width]`` tokens,
    a bool discard mask, the drafter's int32 backup tokens."""
    import torch

    device = drafter.positions.device
    sampled = torch.zeros(reqs, width, dtype=torch.int32, device=device)
    out = [_tensor(reqs, torch.int32, device) for _ in range(2)]
    _helper("eagle_prepare_next_token_padded_kernel")[(reqs,)](
        sampled,
        _tensor(reqs, torch.bool, device),
        drafter.backup_next_token_ids.gpu,
        *out,
        vocab,
        width,
        reqs,
        sampled.stride(0),
        BLOCK_SIZE_TOKENS=next_pow2(width),
    )


def warm_expand(drafter: Any, query: int, total: int) -> None:
    """``set_inputs_first_pass`` with extra slots: the target's int32 tokens and int64
    positions into the drafter's buffers, ``total`` input tokens, a longest query of
    ``query``."""
    import torch

    device = drafter.positions.device
    reqs = max(1, total // query)
    i32 = partial(_tensor, dtype=torch.int32, device=device)
    slots = drafter.net_num_new_slots_per_request
    block = min(TOKEN_BLOCK_CAP, next_pow2(query + slots))
    _helper("copy_and_expand_eagle_inputs_kernel")[(reqs, 1)](
        target_token_ids_ptr=i32(total),
        target_positions_ptr=_tensor(total, torch.int64, device),
        next_token_ids_ptr=i32(reqs),
        out_input_ids_ptr=drafter.input_ids,
        out_positions_ptr=drafter.positions,
        out_is_rejected_token_mask_ptr=drafter.is_rejected_token_mask,
        out_is_masked_token_mask_ptr=drafter.is_masked_token_mask,
        out_new_token_indices_ptr=i32(reqs * drafter.extra_slots_per_request),
        out_hidden_state_mapping_ptr=i32(total),
        query_start_loc_ptr=i32(reqs + 1),
        query_end_loc_ptr=i32(reqs),
        padding_token_id=0,
        parallel_drafting_token_id=drafter.parallel_drafting_token_id,
        total_input_tokens=total,
        num_padding_slots_per_request=drafter.extra_slots_per_request,
        shift_input_ids=drafter.pass_hidden_states_to_model,
        BLOCK_SIZE_TOKENS=block,
    )


def _jobs(engine: Engine, drafter: Any) -> list[Job]:
    most = max(1, int(getattr(drafter, "max_batch_size", max(BATCHES))))
    batches = [b for b in BATCHES if b <= most] or [1]
    k = engine.spec_tokens
    jobs = [
        Job(FAMILY, f"prepare inputs, {b} requests", partial(warm_prepare_inputs, engine.device, b))
        for b in batches
    ]
    vocab = int(engine.runner.input_batch.vocab_size)
    jobs += [
        Job(FAMILY, f"next token, {b}x{w} sampled", partial(warm_next_token, drafter, vocab, w, b))
        for w in sampled_widths(k)
        for b in batches
    ]
    if k > 1:  # the draft loop's steps past the first
        widths = sorted({int(t.block_table.gpu.shape[1]) for t in compat.slot_mapping_tables(
            engine.runner)})  # fmt: skip
        jobs += [
            Job(FAMILY, f"draft step, {b} requests, {w} blocks", partial(warm_step, drafter, w, b))
            for w in widths
            for b in batches
        ]
    if getattr(drafter, "needs_extra_input_slots", False):
        new = int(drafter.net_num_new_slots_per_request)
        jobs += [
            Job(
                FAMILY, f"expand inputs, query {q}, {t} tokens", partial(warm_expand, drafter, q, t)
            )
            for q, t in expand_shapes(new)
        ]
    return jobs


@hookimpl
def tq_warmup_engine_jobs(engine: Engine) -> Iterable[Job | Declined]:
    method = engine.spec_method
    if method is None:
        return [Declined(FAMILY, "no speculative decoding")]
    if not eagle_style(method):
        return [Declined(FAMILY, f"{method} drafts without the EAGLE helper kernels")]
    if engine.features.registry_warms_eagle_helpers:
        return [Declined(FAMILY, "vLLM's JIT warmup registry warms them (0.30+)")]
    if engine.runner_v2:
        # V2's ``_dummy_run`` proposes with its speculator (0.26 ``gpu/model_runner.py``:
        # 605-627); EAGLE k=3 and MTP k=1 there compiled nothing after startup
        # (benchmarks/results/serve-jit/SUMMARY.md).
        why = "the V2 runner's speculator launches its own kernels, in its own warmup steps"
        return [Declined(FAMILY, why)]
    drafter = compat.drafter_of(engine.runner)
    if drafter is None or compat.eagle_helper("eagle_prepare_inputs_padded_kernel") is None:
        why = f"{method}: this runner or release has no EAGLE helper kernels to warm"
        return [Declined(FAMILY, why, warn=engine.jit_monitor_error)]
    return _jobs(engine, drafter)
