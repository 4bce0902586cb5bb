"""vLLM's kernels a TurboQuant server can reach that no warmer covers yet, named at startup.

A MoE model runs Triton's ``fused_moe_kernel`` (``model_executor/layers/fused_moe``),
whose block sizes follow the batch's token count: CUDA graph capture compiles the counts
it captures, and a prefill chunk of another size bucket compiles on first use. A hybrid
model's Mamba or gated-delta-net layers run their own Triton kernels (causal conv1d, the
gated delta rule, their layer norms). vLLM's JIT warmup registry does not register
either family in any release up to 0.33 (read in 0.30.0 and 0.33.0). Seen after startup:
``fused_moe_kernel``, ``_causal_conv1d_*``, ``fused_sigmoid_gating_delta_rule_update_kernel``
and ``layer_norm_fwd_kernel`` in a hybrid Qwen3-Next with MTP (H200, vLLM 0.26.0), and
``fused_moe_kernel`` stopping an error-mode DeepSeek-V2-Lite (upstream #46167). Until a
warmer derives their keys, each family declines in one line: INFO, or a WARNING where
``--jit-monitor-mode error`` will stop the engine core on the first such compile.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..engine import Declined, Engine, Job
from ..hookspecs import hookimpl

__all__ = ["HYBRID", "MOE", "tq_warmup_engine_jobs"]

MOE = "fused MoE"
HYBRID = "Mamba/GDN layers"


@hookimpl
def tq_warmup_engine_jobs(engine: Engine) -> Iterable[Job | Declined]:
    tail = (
        ": --jit-monitor-mode error stops the engine core on the first; serve in warn mode"
        if engine.jit_monitor_error
        else ""
    )
    found = []
    if engine.moe:
        why = "fused_moe_kernel compiles for each token-count bucket startup did not run"
        found.append(Declined(MOE, why + tail, warn=engine.jit_monitor_error))
    if engine.hybrid:
        why = "their conv1d and gated-delta-rule kernels compile on first use"
        found.append(Declined(HYBRID, why + tail, warn=engine.jit_monitor_error))
    return found
