"""Helpers for the ``real_vllm`` tests: a compile-only Triton driver for sm90, a
recorder of the specialization keys that launches ask Triton for, and real impls, KV
caches, metadata and a worker stand-in of the installed vLLM."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Iterable, Iterator
from types import SimpleNamespace
from typing import Any

from tq_warmup_plugin import compat
from tq_warmup_plugin.geometry import Geometry

MAX_NUM_SEQS = 8
# (q_len, cached_len) per request. Rows 0..4 of an odd-width table cover both row
# alignments; cached 3 vs 4 gives arange slices at aligned (4) and unaligned (5)
# offsets; 130 tokens exceed the 128-token fast-path threshold.
PREFILL_BATCHES = [[(5, 3), (6, 4), (130, 20), (3, 3), (4, 4)], [(130, 16)]]


def has_v1_runner() -> bool:
    """Whether the installed vLLM has the V1 model runner (0.20-0.33; 0.34 removed it)."""
    version = compat.parse_version(compat.installed_vllm_version())
    return version is None or compat.features(version).v1_runner


V1_RUNNER_ONLY = "0.34 removed the V1 runner: none of its kernels to warm"


def activate_compile_only_driver() -> None:
    """Make Triton target sm90 on a host without a GPU (a compile-only driver: Triton
    compiles for the target, nothing launches)."""
    from tq_warmup_plugin.shipped.precompile import use_compile_only_target

    use_compile_only_target(90)


VLLM_KERNEL_MODULES = (
    "vllm.v1.worker.block_table",
    "vllm.v1.sample.rejection_sampler",
    "vllm.v1.sample.ops.topk_topp_triton",
    "vllm.v1.worker.gpu.sample.logprob",
    "vllm.v1.spec_decode.utils",
    "vllm.v1.worker.utils",
)
"""vLLM's own kernel modules the engine warmers reach (``engine_warmup``)."""


def forget_compiled(kernels: Iterable[Any]) -> None:
    """Forget what each of ``kernels`` compiled into memory (a JITFunction itself, or the
    one a heuristics/autotune wrapper holds; a JITFunction's own ``fn`` is the Python
    function), so its next launch loads from disk or compiles, and is counted."""
    from triton.runtime.jit import JITFunction

    for value in kernels:
        fn = value if isinstance(value, JITFunction) else getattr(value, "fn", None)
        if isinstance(fn, JITFunction):
            fn.device_caches.clear()


def clear_vllm_kernel_caches() -> None:
    """Forget every compiled kernel of ``VLLM_KERNEL_MODULES``: a test that compiled
    them for real must not turn a later recorder's miss into a launch."""
    import importlib

    for name in VLLM_KERNEL_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # a release without it
            continue
        forget_compiled(vars(module).values())


def block_table(block_size: int, max_len: int = 4096, tokens: int = 2048, reqs: int = 8) -> Any:
    """A V1 ``BlockTable`` as the runner's ``MultiGroupBlockTable`` builds it for a single
    attention group (the plugin's own ``compat.cpu_block_tables``)."""
    return compat.cpu_block_tables(block_size, max_len, reqs, tokens)[0]


@contextlib.contextmanager
def recorded_keys() -> Iterator[set[tuple[str, str]]]:
    """Record ``(kernel, key)`` of every Triton cache miss, compiling nothing.

    Triton's ``jit_cache_hook`` runs before each compile with the exact in-memory
    cache key; returning True makes Triton skip the compile and the launch. Each
    kernel's per-device cache is cleared first so every launch is a miss.
    """
    from triton import knobs

    for name in compat.KERNEL_MODULES:
        compat.kernel_function(name).device_caches.clear()
    clear_vllm_kernel_caches()
    seen: set[tuple[str, str]] = set()

    def hook(*, key: Any, fn: Any, **_: Any) -> bool:
        seen.add((fn.name, str(key)))
        return True

    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        yield seen
    finally:
        knobs.runtime.jit_cache_hook = previous


def impl_geometry(
    feats: compat.Features,
    impl: Any,
    width: int,
    block_size: int,
    kv_strides: tuple[int, int, int] = (0, 0, 0),
    dtype: str = "bfloat16",
    batched_tokens: int = 2048,
) -> Geometry:
    """The geometry a worker with this real impl would discover: heads, scale and splits
    from the impl, a ``width``-block table of ``block_size``-token blocks."""
    return Geometry(
        cache_dtype=impl.kv_cache_dtype,
        head_size=impl.head_size,
        num_heads=impl.num_heads,
        num_kv_heads=impl.num_kv_heads,
        block_size=block_size,
        scale=impl.scale,
        kv_strides=kv_strides,
        model_dtype=dtype,
        block_table_width=width,
        max_num_seqs=MAX_NUM_SEQS,
        max_model_len=width * block_size,
        max_num_batched_tokens=batched_tokens,
        num_kv_splits=impl.max_num_kv_splits,
        fp8_e4b15=0,
        features=feats,
    )


