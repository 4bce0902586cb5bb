"""A plan: the geometry a worker would discover, without the worker. ``PlanRequest`` is
what ``inspect`` and ``precompile`` plan for (vLLM's engine-argument names),
``plan_geometry``/``plan_shape`` turn it and a model's shape (``plan.model``) into a
``Planned`` by the release's rules (``plan.rules``); ``worker_plan`` plans a starting
worker's for the compile-ahead child, and ``plan_draft`` a draft model's own layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

from .. import compat
from ..compat import Features
from ..geometry import DTYPE_BYTES, Geometry, preset
from .model import ModelShape, model_shape, quiet_vllm, shape_of
from .rules import (
    UnsupportedModel,
    attention_kv_tensors,
    block_table_width,
    boundary_layers,
    effective_block_size,
    heads_per_rank,
    kv_view_strides,
    parallel_drafting,
    verify_len,
)

__all__ = [
    "PlanError",
    "PlanRequest",
    "Planned",
    "draft_model",
    "kv_zeroing",
    "named_geometries",
    "plan_draft",
    "plan_geometry",
    "plan_shape",
    "worker_plan",
]


class PlanError(ValueError):
    """Flags or a model that cannot be planned for; the message is the one line the
    CLI prints (exit code 2)."""


class Planned(NamedTuple):
    """A geometry planned without a worker, and the layers it stands for."""

    geometry: Geometry
    layers: int
    """TurboQuant layers (all ranks see the same count)."""
    boundary: bool
    """Whether TurboQuant leaves boundary layers in the model dtype (dense models)."""
    note: str
    """Where the shape came from, for the printed plan."""
    local: Geometry | None = None
    """The geometry of the model's chunked local attention layers (Llama 4), if any."""
    vocab_size: int = 0
    """The logits' width (``--vocab-size`` or the model's), 0 where neither says it."""
    moe: bool = False
    """The model has experts (``ModelConfig.is_moe``)."""
    experts: tuple[compat.MoeExperts, ...] = ()
    """A rank's experts as the config gives them (``ModelShape.experts``)."""
    experts_why: str = ""
    """Why a MoE model's experts are not planned (``ModelShape.experts_why``)."""
    zeroing: compat.KvZeroing | None = None
    """A hybrid's KV-block zeroing (``kv_zeroing``), None for another model or where its
    drafter's layers are not known here."""
    draft: Geometry | None = None
    """The draft model's own TurboQuant geometry (``plan_draft``) where it differs from the
    target's: its layers share the target's KV cache dtype and engine arguments."""


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """What ``inspect`` and ``precompile`` plan for: vLLM's own engine arguments by their
    names (``None``: the model's or the release's value), so planning reads no argparse
    namespace and no environment. The CLI's flags take their defaults from here."""

    kv_cache_dtype: str | None = None
    model: str | None = None
    """The ``--model`` the user gave, for messages (``plan_geometry`` reads its directory)."""
    vllm_version: str | None = None
    """The release to plan for; None: the installed one."""
    tensor_parallel_size: int = 1
    dtype: str | None = None
    max_model_len: int | None = None
    trust_remote_code: bool = False
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_size: int | None = None
    scale: float | None = None
    block_size: int = 16
    runner: str | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    kv_splits: int = 32
    """``attention_config.tq_max_kv_splits_for_cuda_graph``."""
    arch: int = 90
    """The target SM as one number (90: H100/H200)."""
    enable_dbo: bool = False
    attention_chunk_size: int | None = None
    vocab_size: int | None = None
    """The logits' width vLLM's sampler kernels are keyed by; None: the model's."""
    speculative_config: Mapping[str, object] | None = None
    """vLLM's ``--speculative-config``: its draft tokens give the layers the batched verify
    path's rows (``verify_len``) and grow a hybrid's Mamba state, and so its block."""
    enable_prefix_caching: bool = False
    """vLLM's ``--enable-prefix-caching``, opt-in for a hybrid model (0.22-0.33): it may
    align the hybrid's block to its Mamba chunk (``compat.hybrid_block_size``)."""
    mamba_cache_mode: str = "none"
    """vLLM's ``--mamba-cache-mode``; ``none`` with prefix caching is vLLM's own choice."""


