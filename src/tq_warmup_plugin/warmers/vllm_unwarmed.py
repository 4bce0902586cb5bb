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
layers: ``vllm_fused_moe``; the V2 draft_model speculator's inputs: ``vllm_draft_prefill``.)
"""

from __future__ import annotations

from collections.abc import Iterable

from ..hookspecs import hookimpl
from ..vllm_kernels.jobs import Declined, Engine, Job

__all__ = ["HYBRID", "tq_warmup_engine_jobs"]

HYBRID = "Mamba/GDN layers"


@hookimpl
def tq_warmup_engine_jobs(engine: Engine) -> Iterable[Job | Declined]:
    if not engine.hybrid:
        return []
    if engine.full_decode_graphs:
        # vLLM's own startup and FULL graph capture ran these layers' kernels: a Qwen3-Next
        # server with MTP compiled none after startup (benchmarks/results/serve-jit/SUMMARY.md).
        why = "no warmer of their own: vLLM's startup and FULL decode-graph capture ran their "
        why += "kernels"
        return [Declined(HYBRID, why)]
    why = "their conv1d and gated-delta-rule kernels compile on first use"
    if engine.jit_monitor_error:
        why += ": --jit-monitor-mode error stops the engine core on the first; serve in warn mode"
    return [Declined(HYBRID, why, warn=engine.jit_monitor_error)]