def make_impl(cache_dtype: str, d: int, hq: int, hk: int, splits: int, max_len: int) -> Any:
    """The real impl; only the config it reads in ``__init__`` is a stand-in (a full
    VllmConfig needs a model and a device)."""
    from types import SimpleNamespace
    from unittest import mock

    from vllm.v1.attention.backends import turboquant_attn

    config = SimpleNamespace(
        attention_config=SimpleNamespace(tq_max_kv_splits_for_cuda_graph=splits),
        model_config=SimpleNamespace(max_model_len=max_len),  # read by 0.28+
    )
    with mock.patch.object(turboquant_attn, "get_current_vllm_config", return_value=config):
        return turboquant_attn.TurboQuantAttentionImpl(
            num_heads=hq, head_size=d, scale=d**-0.5, num_kv_heads=hk, kv_cache_dtype=cache_dtype
        )


def layer_kv_cache(
    feats: compat.Features, blocks: int, bs: int, hk: int, slot: int, storage: int = 0
) -> Any:
    """The layer's KV tensor as the release allocates it (see planning.kv_view_strides);
    ``storage``: the bytes of the allocation it is a view of (vLLM's KV tensors are views
    of one raw buffer), left untouched (the OS maps it lazily)."""
    import torch

    shape = (blocks, hk, bs, slot) if feats.kv_head_major else (blocks, bs, hk, slot)
    count = blocks * hk * bs * slot
    flat = torch.empty(max(storage, count), dtype=torch.uint8)[:count]
    kv = (flat if storage else flat.zero_()).view(shape)
    return kv.transpose(1, 2) if feats.kv_view_transposed and not feats.kv_head_major else kv


def metadata(requests: list[tuple[int, int]], num_decodes: int, table: Any, seq_buf: Any) -> Any:
    """TurboQuantMetadata as the builder makes it, over the runner's persistent buffers."""
    import torch
    from vllm.v1.attention.backends.turboquant_attn import TurboQuantMetadata

    q_lens = [q for q, _ in requests]
    seq_lens = [q + c for q, c in requests]
    n = len(requests)
    seq_buf[:n] = torch.tensor(seq_lens, dtype=torch.int32)
    qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    fields = {
        "seq_lens": seq_buf[:n],
        "slot_mapping": torch.full((sum(q_lens),), -1, dtype=torch.int64),
        "block_table": table[:n],
        "query_start_loc": qsl,
        "num_actual_tokens": sum(q_lens),
        "max_query_len": max(q_lens),
        "max_seq_len": max(seq_lens),
        "is_prefill": max(q_lens) > 1,
        "num_decodes": num_decodes,
        "num_decode_tokens": num_decodes,
        "query_start_loc_cpu": qsl,
        "seq_lens_cpu": torch.tensor(seq_lens, dtype=torch.int32),
    }
    names = {f.name for f in dataclasses.fields(TurboQuantMetadata)}  # 0.20 lacks the _cpu ones
    return TurboQuantMetadata(**{k: v for k, v in fields.items() if k in names})


def _layer_and_buffers(impl: Any, width: int) -> tuple[Any, Any, Any, Any]:
    """A stand-in ``Attention`` layer and the runner's buffers: the ``width``-block
    table, ``seq_lens`` and the slot mapping."""
    import torch
    from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids

    layer = torch.nn.Module()
    # 0.20 reads centroids that the Attention layer registered at construction;
    # 0.21+ build them in _ensure_on_device and overwrite this.
    layer._tq_centroids = get_centroids(impl.head_size, impl.tq_config.centroid_bits)
    table = torch.zeros(MAX_NUM_SEQS, width, dtype=torch.int32)
    seq_buf = torch.zeros(MAX_NUM_SEQS, dtype=torch.int32)
    return layer, table, seq_buf, torch.zeros(4096, dtype=torch.int64)


def run_backend(
    impl: Any,
    kv: Any,
    width: int,
    dtype: Any,
    batches: list[tuple[list[tuple[int, int]], int]] | None = None,
) -> None:
    """Drive the real backend over ``(requests, num_decodes)`` batches; by default
    every TurboQuant path once: decode, mixed, short and long continuation."""
    import torch

    hq, hk, d = impl.num_heads, impl.num_kv_heads, impl.head_size
    layer, table, seq_buf, _ = _layer_and_buffers(impl, width)
    if batches is None:
        batches = [([(1, 40)] * 3, 3), ([(1, 40), (5, 3)], 1)]
        batches += [(requests, 0) for requests in PREFILL_BATCHES]
    for requests, num_decodes in batches:
        n = sum(q for q, _ in requests)
        q = torch.randn(n, hq * d, dtype=dtype)
        k = torch.randn(n, hk * d, dtype=dtype)
        v = torch.randn(n, hk * d, dtype=dtype)
        meta = metadata(requests, num_decodes, table, seq_buf)
        impl.do_kv_cache_update(layer, k, v, kv, meta.slot_mapping)
        impl.forward(layer, q, k, v, kv, meta, output=torch.zeros(n, hq * d, dtype=dtype))


