"""vLLM's top-k/top-p kernel with top-k alone, top-p alone and both.

``apply_top_k_top_p`` (``v1/sample/ops/topk_topp_sampler.py``) runs
``_topk_topp_kernel`` on batches of 8 rows or more, with ``TOPK_ENABLED`` and
``TOPP_ENABLED`` constexprs and ``BATCH_SIZE`` keyed as a multiple of 16 or not
(0.26). vLLM's own sampler warmup sets both top-k and top-p; the first random batch
asking for top-p alone compiled another binary and killed an error-mode server with
TurboQuant and ngram (vLLM 0.26.0, ``benchmarks/results/serve-jit``). This warmer calls
vLLM's function for each of the three on 16 and 17 rows of the model's own logits: in
float32 as the samplers pass them, and on 0.26 also in the model's dtype, which the V2
sampler keeps there (``compat.Features.v2_top_k_top_p_model_dtype``).

From 0.30 a batch of up to 64 rows asking for top-p also runs vLLM's split-row pipeline,
whose split count ``S`` (a constexpr) follows from the batch size, the vocabulary and the
SM count (``compat.topp_split_count``): 16 and 17 rows reach one or two of its values, and
the first small top-p batch compiled three more kernels and killed an error-mode server
(vLLM 0.34.0, ``benchmarks/results/serve-jit``). So top-p, alone and with top-k, is also
warmed at the fewest rows of every other ``S`` (``split_rows``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial

from .. import compat
from ..hookspecs import hookimpl
from ..vllm_kernels import logits as warm_logits
from ..vllm_kernels.jobs import Declined, Engine, Job

__all__ = ["FAMILY", "ROWS", "VARIANTS", "split_rows", "tq_warmup_engine_jobs", "warm"]

FAMILY = "top-k/top-p"
ROWS = (16, 17)
"""Batch sizes in both of ``BATCH_SIZE``'s classes that the kernel takes (8 and up)."""
VARIANTS: dict[str, tuple[bool, bool]] = {
    "top-k": (True, False),
    "top-p": (False, True),
    "top-k and top-p": (True, True),
}


def warm(engine: Engine, float32: bool, rows: int, top_k: bool, top_p: bool) -> None:
    """One call of vLLM's function on ``rows`` rows like the model's logits."""
    import torch

    logits = warm_logits.rows_like(engine.model_logits, rows)
    if float32:
        logits = logits.to(torch.float32)
    k = torch.full((rows,), 5, dtype=torch.int32, device=engine.device)
    p = torch.full((rows,), 0.9, dtype=torch.float32, device=engine.device)
    compat.top_k_top_p_function()(logits, k if top_k else None, p if top_p else None)


def split_rows(count: Callable[[int], int], most: int, taken: Iterable[int] = ROWS) -> list[int]:
    """The fewest rows of each split count ``count`` gives for 1..``most`` rows, less the
    counts ``taken`` row counts already reach: one batch size per binary."""
    seen = {count(rows) for rows in taken if rows <= most}
    firsts: list[int] = []
    for rows in range(1, most + 1):
        split = count(rows)
        if split not in seen:
            seen.add(split)
            firsts.append(rows)
    return firsts


def _split_jobs(engine: Engine) -> list[Job]:
    """Top-p alone and with top-k, float32, at :func:`split_rows` of this engine's
    vocabulary (none where it is not known)."""
    if engine.vocab_size <= 0:
        return []
    found = compat.topp_split_count(getattr(engine.device, "index", None))
    if found is None:
        return []
    count, most = found
    rows_each = split_rows(lambda rows: count(rows, engine.vocab_size), most)
    top_p = {k: v for k, v in VARIANTS.items() if v[1]}
    return [
        Job(
            FAMILY,
            f"float32, {what}, {rows} rows (split-row top-p)",
            partial(warm, engine, True, rows, *flags),
        )
        for rows in rows_each
        for what, flags in top_p.items()
    ]


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
        *(
            Job(FAMILY, f"{name}, {what}, {rows} rows", partial(warm, engine, f32, rows, *flags))
            for name, f32 in dtypes.items()
            for what, flags in VARIANTS.items()
            for rows in ROWS
        ),
        *_split_jobs(engine),
    ]
