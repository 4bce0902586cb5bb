"""vLLM's fused MoE kernel at the step sizes CUDA graph capture does not compile.

A MoE layer on Hopper launches Triton's ``fused_moe_kernel`` twice per step (the gate-up
and the down GEMM), with a config that follows the step's token count
(``try_get_optimal_moe_config``). A step of at most the largest captured size is padded
to a captured one, whose keys capture compiled; a longer step (a prefill chunk) runs
eagerly at its own size and compiled on first use: ``fused_moe_kernel`` stopped an
error-mode DeepSeek-V2-Lite (upstream #46167) and compiled late in a hybrid Qwen3-Next
with MTP (vLLM 0.26.0, ``benchmarks/results/serve-jit/SUMMARY.md``). vLLM's JIT warmup
registry registers no ``fused_moe_kernel`` key in any supported release (0.34 registers its
router GEMMs only).

Which sizes: ``fused_moe_kernel``'s key depends on the step's ``tokens`` only through
its config and two integer arguments, ``num_valid_tokens`` (tokens x top_k) and each
GEMM's ``EM`` (:func:`em`), which Triton specializes on "is 1" and "is a multiple of
16". So :func:`signature` is the config and those classes, and one step per distinct
signature reaches every key of the eager range: for a 4-expert top-2 Mixtral from 513 to
8192 tokens, 5 steps reach its 10 keys (Mixtral-8x7B's shape with the H200's tuned
configs: 6 steps, 12 keys), not 7,680. ``tests/contract/test_contract_fused_moe`` checks
the choice against the keys vLLM's own ``TritonExperts.apply`` asks for at every size.

How: each chosen size is one step of vLLM's own ``TritonExperts.apply`` on meta tensors
(``compat.moe_steps``) under ``compile_only_launches``: the config lookup, workspaces,
expert assignment and both GEMMs' launchers as serving runs them, every key compiled or
read from disk and loaded, nothing run. The same jobs serve a worker, ``precompile`` and
the compile-ahead child; a worker's steps read its own GPU's tuned configs, an offline
plan's those of ``Engine.gpu_name`` (``compat.moe_experts_of_config`` gives it the
experts). ``tests/contract/test_contract_fused_moe_offline`` holds them to the keys the
worker's forwards launch.

Why steps and not vLLM's warmup forwards (``compat.dummy_run``, serially: ``Job.real``):
with the keys already on disk such forwards were most of what a MoE worker's warmers cost
from a shipped layer, and the steps load the same keys in a fraction of it, with nothing
compiled after startup (``benchmarks/results/serve-jit/SUMMARY.md``).
The forwards stay for a model whose experts run another backend than ``TritonExperts``
(``compat.moe_runs_triton_experts``: FlashInfer's, a quantized method), whose kernels
only a forward reaches. Such forwards compiled a Mixtral's keys at startup, and an
error-mode server then served its mix with no JIT event (vLLM 0.26.0, the same record).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterable, Sequence
from functools import partial
from typing import Any

from .. import compat
from ..hookspecs import hookimpl
from ..vllm_kernels.jobs import Declined, Engine, Job

__all__ = ["FAMILY", "em", "int_class", "signature", "token_counts", "tq_warmup_engine_jobs"]

FAMILY = "fused MoE"

_UNQUANTIZED = ("bfloat16", "float16")
"""Expert weights vLLM's Triton path reads with ``dtype=None`` in its config lookup;
quantized experts have their own config names and kernels."""


def int_class(value: int) -> str:
    """How Triton 3.6-3.8 specializes an integer argument: 1, a multiple of 16, or
    neither (its ``D`` divisibility mark)."""
    return "1" if value == 1 else "16" if value % 16 == 0 else ""


def em(tokens: int, top_k: int, experts: int, block_m: int, rows: int) -> int:
    """``EM``, the sorted-row bound one ``fused_moe_kernel`` launch gets, for a launch
    whose ``A`` has ``rows`` rows (the gate-up GEMM: ``tokens``; the down GEMM: tokens x
    top_k): ``moe_align_block_size``'s buffer (routed + experts x (BLOCK_SIZE_M - 1),
    at most routed x BLOCK_SIZE_M when routed < experts), the launcher's small-batch
    bound (``rows < BLOCK_SIZE_M``), or routed x BLOCK_SIZE_M on the naive assignment
    (routed x 4 <= experts). The same in 0.22, 0.26, 0.30 and 0.33
    (``moe_align_block_size.py``, ``invoke_fused_moe_triton_kernel``,
    ``_prepare_expert_assignment``); the contract test holds it to vLLM's own."""
    routed = tokens * top_k
    if routed * 4 <= experts:
        return routed * block_m
    padded = routed + experts * (block_m - 1)
    if routed < experts:
        padded = min(padded, routed * block_m)
    return min(padded, routed * block_m) if rows < block_m else padded


