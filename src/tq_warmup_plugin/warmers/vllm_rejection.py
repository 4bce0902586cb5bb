"""vLLM's V1 rejection sampler in every sampling mode a verify batch can have.

vLLM's own warmup (``_dummy_sampler_run``, 0.20-0.29) verifies one mixed batch: not all
greedy, not all random. An all-greedy batch passes ``is_greedy=None`` and
``uniform_probs=None`` to ``rejection_greedy_sample_kernel``, another binary (vLLM's
own FIXME there, ``rejection_sampler.py`` 0.26:729), and an all-random one skips it:
the first greedy request with ngram compiled it (vLLM 0.26.0,
``benchmarks/results/serve-jit``). This warmer runs the live ``RejectionSampler`` as
``_dummy_sampler_run`` does, once per mode, under ``compat.compile_only_launches``.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

from .. import compat
from ..hookspecs import hookimpl
from ..vllm_kernels import logits as warm_logits
from ..vllm_kernels.jobs import Declined, Engine, Job

__all__ = ["FAMILY", "MODES", "tq_warmup_engine_jobs", "warm_mode"]

FAMILY = "rejection sampler"
MODES: dict[str, tuple[bool, bool]] = {
    "greedy": (True, False),
    "random": (False, True),
    "mixed": (False, False),
}
"""``(all_greedy, all_random)`` of each sampling mode a batch can be in."""


def warm_mode(engine: Engine, all_greedy: bool, all_random: bool) -> None:
    """A two-request verify batch (a full draft of ``k`` tokens and a one-token one):
    ``max_spec_len`` is ``do_not_specialize`` and the batch size only the grid."""
    import torch

    drafts = [[0] * max(1, engine.spec_tokens), [0]]
    tokens = sum(len(d) for d in drafts)
    runner = engine.runner
    logits = warm_logits.rows_like(engine.model_logits, tokens + len(drafts))
    draft_probs = None
    if engine.draft_probs:
        draft_probs = torch.softmax(
            torch.rand(tokens, logits.shape[-1], device=engine.device, dtype=torch.float32), dim=-1
        )
    metadata = compat.spec_decode_metadata(drafts, engine.device)
    sampling = compat.sampling_metadata(len(drafts), all_greedy, all_random, engine.device)
    runner.rejection_sampler(metadata, draft_probs, logits, sampling)


@hookimpl
def tq_warmup_engine_jobs(engine: Engine) -> Iterable[Job | Declined]:
    if engine.spec_method is None:
        return [Declined(FAMILY, "no speculative decoding")]
    if engine.runner_v2:
        return [Declined(FAMILY, "the V2 runner's own warmup runs its sampler in real steps")]
    if engine.features.registry_warms_rejection_sampler:
        return [Declined(FAMILY, "vLLM's JIT warmup registry warms it (0.30+)")]
    return [
        Job(FAMILY, f"{mode} batch, k={engine.spec_tokens}", partial(warm_mode, engine, *flags))
        for mode, flags in MODES.items()
    ]
