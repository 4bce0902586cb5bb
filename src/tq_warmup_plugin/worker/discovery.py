"""Finds a worker's TurboQuant layers and the geometry their kernels will see."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .. import compat
from ..compat import Features
from ..geometry import Geometry
from . import verify_rows

__all__ = ["PREFILL_ONLY_PATHS", "Discovery", "discover", "layer_geometry"]


@dataclass
class Discovery:
    """TurboQuant layers by name, plus layers that looked TurboQuant but were refused."""

    geometries: dict[str, Geometry] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    boundary: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    """Full-precision FlashAttention-2 layers beside them: (query heads, KV heads, head size)."""
    impls: dict[str, Any] = field(default_factory=dict)
    """The accepted and boundary layers' impls, for the launches that go through them."""
    device: Any = None
    """The device of the KV cache (``None`` when no layer was accepted)."""
    paths: frozenset[str] | None = None
    """The kernel paths the runtime can take; ``None``: every path. A pooling model
    that never reuses a prefix (``compat.prefix_reused``) only stores and prefills."""
    note: str = ""
    """Why some paths are left out, for the report line."""
    flydsl: list[str] = field(default_factory=list)
    """TurboQuant layers left out because they run ROCm's FlyDSL/SoA kernels."""


PREFILL_ONLY_PATHS = frozenset({"store"})
"""Paths of a forward pass over a fresh prompt (no cached prefix): the store kernels;
its attention is FlashAttention (or SDPA) over the new tokens only."""


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def layer_geometry(
    layer: Any,
    block_table: Any,
    vllm_config: Any,
    feats: Features,
    runner_v2: bool = False,
    pointer_ranges: bool = False,
    verify_len: int = 0,
) -> Geometry:
    """The geometry of one live TurboQuant ``Attention`` layer.

    Reads the real KV tensor (its strides and base pointer are what the kernels
    specialize on; hybrid models can pad pages), the runner's real block table, the
    chunk of a chunked local attention layer (whose kernels get a virtual-batch table
    instead, ``Geometry.local_width``), and whether microbatching (``--enable-dbo``)
    slices the metadata on this runner. On
    HIP (``pointer_ranges``), Triton also keys on whether each storage is within
    2 GiB: the KV tensor's and the block table's real sizes are kept (the workspace's
    after the reservation).
    """
    impl = layer.impl
    kv = compat.kv_view(layer.kv_cache, feats)
    if kv.dim() != 4 or kv.shape[2] != impl.num_kv_heads:
        raise ValueError(f"KV cache view of shape {tuple(kv.shape)} does not match the layer")
    capability: tuple[int, int] | None = None
    if kv.is_cuda:
        import torch

        major, minor = torch.cuda.get_device_capability(kv.device)
        capability = (int(major), int(minor))
    scheduler = vllm_config.scheduler_config
    geometry = Geometry(
        cache_dtype=str(impl.kv_cache_dtype),
        head_size=int(impl.head_size),
        num_heads=int(impl.num_heads),
        num_kv_heads=int(impl.num_kv_heads),
        block_size=int(kv.shape[1]),
        scale=float(impl.scale),
        kv_strides=(int(kv.stride(0)), int(kv.stride(1)), int(kv.stride(2))),
        model_dtype=_dtype_name(vllm_config.model_config.dtype),
        block_table_width=int(block_table.stride(0)),
        max_num_seqs=int(scheduler.max_num_seqs),
        max_model_len=int(vllm_config.model_config.max_model_len),
        max_num_batched_tokens=int(scheduler.max_num_batched_tokens),
        num_kv_splits=int(impl.max_num_kv_splits),
        fp8_e4b15=compat.fp8_e4b15(capability),
        features=feats,
        kv_aligned=kv.data_ptr() % 16 == 0,
        ubatch_sliced=compat.ubatch_sliced(feats, compat.ubatching(vllm_config), runner_v2),
        pointer_ranges=pointer_ranges,
        kv_storage_bytes=compat.storage_bytes(kv) if pointer_ranges else 0,
        block_table_bytes=compat.storage_bytes(block_table) if pointer_ranges else 0,
        attention_chunk=compat.local_attention_chunk(layer) or 0,
        verify_len=verify_len,
    )
    geometry.check()
    return geometry


def _flydsl_note(layers: int) -> str:
    return (
        f"ROCm gfx950 with FlyDSL (vLLM 0.28+): {layers} TurboQuant layers store the SoA "
        "layout and run FlyDSL/SoA Triton kernels, which the plugin does not warm: skipped"
    )


def discover(worker: Any, feats: Features) -> Discovery:
    """All attention layers whose impl is exactly ``TurboQuantAttentionImpl``, and the
    boundary layers TurboQuant leaves uncompressed on plain FlashAttention 2.

    Subclasses (UltraQuant, 0.32+) run other kernels; other boundary backends and
    non-attention layers of hybrid models have other impls; on ROCm gfx950 with FlyDSL
    (0.28+) the impl itself runs other kernels (``compat.flydsl_layer``: one note). All
    are left out.
    Pooling models never decode, but reuse a cached prefix through chunked prefill or
    prefix caching when those are on (``compat.prefix_reused``); without them only
    the prefill paths are kept.
    """
    found = Discovery()
    vllm_config = worker.vllm_config
    if not compat.prefix_reused(vllm_config):
        found.paths = PREFILL_ONLY_PATHS
        found.note = (
            "pooling model without chunked prefill or prefix caching: "
            "store and prefill only, no decode/continuation keys, no workspace"
        )
    tq_impl = compat.turboquant_impl_class()
    runner = worker.model_runner
    use_v2 = compat.worker_uses_v2(worker, feats)
    ranges = compat.triton_pointer_ranges()  # HIP: storage sizes are part of the keys
    context = vllm_config.compilation_config.static_forward_context
    for groups in runner.attn_groups:
        for group in groups:
            for name in group.layer_names:
                layer = context.get(name)
                impl = getattr(layer, "impl", None)
                if type(impl) is not tq_impl:
                    try:
                        heads = compat.plain_fa2_heads(impl)
                    except (AttributeError, ValueError, TypeError) as exc:
                        # One odd boundary layer costs its own launch, not the warmup.
                        found.refused[name] = f"boundary layer: {type(exc).__name__}: {exc}"
                        continue
                    if heads is not None:
                        found.boundary[name] = heads
                        found.impls[name] = impl
                    continue
                if compat.flydsl_layer(feats, impl):
                    found.flydsl.append(name)
                    continue
                try:
                    table = compat.block_table(runner, group, group.kv_cache_group_id, use_v2)
                    rows = verify_rows.rows_of(compat.metadata_builder(group))
                    found.geometries[name] = layer_geometry(
                        layer,
                        table,
                        vllm_config,
                        feats,
                        use_v2,
                        ranges,
                        rows.query_len if rows else 0,
                    )
                    found.impls[name] = impl
                    found.device = layer.kv_cache.device
                except (AttributeError, ValueError, TypeError, IndexError) as exc:
                    found.refused[name] = f"{type(exc).__name__}: {exc}"
    if found.flydsl:
        found.note = "; ".join(filter(None, [found.note, _flydsl_note(len(found.flydsl))]))
    return found
