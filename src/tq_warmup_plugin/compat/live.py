"""Accessors on live vLLM objects: the only code that knows where a release keeps them.

Each accessor names the releases it serves ("all releases": every supported one).
Module and class names come from ``vllm_paths`` and are read there at call time, so a
test that stubs a path patches ``compat.vllm_paths``; callers outside ``compat`` use
``compat.X``, which is what tests patch for them.
"""

from __future__ import annotations

import contextlib
import importlib
import types
from collections.abc import Iterator
from typing import Any

from . import vllm_paths as paths
from .releases import Features

__all__ = [
    "block_table",
    "draft_prefill",
    "fa2_stand_in",
    "flash_attn_available",
    "flash_attn_paged",
    "flash_attn_paged_decode",
    "flash_attn_varlen",
    "flydsl_layer",
    "jit_registry",
    "kernel_function",
    "kv_view",
    "kv_warmup_window",
    "local_attention_chunk",
    "metadata_builder",
    "plain_fa2_heads",
    "preallocate_prefill_buffers",
    "prefix_reused",
    "single_token_decode_support",
    "spec_decode_threshold",
    "spec_query_len",
    "speculative_decoding",
    "speculative_setup",
    "turboquant_impl_class",
    "ubatch_sliced",
    "ubatching",
    "worker_uses_v2",
    "workspace_manager",
    "workspace_slot",
    "workspace_slot_bytes",
    "workspace_slots",
]


def turboquant_impl_class() -> type:
    """``TurboQuantAttentionImpl``; same module and name in all releases."""
    cls: type = getattr(importlib.import_module(paths.BACKEND_MODULE), paths.IMPL_CLASS)
    return cls


def speculative_decoding(vllm_config: Any) -> bool:
    """``VllmConfig.speculative_config`` is set (ngram, EAGLE, MTP, draft model) in
    all releases; None without speculative decoding."""
    return getattr(vllm_config, "speculative_config", None) is not None


def speculative_setup(vllm_config: Any) -> tuple[str | None, bool]:
    """``(speculative_config.method or None, scheduler_config.async_scheduling)``; the
    same names in all releases (``async_scheduling`` is resolved to a bool by
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
    own = getattr(importlib.import_module(paths.ATTENTION_MODULE), "max_decode_query_len", None)
    if own is not None:
        return int(own(vllm_config))
    return spec_query_len(int(k), bool(getattr(spec, "parallel_drafting", False)))


def spec_query_len(spec_tokens: int, parallel_drafting: bool = False) -> int:
    """The most query tokens of a request under speculative decoding: ``1 + k``, with twice
    the drafts under ``parallel_drafting`` (0.21-0.32's threshold; 0.33's own
    ``max_decode_query_len`` says the same for these configurations, which the contract
    tests hold)."""
    return 1 + (2 if parallel_drafting else 1) * spec_tokens


def single_token_decode_support() -> Any:
    """``AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE`` from
    ``vllm.v1.attention.backend`` (all releases)."""
    return importlib.import_module(
        paths.ATTENTION_MODULE
    ).AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE


def kernel_function(name: str) -> Any:
    """The ``JITFunction`` object of a TurboQuant kernel (``KERNEL_MODULES``, all releases)."""
    return getattr(importlib.import_module(paths.KERNEL_MODULES[name]), name)


def flash_attn_available() -> bool:
    """``_HAS_FLASH_ATTN`` of the backend module (all releases): without it, prefill and
    long continuations use SDPA and there are no FlashAttention kernels to load."""
    return bool(importlib.import_module(paths.BACKEND_MODULE)._HAS_FLASH_ATTN)


def flash_attn_varlen(impl: Any) -> Any:
    """The impl's own FlashAttention call, ``_flash_attn_varlen(q, k, v, cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k)`` in all releases: it adds the impl's
    ``fa_version``, scale and ``causal=True``, which select the kernel."""
    return impl._flash_attn_varlen


def plain_fa2_heads(impl: Any) -> tuple[int, int, int] | None:
    """``(query heads, KV heads, head size)`` of a boundary layer whose decode we can
    warm, else None.

    TurboQuant keeps its boundary layers in the model dtype on vLLM's
    ``FlashAttentionImpl`` and forces FlashAttention 2 for every layer (all releases:
    ``attention_config.flash_attn_version = 2`` in ``EngineArgs``). Only the plain
    kernel family is warmed: ALiBi, a sliding window, a softcap or sinks select other
    kernels. Attribute names are the same in all releases.
    """
    try:
        flash_attn = importlib.import_module(paths.FLASH_ATTN_MODULE)
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


def _fa_call(module: str, scale: float, fa_version: int, **kwargs: Any) -> Any:
    """``module.flash_attn_varlen_func``, causal, looked up at call time (vLLM binds the
    name at import, and only on CUDA)."""
    varlen = importlib.import_module(module).flash_attn_varlen_func
    return varlen(softmax_scale=scale, causal=True, fa_version=fa_version, **kwargs)


def fa2_stand_in(scale: float) -> Any:
    """An impl that :func:`flash_attn_varlen` and :func:`flash_attn_paged` accept without
    an engine (``tq-warmup driver-cache``): TurboQuant's ``_flash_attn_varlen`` and the
    boundary layers' ``scale`` / ``vllm_flash_attn_version``, with FlashAttention 2 as
    TurboQuant forces it (all releases). The kernel a call loads depends on dtype, head
    size, causality and paging, not on the scale."""

    def flash_attn_varlen(
        q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, max_q: int, max_k: int
    ) -> Any:  # TurboQuantAttentionImpl._flash_attn_varlen's call, fa_version 2
        args = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": max_q}
        return _fa_call(paths.BACKEND_MODULE, scale, 2, q=q, k=k, v=v, max_seqlen_k=max_k, **args)

    return types.SimpleNamespace(
        scale=scale, vllm_flash_attn_version=2, _flash_attn_varlen=flash_attn_varlen
    )


def flash_attn_paged_decode(impl: Any) -> Any:
    """A one-token decode over a paged cache, called as ``FlashAttentionImpl.forward``
    calls it (all releases): the backend module's ``flash_attn_varlen_func`` with the
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
            paths.FLASH_ATTN_MODULE, impl.scale, version, q=q, k=cache, v=cache,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, **args,
        )  # fmt: skip

    return decode