def _features(request: PlanRequest) -> Features:
    installed = compat.installed_vllm_version()
    try:
        return compat.release_features(request.vllm_version or installed)
    except compat.UnsupportedRelease as exc:
        hint = "" if request.vllm_version else " (pass --vllm-version to plan for a release)"
        raise PlanError(f"{exc}{hint}") from None


def plan_geometry(request: PlanRequest, model_dir: str | None) -> Planned:
    """The geometry the worker would discover, from vLLM's ``ModelConfig`` of the
    ``config.json`` in ``model_dir`` (``--model``, checked and read by the CLI) and the
    explicit flags, which take precedence. Raises PlanError with one line."""
    if request.kv_cache_dtype is None:
        raise PlanError("need --kv-cache-dtype (or --geometry-json)")
    feats = _features(request)  # an unsupported release is said before vLLM reads the model
    if request.runner == "v1" and not feats.v1_runner:
        v = feats.version
        raise PlanError(f"--runner v1: vLLM {v[0]}.{v[1]} has no V1 model runner (removed in 0.34)")
    shape: ModelShape | None = None
    if model_dir is not None:
        try:
            shape = model_shape(model_dir, request.tensor_parallel_size, request.dtype,
                                request.max_model_len, request.trust_remote_code)  # fmt: skip
        except ImportError as exc:
            raise PlanError(
                f"--model needs vLLM installed to read the config ({exc}); or give "
                "--head-size, --num-heads and --num-kv-heads"
            ) from None
        except UnsupportedModel as exc:
            raise PlanError(f"--model {request.model}: {exc}") from None
        if request.dtype is None and shape.config_dtype == "float32":
            raise PlanError(
                f"--model {request.model}: config.json says float32 and TurboQuant runs the "
                "model in 16 bits: pass --dtype bfloat16 or float16 (what vLLM's --dtype is)"
            )
    return plan_shape(request, shape)


