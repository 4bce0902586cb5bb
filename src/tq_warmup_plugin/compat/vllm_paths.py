"""Every vLLM module, class and function name the plugin imports or patches (all releases;
the V1 runner's, which 0.34 removed, are reached only on a V1 engine, ``Features.v1_runner``).

Each path is written once, here: the accessors import them with
``importlib.import_module(NAME)``, never ``from vllm... import``, so the same string is
the one the import hook (``install``) waits for, the one a guard declares as its
``MODULE`` and the one the tests stub in ``sys.modules`` (``import_module`` returns a
stubbed module without importing its parents). A static import would check nothing
more: vLLM is untyped for the plugin's mypy run (``vllm.*`` is ignored in pyproject).
"""

from __future__ import annotations

__all__ = [
    "ATTENTION_MODULE",
    "BACKEND_CLASS",
    "BACKEND_MODULE",
    "BLOCK_TABLE_MODULE",
    "BUILDER_CLASS",
    "CALL_SITE_MODULES",
    "CHUNKED_LOCAL_CLASS",
    "CHUNKED_LOCAL_MODULE",
    "CONTINUATION_DECODE_THRESHOLD",
    "CUSTOM_OPS_MODULE",
    "DECODE_LAUNCHER",
    "DECODE_MODULE",
    "DRAFT_CALL_SITE_MODULES",
    "DRAFT_PREFILL_LAUNCHER",
    "DRAFT_PREFILL_MODULES",
    "ELASTIC_MODULE",
    "EXTEND_QUERIES_FUNCTION",
    "FLASH_ATTN_MODULE",
    "FUSED_MOE_CONFIG_MODULE",
    "FUSED_MOE_MODULE",
    "IMPL_CLASS",
    "JIT_WARMUP_MODULE",
    "KERNEL_MODULES",
    "KV_WARMUP_WINDOW",
    "LAUNCHER_DEFAULT_KV_SPLITS",
    "LOGITS_PROCESSOR_MODULE",
    "MODEL_CONFIGS_MODULE",
    "MODEL_CONFIG_MODULE",
    "MODEL_REGISTRY_MODULE",
    "MODEL_UTILS_MODULE",
    "MOE_ACTIVATION_MODULE",
    "PLATFORMS_MODULE",
    "PLATFORM_INTERFACE_MODULE",
    "PLATFORM_UTILS_MODULE",
    "REJECTION_MODULE",
    "SAMPLER_MODULE",
    "SAMPLING_METADATA_MODULE",
    "SPEC_METADATA_MODULE",
    "SPEC_UTILS_MODULE",
    "STAGE2_MODULE",
    "STORE_MODULE",
    "TOPK_TOPP_MODULE",
    "TOPK_TOPP_TRITON_MODULE",
    "TQ_CONFIG_MODULE",
    "TQ_DTYPE_PREFIX",
    "TRITON_EXPERTS_MODULE",
    "UBATCH_VIEWS_V1",
    "V2_INPUT_BATCH_MODULE",
    "V2_LOGPROB_MODULE",
    "WARMUP_MODULE",
    "WORKER_MODULE",
    "WORKER_UTILS_MODULE",
    "WORKSPACE_MODULE",
]

DECODE_MODULE = "vllm.v1.attention.ops.triton_turboquant_decode"
STAGE2_MODULE = "vllm.v1.attention.ops.triton_decode_attention"
STORE_MODULE = "vllm.v1.attention.ops.triton_turboquant_store"
BACKEND_MODULE = "vllm.v1.attention.backends.turboquant_attn"
WARMUP_MODULE = "vllm.model_executor.warmup.kernel_warmup"
JIT_WARMUP_MODULE = "vllm.model_executor.warmup.jit_warmup"  # 0.27+: JitWarmupRegistry
KV_WARMUP_WINDOW = "_outside_kv_cache_transient_window"  # 0.34+, in WARMUP_MODULE
WORKER_MODULE = "vllm.v1.worker.gpu_worker"
ELASTIC_MODULE = "vllm.distributed.elastic_ep.elastic_execute"
WORKSPACE_MODULE = "vllm.v1.worker.workspace"
ATTENTION_MODULE = "vllm.v1.attention.backend"
# vLLM's own kernels around TurboQuant's (engine_warmup), same modules in all releases but
# the V1 runner's (block_table, sample.*, spec_decode.*: 0.20-0.33).
BLOCK_TABLE_MODULE = "vllm.v1.worker.block_table"
WORKER_UTILS_MODULE = "vllm.v1.worker.utils"
"""Defines ``select_common_block_size``, the attention kernel's block for a KV manager block."""
SPEC_METADATA_MODULE = "vllm.v1.spec_decode.metadata"
SAMPLING_METADATA_MODULE = "vllm.v1.sample.metadata"
LOGITS_PROCESSOR_MODULE = "vllm.v1.sample.logits_processor"
V2_LOGPROB_MODULE = "vllm.v1.worker.gpu.sample.logprob"
TOPK_TOPP_MODULE = "vllm.v1.sample.ops.topk_topp_sampler"
TOPK_TOPP_TRITON_MODULE = "vllm.v1.sample.ops.topk_topp_triton"  # 0.26+
SAMPLER_MODULE = "vllm.v1.sample.sampler"
REJECTION_MODULE = "vllm.v1.sample.rejection_sampler"
FLASH_ATTN_MODULE = "vllm.v1.attention.backends.flash_attn"
FUSED_MOE_MODULE = "vllm.model_executor.layers.fused_moe.fused_moe"
FUSED_MOE_CONFIG_MODULE = "vllm.model_executor.layers.fused_moe.config"
MOE_ACTIVATION_MODULE = "vllm.model_executor.layers.fused_moe.activation"
TRITON_EXPERTS_MODULE = "vllm.model_executor.layers.fused_moe.experts.triton_moe"
CUSTOM_OPS_MODULE = "vllm._custom_ops"
PLATFORMS_MODULE = "vllm.platforms"
PLATFORM_INTERFACE_MODULE = "vllm.platforms.interface"
"""``Platform``, whose ``_align_hybrid_block_size`` sizes a hybrid model's attention block
to its Mamba state (0.21-0.33)."""
PLATFORM_UTILS_MODULE = "vllm.utils.platform_utils"  # 0.26+

