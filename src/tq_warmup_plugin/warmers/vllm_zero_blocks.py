"""vLLM's KV-block zeroing kernel at every class of block count a step may zero.

A model with Mamba layers (``KVCacheConfig.needs_kv_cache_zeroing``) zeroes each step's
newly allocated attention blocks in one ``_zero_kv_blocks_kernel`` launch
(``KVBlockZeroer.zero_block_ids``, ``v1/worker/utils.py``), whose ``n_blocks`` Triton
keys as 1, a multiple of 16 or other (0.22-0.26; 0.30 and 0.33 grid over the blocks
instead, one key for every count, which their V2 runner warms and their V1 runner does
not). vLLM 0.26 warms it for Qwen models only, at 1 and 2 blocks
(``qwen_triton_warmup.py``); 0.22 not at all. A burst of 16 fresh requests took 16 blocks
in one step and compiled it after startup in an in-process Qwen3-Next with MTP (H200,
0.26.0, ``serve-jit --in-process``, runs AH and AI), where a server fed over HTTP, its
requests spread over several steps, had not (runs AB, AD). This warmer calls the runner's
own zeroer at 1, 2 and 16 blocks under ``compat.compile_only_launches``: its segment
table, page size and tile are serving's, and no block is zeroed. Not offline: those come
from the allocated KV cache.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

from .. import compat
from ..engine import Declined, Engine, Job
from ..hookspecs import hookimpl

__all__ = ["BLOCK_COUNTS", "FAMILY", "tq_warmup_engine_jobs"]

FAMILY = "KV block zeroing"
BLOCK_COUNTS = (1, 2, 16)
"""One block count in each of Triton's integer classes (1, other, a multiple of 16)."""


@hookimpl
def tq_warmup_engine_jobs(engine: Engine) -> Iterable[Job | Declined]:
    if not engine.hybrid or engine.runner is None:
        return []
    zeroer = compat.kv_block_zeroer(engine.runner)
    if zeroer is None:
        return [Declined(FAMILY, "the runner zeroes no attention blocks")]
    return [
        Job(FAMILY, f"{n} blocks", partial(zeroer.zero_block_ids, list(range(n))), offline=False)
        for n in BLOCK_COUNTS
    ]
