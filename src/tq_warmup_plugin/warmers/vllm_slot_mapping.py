"""vLLM's V1 slot-mapping kernel at the block sizes the engine really has.

``_compute_slot_mapping_kernel`` (``v1/worker/block_table.py``) turns positions into
KV slots on every step of the V1 runner. vLLM 0.26 warms it for block sizes 3 and 16
(``v1_block_table_warmup.py``) with ``KV_CACHE_BLOCK_SIZE`` a constexpr; TurboQuant's
bf16 block size there is 32, so the first request compiled it, and a JIT monitor in
``error`` mode killed the engine core on it (``benchmarks/results/serve-jit``). 0.20-0.25
warm it not at all and also specialize ``num_tokens`` (no ``do_not_specialize``). This
warmer calls each live table's own ``compute_slot_mapping`` under
``compat.compile_only_launches``: the table's constexprs, stride and block size are
serving's, and nothing is written.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import Any

from .. import compat
from ..hookspecs import hookimpl
from ..vllm_kernels.jobs import Declined, Engine, Job

__all__ = ["FAMILY", "TOKEN_COUNTS", "tq_warmup_engine_jobs"]

FAMILY = "slot mapping"
TOKEN_COUNTS = (1, 16, 17)
"""One step's token count in each of Triton's integer classes (1, a multiple of 16,
any other): 0.20-0.25 key on ``num_tokens``; 0.26-0.28 declare it
``do_not_specialize`` and the three are one binary."""


def describe(table: Any) -> str:
    size = getattr(table, "kv_cache_block_size", table.block_size)
    stride = table.block_table.gpu.stride(0)
    return f"block size {size}, kernel block {table.block_size}, row stride {stride}"


def warm_table(table: Any, device: Any) -> None:
    """One request of each ``TOKEN_COUNTS`` length, as ``_prepare_inputs`` passes them:
    the runner's int32 ``query_start_loc`` and int64 ``positions`` from their base."""
    import torch

    for tokens in TOKEN_COUNTS:
        if tokens > table.max_num_batched_tokens:
            continue
        starts = torch.tensor([0, tokens], dtype=torch.int32, device=device)
        positions = torch.zeros(tokens, dtype=torch.int64, device=device)
        table.compute_slot_mapping(1, starts, positions)


@hookimpl
def tq_warmup_engine_jobs(engine: Engine) -> Iterable[Job | Declined]:
    if engine.pooling:
        return [Declined(FAMILY, "a pooling model maps no slots")]
    if engine.runner_v2:
        return [Declined(FAMILY, "the V2 runner's own warmup runs real steps, which map slots")]
    if engine.features.registry_warms_slot_mapping:
        return [Declined(FAMILY, "vLLM's JIT warmup registry warms every block table (0.29+)")]
    tables = compat.slot_mapping_tables(engine.runner)
    return [Job(FAMILY, describe(t), partial(warm_table, t, engine.device)) for t in tables]
