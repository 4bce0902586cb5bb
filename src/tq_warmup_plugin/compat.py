"""Every difference between vLLM releases 0.20-0.33 that the plugin depends on.

Each branch names the releases it covers. The version gates are pure; the
accessors at the bottom take live vLLM objects and are the only place that
knows where a release keeps them. Source: the released wheels of 0.20.0-0.33.0,
read file by file; the ``real_vllm`` contract tests pin each difference down
against the real code of the releases CI installs.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import re
import types
from collections.abc import Iterator
from typing import Any, NamedTuple

__all__ = [
    "AMD_BACKEND_MODULE",
    "ATTENTION_MODULE",
    "BACKEND_MODULE",
    "BUILDER_CLASS",
    "CALL_SITE_MODULES",
    "CONTINUATION_DECODE_THRESHOLD",
    "DECODE_MODULE",
    "ELASTIC_MODULE",
    "FLASH_ATTN_MODULE",
    "KERNEL_MODULES",
    "LAUNCHER_DEFAULT_KV_SPLITS",
    "MODEL_CONFIG_MODULE",
    "NEWEST",
    "OLDEST",
    "POINTER_RANGE_MAX",
    "RAY_EXTRA_PREFIXES_VAR",
    "RAY_EXTRA_VARS_VAR",
    "STAGE2_MODULE",
    "STORE_MODULE",
    "TQ_CONFIG_MODULE",
    "TQ_DTYPE_PREFIX",
    "UBATCH_VIEWS_V1",
    "WARMUP_MODULE",
    "WORKER_MODULE",
    "WORKSPACE_MODULE",
    "Features",
    "ModelShape",
    "UnsupportedModel",
    "UnsupportedRelease",
    "Version",
    "block_table",
    "block_table_width",
    "boundary_layers",
    "effective_block_size",
    "fa2_stand_in",
    "features",
    "flash_attn_available",
    "flash_attn_paged",
    "flash_attn_paged_decode",
    "flash_attn_varlen",
    "flydsl_layer",
    "fp8_e4b15",
    "heads_per_rank",
    "installed_vllm_version",
    "kernel_function",
    "kv_view",
    "kv_view_strides",
    "local_attention_chunk",
    "metadata_builder",
    "model_scale",
    "model_shape",
    "parse_version",
    "plain_fa2_heads",
    "pointer_in_range",
    "preallocate_prefill_buffers",
    "prefix_reused",
    "release_features",
    "rewarm_cause",
    "same_release",
    "single_token_decode_support",
    "spec_decode_problem",
    "spec_decode_threshold",
    "speculative_decoding",
    "speculative_setup",
    "storage_bytes",
    "support_problem",
    "triton_pointer_ranges",
    "turboquant_impl_class",
    "ubatch_sliced",
    "ubatching",
    "with_csv_items",
    "worker_uses_v2",
    "workspace_buffer_sizes",
    "workspace_manager",
    "workspace_slot",
    "workspace_slot_bytes",
    "workspace_slots",
]

Version = tuple[int, int]

OLDEST: Version = (0, 20)
NEWEST: Version = (0, 33)

# Every vLLM module the plugin imports or patches, by name (0.20-0.33). The accessors
# import them with ``importlib.import_module(NAME)``, never ``from vllm... import``:
# each path is then written once, here, the same string the import hook (``install``)
# waits for and the tests stub in ``sys.modules`` (``import_module`` returns a stubbed
# module without importing its parents). A static import would check nothing more:
# vLLM is untyped for the plugin's mypy run (``vllm.*`` is ignored in pyproject).
DECODE_MODULE = "vllm.v1.attention.ops.triton_turboquant_decode"
STAGE2_MODULE = "vllm.v1.attention.ops.triton_decode_attention"
STORE_MODULE = "vllm.v1.attention.ops.triton_turboquant_store"
BACKEND_MODULE = "vllm.v1.attention.backends.turboquant_attn"
WARMUP_MODULE = "vllm.model_executor.warmup.kernel_warmup"
WORKER_MODULE = "vllm.v1.worker.gpu_worker"
ELASTIC_MODULE = "vllm.distributed.elastic_ep.elastic_execute"
WORKSPACE_MODULE = "vllm.v1.worker.workspace"
ATTENTION_MODULE = "vllm.v1.attention.backend"
FLASH_ATTN_MODULE = "vllm.v1.attention.backends.flash_attn"

# Modules whose global ``kernel_warmup`` vLLM calls: the defining module, the
# worker, which binds the name at import (0.20-0.33), and elastic EP, which does
# too and passes ``process_local_only=True`` (0.27+). Absent modules are skipped.
CALL_SITE_MODULES = (WARMUP_MODULE, WORKER_MODULE, ELASTIC_MODULE)

# The module that defines each Triton kernel we warm (identical in 0.20-0.33).
KERNEL_MODULES: dict[str, str] = {
    "_tq_decode_stage1": DECODE_MODULE,
    "_tq_full_dequant_kv": DECODE_MODULE,
    "_fwd_kernel_stage2": STAGE2_MODULE,
    "_tq_fused_store_mse": STORE_MODULE,
    "_tq_fused_store_fp8": STORE_MODULE,
}

# `_CONTINUATION_DECODE_THRESHOLD` in the backend, 128 in 0.20-0.33: continuation
# chunks up to this many tokens reuse the decode kernels, longer ones dequantize.
CONTINUATION_DECODE_THRESHOLD = 128
# The launcher default for `max_num_kv_splits`; the continuation fast path never
# passes its own value, so it always runs with this many splits (0.20-0.33).
LAUNCHER_DEFAULT_KV_SPLITS = 32


def parse_version(text: str | None) -> Version | None:
    """``"0.26.0"``, ``"0.26.1rc1.dev3+g12ab"`` -> ``(0, 26)``; anything else -> None."""
    match = re.match(r"^\s*(\d+)\.(\d+)", text or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


class UnsupportedRelease(ValueError):
    """The installed (or named) vLLM release is not one the plugin knows; the message
    is the one-line reason."""


def support_problem(version: Version | None) -> str | None:
    """None when the release is supported, else a one-line reason."""
    if version is None:
        return "cannot determine the installed vLLM version"
    if not OLDEST <= version <= NEWEST:
        lo, hi = (".".join(map(str, v)) for v in (OLDEST, NEWEST))
        return f"vLLM {version[0]}.{version[1]} is outside the supported releases {lo}-{hi}"
    return None


class Features(NamedTuple):
    """What a release does, as far as TurboQuant warmup is concerned."""

    version: Version
    kv_view_transposed: bool
    """0.26+: ``forward()`` hands the kernels ``kv_cache.transpose(1, 2)``."""
    kv_head_major: bool
    """0.26-0.28: the cache is physically (blocks, heads, tokens, slot)."""
    stage2_output_fp16: bool
    """0.21+: stage 2 has ``OUTPUT_FP16`` and writes the query dtype; 0.20 writes fp32."""
    continuation_seq_lens_sliced: bool
    """0.21+: the continuation fast path slices a cached arange, so its ``seq_lens``
    pointer is 16-byte aligned for some chunks and not for others; 0.20 allocates."""
    uses_workspace: bool
    """0.21+: decode and long continuation take scratch from the WorkspaceManager."""
    unrotate_fp16: bool
    """0.21+: a long continuation un-rotates MSE keys with an fp16 GEMM
    (``layer._tq_Pi_half``); 0.20 does it in fp32."""
    spec_graphs_unsafe: bool
    """0.20-0.33: ``TurboQuantMetadataBuilder`` reports ``UNIFORM_BATCH`` while verify
    batches are not decodes (``supports_spec_as_decode=False``), so under speculative
    decoding vLLM captures FULL graphs of 1+k-token verify batches. Capture runs
    ``_prefill_attention``'s per-request loop on dummy metadata (``seq_len == q_len``)
    and bakes in "attention over the new tokens only": 0.21-0.33 replay it with the
    cached context ignored (upstream #40831, #52475, #53180), 0.20 calls ``.tolist()``
    on GPU tensors during capture and fails at startup (#40807). The fixes (#43747,
    #53406) are unmerged in every release up to 0.33."""
    spec_verify_batched: bool
    """0.21-0.33: verify batches can be served as decode rows inside FULL graphs
    (``guards/batched_verify.py``); 0.20 keeps decode scratch on the layer."""
    v1_tq_cache_dtype_lost: bool
    """0.25-0.26: ``TQFullAttentionSpec`` is built without ``kv_quant_mode``
    (``attention.py`` 0.25:672-679, 0.26:677-684), so the V1 runner passes
    ``cache_dtype_str="auto"`` to TurboQuant's ``get_kv_cache_shape``
    (``gpu_model_runner.py`` 0.25:7192-7208, 0.26:7349-7365), which raises "Unknown
    TurboQuant cache dtype: 'auto'" (upstream #50709). 0.20-0.24 pass the cache
    config's dtype; 0.27.1+ have ``KVQuantMode.TURBOQUANT``; V2 special-cases it."""
    prefill_buffers_cached: bool
    """0.21+: ``_prefill_attention`` caches ``_cu_2`` and ``_arange_cache`` on the impl
    the first time it runs (``_continuation_prefill`` ``_cu_2_q``/``_cu_2_k``), growing
    the arange when a longer sequence comes; 0.20 allocates them on every call."""
    draft_cpu_seq_lens_stale: bool
    """0.21-0.33: TurboQuant's prefill loop takes each request's length from
    ``seq_lens_cpu_upper_bound`` (``turboquant_attn.py`` 0.22:238, 0.33:297; 0.20 reads
    the GPU ``seq_lens``, :571), and ``extend_all_queries_by_N``, which lengthens every
    query of a V1 draft pass by N (draft_model: N=1, ``llm_base_proposer.py`` 0.22:98-101,
    823), raises the GPU ``seq_lens`` but not that bound nor ``_seq_lens_cpu``
    (``spec_decode/utils.py`` 0.22:293-303, 0.33:413-423): a fresh prompt gets
    ``cached_len = -1``, a crash over 128 tokens ("expanded size ... (0)"). draft_model
    runs on V1 up to 0.30 (V2 refuses it, ``config/vllm.py`` 0.23:2011, 0.30:2844), on
    request (``VLLM_USE_V2_MODEL_RUNNER=0``) in 0.31-0.33; async by default from 0.28, where
    the bound's prefill rows are still exact (``backend.py`` 0.22:405-409): all need it."""
    v2_ubatches: bool
    """0.30+: the V2 runner splits batches into microbatches itself
    (``v1/worker/gpu/ubatch_utils.py``) and copies each one's ``seq_lens`` into a buffer
    of its own (``_slice_seq_lens``, 0.30:229, 0.33:235). 0.20-0.29 list dual-batch
    overlap as unsupported by V2 (``config/vllm.py`` 0.20:1803, 0.25:2096, 0.29:2591),
    so it runs on V1."""
    rocm_flydsl: bool
    """0.28+: on ROCm gfx950 with FlyDSL importable, ``TurboQuantAttentionImpl`` sets
    ``_soa_store = _use_flydsl = is_flydsl_available()`` (``turboquant_attn.py``
    0.28:398-399, 0.29-0.33:369-370) and then stores, decodes and dequantizes with the
    SoA Triton and FlyDSL kernels (0.33: ``_store_kv`` :686, continuation :839,
    ``_continuation_prefill`` :952, ``_decode_attention`` :1129; 0.28: :715, :868, :981,
    :1158), never the ones warmed here. 0.20-0.27 have no such path."""
    local_boundary_tq_backend: bool
    """0.20-0.33: ``ChunkedLocalAttention`` picks its backend from the cache config's
    dtype (``chunked_local_attention.py`` 0.20-0.26:102, 0.27.1-0.33:101) before
    ``Attention.__init__`` gives a layer in ``kv_cache_dtype_skip_layers`` the dtype
    ``"auto"`` (``attention.py`` 0.22:264, 0.26:312, 0.33:312): a TurboQuant boundary
    layer that is chunked local (Llama 4's layer 0) gets TurboQuant's impl with
    ``"auto"``, which raises "Unknown TurboQuant cache dtype: 'auto'" at startup."""
    local_tq_spec_plain: bool
    """0.20-0.27: a TurboQuant layer's KV-cache spec is ``TQFullAttentionSpec``
    (``attention.py`` 0.26:677, 0.27.1:677) but a chunked local TurboQuant layer's is
    ``ChunkedLocalAttentionSpec`` of uint8 at the full head size
    (``chunked_local_attention.py`` 0.20-0.26:122, 0.27.1:121): 32768 bytes a page
    beside 17152 at 128x8 heads, so a Llama 4 fails in KV-cache grouping ("page size is
    not divisible by the maximum page size", H200, 0.26.0). 0.28+ give both the same
    spec with ``kv_quant_mode``."""
    local_prefill_real_lens: bool
    """0.21-0.29: on a chunked local attention layer (Llama 4) TurboQuant's prefill loop
    takes each *virtual* request's length from ``seq_lens_cpu_upper_bound``
    (``turboquant_attn.py`` 0.22:238, 0.29:297), which
    ``make_local_attention_virtual_batches`` copies from the real batch
    (``v1/attention/backends/utils.py`` 0.22:387, 0.29:615): every virtual row can
    reach the continuation kernels, and one past the real batch raises IndexError
    (upstream bug). 0.30+ pass the virtual lengths (``seq_lens_cpu_upper_bound=
    seq_lens_cpu``, 0.30:627, 0.33:683); 0.20 reads the virtual GPU ``seq_lens`` (:571):
    only a request's first virtual row continues a cached prefix."""


def features(version: Version) -> Features:
    """The feature set of a supported release."""
    return Features(
        version=version,
        kv_view_transposed=version >= (0, 26),
        kv_head_major=(0, 26) <= version <= (0, 28),
        stage2_output_fp16=version >= (0, 21),
        continuation_seq_lens_sliced=version >= (0, 21),
        uses_workspace=version >= (0, 21),
        unrotate_fp16=version >= (0, 21),
        spec_graphs_unsafe=OLDEST <= version <= (0, 33),
        spec_verify_batched=(0, 21) <= version <= (0, 33),
        v1_tq_cache_dtype_lost=(0, 25) <= version <= (0, 26),
        prefill_buffers_cached=version >= (0, 21),
        draft_cpu_seq_lens_stale=(0, 21) <= version <= (0, 33),
        v2_ubatches=version >= (0, 30),
        rocm_flydsl=version >= (0, 28),
        local_boundary_tq_backend=OLDEST <= version <= (0, 33),
        local_tq_spec_plain=OLDEST <= version <= (0, 27),
        local_prefill_real_lens=(0, 21) <= version <= (0, 29),
    )


def release_features(version_text: str | None) -> Features:
    """Features of the release named by a version string; raises UnsupportedRelease."""
    version = parse_version(version_text)
    problem = support_problem(version)
    if problem is not None or version is None:
        raise UnsupportedRelease(problem)
    return features(version)


def same_release(wanted: str, installed: str | None) -> bool:
    """Whether ``wanted`` (``"0.26.0"``, ``"v0.26.0"``, or ``"0.26"`` for any 0.26.x)
    names the ``installed`` version: the Triton cache is only valid for the kernel
    sources it was built from."""
    wanted = wanted.strip().removeprefix("v")
    return installed is not None and (installed == wanted or installed.startswith(wanted + "."))


class UnsupportedModel(ValueError):
    """vLLM would not run TurboQuant on this model (or cannot read it); the message is
    the one-line reason."""


def heads_per_rank(heads: int, kv_heads: int, tp: int) -> tuple[int, int]:
    """Query and KV heads on one tensor-parallel rank, as vLLM splits them (0.20-0.33):
    ``ModelConfig.get_num_attention_heads`` is ``heads // tp`` after
    ``verify_with_parallel_config`` refused ``heads % tp``; ``get_num_kv_heads`` is
    ``max(1, kv_heads // tp)``, KV heads replicated when tp > kv_heads, which
    ``QKVParallelLinear`` only allows when tp is a multiple of them (``divide``)."""
    if tp < 1:
        raise UnsupportedModel(f"tensor parallel size {tp} is not a positive number")
    if heads < 1 or kv_heads < 1:
        raise UnsupportedModel(f"{heads} query heads and {kv_heads} KV heads: both must be >= 1")
    if heads % kv_heads:
        raise UnsupportedModel(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    if heads % tp:
        raise UnsupportedModel(f"{heads} query heads do not divide over tensor parallel size {tp}")
    if kv_heads % tp and tp % kv_heads:
        raise UnsupportedModel(
            f"{kv_heads} KV heads neither divide over nor replicate evenly to "
            f"tensor parallel size {tp}"
        )
    return heads // tp, max(1, kv_heads // tp)


def boundary_layers(feats: Features, num_layers: int, hybrid: bool) -> tuple[int, ...]:
    """Layers TurboQuant leaves in the model dtype (``kv_cache_dtype_skip_layers``, set by
    ``EngineArgs.create_engine_config`` from ``TurboQuantConfig.get_boundary_skip_layers``).

    Dense models: the first and last 2 layers, at most half of them (0.20-0.33).
    Hybrid models: none in 0.21-0.33 (every full-attention layer is TurboQuant); 0.20
    refuses TurboQuant for them (``NotImplementedError`` in ``arg_utils.py``).
    """
    if hybrid:
        if feats.version < (0, 21):
            raise UnsupportedModel(
                "vLLM 0.20 refuses TurboQuant for hybrid (attention + Mamba) models"
            )
        return ()
    n = min(2, num_layers // 2)
    return tuple(sorted(set(range(n)) | set(range(num_layers - n, num_layers))))


def kv_view_strides(
    feats: Features, block_size: int, num_kv_heads: int, slot_size: int
) -> tuple[int, int, int]:
    """Block, position and head strides of the KV view the kernels get, for an
    unpadded cache (hybrid models may pad pages: discovery reads the real tensor).

    0.20-0.25 and 0.29-0.33 (LBNHC) are token-major: (blocks, tokens, heads, slot).
    0.26-0.28 allocate (blocks, heads, tokens, slot) and transpose it for the kernels.
    """
    page = block_size * num_kv_heads * slot_size
    if feats.kv_head_major:
        return (page, slot_size, block_size * slot_size)
    return (page, num_kv_heads * slot_size, slot_size)


def effective_block_size(feats: Features, requested: int, model_dtype_bytes: int) -> int:
    """The block size vLLM settles on for TurboQuant layers, for planning without a
    worker (a worker's real KV tensor says it directly).

    0.25-0.33: TurboQuant leaves boundary layers in the model dtype, and
    ``Platform._align_heterogeneous_kv_block_size`` grows the block until a
    TurboQuant page, sized there as uint8 K+V per token, covers a 16-token page of
    those layers: ``align * ceil(16 * dtype_bytes / align)`` with
    ``align = max(16, requested)`` (32 for a bf16 model at the default 16; seen on
    the H200 with 0.26.0). 0.20-0.24 keep the requested size.
    """
    if feats.version < (0, 25):
        return requested
    align = max(16, requested)
    return align * -(-16 * model_dtype_bytes // align)


def block_table_width(feats: Features, max_model_len: int, block_size: int, v2: bool) -> int:
    """Row stride of the runner's block table, for planning without a worker.

    V2 runner (read in 0.26 and 0.33): ``cdiv(max_model_len, bs)`` rounded up to a
    multiple of ``128 // bs`` when bs <= 128. V1: 0.27+ round up to a multiple of
    ``128 / gcd(128, bs)``; 0.20-0.26 do not round.
    """
    blocks = -(-max_model_len // block_size)
    if v2 and block_size <= 128:
        align = 128 // block_size
    elif not v2 and feats.version >= (0, 27):
        align = 128 // math.gcd(128, block_size)
    else:
        align = 1
    return -(-blocks // align) * align


# Triton 3.6.0, 3.7.1 and 3.8.0 (the releases of vLLM 0.20-0.33): the HIP backend's
# ``get_tensor_specialization`` (``triton/backends/amd/compiler.py`` 3.6.0:182-186,
# 3.7.1:187-191, 3.8.0:236-240) adds "S" to a pointer's key when ``knobs.amd.use_buffer_ops``
# (``AMDGCN_USE_BUFFER_OPS``, default on: ``knobs.py`` 3.6.0/3.7.1:505, 3.8.0:517) and
# ``is_within_2gb(arg)``: ``arg.untyped_storage().size() <= 2**31 - 1``, the tensor's whole
# storage in bytes, not its view (3.6.0:164-171, 3.7.1:169-176, 3.8.0:211-225). The
# compiler then assumes 32-bit offsets (``tt.pointer_range``). CUDA has no such flag.
POINTER_RANGE_MAX = 2**31 - 1
AMD_BACKEND_MODULE = "triton.backends.amd.compiler"


def pointer_in_range(storage_bytes: int) -> bool:
    """Triton's HIP "S" answer for a tensor whose storage holds this many bytes."""
    return storage_bytes <= POINTER_RANGE_MAX


def triton_pointer_ranges() -> bool:
    """Whether the active Triton target keys pointers on their storage size: a HIP
    target, buffer ops on, and a HIP backend that has ``is_within_2gb`` (3.6-3.8)."""
    try:
        from triton import knobs
        from triton.runtime import driver

        target = driver.active.get_current_target()
        backend = importlib.import_module(AMD_BACKEND_MODULE).HIPBackend
    except (ImportError, RuntimeError, AttributeError):  # no Triton, no driver, no AMD
        return False
    return (
        getattr(target, "backend", None) == "hip"
        and hasattr(backend, "is_within_2gb")
        and bool(getattr(getattr(knobs, "amd", None), "use_buffer_ops", False))
    )


def storage_bytes(tensor: Any) -> int:
    """Bytes of a tensor's whole storage, what ``is_within_2gb`` measures (Triton
    3.6-3.8): a layer's KV view of a larger cache allocation counts it all."""
    return int(tensor.untyped_storage().size())


def fp8_e4b15(capability: tuple[int, int] | None) -> int:
    """``FP8_E4B15`` constexpr: 1 on CUDA devices below SM 8.9, else 0 (0.20-0.33)."""
    return 1 if capability is not None and capability < (8, 9) else 0


def spec_decode_problem(
    feats: Features,
    method: str | None,
    async_scheduling: bool,
    runner_v2: bool,
    draft_guarded: bool = True,
) -> str | None:
    """The one-line warning for a speculative-decoding setup whose TurboQuant sequence
    lengths the plugin does not fix, else None. ``method`` is
    ``speculative_config.method`` (None without speculative decoding).

    All causes need ``draft_cpu_seq_lens_stale`` (TurboQuant reading the CPU bound):
    * async scheduling: the bound "assumes every draft was accepted" (``backend.py``
      0.22:405-409; V1 ``gpu_model_runner.py`` 0.22:1985-1993, V2 takes the scheduler's
      optimistic ``num_computed_tokens``, ``model_runner.py`` 0.33:1534-1542), so after
      a rejected draft a verify batch's ``cached_len`` is too large;
    * draft_model on V2 (0.31+): the first draft pass gets the target's bound
      (``step=0``, ``standalone_ar/speculator.py`` 0.33:230, ``speculator.py``
      0.33:362-368) for queries one token longer, the same -1 as on V1;
    * draft_model on V1 without the guard (``TQ_WARMUP_SPEC_GUARD=0``).
    """
    if method is None or not feats.draft_cpu_seq_lens_stale:
        return None
    causes = []
    if method == "draft_model" and runner_v2:
        causes.append(
            "the V2 runner's first draft pass reads a CPU sequence length one short of "
            "its query (step=0), so a fresh prompt over 128 tokens crashes "
            '("expanded size ... (0)") and shorter ones attend wrong lengths'
        )
    elif method == "draft_model" and not draft_guarded:
        causes.append(
            "extend_all_queries_by_N leaves the CPU sequence lengths one short, so a fresh "
            'prompt over 128 tokens crashes ("expanded size ... (0)"); '
            "TQ_WARMUP_SPEC_GUARD=0 turned the plugin's fix off"
        )
    if async_scheduling:
        causes.append(
            "TurboQuant reads seq_lens_cpu_upper_bound, which assumes every draft was "
            "accepted, as the exact length: after a rejected draft it attends past the "
            "context (--no-async-scheduling avoids it)"
        )
    if not causes:
        return None
    setup = " with async scheduling" if async_scheduling else ""
    runner = "V2" if runner_v2 else "V1"
    return (
        f"tq-warmup: speculative decoding {method!r}{setup} on the {runner} runner with "
        f"TurboQuant on vLLM {feats.version[0]}.{feats.version[1]}: {'; '.join(causes)}; "
        "the plugin does not fix this"
    )


def installed_vllm_version() -> str | None:
    """The installed vLLM distribution's version, without importing vLLM."""
    from importlib import metadata  # not at module level: register() must stay cheap

    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


# --------------------------------------------------------------------------
# Accessors on live vLLM objects (the edge). Each names the releases it serves.
# --------------------------------------------------------------------------


def turboquant_impl_class() -> type:
    """``TurboQuantAttentionImpl``; same module and name in 0.20-0.33."""
    cls: type = importlib.import_module(BACKEND_MODULE).TurboQuantAttentionImpl
    return cls


BUILDER_CLASS = "TurboQuantMetadataBuilder"


def speculative_decoding(vllm_config: Any) -> bool:
    """``VllmConfig.speculative_config`` is set (ngram, EAGLE, MTP, draft model) in
    0.20-0.33; None without speculative decoding."""
    return getattr(vllm_config, "speculative_config", None) is not None


def speculative_setup(vllm_config: Any) -> tuple[str | None, bool]:
    """``(speculative_config.method or None, scheduler_config.async_scheduling)``; the
    same names in 0.20-0.33 (``async_scheduling`` is resolved to a bool by
    ``VllmConfig.__post_init__`` before the workers start)."""
    spec = getattr(vllm_config, "speculative_config", None)
    method = getattr(spec, "method", None) if spec is not None else None
    scheduler = getattr(vllm_config, "scheduler_config", None)
    return (
        None if method is None else str(method),
        bool(getattr(scheduler, "async_scheduling", False)),
    )


def spec_decode_threshold(vllm_config: Any) -> int:
    """The decode threshold of a builder that supports spec-as-decode
    (``AttentionMetadataBuilder._init_reorder_batch_threshold(1, True)``), 0 where it
    stays 1: no speculative decoding, or decode context parallelism, which forces 1
    (0.21-0.33). 0.33: vLLM's own ``max_decode_query_len`` (``backend.py:572``);
    0.21-0.32: ``1 + k``, doubled under ``parallel_drafting``."""
    spec = getattr(vllm_config, "speculative_config", None)
    k = getattr(spec, "num_speculative_tokens", None) if spec is not None else None
    parallel = getattr(vllm_config, "parallel_config", None)
    if not k or int(getattr(parallel, "decode_context_parallel_size", 1) or 1) > 1:
        return 0
    own = getattr(importlib.import_module(ATTENTION_MODULE), "max_decode_query_len", None)
    if own is not None:
        return int(own(vllm_config))
    return 1 + (2 if getattr(spec, "parallel_drafting", False) else 1) * int(k)


def single_token_decode_support() -> Any:
    """``AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE`` from
    ``vllm.v1.attention.backend`` (0.20-0.33)."""
    return importlib.import_module(ATTENTION_MODULE).AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE


def kernel_function(name: str) -> Any:
    """The ``JITFunction`` object of a TurboQuant kernel (``KERNEL_MODULES``, 0.20-0.33)."""
    return getattr(importlib.import_module(KERNEL_MODULES[name]), name)


def flash_attn_available() -> bool:
    """``_HAS_FLASH_ATTN`` of the backend module (0.20-0.33): without it, prefill and
    long continuations use SDPA and there are no FlashAttention kernels to load."""
    return bool(importlib.import_module(BACKEND_MODULE)._HAS_FLASH_ATTN)


def flash_attn_varlen(impl: Any) -> Any:
    """The impl's own FlashAttention call, ``_flash_attn_varlen(q, k, v, cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k)`` in 0.20-0.33: it adds the impl's
    ``fa_version``, scale and ``causal=True``, which select the kernel."""
    return impl._flash_attn_varlen


def _fa_call(module: str, scale: float, fa_version: int, **kwargs: Any) -> Any:
    """``module.flash_attn_varlen_func``, causal, looked up at call time (vLLM binds the
    name at import, and only on CUDA)."""
    varlen = importlib.import_module(module).flash_attn_varlen_func
    return varlen(softmax_scale=scale, causal=True, fa_version=fa_version, **kwargs)


def fa2_stand_in(scale: float) -> Any:
    """An impl that :func:`flash_attn_varlen` and :func:`flash_attn_paged` accept without
    an engine (``tq-warmup driver-cache``): TurboQuant's ``_flash_attn_varlen`` and the
    boundary layers' ``scale`` / ``vllm_flash_attn_version``, with FlashAttention 2 as
    TurboQuant forces it (0.20-0.33). The kernel a call loads depends on dtype, head
    size, causality and paging, not on the scale."""

    def flash_attn_varlen(
        q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, max_q: int, max_k: int
    ) -> Any:  # TurboQuantAttentionImpl._flash_attn_varlen's call, fa_version 2
        args = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": max_q}
        return _fa_call(BACKEND_MODULE, scale, 2, q=q, k=k, v=v, max_seqlen_k=max_k, **args)

    return types.SimpleNamespace(
        scale=scale, vllm_flash_attn_version=2, _flash_attn_varlen=flash_attn_varlen
    )


def plain_fa2_heads(impl: Any) -> tuple[int, int, int] | None:
    """``(query heads, KV heads, head size)`` of a boundary layer whose decode we can
    warm, else None.

    TurboQuant keeps its boundary layers in the model dtype on vLLM's
    ``FlashAttentionImpl`` and forces FlashAttention 2 for every layer (0.20-0.33:
    ``attention_config.flash_attn_version = 2`` in ``EngineArgs``). Only the plain
    kernel family is warmed: ALiBi, a sliding window, a softcap or sinks select other
    kernels. Attribute names are those of 0.20-0.33.
    """
    try:
        flash_attn = importlib.import_module(FLASH_ATTN_MODULE)
    except ImportError:  # a platform without vLLM's FlashAttention: no such layer exists
        return None
    if type(impl) is not flash_attn.FlashAttentionImpl or impl.vllm_flash_attn_version != 2:
        return None
    plain = (
        impl.alibi_slopes is None
        and tuple(impl.sliding_window) == (-1, -1)
        and not impl.logits_soft_cap
        and impl.sinks is None
    )
    return (int(impl.num_heads), int(impl.num_kv_heads), int(impl.head_size)) if plain else None


def flash_attn_paged_decode(impl: Any) -> Any:
    """A one-token decode over a paged cache, called as ``FlashAttentionImpl.forward``
    calls it (0.20-0.33): the backend module's ``flash_attn_varlen_func`` with the
    impl's scale and ``fa_version`` and ``num_splits`` left at 0, as outside CUDA graphs,
    so FlashAttention's own heuristic splits the keys the way a first long decode does.
    0.33 makes that call through ``_FA4_DENSE_ATTENTION_KERNEL``, which hands the same
    keywords to the same function."""
    return flash_attn_paged(impl, 1)


def flash_attn_paged(impl: Any, max_seqlen_q: int) -> Any:
    """:func:`flash_attn_paged_decode` for one request of ``max_seqlen_q`` query tokens:
    over 1 it is a boundary layer's prefill, which FA2 runs with its split-KV kernel
    too (a paged cache forces it) but causal, another module than the decode's (FA2
    treats a one-token causal query as non-causal)."""

    def decode(
        q: Any, cache: Any, cu_seqlens_q: Any, seqused_k: Any, block_table: Any, max_seqlen_k: int
    ) -> Any:
        args = {"cu_seqlens_q": cu_seqlens_q, "seqused_k": seqused_k, "block_table": block_table}
        version = impl.vllm_flash_attn_version
        return _fa_call(
            FLASH_ATTN_MODULE, impl.scale, version, q=q, k=cache, v=cache,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, **args,
        )  # fmt: skip

    return decode


def preallocate_prefill_buffers(impl: Any, device: Any, max_model_len: int) -> int:
    """Create, before any CUDA graph capture, the buffers ``_prefill_attention`` and
    ``_continuation_prefill`` would otherwise create on first use (0.21-0.33, same
    names and dtypes: int32 ``_cu_2``, ``_cu_2_q``, ``_cu_2_k`` of 2 and an int32
    ``_arange_cache`` of ``0..max_model_len + 1``, long enough that the loop never
    regrows it). Created lazily, the first one made inside a capture would live in
    the graph's private pool. Returns the bytes allocated; buffers that exist stay."""
    import torch

    made = 0
    for name in ("_cu_2", "_cu_2_q", "_cu_2_k"):
        if not hasattr(impl, name):
            setattr(impl, name, torch.zeros(2, device=device, dtype=torch.int32))
            made += 8
    arange = getattr(impl, "_arange_cache", None)
    if arange is None or arange.shape[0] < max_model_len + 2:
        impl._arange_cache = torch.arange(max_model_len + 2, device=device, dtype=torch.int32)
        made += 4 * (max_model_len + 2)
    return made


def kv_view(kv_cache: Any, feats: Features) -> Any:
    """The KV tensor exactly as the kernels receive it (strides and pointer): 0.26-0.33
    hand them ``kv_cache.transpose(1, 2)``, 0.20-0.25 the tensor as allocated."""
    return kv_cache.transpose(1, 2) if feats.kv_view_transposed else kv_cache


def block_table(runner: Any, group: Any, group_id: int, use_v2: bool) -> Any:
    """The block table tensor whose rows the attention kernels read.

    0.32-0.33 (V1): when the kernel block size differs from the manager's, rows come
    from the attention group's ``kernel_block_table`` ([ubatch, reqs, width]).
    V2 (0.20-0.33): ``runner.block_tables.input_block_tables[gid]``.
    V1 (0.20-0.33): ``runner.input_batch.block_table[gid].block_table.gpu``.
    """
    kernel_table = getattr(group, "kernel_block_table", None)  # only set in 0.32+
    if kernel_table is not None:
        return kernel_table[0]
    if use_v2:
        return runner.block_tables.input_block_tables[group_id]
    return runner.input_batch.block_table[group_id].block_table.gpu


def prefix_reused(vllm_config: Any) -> bool:
    """Whether a request's later forward passes can run over its own cached prefix:
    continuation chunks (short ones on the decode kernels, long ones dequantized),
    and one-token tails that TurboQuant runs as decodes.

    Generative models: always (decode). Pooling models finish after their prompt, so
    only through chunked prefill or a prefix-cache hit. 0.20-0.33 set both defaults in
    ``EngineArgs._set_default_chunked_prefill_and_prefix_caching_args`` from
    ``ModelConfig.is_chunked_prefill_supported`` / ``is_prefix_caching_supported``:
    off for encoder-only (bidirectional) models and for causal models with MEAN or
    CLS sequence pooling or STEP token pooling, on for the rest (LAST, ALL). The
    operator may override either (vLLM only warns), so the resolved
    ``scheduler_config.enable_chunked_prefill`` and ``cache_config.enable_prefix_caching``
    (plain bools in 0.20-0.33) decide; anything unreadable counts as reused.
    Encoder-only models have no TurboQuant layers at all: TurboQuant supports only
    ``AttentionType.DECODER`` (``supports_attn_type``, 0.20-0.33).
    """
    model = getattr(vllm_config, "model_config", None)
    if getattr(model, "runner_type", "generate") != "pooling":
        return True
    chunked = getattr(
        getattr(vllm_config, "scheduler_config", None), "enable_chunked_prefill", True
    )
    cached = getattr(getattr(vllm_config, "cache_config", None), "enable_prefix_caching", True)
    return chunked is not False or cached is not False


def worker_uses_v2(worker: Any) -> bool:
    """``Worker.use_v2_model_runner`` exists in 0.20-0.33."""
    return bool(worker.use_v2_model_runner)


def ubatching(vllm_config: Any) -> bool:
    """Whether the worker splits batches into microbatches: ``--enable-dbo`` (dual-batch
    overlap) or ``--ubatch-size`` over 1, resolved as ``parallel_config.use_ubatching``,
    a property of ``ParallelConfig`` in 0.20-0.33 (``config/parallel.py`` 0.20:492,
    0.26:535, 0.33:645). Anything unreadable counts as off."""
    parallel = getattr(vllm_config, "parallel_config", None)
    return getattr(parallel, "use_ubatching", False) is True


UBATCH_VIEWS_V1 = ("block_table", "seq_lens", "slot_mapping")


def ubatch_sliced(feats: Features, ubatching: bool, runner_v2: bool) -> tuple[str, ...]:
    """The attention metadata tensors a microbatch after the first gets as views at the
    offset where it starts, so their pointers can lose 16-byte alignment (request r of
    an int32 ``seq_lens`` starts at ``4 * r`` bytes, token t of the int64 slot mapping at
    ``8 * t``, block-table row r at ``4 * r * width``). Nothing without microbatching.

    V1 (0.20-0.33, ``_make_metadata_with_slice`` in ``v1/worker/ubatch_utils.py``):
    ``seq_lens[request_slice]`` (0.20-0.29:179, 0.30:282, 0.33:283; a clone only when
    the microbatch's last request continues in the next one), ``block_table_tensor
    [request_slice]`` and ``slot_mapping[token_slice]`` (0.20:230-231, 0.21-0.29:232-233,
    0.30:320-321, 0.33:321-322); the store's slot mapping comes from the forward context,
    sliced by ``token_slice`` too (``gpu_model_runner.py`` 0.22:3939, 0.33:3890). 0.32+
    copy a block table whose kernel block size differs into ``kernel_block_table
    [ubatch]`` (``v1/worker/utils.py`` 0.33:380-392), whose base is also at an offset.
    V2 (``v2_ubatches``, 0.30-0.33, ``v1/worker/gpu/ubatch_utils.py``): ``seq_lens``
    copied into a per-microbatch buffer, ``block_table[request_slice]`` and
    ``slot_mappings[:, token_slice]`` (0.30:361-363, 0.33:367-369).
    """
    if not ubatching:
        return ()
    if runner_v2:
        return ("block_table", "slot_mapping") if feats.v2_ubatches else ()
    return UBATCH_VIEWS_V1


def workspace_manager(feats: Features, locked_too: bool = False) -> Any | None:
    """The current WorkspaceManager while it can still grow (or, ``locked_too``, also
    after the lock), else None.

    0.20 TurboQuant does not use the workspace. 0.21-0.33: the module functions
    ``is_workspace_manager_initialized`` / ``current_workspace_manager`` exist.
    """
    if not feats.uses_workspace:
        return None
    workspace = importlib.import_module(WORKSPACE_MODULE)
    if not workspace.is_workspace_manager_initialized():
        return None
    manager = workspace.current_workspace_manager()
    return None if manager.is_locked() and not locked_too else manager


def workspace_slots(manager: Any) -> list[tuple[int, int]]:
    """Every ``(ubatch, lane)`` slot the manager keeps a separate buffer for.

    0.21-0.33: one buffer per ubatch, ``num_ubatches = 2`` with dual-batch overlap
    (``--enable-dbo``, ``gpu_worker.py``), kept as ``_num_ubatches``. 0.28+: times
    ``_num_lanes`` lanes (``_num_workspace_lanes``: 2 for the V2 runner with DSpark
    speculative decoding, whose drafter runs in lane 1). Read from the manager
    itself, so what is reserved is what that worker configured.
    """
    ubatches = int(getattr(manager, "_num_ubatches", 1) or 1)
    lanes = int(getattr(manager, "_num_lanes", 1) or 1)
    return [(u, lane) for u in range(ubatches) for lane in range(lanes)]


@contextlib.contextmanager
def workspace_slot(ubatch: int, lane: int) -> Iterator[None]:
    """Make the workspace manager serve ``(ubatch, lane)`` to this thread.

    The manager reads the ubatch from ``dbo_current_ubatch_id``, bound by name in
    ``vllm.v1.worker.workspace`` (0.21-0.33), which DBO answers per thread from its
    running ubatch contexts; outside them it is 0, so the name is rebound for the
    duration. Lanes: the public ``use_workspace_lane`` context (0.28+). Slot (0, 0)
    is what every caller gets already: nothing changes.
    """
    if not ubatch and not lane:
        yield
        return
    workspace: Any = importlib.import_module(WORKSPACE_MODULE)

    with contextlib.ExitStack() as stack:
        if ubatch:
            original = workspace.dbo_current_ubatch_id
            workspace.dbo_current_ubatch_id = lambda: ubatch
            stack.callback(setattr, workspace, "dbo_current_ubatch_id", original)
        if lane:
            stack.enter_context(workspace.use_workspace_lane(lane))
        yield


def workspace_buffer_sizes(feats: Features) -> tuple[int, ...]:
    """Distinct byte sizes of the workspace buffers every ``(ubatch, lane)`` slot holds
    now (0.21-0.33), the storages decode and dequantization views come from (locked
    ones too: elastic EP warms again after the lock); empty where there are none."""
    manager = workspace_manager(feats, locked_too=True)
    if manager is None:
        return ()
    slots = workspace_slots(manager)
    return tuple(sorted({workspace_slot_bytes(manager, u, lane) for u, lane in slots}))


def workspace_slot_bytes(manager: Any, ubatch: int, lane: int) -> int:
    """Bytes the ``(ubatch, lane)`` slot holds now: ``_current_workspaces``, a list of
    uint8 tensors or None indexed ``ubatch * _num_lanes + lane`` (0.21-0.33; no lanes
    before 0.28). A manager that grows a slot drops its old buffer first
    (``_ensure_workspace_size``), so after an out-of-memory error the slot is empty:
    this is how much to put back. 0 when unreadable."""
    buffers = getattr(manager, "_current_workspaces", None)
    index = ubatch * int(getattr(manager, "_num_lanes", 1) or 1) + lane
    try:
        buffer = buffers[index] if buffers is not None else None
        return 0 if buffer is None else int(buffer.numel() * buffer.element_size())
    except (IndexError, TypeError, AttributeError):
        return 0


def rewarm_cause(feats: Features) -> str:
    """Why ``kernel_warmup`` can run more than once in a worker process, for the report.

    0.27-0.33: elastic EP calls ``kernel_warmup(worker, process_local_only=True)``
    on a new worker (``warmup_local_kernels``, 0.33 ``warmup_new_worker``) and then
    ``warm_and_capture``, which calls it again through ``compile_or_warm_up_model``;
    existing workers re-run ``warm_and_capture`` at every scale-up/down commit.
    0.20-0.26 call it once per worker.
    """
    if feats.version >= (0, 27):
        return "elastic EP warms a worker more than once"
    return "kernel_warmup ran again in this process"


def flydsl_layer(feats: Features, impl: Any) -> bool:
    """Whether a ``TurboQuantAttentionImpl`` runs ROCm's SoA/FlyDSL kernels instead of
    the warmed ones: ``impl._soa_store`` is True (``rocm_flydsl``, 0.28-0.33; the store,
    the decode and both continuation paths branch on it or on ``_use_flydsl``, set
    together)."""
    return feats.rocm_flydsl and getattr(impl, "_soa_store", False) is True


def metadata_builder(group: Any) -> Any:
    """The first (ubatch 0) metadata builder of an attention group:
    ``AttentionGroup.get_metadata_builder()`` (0.20-0.33, V1 and V2), None without."""
    getter = getattr(group, "get_metadata_builder", None)
    return getter() if callable(getter) else None


def local_attention_chunk(layer: Any) -> int | None:
    """``attention_chunk_size`` of a chunked local attention layer (Llama 4), else None.

    0.20-0.33: ``ChunkedLocalAttention`` keeps ``self.attention_chunk_size`` and wraps
    the backend only in a builder subclass, so its impl is the plain
    ``TurboQuantAttentionImpl``; but the builder's ``build`` (also behind
    ``build_for_cudagraph_capture``; it reports ``AttentionCGSupport.NEVER``) hands the
    kernels a virtual-batch block table of ``attention_chunk_size // block_size``
    columns and fresh ``seq_lens`` (``make_local_attention_virtual_batches``,
    ``v1/attention/backends/utils.py``), never the runner's, with more (virtual) rows
    than ``max_num_seqs``: ``Geometry.local_width``, ``Geometry.decode_rows``.
    """
    chunk = getattr(layer, "attention_chunk_size", None)
    return chunk if isinstance(chunk, int) and chunk > 0 else None


# --- Multi-node: the environment vLLM's Ray paths give processes on other nodes ---------
# Read in the wheels of 0.20-0.33 (the same function in every one):
# ``vllm.ray.ray_env.get_env_vars_to_copy`` picks the head's variables that a remote
# process gets: the names ``vllm.envs`` registers, those starting with a prefix of
# ``DEFAULT_ENV_VAR_PREFIXES`` (VLLM_, LMCACHE_, NCCL_, UCX_, HF_, HUGGING_FACE_;
# FLASH_ATTENTION_ from 0.27.1) or of the comma-separated RAY_EXTRA_PREFIXES_VAR, and
# the names in RAY_EXTRA_VARS_VAR. Both lists add to vLLM's defaults and are read when
# the copy is made. Its callers: ``RayDistributedExecutor``'s workers
# (``v1/executor/ray_executor.py``, 0.20-0.32: the default Ray executor in 0.20, chosen
# by VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0 in 0.21-0.32, gone in 0.33) and the engine
# cores that ``--data-parallel-backend ray`` starts as Ray actors (``v1/engine/utils.py``,
# 0.20-0.33). ``RayExecutorV2`` (VLLM_USE_RAY_V2_EXECUTOR_BACKEND=1, the default from
# 0.21; 0.33's only Ray executor) gives its workers the head's whole environment
# instead, never replacing a value the worker's node has (``get_driver_env_vars``,
# ``v1/executor/ray_env_utils.py``, 0.20-0.33).
RAY_EXTRA_PREFIXES_VAR = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"
RAY_EXTRA_VARS_VAR = "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"


def with_csv_items(value: str, items: tuple[str, ...]) -> str:
    """vLLM's comma-separated ``value`` with the ``items`` it lacks appended; the
    user's own entries stay as they are (``_parse_csv`` in ``ray_env``, 0.20-0.33)."""
    present = {tok.strip() for tok in value.split(",") if tok.strip()}
    missing = [item for item in items if item not in present]
    if not missing:
        return value
    return ",".join([*([value.rstrip(", ")] if present else []), *missing])


# --------------------------------------------------------------------------
# A model's attention as vLLM's own ModelConfig reads it (CLI planning, no worker).
# --------------------------------------------------------------------------

MODEL_CONFIG_MODULE = "vllm.config"
TQ_CONFIG_MODULE = "vllm.model_executor.layers.quantization.turboquant.config"
TQ_DTYPE_PREFIX = "turboquant_"
"""What every TurboQuant ``kv_cache_dtype`` starts with (0.20-0.33); vLLM selects
TurboQuant's backend, and adds its boundary layers to the skip list, on that prefix."""

# Models whose vLLM code sets the attention scale from a config field instead of
# ``head_size**-0.5`` (model_executor/models, 0.20-0.33): gemma2/gemma3/rnj1
# ``config.query_pre_attn_scalar**-0.5``, granite/hyperclovax ``config.attention_multiplier``.
_SCALE_FROM_QUERY_PRE_ATTN = frozenset({"gemma2", "gemma3", "gemma3_text", "rnj1"})
_SCALE_FROM_MULTIPLIER = frozenset({"granite", "hyperclovax"})


class ModelShape(NamedTuple):
    """A model's attention as vLLM's ``ModelConfig`` describes it."""

    architecture: str
    head_size: int
    """``get_head_size()``."""
    total_heads: int
    total_kv_heads: int
    num_heads: int
    """Query heads per rank, ``get_num_attention_heads(parallel_config)``."""
    num_kv_heads: int
    """KV heads per rank, ``get_num_kv_heads(parallel_config)``."""
    num_layers: int
    """``hf_text_config.num_hidden_layers``, what the boundary rule counts."""
    attention_layers: tuple[int, ...]
    """Indices of the layers with full attention: all of them for a dense model."""
    hybrid: bool
    dtype: str
    """The dtype vLLM resolves (``--dtype`` or the config's)."""
    config_dtype: str | None
    """The dtype config.json declares, before vLLM resolves it."""
    max_model_len: int
    scale: float | None
    """The model's attention scale where its vLLM code sets one (else None)."""
    attention_chunk: int | None = None
    """``ModelConfig.attention_chunk_size`` (the text config's, 0.20-0.33): Llama 4 runs
    its RoPE layers as ``ChunkedLocalAttention`` with it; None without one."""


def _dtype_text(value: Any) -> str | None:
    return None if value is None else str(value).removeprefix("torch.")


def _config_dtype(hf_config: Any) -> str | None:
    """``dtype`` (transformers 4.56+) or ``torch_dtype`` (older) of a HF config."""
    for name in ("dtype", "torch_dtype"):
        value = getattr(hf_config, name, None)
        if value is not None:
            return _dtype_text(value)
    return None


def model_scale(model_type: str, hf_text_config: Any) -> float | None:
    """The attention scale the model's vLLM code sets from its config, else None."""
    if model_type in _SCALE_FROM_QUERY_PRE_ATTN:
        value = getattr(hf_text_config, "query_pre_attn_scalar", None)
        return float(value) ** -0.5 if value else None
    if model_type in _SCALE_FROM_MULTIPLIER:
        value = getattr(hf_text_config, "attention_multiplier", None)
        return float(value) if value else None
    return None


def _exception_line(exc: BaseException) -> str:
    """One readable line of an exception from vLLM or transformers: pydantic's
    ValidationError keeps the real message in ``errors()``."""
    errors = getattr(exc, "errors", None)
    text = str(exc)
    if callable(errors):
        with contextlib.suppress(Exception):
            text = str(errors()[0]["msg"]).removeprefix("Value error, ")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):  # huggingface_hub's strict dataclasses
        lines[0] += f" {lines[1]}"  # (vLLM 0.33): "... for field 'x':" then the reason
    return (lines[0] if lines else type(exc).__name__)[:400]


@contextlib.contextmanager
def _vllm_quiet() -> Iterator[None]:
    """vLLM logs INFO lines and, when it cannot inspect a model class, a traceback;
    the CLI says what went wrong in its own one line instead."""
    import logging

    logger = logging.getLogger("vllm")
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


def _inspect_failure(line: str) -> str:
    """vLLM's "Model architectures [...] failed to be inspected" (0.20-0.33) points at a
    log the CLI silenced: import the model's module here for the real reason (the
    registry's ``_LazyRegisteredModel.module_name``, 0.20-0.33), e.g. a missing
    dependency of that model."""
    match = re.search(r"architectures \[(.*?)\] failed to be inspected", line)
    if match is None:
        return line
    registry = importlib.import_module("vllm.model_executor.models.registry").ModelRegistry
    for arch in re.findall(r"'([^']+)'", match.group(1)):
        module = getattr(registry.models.get(arch), "module_name", None)
        if module is None:
            continue
        try:
            importlib.import_module(module)
        except Exception as exc:  # whatever the model's module raises on import
            return (
                f"vLLM cannot import its {arch} code here ({type(exc).__name__}: "
                f"{_exception_line(exc)}), so it cannot tell which layers are attention"
            )
    return line


def _full_attention_layers(model_config: Any) -> list[int]:
    """``_get_full_attention_layer_indices`` of the TurboQuant config module (0.21-0.33):
    ``layer_types``, ``layers_block_type`` or ``attn_type_list``, as vLLM reads them."""
    finder = importlib.import_module(TQ_CONFIG_MODULE)._get_full_attention_layer_indices
    return [int(i) for i in finder(model_config)]


def model_shape(
    directory: str,
    tp: int,
    dtype: str | None,
    max_model_len: int | None,
    trust_remote_code: bool,
) -> ModelShape:
    """Build vLLM's ``ModelConfig`` for a local directory holding a ``config.json`` (no
    tokenizer, no weights, no GPU) and read the attention from it; raises
    UnsupportedModel with one line when vLLM would not run TurboQuant on it or cannot
    read it. ``ModelConfig(model=..., skip_tokenizer_init=True)`` and the methods read
    here exist in 0.20-0.33; the model class is inspected once per architecture (vLLM
    caches it under ``~/.cache/vllm/modelinfos``). transformers parses the config
    (``AutoConfig``, or vLLM's own config classes, e.g. ChatGLM's)."""
    config = importlib.import_module(MODEL_CONFIG_MODULE)
    with _vllm_quiet():  # after the import: vLLM configures its logger when imported
        try:
            model_config = config.ModelConfig(
                model=directory,
                skip_tokenizer_init=True,
                trust_remote_code=trust_remote_code,
                dtype=dtype or "auto",
                max_model_len=max_model_len,
            )
            parallel = config.ParallelConfig(tensor_parallel_size=tp)
            one = config.ParallelConfig(tensor_parallel_size=1)
            model_config.verify_with_parallel_config(parallel)
        except Exception as exc:  # vLLM and transformers raise anything from a config
            line = _inspect_failure(_exception_line(exc))
            if "trust_remote_code" in line and not trust_remote_code:
                line += " (pass --trust-remote-code to run the model's own config code)"
            raise UnsupportedModel(line) from None
        arch = str(model_config.architecture)
        if model_config.use_mla:
            raise UnsupportedModel(
                f"{arch} uses multi-head latent attention (MLA): vLLM keeps it on an "
                "MLA backend and never selects TurboQuant for it"
            )
        attn_type = getattr(model_config, "attn_type", None)  # 0.21+
        if model_config.is_attention_free or attn_type == "attention_free":
            raise UnsupportedModel(f"{arch} has no attention layers: nothing for TurboQuant")
        if attn_type == "encoder_only" or (
            attn_type is None
            and getattr(model_config, "runner_type", "") == "pooling"
            and not getattr(model_config.hf_config, "is_causal", True)
        ):
            raise UnsupportedModel(
                f"{arch} is encoder-only (bidirectional attention): TurboQuant supports "
                "decoder attention only"
            )
        text = model_config.hf_text_config
        num_layers = int(getattr(text, "num_hidden_layers", 0) or 0)
        hybrid = bool(model_config.is_hybrid)
        if hybrid:
            try:
                layers = _full_attention_layers(model_config)
            except (ImportError, AttributeError):
                raise UnsupportedModel(
                    f"{arch} is a hybrid model and this vLLM cannot list its attention "
                    "layers (0.21+ can)"
                ) from None
            if not layers:
                raise UnsupportedModel(
                    f"{arch} is a hybrid model without identifiable full-attention "
                    "layers: vLLM refuses TurboQuant for it"
                )
        else:
            layers = list(range(num_layers))
        return ModelShape(
            architecture=arch,
            head_size=int(model_config.get_head_size()),
            total_heads=int(model_config.get_num_attention_heads(one)),
            total_kv_heads=int(model_config.get_total_num_kv_heads()),
            num_heads=int(model_config.get_num_attention_heads(parallel)),
            num_kv_heads=int(model_config.get_num_kv_heads(parallel)),
            num_layers=num_layers,
            attention_layers=tuple(layers),
            hybrid=hybrid,
            dtype=str(_dtype_text(model_config.dtype)),
            config_dtype=_config_dtype(text) or _config_dtype(model_config.hf_config),
            max_model_len=int(model_config.max_model_len),
            scale=model_scale(str(getattr(text, "model_type", "")), text),
            attention_chunk=getattr(model_config, "attention_chunk_size", None) or None,
        )
