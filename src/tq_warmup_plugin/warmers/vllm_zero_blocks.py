"""vLLM's KV-block zeroing kernel at every class of block count a step may zero.

A model with Mamba layers (``KVCacheConfig.needs_kv_cache_zeroing``) zeroes each step's
newly allocated attention blocks in one ``_zero_kv_blocks_kernel`` launch
(``KVBlockZeroer.zero_block_ids``, ``v1/worker/utils.py``), whose ``n_blocks`` Triton
keys as 1, a multiple of 16 or other (0.22-0.26; 0.30 and 0.33 grid over the blocks
instead, one key for every count, which their V2 runner warms and their V1 runner does
not). vLLM 0.26 warms it for Qwen models only, at 1 and 2 blocks
(``qwen_triton_warmup.py``); 0.22 not at all. A burst of 16 fresh requests took 16 blocks
in one step and compiled it after startup in an in-process Qwen3-Next with MTP, where a
server fed over HTTP, its requests spread over several steps, had not
(``benchmarks/results/serve-jit/SUMMARY.md``). This warmer calls the runner's
own zeroer at each count that is a key of its own (``compat.kv_zeroing_counts``: 1, 2 and
16 blocks on 0.22-0.26) under ``compat.compile_only_launches``: its segment
table, page size and tile are serving's, and no block is zeroed.

Offline (``precompile``, ``inspect``, the compile-ahead child), where no KV cache is allocated,
the constants come from the plan (``plan.request.kv_zeroing``: the attention layers' KV tensors by
vLLM's grouping, their page by the plan's layout) and vLLM's kernel is launched with them
(``compat.zero_blocks_launch``), so a shipped layer holds the keys: a hybrid served from a
layer compiles none of them in the worker (the same record). Where the plan misses the live
cache (a model whose layers group otherwise), the worker compiles its own key at startup, as
without the layer.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

from .. import compat
from ..hookspecs import hookimpl
from ..vllm_kernels.jobs import Declined, Engine, Job

__all__ = ["FAMILY", "tq_warmup_engine_jobs"]

FAMILY = "KV block zeroing"


@hookimpl
def tq_warmup_engine_jobs(engine: Engine) -> Iterable[Job | Declined]:
    if engine.planned:
        zeroing = engine.kv_zeroing
        if zeroing is None:
            return []
        return [
            Job(
                FAMILY, f"{n} blocks", partial(compat.zero_blocks_launch, zeroing, n, engine.device)
            )
            for n in compat.kv_zeroing_counts()
        ]
    if not engine.hybrid or engine.runner is None:
        return []
    zeroer = compat.kv_block_zeroer(engine.runner)
    if zeroer is None:
        return [Declined(FAMILY, "the runner zeroes no attention blocks")]
    return [
        Job(FAMILY, f"{n} blocks", partial(zeroer.zero_block_ids, list(range(n))), offline=False)
        for n in compat.kv_zeroing_counts()
    ]
