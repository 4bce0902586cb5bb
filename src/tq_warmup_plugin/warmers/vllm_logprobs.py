"""vLLM's logprob kernels for every number of logprobs a request may ask for.

The V2 sampler gathers logprobs with ``_topk_log_softmax_kernel`` (and ranks with
``_ranks_kernel``, ``v1/worker/gpu/sample/logprob.py`` all releases), whose
``TOPK_BLOCK_SIZE`` constexpr is the next power of two of ``1 + logprobs`` and whose
``topk`` argument is keyed as 1, a multiple of 16 or other. V2's warmup steps ask for
no logprobs, so the first request with ``logprobs`` compiled it (vLLM 0.26.0,
``benchmarks/results/README.md``). This warmer calls the live sampler's launcher once per
distinct key, on two rows of the model's own logits. The V1 sampler counts ranks with
``batched_count_greater_than`` (``v1/sample/ops/logprobs.py``, ``torch.compile``: static at
its first shape, dynamic from the second), so there it samples two batches of different
shapes with logprobs.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

from .. import compat
from ..hookspecs import hookimpl
from ..keys import Int, next_pow2
from ..vllm_kernels import logits as warm_logits
from ..vllm_kernels.jobs import Declined, Engine, Job

__all__ = ["FAMILY", "TOPK_BLOCK_CAP", "logprob_counts", "tq_warmup_engine_jobs"]

FAMILY = "logprobs"
TOPK_BLOCK_CAP = 1024
"""``_MAX_TOPK_BLOCK`` (0.26-0.33; 0.20-0.25 do not cap, and then a count past it is
warmed up to here only)."""


def logprob_counts(max_logprobs: int) -> list[int]:
    """One number of logprobs per distinct kernel key, 0 to ``max_logprobs``
    (-1: as many as the vocabulary, warmed up to the block cap). The launch gathers
    ``1 + n`` token ids: the sampled one and the top ``n``."""
    limit = TOPK_BLOCK_CAP - 1 if max_logprobs < 0 else min(max_logprobs, TOPK_BLOCK_CAP - 1)
    seen: dict[tuple[int, Int], int] = {}
    for n in range(limit + 1):
        ids = n + 1
        block = min(next_pow2(ids), TOPK_BLOCK_CAP)
        seen.setdefault((block, Int.of(ids)), n)  # Triton's class of the ``topk`` int
    return sorted(seen.values())


def warm_count(engine: Engine, logprobs: int) -> None:
    import torch

    logits = warm_logits.rows_like(engine.model_logits, 2)
    sampled = torch.zeros(2, dtype=torch.int64, device=engine.device)  # V2 samples int64
    compat.topk_logprobs_function()(logits, logprobs, sampled)


def warm_v1(engine: Engine) -> None:
    """Two greedy batches with logprobs through the live V1 sampler: 2 rows with 1
    logprob, then 3 with 2, so the compiled rank count is dynamic in both; in inference
    mode, as ``execute_model`` samples. Dynamo keys a graph on its inputs' dispatch keys,
    and the graph this warmer compiled outside it was compiled again by serving: the
    first batch with logprobs of an in-process Qwen3-Next with MTP
    (``triton_red_fused_ge_sum_0``, vLLM 0.26.0, ``benchmarks/results/serve-jit/SUMMARY.md``);
    on the CPU, 1 graph of 1 (``tests/contract/test_contract_v1_rank_count.py``)."""
    import torch

    runner = engine.runner
    with torch.inference_mode():
        for rows, logprobs in ((2, 1), (3, 2)):
            logits = compat.logits_of(runner, rows)
            sampling = compat.sampling_metadata(rows, True, False, engine.device, logprobs)
            runner.sampler(logits=logits, sampling_metadata=sampling)


@hookimpl
def tq_warmup_engine_jobs(engine: Engine) -> Iterable[Job | Declined]:
    if engine.pooling:
        return [Declined(FAMILY, "a pooling model samples nothing")]
    if engine.max_logprobs == 0:
        return [Declined(FAMILY, "max_logprobs is 0: no request may ask for logprobs")]
    if not engine.runner_v2:
        # torch.compile'd for the device: nothing a CPU can build for it
        return [
            Job(FAMILY, "V1 sampler, 2 batch shapes", partial(warm_v1, engine), graphs=True,
                offline=False)
        ]  # fmt: skip
    return [
        Job(FAMILY, f"V2 sampler, {n} logprobs", partial(warm_count, engine, n))
        for n in logprob_counts(engine.max_logprobs)
    ]
