"""vLLM's kernels a TurboQuant server can reach that no warmer covers yet, named at startup.

A hybrid model's Mamba or gated-delta-net layers run their own Triton kernels (causal conv1d,
the gated delta rule, their layer norms), keyed by each step's batch shape. vLLM's JIT warmup
registry registers none of them on 0.30-0.33 (read in 0.30.0 and 0.33.0); 0.34 registers the
layer norm (``layernorm_guard.py``) and not the others. An in-process hybrid Qwen3-Next
with MTP compiled ``_causal_conv1d_*``, ``fused_sigmoid_gating_delta_rule_update_kernel`` and
``layer_norm_fwd_kernel`` after startup, where served with vLLM's default FULL_AND_PIECEWISE
graphs it compiled none of them (vLLM 0.26.0, ``benchmarks/results/serve-jit/SUMMARY.md``):
there the family declines in one INFO line. Elsewhere (``--enforce-eager``, PIECEWISE
graphs), until a warmer derives their keys, it declines in one line: INFO, or a WARNING where
``--jit-monitor-mode error`` will stop the engine core on the first such compile. (MoE
layers: ``vllm_fused_moe``.)

The V2 draft_model speculator's first-pass input kernel (0.30+) is the other: its
``BLOCK_SIZE`` follows the step's longest query, and an error-mode server with draft_model
died on it (vLLM 0.34.0, ``benchmarks/results/serve-jit/SUMMARY.md``); it declines the same
way.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..hookspecs import hookimpl
from ..vllm_kernels.jobs import Declined, Engine, Job

__all__ = ["DRAFT_PREFILL", "HYBRID", "tq_warmup_engine_jobs"]

HYBRID = "Mamba/GDN layers"
DRAFT_PREFILL = "draft speculator inputs"


def _draft_prefill(engine: Engine) -> list[Declined]:
    """The V2 draft_model speculator's first-pass input kernel (0.30+), keyed by the step's
    longest query: compiled after startup by an error-mode server with draft_model, which
    then served none of its requests (vLLM 0.34.0, ``benchmarks/results/serve-jit``)."""
    if not (
        engine.runner_v2
        and engine.spec_method == "draft_model"
        and engine.features.v2_draft_prefill_kernel
    ):
        return []
    why = "_prepare_prefill_inputs_kernel compiles per power of two of a step's longest query"
    return [_compiled_late(DRAFT_PREFILL, why, engine)]


def _compiled_late(family: str, why: str, engine: Engine) -> Declined:
    """``family``'s decline for kernels that compile on first use: a WARNING, and says so,
    where ``--jit-monitor-mode error`` will stop the engine core on the first."""
    if engine.jit_monitor_error:
        why += ": --jit-monitor-mode error stops the engine core on the first; serve in warn mode"
    return Declined(family, why, warn=engine.jit_monitor_error)


@hookimpl
def tq_warmup_engine_jobs(engine: Engine) -> Iterable[Job | Declined]:
    drafts = _draft_prefill(engine)
    if not engine.hybrid:
        return drafts
    if engine.full_decode_graphs:
        # vLLM's own startup and FULL graph capture ran these layers' kernels: a Qwen3-Next
        # server with MTP compiled none after startup (benchmarks/results/serve-jit/SUMMARY.md).
        return [*drafts, Declined(HYBRID, "no warmer of their own: vLLM's startup and its "
                         "FULL decode-graph capture ran their kernels (0 compiles after "
                         "startup in a Qwen3-Next server, H200, 0.26.0)")]  # fmt: skip
    why = "their conv1d and gated-delta-rule kernels compile on first use"
    return [*drafts, _compiled_late(HYBRID, why, engine)]
