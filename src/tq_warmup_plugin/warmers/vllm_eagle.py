"""vLLM's EAGLE drafter helpers: not warmed yet, and said so where they will compile.

An EAGLE-style drafter (``eagle``, ``eagle3``, MTP, ``draft_model``) launches small
Triton kernels of its own between the target's steps (``v1/spec_decode/utils.py``):
``eagle_step_slot_mapping_metadata_kernel``, ``eagle_prepare_inputs_padded_kernel``,
``eagle_prepare_next_token_padded_kernel`` and ``copy_and_expand_eagle_inputs_kernel``.
vLLM's startup does not compile them before 0.30 (read in 0.22 and 0.26-0.29), where
its JIT warmup registry takes them over (``compat.Features.registry_warms_eagle_helpers``);
on 0.26.0 all four
compiled on the first requests of a TurboQuant ``vllm serve`` with ``draft_model`` k=3
(H200, ``benchmarks/results/serve-jit``). Their keys follow the batch (``num_reqs`` and
``batch_size`` in each of Triton's integer classes) and, for the last one, a
``BLOCK_SIZE_TOKENS`` constexpr per power of two of the longest query up to 256: vLLM
0.30's registry enumerates the same ranges. No warmer launches them yet, so this one
declines in one line, a WARNING where ``--jit-monitor-mode error`` will stop the engine
core on the first of them.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..engine import Declined, Engine, Job
from ..hookspecs import hookimpl

__all__ = ["EAGLE_STYLE", "FAMILY", "eagle_style", "tq_warmup_engine_jobs"]

FAMILY = "EAGLE helpers"
EAGLE_STYLE = frozenset({"eagle", "eagle3", "mtp", "draft_model"})
"""``speculative_config.method`` values whose drafter is vLLM's model-based proposer
(``llm_base_proposer``); a model's own MTP method name (``deepseek_mtp``, ...) ends in
``mtp``. ngram and suffix decoding draft on the CPU."""


def eagle_style(method: str) -> bool:
    return method in EAGLE_STYLE or method.endswith("_mtp")


@hookimpl
def tq_warmup_engine_jobs(engine: Engine) -> Iterable[Job | Declined]:
    method = engine.spec_method
    if method is None:
        return [Declined(FAMILY, "no speculative decoding")]
    if not eagle_style(method):
        return [Declined(FAMILY, f"{method} drafts without the EAGLE helper kernels")]
    if engine.features.registry_warms_eagle_helpers:
        return [Declined(FAMILY, "vLLM's JIT warmup registry warms them (0.30+)")]
    why = (
        f"{method}'s Triton helpers (eagle_prepare_inputs_padded_kernel and 3 more) compile "
        "on the first draft steps, which vLLM warms from 0.30"
    )
    if engine.jit_monitor_error:
        why += ": --jit-monitor-mode error stops the engine core on the first; serve in warn mode"
    return [Declined(FAMILY, why, warn=engine.jit_monitor_error)]