def make_flash_impl(hq: int, hk: int, d: int, version: int = 2, **kwargs: Any) -> Any:
    """vLLM's real ``FlashAttentionImpl`` as a boundary layer holds it; the FlashAttention
    version is what TurboQuant forces (2) unless given, since a CPU host cannot pick one."""
    from unittest import mock

    from vllm.v1.attention.backends import flash_attn

    args: dict[str, Any] = {
        "alibi_slopes": None,
        "sliding_window": None,
        "kv_cache_dtype": "auto",
        "logits_soft_cap": None,
        **kwargs,
    }
    with mock.patch.object(flash_attn, "get_flash_attn_version", return_value=version):
        return flash_attn.FlashAttentionImpl(
            num_heads=hq, head_size=d, scale=d**-0.5, num_kv_heads=hk, **args
        )


def common_metadata(
    requests: list[tuple[int, int]], table: Any, seq_buf: Any, slot_buf: Any
) -> Any:
    """vLLM's ``CommonAttentionMetadata`` of one V1 step, over the runner's persistent
    buffers (``seq_lens``, block table and slot mapping views from their base)."""
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata

    q_lens = [q for q, _ in requests]
    seq_lens = [q + c for q, c in requests]
    n, tokens = len(requests), sum(q_lens)
    seq_buf[:n] = torch.tensor(seq_lens, dtype=torch.int32)
    slot_buf[:tokens] = -1
    qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    seq_cpu = torch.tensor(seq_lens, dtype=torch.int32)
    fields = {
        "query_start_loc": qsl.clone(),
        "query_start_loc_cpu": qsl,
        "seq_lens": seq_buf[:n],
        "num_reqs": n,
        "num_actual_tokens": tokens,
        "max_query_len": max(q_lens),
        "max_seq_len": max(seq_lens),
        "block_table_tensor": table[:n],
        "slot_mapping": slot_buf[:tokens],
        "seq_lens_cpu_upper_bound": seq_cpu,
        "_seq_lens_cpu": seq_cpu,  # absent from 0.30
        "_num_computed_tokens_cpu": torch.tensor([c for _, c in requests], dtype=torch.int32),
    }
    names = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    return CommonAttentionMetadata(**{k: v for k, v in fields.items() if k in names})


def run_ubatches(
    impl: Any,
    kv: Any,
    width: int,
    dtype: Any,
    batches: list[list[tuple[int, int]]],
    num_ubatches: int = 2,
) -> None:
    """Drive the real backend over each batch as the V1 runner does with microbatching:
    vLLM's own ``maybe_create_ubatch_slices`` and ``split_attn_metadata`` slice the
    step's metadata, its builder builds each microbatch's metadata, and each one stores
    (its slot-mapping slice) and attends in turn."""
    import numpy as np
    import torch
    from vllm.v1.attention.backends.turboquant_attn import TurboQuantMetadataBuilder
    from vllm.v1.worker import ubatch_utils

    hq, hk, d = impl.num_heads, impl.num_kv_heads, impl.head_size
    layer, table, seq_buf, slot_buf = _layer_and_buffers(impl, width)
    builder = TurboQuantMetadataBuilder.__new__(TurboQuantMetadataBuilder)
    builder.reorder_batch_threshold = 1  # what __init__ sets (_init_reorder_batch_threshold(1))
    for requests in batches:
        common = common_metadata(requests, table, seq_buf, slot_buf)
        scheduled = np.array([q for q, _ in requests], dtype=np.int32)
        tokens = int(scheduled.sum())
        slices, _ = ubatch_utils.maybe_create_ubatch_slices(
            True, scheduled, tokens, len(requests), num_ubatches
        )
        for sliced in ubatch_utils.split_attn_metadata(slices, common):
            n = sliced.num_actual_tokens
            q = torch.randn(n, hq * d, dtype=dtype)
            k = torch.randn(n, hk * d, dtype=dtype)
            v = torch.randn(n, hk * d, dtype=dtype)
            meta = builder.build(0, sliced)
            impl.do_kv_cache_update(layer, k, v, kv, sliced.slot_mapping)
            impl.forward(layer, q, k, v, kv, meta, output=torch.zeros(n, hq * d, dtype=dtype))


