"""The engine warmers' logits: the model's one GEMM where the jobs are planned, copies
in the jobs.

Jobs run on a thread pool (``run.run``). A cuBLAS GEMM on a thread that has made none
makes torch create a cuBLAS handle and a workspace for that thread, and torch keeps the
workspace allocated for the life of the process. vLLM 0.34's extensible KV cache is sized
from the memory left after warmup, so memory no serving step uses would cost KV blocks
(``benchmarks/results/kv-reserve/SUMMARY.md``). With tensor parallelism,
``compute_logits`` also gathers across ranks, which pool threads could start in a
different order on each rank. So the logits are computed once (:func:`sample`, cached
as ``Engine.model_logits``) on the worker's thread before the pool starts, and each job
takes :func:`rows_like` of them: the same dtype, width and row stride, as many rows as it
needs, with no GEMM.
"""

from __future__ import annotations

from typing import Any

from .. import compat

__all__ = ["rows_like", "sample"]


def sample(runner: Any) -> Any:
    """Two rows of logits as the live model computes them (``compat.logits_of``), on the
    calling thread. Two, not one: a dimension of size 1 may carry any stride, and the row
    stride is what :func:`rows_like` copies."""
    return compat.logits_of(runner, 2)


def rows_like(logits: Any, rows: int) -> Any:
    """A new tensor of ``rows`` rows, each the first row of ``logits`` (a :func:`sample`),
    with its dtype, device, width and row stride: what ``compute_logits`` would return for
    that many rows, made with one copy kernel."""
    import torch

    out = torch.empty_strided(
        (rows, logits.shape[-1]),
        (logits.stride(0), logits.stride(1)),
        dtype=logits.dtype,
        device=logits.device,
    )
    return out.copy_(logits[:1].expand(rows, -1))
