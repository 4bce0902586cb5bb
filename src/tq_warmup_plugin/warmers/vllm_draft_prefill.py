"""The V2 draft_model speculator's first-pass input kernel, at every block its steps reach.

On the V2 runner (0.31-0.34) a draft_model speculator starts each round with
``prepare_prefill_inputs``, which launches ``_prepare_prefill_inputs_kernel`` with a
``BLOCK_SIZE`` of ``min(512, next_power_of_2(longest query + 2))``. vLLM's warmup steps skip
it (``propose`` with ``skip_attn_for_dummy_run``), so each block compiled on the first
step whose longest query reached it, and an error-mode server with draft_model died on the
first (vLLM 0.34.0, ``benchmarks/results/serve-jit/SUMMARY.md``).

Every other input of its key is fixed per server: the pointers are offset-0 slices of
the runner's and the speculator's own buffers, or fresh ``.int()`` copies (all aligned),
and ``max_num_reqs`` and ``max_model_len`` are the speculator's. So one job per block
calls vLLM's own launcher with one request of a query that lands in that block, on the
speculator's buffers, under ``compat.compile_only_launches``: nothing runs and nothing
is written. Offline (``precompile``, the compile-ahead child) the speculator is rebuilt from
the engine arguments on meta tensors (``vllm_kernels.offline.offline_speculator``).
``tests/contract/test_contract_draft_prefill.py`` checks both against vLLM's launcher over
batches built by vLLM's ``InputBatch.make_dummy``.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from types import SimpleNamespace
from typing import Any

from .. import compat
from ..hookspecs import hookimpl
from ..keys import next_pow2
from ..vllm_kernels.jobs import Declined, Engine, Job

__all__ = ["BLOCK_CAP", "FAMILY", "blocks", "reaches", "tq_warmup_engine_jobs", "warm_block"]

FAMILY = "draft speculator inputs"
BLOCK_CAP = 512
"""``prepare_prefill_inputs`` caps ``BLOCK_SIZE`` at 512 (0.31-0.34)."""


def reaches(features: compat.Features, runner_v2: bool, spec_method: str | None) -> bool:
    """Whether a worker runs the V2 draft_model speculator that launches this kernel
    (0.31+, ``Features.v2_draft_prefill_kernel``): the worker's engine and an offline plan's
    request (``vllm_kernels.offline.offline_speculator``) ask the same question."""
    return runner_v2 and spec_method == "draft_model" and features.v2_draft_prefill_kernel


def blocks(max_tokens: int) -> list[int]:
    """Each ``BLOCK_SIZE`` a step of at most ``max_tokens`` scheduled tokens reaches: the
    power of two of its longest query plus 2, from a query of 1 (4) up to the cap."""
    top = min(BLOCK_CAP, next_pow2(max(1, max_tokens) + 2))
    found, block = [], 4
    while block <= top:
        found.append(block)
        block *= 2
    return found


def warm_block(launcher: Any, speculator: Any, block: int) -> None:
    """One request whose query (``block - 2``, at most the speculator's token budget) has
    this block, as the runner's input batch passes it: offset-0 slices of the input buffers,
    ``int64`` request indices, and host query starts (vLLM's are numpy; the launcher only
    takes their largest difference)."""
    import torch

    buffers = speculator.input_buffers
    query = max(1, min(block - 2, int(speculator.max_num_tokens)))
    device = speculator.expanded_input_ids.device
    batch = SimpleNamespace(  # the fields of vLLM's InputBatch that the launcher reads
        num_reqs=1,
        num_tokens=query,
        query_start_loc_np=torch.tensor([0, query], dtype=torch.int32),
        input_ids=buffers.input_ids[:query],
        positions=buffers.positions[:query],
        idx_mapping=torch.zeros(1, dtype=torch.int64, device=device),
        query_start_loc=buffers.query_start_loc[:2],
        seq_lens=buffers.seq_lens[:1],
    )
    launcher(
        input_buffers=buffers,
        input_batch=batch,
        last_sampled=torch.zeros(speculator.max_num_reqs, dtype=torch.int64, device=device),
        num_rejected=torch.zeros(1, dtype=torch.int64, device=device),
        expanded_input_ids=speculator.expanded_input_ids,
        expanded_positions=speculator.expanded_positions,
        last_token_indices=speculator.last_token_indices,
        max_num_reqs=speculator.max_num_reqs,
        max_model_len=speculator.max_model_len,
    )


@hookimpl
def tq_warmup_engine_jobs(engine: Engine) -> Iterable[Job | Declined]:
    if not reaches(engine.features, engine.runner_v2, engine.spec_method):
        return []
    found = compat.draft_prefill(engine.runner)
    if found is None:
        why = "this runner has no draft_model speculator with vLLM's prepare_prefill_inputs"
        return [Declined(FAMILY, why, warn=engine.jit_monitor_error)]
    launcher, speculator = found
    return [
        Job(FAMILY, f"block {b}", partial(warm_block, launcher, speculator, b))
        for b in blocks(int(speculator.max_num_tokens))
    ]