# Modules whose global ``kernel_warmup`` vLLM calls: the defining module, the
# worker, which binds the name at import (all releases), and elastic EP, which does
# too and passes ``process_local_only=True`` (0.27+). Absent modules are skipped.
CALL_SITE_MODULES = (WARMUP_MODULE, WORKER_MODULE, ELASTIC_MODULE)

# The module that defines each Triton kernel we warm (identical in all releases).
KERNEL_MODULES: dict[str, str] = {
    "_tq_decode_stage1": DECODE_MODULE,
    "_tq_full_dequant_kv": DECODE_MODULE,
    "_fwd_kernel_stage2": STAGE2_MODULE,
    "_tq_fused_store_mse": STORE_MODULE,
    "_tq_fused_store_fp8": STORE_MODULE,
}

# `_CONTINUATION_DECODE_THRESHOLD` in the backend, 128 in all releases: continuation
# chunks up to this many tokens reuse the decode kernels, longer ones dequantize.
CONTINUATION_DECODE_THRESHOLD = 128
# The decode launcher as the backend module names it: its prefill loop serves a short
# continuation (all rows of one request) with one call of it (0.21-0.34, the AoS store).
DECODE_LAUNCHER = "triton_turboquant_decode_attention"
# The launcher default for `max_num_kv_splits`; the continuation fast path never
# passes its own value, so it always runs with this many splits (all releases).
LAUNCHER_DEFAULT_KV_SPLITS = 32


BACKEND_CLASS = "TurboQuantAttentionBackend"
"""The backend class in ``BACKEND_MODULE`` (all releases)."""
IMPL_CLASS = "TurboQuantAttentionImpl"
"""The attention impl class in ``BACKEND_MODULE`` (all releases)."""
BUILDER_CLASS = "TurboQuantMetadataBuilder"
"""The metadata builder class in ``BACKEND_MODULE`` (all releases)."""

CHUNKED_LOCAL_MODULE = "vllm.model_executor.layers.attention.chunked_local_attention"
"""Defines ``ChunkedLocalAttention`` in all releases."""
CHUNKED_LOCAL_CLASS = "ChunkedLocalAttention"
MODEL_UTILS_MODULE = "vllm.model_executor.models.utils"
"""Defines ``extract_layer_index`` in all releases."""

SPEC_UTILS_MODULE = "vllm.v1.spec_decode.utils"
"""Defines ``extend_all_queries_by_N`` and the EAGLE helper kernels (0.20-0.33; 0.34
removed the module with the V1 runner)."""
EXTEND_QUERIES_FUNCTION = "extend_all_queries_by_N"
DRAFT_PREFILL_MODULES = (
    "vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator",
    "vllm.v1.worker.gpu.spec_decode.draft_model.speculator",
)
"""The V2 draft_model speculator's module, which defines ``prepare_prefill_inputs`` (0.32-0.34:
``standalone_ar``; 0.31: ``draft_model``; 0.30's V2 runner has no draft_model speculator)."""
DRAFT_PREFILL_LAUNCHER = "prepare_prefill_inputs"
V2_INPUT_BATCH_MODULE = "vllm.v1.worker.gpu.input_batch"
"""Defines the V2 runner's ``InputBuffers`` (read in 0.31-0.34)."""
DRAFT_CALL_SITE_MODULES = ("vllm.v1.spec_decode.llm_base_proposer",)
"""Modules that import ``extend_all_queries_by_N`` by name (0.20-0.33: only this one)."""

# The attention metadata tensors a V1 microbatch gets as views (``compat.ubatch_sliced``).
UBATCH_VIEWS_V1 = ("block_table", "seq_lens", "slot_mapping")

MODEL_CONFIG_MODULE = "vllm.config"
MODEL_CONFIGS_MODULE = "vllm.model_executor.models.config"
"""The models' ``VerifyAndUpdateConfig`` classes: ``HybridAttentionMambaModelConfig`` sets a
hybrid's ``mamba_cache_mode`` from prefix caching (0.22-0.33)."""
TQ_CONFIG_MODULE = "vllm.model_executor.layers.quantization.turboquant.config"
TQ_DTYPE_PREFIX = "turboquant_"
"""What every TurboQuant ``kv_cache_dtype`` starts with (all releases); vLLM selects
TurboQuant's backend, and adds its boundary layers to the skip list, on that prefix."""
MODEL_REGISTRY_MODULE = "vllm.model_executor.models.registry"
"""Defines ``ModelRegistry`` in all releases."""
