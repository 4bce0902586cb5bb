"""vLLM's top-k/top-p kernel with top-k alone, top-p alone and both.

``apply_top_k_top_p`` (``v1/sample/ops/topk_topp_sampler.py``) runs
``_topk_topp_kernel`` on batches of 8 rows or more, with ``TOPK_ENABLED`` and
``TOPP_ENABLED`` constexprs and ``BATCH_SIZE`` keyed as a multiple of 16 or not
(0.26). vLLM's own sampler warmup sets both top-k and top-p; the first random batch
asking for top-p alone compiled another binary and killed an error-mode server with
TurboQuant and ngram (H200, 0.26.0, after the slot-mapping warmer). This warmer calls
vLLM's function for each of the three on 16 and 17 rows of the model's own logits: in
float32 as the samplers pass them, and on 0.26 also in the model's dtype, which the V2
sampler keeps there (``compat.Features.v2_top_k_top_p_model_dtype``).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

from .. import compat
from ..hookspecs import hookimpl
from ..vllm_kernels.jobs import Declined, Engine, Job

__all__ = ["FAMILY", "ROWS", "VARIANTS", "tq_warmup_engine_jobs", "warm"]

FAMILY = "top-k/top-p"
ROWS = (16, 17)
"""Batch sizes in both of ``BATCH_SIZE``'s classes that the kernel takes (8 and up)."""
VARIANTS: dict[str, tuple[bool, bool]] = {
    "top-k": (True, False),
    "top-p": (False, True),
    "top-k and top-p": (True, True),
}


def warm(engine: Engine, float32: bool, rows: int, top_k: bool, top_p: bool) -> None:
    import torch

    logits = compat.logits_of(engine.runner, rows)
    if float32:
        logits = logits.to(torch.float32)
    k = torch.full((rows,), 5, dtype=torch.int32, device=engine.device)
    p = torch.full((rows,), 0.9, dtype=torch.float32, device=engine.device)
    compat.top_k_top_p_function()(logits, k if top_k else None, p if top_p else None)


@hookimpl
def tq_warmup_engine_jobs(engine: Engine) -> Iterable[Job | Declined]:
    """One job a binary, so the host compiles them side by side. The V1 sampler and the
    rejection samplers pass float32, and so does the V2 sampler but on 0.26, where it
    passes the logits' own dtype (``Features.v2_top_k_top_p_model_dtype``)."""
    if engine.pooling:
        return [Declined(FAMILY, "a pooling model samples nothing")]
    dtypes = {"float32": True}
    if engine.runner_v2 and engine.features.v2_top_k_top_p_model_dtype:
        dtypes = {"model dtype": False, **({"float32": True} if engine.spec_method else {})}
    return [
        Job(FAMILY, f"{name}, {what}, {rows} rows", partial(warm, engine, f32, rows, *flags))
        for name, f32 in dtypes.items()
        for what, flags in VARIANTS.items()
        for rows in ROWS
    ]
