"""Offline planning: a model's attention and TurboQuant layout without a worker.

The CLI's twin of ``discovery``: where a worker reads the real KV tensor and block
table, ``inspect`` and ``precompile`` derive them from vLLM's own ``ModelConfig`` of a
model directory and the release's rules, each naming the releases it covers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from .. import compat
from ..compat import Features
from ..geometry import DTYPE_BYTES, Geometry, preset

__all__ = [
    "STATELESS_LAYER_TYPES",
    "ModelShape",
    "PlanError",
    "PlanRequest",
    "Planned",
    "UnsupportedModel",
    "attention_kv_tensors",
    "block_table_width",
    "boundary_layers",
    "effective_block_size",
    "heads_per_rank",
    "kv_view_strides",
    "kv_zeroing",
    "model_scale",
    "model_shape",
    "named_geometries",
    "plan_geometry",
    "plan_shape",
    "shape_of",
    "state_layer_count",
    "verify_len",
    "worker_plan",
]


class UnsupportedModel(ValueError):
    """vLLM would not run TurboQuant on this model (or cannot read it); the message is
    the one-line reason."""


def heads_per_rank(heads: int, kv_heads: int, tp: int) -> tuple[int, int]:
    """Query and KV heads on one tensor-parallel rank, as vLLM splits them (all releases):
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

    Dense models: the first and last 2 layers, at most half of them (all releases).
    Hybrid models: none (every full-attention layer is TurboQuant) where
    ``Features.hybrid_turboquant``; 0.20 refuses TurboQuant for them.
    """
    if hybrid:
        if not feats.hybrid_turboquant:
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

    ``Features.tq_block_aligned`` (0.25+): TurboQuant leaves boundary layers in the model dtype, and
    ``Platform._align_heterogeneous_kv_block_size`` grows the block until a
    TurboQuant page, sized there as uint8 K+V per token, covers a 16-token page of
    those layers: ``align * ceil(16 * dtype_bytes / align)`` with
    ``align = max(16, requested)`` (32 for a bf16 model at the default 16; seen on
    the H200 with 0.26.0). 0.20-0.24 keep the requested size.
    """
    if not feats.tq_block_aligned:
        return requested
    align = max(16, requested)
    return align * -(-16 * model_dtype_bytes // align)


def block_table_width(
    feats: Features, max_model_len: int, block_size: int, v2: bool, kernel_block: int = 0
) -> int:
    """Row stride of the runner's block table, for planning without a worker.

    ``cdiv(max_model_len, bs)`` blocks, rounded up: 0.27+, both runners, to a multiple of
    ``128 / gcd(128, bs)`` (``Features.block_table_rounded``); 0.21-0.26 V1 and 0.26 V2 to
    a multiple of ``128 // bs`` where bs <= 128; 0.20 V1 not at all. Where the kernels run
    blocks of ``kernel_block`` tokens, smaller than the manager's (a hybrid model's,
    ``compat.kernel_block_size``), the row holds each manager block as ``bs //
    kernel_block`` kernel blocks, in every runner: V1's ``BlockTable`` and V2's
    ``BlockTables`` split their own rows (``blocks_per_kv_block``, 0.21-0.31 and 0.26-0.31),
    0.32+ the attention group's kernel table (``AttentionGroup.create_metadata_builders``).
    Both matter: unrounded, 900 tokens of 16 are 57 blocks where vLLM's own V1 table on
    0.21-0.26 has 64 (``test_contract_worker_plan``); unsplit, a V2 hybrid's row is 2 blocks of
    2160 where vLLM's has 1080 blocks of 16 (``test_contract_table_width``). The keys read the
    row as its stride's divisibility by 16 and its rows' 16-byte alignment: on 0.27+ 5 of that
    test's 10 hybrid and odd-block cases planned another key, on 0.26 none."""
    blocks = -(-max_model_len // block_size)
    if feats.block_table_rounded:
        align = 128 // math.gcd(128, block_size)
    elif (v2 or feats.v1_block_table_aligned) and block_size <= 128:
        align = 128 // block_size
    else:
        align = 1
    width = -(-blocks // align) * align
    if not kernel_block or block_size % kernel_block:
        return width
    return width * (block_size // kernel_block)


# Models whose vLLM code sets the attention scale from a config field instead of
# ``head_size**-0.5`` (model_executor/models, all releases): gemma2/gemma3/rnj1
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
    """``ModelConfig.attention_chunk_size`` (the text config's, all releases): Llama 4 runs
    its RoPE layers as ``ChunkedLocalAttention`` with it; None without one."""
    vocab_size: int = 0
    """``get_vocab_size()``: the width of the logits vLLM's samplers get."""
    moe: bool = False
    """``ModelConfig.is_moe``: the model runs ``fused_moe_kernel``."""
    experts: tuple[compat.MoeExperts, ...] = ()
    """A rank's experts, from the config (``compat.moe_experts_of_config``)."""
    experts_why: str = ""
    """Why a MoE model's experts are not derived offline (their keys then warm in a
    worker, by model forwards)."""
    state_layers: int = 0
    """A hybrid's layers that keep a Mamba state (gated delta nets, Mamba; not an MLP-only
    layer: ``state_layer_count``): with the attention layers they make vLLM's KV cache
    groups."""
    mtp_layers: int = 0
    """The model's own MTP layers (``num_nextn_predict_layers``, Qwen3.5's
    ``mtp_num_hidden_layers``: what vLLM's MTP models read), which ``mtp`` drafts with."""
    config: Any = None
    """vLLM's ``ModelConfig`` it was read from, for what only vLLM computes from the model:
    a hybrid's attention block (``compat.hybrid_block_size``); None where that is known
    already (a worker's, whose block vLLM has set)."""


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
    """vLLM's "Model architectures [...] failed to be inspected" (all releases) points at a
    log the CLI silenced: import the model's module here for the real reason (the
    registry's ``_LazyRegisteredModel.module_name``, all releases), e.g. a missing
    dependency of that model."""
    match = re.search(r"architectures \[(.*?)\] failed to be inspected", line)
    if match is None:
        return line
    registry = importlib.import_module(compat.MODEL_REGISTRY_MODULE).ModelRegistry
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


STATELESS_LAYER_TYPES = frozenset({"full_attention", "attention", "mlp", "moe"})
"""Layer types of vLLM's hybrid configs that keep no Mamba state: full attention, and
Nemotron-H's MLP-only and MoE-only layers (``hybrid_override_pattern`` ``-`` and ``E``, read
as ``layers_block_type``), which have no KV cache spec and so no place in vLLM's KV cache
groups. Zamba2's ``hybrid`` layers hold a Mamba state beside their shared attention."""


def _layer_types(model_config: Any) -> list[str] | None:
    """The per-layer types vLLM's TurboQuant config reads a hybrid's attention from, in its
    order (``_get_full_attention_layer_indices``, 0.21-0.33): ``layer_types``,
    ``layers_block_type``, or ``attn_type_list`` (1 full attention, else linear); None
    without any."""
    text, hf = model_config.hf_text_config, model_config.hf_config
    for listed in (getattr(text, "layer_types", None), getattr(text, "layers_block_type", None)):
        if listed is not None:
            return [str(t) for t in listed]
    kinds = getattr(hf, "attn_type_list", None)
    return None if kinds is None else ["attention" if k == 1 else "linear" for k in kinds]


def state_layer_count(types: Sequence[str] | None, num_layers: int, attention: int) -> int:
    """A hybrid's layers that keep a Mamba state (``ModelShape.state_layers``): of its
    listed layer types, those not in ``STATELESS_LAYER_TYPES``; without a list, every
    layer but the attention ones. A Nemotron-H counts its Mamba layers, not its MLPs."""
    if types is None:
        return num_layers - attention
    return sum(1 for kind in types if kind not in STATELESS_LAYER_TYPES)


def _full_attention_layers(model_config: Any) -> list[int]:
    """``_get_full_attention_layer_indices`` of the TurboQuant config module (0.21-0.33):
    ``layer_types``, ``layers_block_type`` or ``attn_type_list``, as vLLM reads them."""
    finder = importlib.import_module(compat.TQ_CONFIG_MODULE)._get_full_attention_layer_indices
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
    here exist in all releases; the model class is inspected once per architecture (vLLM
    caches it under ``~/.cache/vllm/modelinfos``). transformers parses the config
    (``AutoConfig``, or vLLM's own config classes, e.g. ChatGLM's)."""
    config = importlib.import_module(compat.MODEL_CONFIG_MODULE)
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
            model_config.verify_with_parallel_config(parallel)
        except Exception as exc:  # vLLM and transformers raise anything from a config
            line = _inspect_failure(_exception_line(exc))
            if "trust_remote_code" in line and not trust_remote_code:
                line += " (pass --trust-remote-code to run the model's own config code)"
            raise UnsupportedModel(line) from None
    return shape_of(model_config, parallel)


def shape_of(model_config: Any, parallel: Any) -> ModelShape:
    """The attention of vLLM's own ``ModelConfig`` on one rank of ``parallel`` (its
    ``ParallelConfig``): a directory's (``model_shape``) or a starting worker's
    (``worker_plan``); raises UnsupportedModel with one line where vLLM would not run
    TurboQuant on it."""
    config = importlib.import_module(compat.MODEL_CONFIG_MODULE)
    tp = int(getattr(parallel, "tensor_parallel_size", 1))
    with _vllm_quiet():
        one = config.ParallelConfig(tensor_parallel_size=1)
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
        try:
            experts, experts_why = compat.moe_experts_of_config(model_config, tp), ""
        except compat.CompatError as exc:
            experts, experts_why = (), str(exc)
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
            vocab_size=int(model_config.get_vocab_size()),
            moe=bool(getattr(model_config, "is_moe", False)),
            experts=experts,
            experts_why=experts_why,
            state_layers=(
                state_layer_count(_layer_types(model_config), num_layers, len(layers))
                if hybrid
                else 0
            ),
            mtp_layers=int(
                getattr(text, "num_nextn_predict_layers", 0)
                or getattr(text, "mtp_num_hidden_layers", 0)
                or 0
            ),
            config=model_config,
        )


# --------------------------------------------------------------------------
# The geometry of ``inspect`` / ``precompile`` flags, as a worker would discover it.
# --------------------------------------------------------------------------


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
    if not hybrid:  # a hybrid has no boundary layers to cover
        bs = effective_block_size(feats, bs, DTYPE_BYTES[dtype])
    with _vllm_quiet():  # vLLM's platform says what it cannot import (0.33), the CLI not
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
    layout = preset(request.kv_cache_dtype, head_size)
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
        verify_len=verify_len(
            feats, tokens, _parallel_drafting(request.speculative_config), method
        ),
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


def attention_kv_tensors(attention: int, state: int) -> int:
    """The KV tensors a hybrid's ``attention`` layers write, beside ``state`` layers of one
    other type: vLLM's uniform-page grouping (``_get_kv_cache_groups_uniform_page_size``,
    read in 0.22, 0.26 and 0.30) sizes groups by the smaller count, or the larger where it
    is under 1.5 times the smaller (a drafter's extra layer), deals each type's layers
    round-robin over as many groups as that size needs, and layer i of every group shares
    tensor i (``get_kv_cache_config_from_groups``): the longest attention group's length.
    6 attention layers beside 4 are 2 groups of 3, so 3 tensors, not 4."""
    if state == 0:
        return attention
    small, large = sorted((attention, state))
    size = large if large < small * 1.5 else small
    groups = -(-attention // size)
    return -(-attention // groups)


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


def verify_len(
    feats: Features, spec_tokens: int, parallel_drafting: bool = False, method: str | None = None
) -> int:
    """The query length the batched verify path serves as decode rows (``1 + k``, doubled
    drafts under ``parallel_drafting``: ``compat.spec_decode_threshold``, 0.21-0.32; one
    more for draft_model's correction token where ``Features.draft_slot_in_threshold``)
    where the release has it (``Features.spec_verify_batched``), else 0: the geometry's
    ``verify_len`` that discovery reads off a served builder (``verify_rows.rows_of``)."""
    if not spec_tokens or not feats.spec_verify_batched:
        return 0
    extra = int(feats.draft_slot_in_threshold and method == "draft_model")
    return compat.spec_query_len(spec_tokens, parallel_drafting) + extra


def _parallel_drafting(spec: Mapping[str, object] | None) -> bool:
    return bool(spec and spec.get("parallel_drafting", False))


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