def signature(
    tokens: int, experts: Sequence[compat.MoeExperts], config_of: Callable[..., Any]
) -> Hashable:
    """What every layer's two ``fused_moe_kernel`` keys depend on at a step of ``tokens``:
    the config, and Triton's class of each integer argument that follows the step
    (``num_valid_tokens``, each GEMM's ``EM``) and of the naive assignment."""
    parts = []
    for layer in experts:
        config = config_of(layer.w13, layer.w2, layer.top_k, None, tokens)
        block_m = int(config.get("BLOCK_SIZE_M", 16))
        routed = tokens * layer.top_k
        gate_up = em(tokens, layer.top_k, layer.experts, block_m, rows=tokens)
        down = em(tokens, layer.top_k, layer.experts, block_m, rows=routed)
        naive = routed * 4 <= layer.experts
        parts.append((tuple(sorted(config.items())), int_class(routed), int_class(gate_up),
                      int_class(down), naive))  # fmt: skip
    return tuple(parts)


def token_counts(first: int, last: int, signature_of: Callable[[int], Hashable]) -> list[int]:
    """The smallest step size of each distinct signature in ``first..last``."""
    seen: dict[Hashable, int] = {}
    for tokens in range(first, last + 1):
        seen.setdefault(signature_of(tokens), tokens)
    return sorted(seen.values())


@hookimpl
def tq_warmup_engine_jobs(engine: Engine) -> Iterable[Job | Declined]:
    if not engine.moe:
        return []
    offline = engine.planned
    found = engine.planned_experts if offline else compat.moe_experts(engine.runner)
    experts = sorted(set(found), key=repr)
    warn = engine.jit_monitor_error
    if offline and not experts:
        return [Declined(FAMILY, "no experts derived from the config: warmed at startup")]
    if not experts:
        return [Declined(FAMILY, "no layer holds MoE expert weights (w13_weight, w2_weight)")]
    if offline and not engine.gpu_name:
        return [Declined(FAMILY, "no GPU name for vLLM's tuned configs: warmed at startup")]
    quantized = sorted({e.dtype for e in experts} - set(_UNQUANTIZED))
    if quantized:
        why = f"experts of dtype {', '.join(quantized)}: their configs are not derived yet"
        return [Declined(FAMILY, why, warn=warn)]
    if engine.micro_batches:
        why = "microbatches (--enable-dbo, --ubatch-size) run its layers at sizes not derived yet"
        return [Declined(FAMILY, why, warn=warn)]
    first = engine.graph_tokens + 1
    if first > engine.max_tokens:
        why = f"every step fits a CUDA graph (up to {engine.graph_tokens} tokens): capture compiles"
        return [Declined(FAMILY, why)]
    config_of = compat.moe_config_function()
    # offline, the target GPU's configs: named once, not per lookup, as naming empties
    # vLLM's config cache and each lookup would re-read its tuned JSON (vLLM 0.26.0,
    # commit 78a901d)
    with compat.named_gpu(engine.gpu_name) if offline else contextlib.nullcontext():
        sizes = token_counts(first, engine.max_tokens, partial(signature, experts=experts,
                                                                config_of=config_of))  # fmt: skip
    if not offline and not compat.moe_runs_triton_experts(engine.runner):
        return [
            Job(FAMILY, f"{n} tokens", partial(compat.dummy_run, engine.runner, n), real=True)
            for n in sizes
        ]
    gpu = engine.gpu_name if offline else compat.device_name()
    return [Job(FAMILY, f"{n} tokens", partial(_step, tuple(experts), n, gpu)) for n in sizes]


def _step(experts: Sequence[compat.MoeExperts], tokens: int, gpu_name: str) -> None:
    for layer in experts:
        compat.moe_steps(layer, [tokens], gpu_name)
