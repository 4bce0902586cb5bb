"""Reading a model through vLLM: its attention as vLLM's own ``ModelConfig`` describes it
(``ModelShape``), of a model directory (``model_shape``: ``inspect``, ``precompile``) or of
a starting worker (``shape_of``: the compile-ahead child), or one line where vLLM would not
run TurboQuant on it (``rules.UnsupportedModel``).

The CLI's twin of ``discovery``: where a worker reads the real KV tensor and block table,
the plan derives them from this shape and the release's rules (``plan.rules``).
"""

from __future__ import annotations

import contextlib
import importlib
import re
from collections.abc import Iterator
from typing import Any, NamedTuple

from .. import compat
from .rules import UnsupportedModel, state_layer_count

__all__ = [
    "ModelShape",
    "model_scale",
    "model_shape",
    "quiet_vllm",
    "shape_of",
]


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
def quiet_vllm() -> Iterator[None]:
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
    with quiet_vllm():  # after the import: vLLM configures its logger when imported
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
    with quiet_vllm():
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