def preallocate_prefill_buffers(impl: Any, device: Any, max_model_len: int) -> int:
    """Create, before any CUDA graph capture, the buffers ``_prefill_attention`` and
    ``_continuation_prefill`` would otherwise create on first use (every release with
    ``prefill_buffers_cached``, same names and dtypes: int32 ``_cu_2``, ``_cu_2_q``,
    ``_cu_2_k`` of 2 and an int32 ``_arange_cache`` of ``0..max_model_len + 1``, long enough
    that the loop never regrows it). ``prefill_buffers_cached``: 0.21+ cache them on the impl
    the first time the loop runs and grow the arange when a longer sequence comes; 0.20
    allocates them on every call. Created lazily, the first one made inside a capture would
    live in the graph's private pool. Returns the bytes allocated; buffers that exist stay."""
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
    V2 (all releases): ``runner.block_tables.input_block_tables[gid]``.
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
    only through chunked prefill or a prefix-cache hit. All releases set both defaults in
    ``EngineArgs._set_default_chunked_prefill_and_prefix_caching_args`` from
    ``ModelConfig.is_chunked_prefill_supported`` / ``is_prefix_caching_supported``:
    off for encoder-only (bidirectional) models and for causal models with MEAN or
    CLS sequence pooling or STEP token pooling, on for the rest (LAST, ALL). The
    operator may override either (vLLM only warns), so the resolved
    ``scheduler_config.enable_chunked_prefill`` and ``cache_config.enable_prefix_caching``
    (plain bools in all releases) decide; anything unreadable counts as reused.
    Encoder-only models have no TurboQuant layers at all: TurboQuant supports only
    ``AttentionType.DECODER`` (``supports_attn_type``, all releases).
    """
    model = getattr(vllm_config, "model_config", None)
    if getattr(model, "runner_type", "generate") != "pooling":
        return True
    chunked = getattr(
        getattr(vllm_config, "scheduler_config", None), "enable_chunked_prefill", True
    )
    cached = getattr(getattr(vllm_config, "cache_config", None), "enable_prefix_caching", True)
    return chunked is not False or cached is not False


def jit_registry(worker: Any, feats: Features) -> Any | None:
    """The runner's ``JitWarmupRegistry`` where this ``kernel_warmup`` will compile its
    registrations (``Features.jit_registry_collects`` and ``kernel_config.
    enable_jit_warmup``, default on), else None: 0.20-0.28, or an operator who turned it off."""
    if not feats.jit_registry_collects:
        return None
    kernel_config = getattr(getattr(worker, "vllm_config", None), "kernel_config", None)
    if not getattr(kernel_config, "enable_jit_warmup", False):
        return None
    registry = getattr(getattr(worker, "model_runner", None), "jit_warmup_registry", None)
    return registry if callable(getattr(registry, "activate", None)) else None


def kv_warmup_window(worker: Any, feats: Features) -> contextlib.AbstractContextManager[Any]:
    """Where the plugin's one-off work runs: outside the extensible KV cache's transient
    window, as vLLM runs its own autotune (``Features.kv_transient_window``), so that
    scratch no request allocates again is not kept free for the server's lifetime.

    vLLM's own context manager does it: the peak reached so far is folded into the reserve
    first, and peak tracking restarts after, so what stays allocated (the workspace) counts
    as resident memory and what was freed counts nowhere. A null context on 0.20-0.33, on a
    cache that is not extensible (``kv_cache_memory_bytes`` or ``num_gpu_blocks_override``
    set, not CUDA), and where the helper is missing."""
    if not feats.kv_transient_window:
        return contextlib.nullcontext()
    runner = getattr(worker, "model_runner", None)
    if getattr(runner, "extensible_kv_cache", None) is None:
        return contextlib.nullcontext()
    window = getattr(importlib.import_module(paths.WARMUP_MODULE), paths.KV_WARMUP_WINDOW, None)
    return window(worker) if callable(window) else contextlib.nullcontext()


def worker_uses_v2(worker: Any, feats: Features) -> bool:
    """``Worker.use_v2_model_runner`` (0.20-0.33); 0.34 removed it with the V1 runner, and
    every worker runs V2 (``Features.v1_runner``)."""
    return not feats.v1_runner or bool(getattr(worker, "use_v2_model_runner", False))


def draft_prefill(runner: Any) -> tuple[Any, Any] | None:
    """vLLM's ``prepare_prefill_inputs`` and the V2 runner's draft_model speculator
    (``runner.speculator``) that calls it with its own buffers and constants
    (``input_buffers``, ``expanded_input_ids``, ``expanded_positions``,
    ``last_token_indices``, ``max_num_reqs``, ``max_model_len``, ``max_num_tokens``; the same
    signature in 0.31-0.34, ``vllm_paths.DRAFT_PREFILL_MODULES``); None for any other
    speculator, runner or release."""
    speculator = getattr(runner, "speculator", None)
    needed = ("input_buffers", "expanded_input_ids", "expanded_positions", "last_token_indices")
    if speculator is None or not all(hasattr(speculator, name) for name in needed):
        return None
    for module in paths.DRAFT_PREFILL_MODULES:
        with contextlib.suppress(ImportError):
            launcher = getattr(importlib.import_module(module), paths.DRAFT_PREFILL_LAUNCHER, None)
            if launcher is not None:
                return launcher, speculator
    return None


def ubatching(vllm_config: Any) -> bool:
    """Whether the worker splits batches into microbatches: ``--enable-dbo`` (dual-batch
    overlap) or ``--ubatch-size`` over 1, resolved as ``parallel_config.use_ubatching``,
    a property of ``ParallelConfig`` in all releases (``config/parallel.py`` 0.20:492,
    0.26:535, 0.33:645). Anything unreadable counts as off."""
    parallel = getattr(vllm_config, "parallel_config", None)
    return getattr(parallel, "use_ubatching", False) is True


def ubatch_sliced(feats: Features, ubatching: bool, runner_v2: bool) -> tuple[str, ...]:
    """The attention metadata tensors a microbatch after the first gets as views at the
    offset where it starts, so their pointers can lose 16-byte alignment (request r of
    an int32 ``seq_lens`` starts at ``4 * r`` bytes, token t of the int64 slot mapping at
    ``8 * t``, block-table row r at ``4 * r * width``). Nothing without microbatching.

    V1 (``v1_runner``, ``_make_metadata_with_slice`` in ``v1/worker/ubatch_utils.py``):
    ``seq_lens[request_slice]`` (0.20-0.29:179, 0.30:282, 0.33:283; a clone only when
    the microbatch's last request continues in the next one), ``block_table_tensor
    [request_slice]`` and ``slot_mapping[token_slice]`` (0.20:230-231, 0.21-0.29:232-233,
    0.30:320-321, 0.33:321-322); the store's slot mapping comes from the forward context,
    sliced by ``token_slice`` too (``gpu_model_runner.py`` 0.22:3939, 0.33:3890). 0.32+
    copy a block table whose kernel block size differs into ``kernel_block_table
    [ubatch]`` (``v1/worker/utils.py`` 0.33:380-392), whose base is also at an offset.
    V2 (``v2_ubatches``, ``v1/worker/gpu/ubatch_utils.py``): ``seq_lens``
    copied into a per-microbatch buffer (``_slice_seq_lens``, 0.30:229, 0.33:235),
    ``block_table[request_slice]`` and ``slot_mappings[:, token_slice]`` (0.30:361-363,
    0.33:367-369). 0.20-0.29 list dual-batch overlap as unsupported by V2
    (``config/vllm.py`` 0.20:1803, 0.25:2096, 0.29:2591), so it runs on V1.
    """
    if not ubatching:
        return ()
    if runner_v2:
        return ("block_table", "slot_mapping") if feats.v2_ubatches else ()
    return paths.UBATCH_VIEWS_V1


def workspace_manager(feats: Features, locked_too: bool = False) -> Any | None:
    """The current WorkspaceManager while it can still grow (or, ``locked_too``, also
    after the lock), else None.

    0.20 TurboQuant does not use the workspace. 0.21-0.33: the module functions
    ``is_workspace_manager_initialized`` / ``current_workspace_manager`` exist.
    """
    if not feats.uses_workspace:
        return None
    workspace = importlib.import_module(paths.WORKSPACE_MODULE)
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
    workspace: Any = importlib.import_module(paths.WORKSPACE_MODULE)

    with contextlib.ExitStack() as stack:
        if ubatch:
            original = workspace.dbo_current_ubatch_id
            workspace.dbo_current_ubatch_id = lambda: ubatch
            stack.callback(setattr, workspace, "dbo_current_ubatch_id", original)
        if lane:
            stack.enter_context(workspace.use_workspace_lane(lane))
        yield


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


def flydsl_layer(feats: Features, impl: Any) -> bool:
    """Whether a ``TurboQuantAttentionImpl`` runs ROCm's SoA/FlyDSL kernels instead of
    the warmed ones: ``impl._soa_store`` is True.

    Where ``rocm_flydsl``: on ROCm gfx950 with FlyDSL importable, the impl sets
    ``_soa_store = _use_flydsl = is_flydsl_available()`` (``turboquant_attn.py``
    0.28:398-399, 0.29-0.33:369-370, 0.34:368-369) and then stores, decodes and dequantizes with the
    SoA Triton and FlyDSL kernels (0.33: ``_store_kv`` :686, continuation :839,
    ``_continuation_prefill`` :952, ``_decode_attention`` :1129; 0.28: :715, :868, :981,
    :1158). 0.20-0.27 have no such path.
    """
    return feats.rocm_flydsl and getattr(impl, "_soa_store", False) is True


def metadata_builder(group: Any) -> Any:
    """The first (ubatch 0) metadata builder of an attention group:
    ``AttentionGroup.get_metadata_builder()`` (all releases, V1 and V2), None without."""
    getter = getattr(group, "get_metadata_builder", None)
    return getter() if callable(getter) else None


def local_attention_chunk(layer: Any) -> int | None:
    """``attention_chunk_size`` of a chunked local attention layer (Llama 4), else None.

    all releases: ``ChunkedLocalAttention`` keeps ``self.attention_chunk_size`` and wraps
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