def local_builder(chunk: int, block_size: int) -> Any:
    """vLLM's real metadata builder of a ``ChunkedLocalAttention`` layer (Llama 4) over
    TurboQuant: the subclass ``create_chunked_local_attention_backend`` makes, without
    its ``__init__`` (which needs a VllmConfig and a device); ``build`` reads only the
    kernel block size of its spec and TurboQuant's reorder threshold."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.attention.chunked_local_attention import (
        create_chunked_local_attention_backend,
    )
    from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionBackend

    cls = create_chunked_local_attention_backend(
        TurboQuantAttentionBackend, chunk
    ).get_builder_cls()
    builder = cls.__new__(cls)
    builder.kv_cache_spec = SimpleNamespace(block_size=block_size)
    builder.reorder_batch_threshold = 1  # what TurboQuant's __init__ sets
    return builder


def build_virtual(builder: Any, common: Any) -> Any:
    """``builder.build`` of a local builder on a host without pinned memory: 0.24+
    copy the virtual batch through ``async_tensor_h2d``, which stages in pinned memory
    when ``PIN_MEMORY`` (true on a CPU-only host too)."""
    from unittest import mock

    from vllm.utils import torch_utils

    with mock.patch.object(torch_utils, "PIN_MEMORY", False, create=True):
        return builder.build(0, common)


def run_local(
    impl: Any,
    kv: Any,
    width: int,
    chunk: int,
    block_size: int,
    dtype: Any,
    batches: list[list[tuple[int, int]]],
) -> list[Any]:
    """Drive the real backend over each batch as a chunked local attention layer gets
    it: the step's metadata over the runner's buffers (a ``width``-block table), turned
    into a virtual batch by the real builder (``make_local_attention_virtual_batches``);
    each batch stores and attends. Returns the metadata each batch was built into."""
    import torch

    hq, hk, d = impl.num_heads, impl.num_kv_heads, impl.head_size
    layer, table, seq_buf, slot_buf = _layer_and_buffers(impl, width)
    builder = local_builder(chunk, block_size)
    built = []
    for requests in batches:
        common = common_metadata(requests, table, seq_buf, slot_buf)
        n = common.num_actual_tokens
        q = torch.randn(n, hq * d, dtype=dtype)
        k = torch.randn(n, hk * d, dtype=dtype)
        v = torch.randn(n, hk * d, dtype=dtype)
        meta = build_virtual(builder, common)
        built.append(meta)
        impl.do_kv_cache_update(layer, k, v, kv, common.slot_mapping)
        impl.forward(layer, q, k, v, kv, meta, output=torch.zeros(n, hq * d, dtype=dtype))
    return built


VOCAB = 1000


class LogitsModel:
    """The model stand-in of ``fake_worker``: ``compute_logits`` gives ``VOCAB`` logits
    a row in the hidden states' dtype, as vLLM's ``LogitsProcessor`` does."""

    def compute_logits(self, hidden: Any) -> Any:
        import torch

        return torch.randn(hidden.shape[0], VOCAB, dtype=hidden.dtype)


def fake_worker(impls: dict[str, Any], feats: compat.Features, width: int) -> Any:
    """A worker/runner stand-in whose layers carry real impls and real KV tensors."""
    import torch

    layers = {}
    for name, impl in impls.items():
        kv = layer_kv_cache(feats, 4, 16, impl.num_kv_heads, impl.tq_config.slot_size_aligned)
        layers[name] = SimpleNamespace(impl=impl, kv_cache=kv)
    layers["not_attention"] = SimpleNamespace(impl=object(), kv_cache=None)
    layers["boundary"] = SimpleNamespace(impl=make_flash_impl(8, 2, 128), kv_cache=None)
    group = SimpleNamespace(layer_names=[*layers], kv_cache_group_id=0)
    table = torch.zeros(MAX_NUM_SEQS, width, dtype=torch.int32)
    model_config = SimpleNamespace(
        runner_type="generate",
        dtype=torch.bfloat16,
        max_model_len=width * 16,
        max_logprobs=20,
        get_hidden_size=lambda: 64,
    )
    runner = SimpleNamespace(
        attn_groups=[[group]],
        block_tables=SimpleNamespace(input_block_tables=[table]),
        model=LogitsModel(),
        model_config=model_config,
        device=torch.device("cpu"),
    )
    config = SimpleNamespace(
        model_config=model_config,
        scheduler_config=SimpleNamespace(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=2048),
        compilation_config=SimpleNamespace(static_forward_context=layers),
    )
    return SimpleNamespace(
        vllm_config=config, model_runner=runner, use_v2_model_runner=True, rank=0
    )