def plan_shape(request: PlanRequest, shape: ModelShape | None) -> Planned:
    """The geometry of a model's ``shape`` (``model_shape``, ``shape_of``; None: the flags
    alone) under ``request``'s engine arguments, which take precedence. Its block is the
    kernels' (``compat.kernel_block_size``): a hybrid model's manager block of thousands
    of tokens runs kernel blocks of 16. Raises PlanError with one line."""
    if request.kv_cache_dtype is None:
        raise PlanError("need --kv-cache-dtype (or --geometry-json)")
    feats = _features(request)
    tp = request.tensor_parallel_size
    heads = request.num_heads or (shape.total_heads if shape else None)
    kv_heads = request.num_kv_heads or (shape.total_kv_heads if shape else None) or heads
    head_size = request.head_size or (shape.head_size if shape else None)
    if not (heads and kv_heads and head_size):
        raise PlanError("need --model, or --head-size, --num-heads and --num-kv-heads")
    try:
        hq, hk = heads_per_rank(heads, kv_heads, tp)
    except UnsupportedModel as exc:
        raise PlanError(str(exc)) from None
    if shape is not None and not (request.num_heads or request.num_kv_heads):
        hq, hk = shape.num_heads, shape.num_kv_heads  # vLLM's own split
    max_model_len = request.max_model_len or (shape.max_model_len if shape else 4096)
    dtype = request.dtype or (shape.dtype if shape else "bfloat16")
    if dtype not in ("bfloat16", "float16"):
        raise PlanError(f"model dtype {dtype}: TurboQuant runs bfloat16 or float16 models")
    try:
        skip = boundary_layers(
            feats, shape.num_layers if shape else 0, shape.hybrid if shape else False
        )
    except UnsupportedModel as exc:
        raise PlanError(f"--model {request.model}: {exc}") from None
    if shape is not None:
        layers = len(set(shape.attention_layers) - set(skip))
        if layers == 0:
            raise PlanError(
                f"--model {request.model}: all {shape.num_layers} layers are boundary layers "
                "TurboQuant leaves in the model dtype: nothing to warm"
            )
        note = f"{shape.architecture}, {len(shape.attention_layers)} attention layers"
        note += f", boundary {', '.join(map(str, skip))}" if skip else ", no boundary layers"
    else:
        layers, note = 0, "from flags"
    scale = request.scale
    if scale is None:
        scale = shape.scale if shape and shape.scale is not None else head_size**-0.5
    method, tokens, _ = compat.speculative_fields(request.speculative_config)
    bs = request.block_size
    hybrid = shape is not None and shape.hybrid
    layout = preset(request.kv_cache_dtype, head_size)
    if not hybrid:  # a hybrid has no boundary layers to cover
        bs = effective_block_size(
            feats, bs, DTYPE_BYTES[dtype], head_size, layout.slot_size_aligned
        )
    with quiet_vllm():  # vLLM's platform says what it cannot import (0.33), the CLI not
        if hybrid and shape is not None and shape.config is not None:
            try:
                bs = compat.hybrid_block_size(
                    shape.config, tp, request.kv_cache_dtype, bs, tokens,
                    request.enable_prefix_caching, request.mamba_cache_mode,
                )  # fmt: skip
                note += f"; hybrid: attention block {bs} tokens (vLLM's, to its Mamba state)"
            except compat.CompatError as exc:
                note += f"; hybrid: block {bs} ({exc}), --geometry-json is exact"
        kernel = compat.kernel_block_size(bs)
    moe = bool(shape and shape.moe)  # vLLM runs a MoE model on V1 where it has one
    runner = "v2" if compat.runs_v2(feats, method, moe, request.runner) else "v1"
    width = block_table_width(feats, max_model_len, bs, runner == "v2", kernel)
    geometry = Geometry(
        cache_dtype=request.kv_cache_dtype,
        head_size=head_size,
        num_heads=hq,
        num_kv_heads=hk,
        block_size=kernel,
        scale=scale,
        kv_strides=kv_view_strides(feats, kernel, hk, layout.slot_size_aligned),
        model_dtype=dtype,
        block_table_width=width,
        max_num_seqs=request.max_num_seqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=request.max_num_batched_tokens,
        num_kv_splits=request.kv_splits,
        fp8_e4b15=compat.fp8_e4b15((request.arch // 10, request.arch % 10)),
        features=feats,
        ubatch_sliced=compat.ubatch_sliced(feats, request.enable_dbo, runner == "v2"),
        verify_len=verify_len(feats, tokens, parallel_drafting(request.speculative_config), method),
    )
    chunk = request.attention_chunk_size
    if chunk is None:
        chunk = shape.attention_chunk if shape else None
    local = dataclasses.replace(geometry, attention_chunk=chunk) if chunk else None
    try:
        for g in filter(None, (geometry, local)):
            g.check()
    except ValueError as exc:
        raise PlanError(f"not a TurboQuant geometry: {exc}") from None
    if local is not None:
        note += f"; chunked local attention of {chunk} tokens"
    vocab = request.vocab_size or (shape.vocab_size if shape else 0)
    experts, why = (shape.experts, shape.experts_why) if shape else ((), "")
    zeroing = None
    if hybrid and shape is not None:
        zeroing = kv_zeroing(shape, method, geometry.kv_strides[0], bs // kernel)
    return Planned(
        geometry, layers, bool(skip) or shape is None, note, local, vocab, moe, experts, why,
        zeroing,
    )  # fmt: skip


def kv_zeroing(
    shape: ModelShape, method: str | None, kernel_page: int, blocks_per_block: int
) -> compat.KvZeroing | None:
    """A hybrid's KV-block zeroing (``compat.KvZeroing``): its attention layers with the
    drafter's (none for ngram and suffix decoding, the model's own MTP layers for ``mtp``
    and ``*_mtp``; None for a draft model or EAGLE head, whose layers its own config
    says) over ``attention_kv_tensors``, pages of ``kernel_page`` bytes per kernel block,
    ``blocks_per_block`` kernel blocks to a manager block."""
    if method in (None, "ngram", "suffix"):
        drafts = 0
    elif (method == "mtp" or method.endswith("_mtp")) and shape.mtp_layers:
        drafts = shape.mtp_layers
    else:
        return None
    tensors = attention_kv_tensors(len(shape.attention_layers) + drafts, shape.state_layers)
    return compat.KvZeroing(tensors, kernel_page * blocks_per_block, kernel_page)


def named_geometries(planned: Planned) -> dict[str, Geometry]:
    """A plan's distinct geometries by name (its chunked local layers' and its draft
    model's apart)."""
    named = {"geometry0": planned.geometry}
    if planned.local is not None:
        named["local"] = planned.local
    if planned.draft is not None:
        named["draft"] = planned.draft
    return named


def draft_model(spec: Mapping[str, object] | None) -> str | None:
    """The draft model a speculative config names (``"model"``), or None: ngram, suffix
    and MTP draft with no model of their own."""
    name = (spec or {}).get("model")
    return name if isinstance(name, str) and name else None


def plan_draft(request: PlanRequest, target: Planned, draft_dir: str | None) -> Planned:
    """``target`` and its draft model's own TurboQuant layers: vLLM runs the drafter's
    attention with the target's KV cache dtype and engine arguments, so a draft model
    of another head size (a 64-wide drafter of a 128-wide target) has keys of its own.
    Planned from the config in ``draft_dir`` (the speculative config's ``"model"``,
    checked and read by the CLI); where there is none here, or vLLM cannot read it,
    the plan's note says in one clause why those keys are not planned."""
    name = draft_model(request.speculative_config)
    if name is None:
        return target
    g = target.geometry
    if draft_dir is None:
        why = "no local config.json (give the speculative config's model as a directory)"
        return target._replace(note=f"{target.note}; draft model {name}: not planned, {why}")
    drafter = dataclasses.replace(
        request, model=name, num_heads=None, num_kv_heads=None, head_size=None, scale=None,
        attention_chunk_size=None, vocab_size=None, dtype=g.model_dtype,
        max_model_len=g.max_model_len,
    )  # fmt: skip
    try:
        shape = model_shape(  # its own length: vLLM caps the target's to it, rows stay
            draft_dir, request.tensor_parallel_size, g.model_dtype, None,
            request.trust_remote_code,
        )  # fmt: skip
        planned = plan_shape(drafter, shape)
    except (ImportError, UnsupportedModel, PlanError) as exc:
        why = str(exc).removeprefix(f"--model {name}: ")
        return target._replace(note=f"{target.note}; draft model {name}: not planned, {why}")
    draft = planned.geometry
    said = f"{target.note}; draft model: {planned.layers} TurboQuant layers, head size "
    said += f"{draft.head_size}, heads {draft.num_heads}/{draft.num_kv_heads}"
    if draft == g:
        return target._replace(note=f"{said}, the target's keys")
    return target._replace(note=said, draft=draft)


def worker_plan(
    vllm_config: Any, feats: Features, arch: int, runner_v2: bool, verify_rows: bool
) -> Planned:
    """What a worker of this ``VllmConfig`` will discover, planned before its model exists
    (the compile-ahead child, ``ahead``): the shape from its own ``ModelConfig`` on its
    rank (``shape_of``) and its engine arguments (the manager block as its
    ``CacheConfig`` has it, final where the child starts; the batched verify path's rows
    where ``verify_rows``, the guard's setting), and a hybrid's KV-block zeroing with its
    real drafter's layers (``kv_zeroing``), whose 3 keys the worker otherwise compiles
    itself. A guess that misses the layers a worker then reads costs that worker the
    keys' compiles, never a wrong key: the worker plans its own from what it discovers.
    Raises PlanError or UnsupportedModel with one line."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    scheduler = vllm_config.scheduler_config
    attention = getattr(vllm_config, "attention_config", None)
    splits = getattr(attention, "tq_max_kv_splits_for_cuda_graph", PlanRequest.kv_splits)
    served = verify_rows and compat.spec_decode_threshold(vllm_config) > 1  # the guard's test
    request = PlanRequest(
        kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
        vllm_version=".".join(map(str, feats.version)),
        tensor_parallel_size=int(parallel.tensor_parallel_size),
        max_model_len=int(model.max_model_len),
        block_size=int(vllm_config.cache_config.block_size),
        runner="v2" if runner_v2 else "v1",
        max_num_seqs=int(scheduler.max_num_seqs),
        max_num_batched_tokens=int(scheduler.max_num_batched_tokens),
        kv_splits=int(splits),
        arch=arch,
        enable_dbo=compat.ubatching(vllm_config),
        speculative_config=compat.speculative_config_of(vllm_config) if served else None,
    )
    shape = shape_of(model, parallel)._replace(config=None)
    planned = plan_shape(request, shape)
    if not shape.hybrid:
        return planned
    # the zeroing's drafters are the worker's own, whichever path serves its verify rows
    g = planned.geometry
    method = compat.speculative_of(vllm_config)[0]
    zeroing = kv_zeroing(shape, method, g.kv_strides[0], request.block_size // g.block_size)
    return planned._replace(zeroing=zeroing)
