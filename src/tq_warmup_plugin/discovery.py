"""Finds a worker's TurboQuant layers and the geometry their kernels will see."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import compat
from .compat import Features
from .geometry import Geometry


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


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def layer_geometry(layer: Any, block_table: Any, vllm_config: Any, feats: Features) -> Geometry:
    """The geometry of one live TurboQuant ``Attention`` layer.

    Reads the real KV tensor (its strides and base pointer are what the kernels
    specialize on; hybrid models can pad pages) and the runner's real block table.
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
    )
    geometry.check()
    return geometry


def discover(worker: Any, feats: Features) -> Discovery:
    """All attention layers whose impl is exactly ``TurboQuantAttentionImpl``, and the
    boundary layers TurboQuant leaves uncompressed on plain FlashAttention 2.

    Subclasses (UltraQuant, 0.32+) run other kernels; other boundary backends and
    non-attention layers of hybrid models have other impls; pooling models never
    decode. All are left out.
    """
    found = Discovery()
    vllm_config = worker.vllm_config
    if vllm_config.model_config.runner_type == "pooling":
        return found
    tq_impl = compat.turboquant_impl_class()
    runner = worker.model_runner
    use_v2 = compat.worker_uses_v2(worker)
    context = vllm_config.compilation_config.static_forward_context
    for groups in runner.attn_groups:
        for group in groups:
            for name in group.layer_names:
                layer = context.get(name)
                impl = getattr(layer, "impl", None)
                if type(impl) is not tq_impl:
                    heads = compat.plain_fa2_heads(impl)
                    if heads is not None:
                        found.boundary[name] = heads
                        found.impls[name] = impl
                    continue
                try:
                    table = compat.block_table(runner, group, group.kv_cache_group_id, use_v2)
                    found.geometries[name] = layer_geometry(layer, table, vllm_config, feats)
                    found.impls[name] = impl
                    found.device = layer.kv_cache.device
                except (AttributeError, ValueError, TypeError, IndexError) as exc:
                    found.refused[name] = f"{type(exc).__name__}: {exc}"
    return found
