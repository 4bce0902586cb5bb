"""Where vLLM keeps the launchers of its own kernels around TurboQuant's (all releases).

``engine_warmup`` calls vLLM's own launcher functions (slot mapping, the rejection
sampler, top-k/top-p, logprobs) on a few bytes; this module finds them and builds their inputs,
each accessor naming the releases it serves.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from typing import Any

from . import vllm_paths as paths
from .live import ubatching
from .releases import Features

__all__ = [
    "CompatError",
    "MoeExperts",
    "cpu_block_tables",
    "drafter_of",
    "dummy_run",
    "eagle_helper",
    "engine_of",
    "full_decode_graphs",
    "graph_tokens",
    "kernel_block_size",
    "logits_of",
    "moe_config_function",
    "moe_experts",
    "sampling_metadata",
    "slot_mapping_tables",
    "spec_decode_metadata",
    "speculative_fields",
    "speculative_of",
    "top_k_top_p_function",
    "topk_logprobs_function",
]


class CompatError(RuntimeError):
    """A vLLM object has a shape this release table does not know: the job that met it
    fails in one error line (``engine_warmup``)."""


def engine_of(worker: Any, feats: Features) -> dict[str, Any]:
    """The fields of a live worker's ``engine.Engine`` (all releases:
    ``use_v2_model_runner``, ``model_runner``, ``vllm_config.speculative_config``,
    ``model_config.max_logprobs``, ``is_moe``, ``is_hybrid`` and ``is_pooling_model``
    under the same names)."""
    config = worker.vllm_config
    method, tokens, probs = speculative_of(config)
    runner = worker.model_runner
    return dict(
        features=feats,
        runner_v2=bool(getattr(worker, "use_v2_model_runner", False)),
        pooling=bool(getattr(runner, "is_pooling_model", False)),
        spec_method=method,
        spec_tokens=tokens,
        draft_probs=probs,
        max_logprobs=int(getattr(config.model_config, "max_logprobs", 20)),
        moe=bool(getattr(config.model_config, "is_moe", False)),
        hybrid=bool(getattr(config.model_config, "is_hybrid", False)),
        # 0.25+ (``ObservabilityConfig.jit_monitor_mode``); before, no monitor: False.
        jit_monitor_error=getattr(
            getattr(config, "observability_config", None), "jit_monitor_mode", None
        )
        == "error",
        max_tokens=int(
            getattr(getattr(config, "scheduler_config", None), "max_num_batched_tokens", 0) or 0
        ),
        graph_tokens=graph_tokens(config),
        full_decode_graphs=full_decode_graphs(config),
        micro_batches=ubatching(config),
        device=getattr(runner, "device", None),
        runner=runner,
    )


_SPEC_FIELDS = (
    "method", "num_speculative_tokens", "rejection_sample_method", "draft_sample_method"
)  # fmt: skip


def speculative_fields(config: Mapping[str, object] | None) -> tuple[str | None, int, bool]:
    """Method, draft tokens, and whether the rejection sampler gets the draft's
    probabilities, from a ``SpeculativeConfig``'s fields or the ``--speculative-config``
    JSON object, with vLLM's defaults: 0.26 ``_dummy_sampler_run`` passes them for
    ``rejection_sample_method`` "standard" (the default) and ``draft_sample_method``
    "probabilistic" (default "greedy"); these fields are new in 0.25, and before, draft
    probabilities were never passed. None: no speculative decoding. A config without a
    method or with fewer than one draft token raises ValueError (one line)."""
    if not config:
        return None, 0, False
    method = config.get("method")
    if not isinstance(method, str) or not method:
        raise ValueError('a speculative config needs a "method" (ngram, eagle, mtp, ...)')
    tokens = config.get("num_speculative_tokens")
    if type(tokens) is not int or tokens < 1:
        raise ValueError('a speculative config needs "num_speculative_tokens" of 1 or more')
    probs = (
        config.get("rejection_sample_method", "standard") == "standard"
        and config.get("draft_sample_method", "greedy") == "probabilistic"
    )
    return method, tokens, probs


def speculative_of(vllm_config: Any) -> tuple[str | None, int, bool]:
    """``speculative_fields`` of a ``VllmConfig``'s ``speculative_config`` (all releases)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return None, 0, False
    return speculative_fields({k: getattr(spec, k) for k in _SPEC_FIELDS if hasattr(spec, k)})


def graph_tokens(config: Any) -> int:
    """The largest token count a CUDA graph runs: ``max(cudagraph_capture_sizes)`` (all
    releases), 0 under ``enforce_eager`` or ``cudagraph_mode`` NONE (all releases)."""
    model = getattr(config, "model_config", None)
    graphs = getattr(config, "compilation_config", None)
    if graphs is None or getattr(model, "enforce_eager", False):
        return 0
    if getattr(getattr(graphs, "cudagraph_mode", None), "name", "") == "NONE":
        return 0
    return int(max(getattr(graphs, "cudagraph_capture_sizes", None) or [0]))


def full_decode_graphs(config: Any) -> bool:
    """Whether decode steps run FULL CUDA graphs, which vLLM captures with real attention
    metadata: ``cudagraph_mode.decode_mode()`` is FULL (FULL, FULL_DECODE_ONLY and the
    default FULL_AND_PIECEWISE; 0.22, 0.26 and 0.33 alike), not under ``enforce_eager``."""
    mode = getattr(getattr(config, "compilation_config", None), "cudagraph_mode", None)
    decode = getattr(mode, "decode_mode", None)
    if graph_tokens(config) == 0 or not callable(decode):
        return False
    return bool(getattr(decode(), "name", "") == "FULL")


@dataclasses.dataclass(frozen=True)
class MoeExperts:
    """What vLLM's fused MoE launcher reads from one layer's experts: its weights'
    shapes and dtype, the global expert count and the experts per token."""

    w13: tuple[int, ...]
    w2: tuple[int, ...]
    experts: int
    top_k: int
    dtype: str


def moe_experts(runner: Any) -> list[MoeExperts]:
    """Each module of the runner's model (``get_model()``: without its CUDA graph
    wrapper, all releases) that holds MoE expert weights: ``w13_weight`` and
    ``w2_weight`` beside a ``moe_config`` (``FusedMoEConfig``: ``num_experts``,
    ``experts_per_token``). Where that module is differs: ``FusedMoE`` itself up to
    0.25, its ``RoutedExperts`` from 0.26 (``fused_moe/layer.py``)."""
    found = []
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    for module in model.modules():
        w13 = getattr(module, "w13_weight", None)
        w2 = getattr(module, "w2_weight", None)
        moe = getattr(module, "moe_config", None)
        if w13 is None or w2 is None or moe is None:
            continue
        found.append(
            MoeExperts(
                w13=tuple(w13.shape),
                w2=tuple(w2.shape),
                experts=int(moe.num_experts),
                top_k=int(moe.experts_per_token),
                dtype=str(w13.dtype).removeprefix("torch."),
            )
        )
    return found


def moe_config_function() -> Any:
    """vLLM's ``try_get_optimal_moe_config(w1_shape, w2_shape, top_k, dtype, M)``: the
    Triton config a step of ``M`` tokens launches ``fused_moe_kernel`` with (a tuned JSON
    of this GPU, else vLLM's defaults). This module and signature in 0.22, 0.26, 0.30 and
    0.33, the releases its contract test runs."""
    return importlib.import_module(paths.FUSED_MOE_MODULE).try_get_optimal_moe_config


def dummy_run(runner: Any, tokens: int) -> None:
    """One forward of ``tokens`` tokens without attention, as the worker's own
    ``compile_or_warm_up_model`` runs its compile sizes (``_dummy_run(size,
    skip_eplb=True, remove_lora=False)``, V1 and V2 runners, all releases)."""
    runner._dummy_run(tokens, skip_eplb=True, remove_lora=False)


def slot_mapping_tables(runner: Any) -> list[Any]:
    """The V1 runner's ``BlockTable`` objects that map tokens to slots:
    ``input_batch.block_table.block_tables`` (``MultiGroupBlockTable``, all releases).
    0.26+ mark mamba-like groups ``slot_mapping_mode == NONE``; they map nothing."""
    tables = runner.input_batch.block_table.block_tables
    return [t for t in tables if _mode(t) != "none"]


def kernel_block_size(block_size: int) -> int:
    """The block TurboQuant's kernels run on for a KV manager block of ``block_size``
    tokens: vLLM's own ``select_common_block_size`` over TurboQuant's backend, as the V1
    runner's ``prepare_kernel_block_sizes`` picks it for an attention group (0.22-0.33,
    ``vllm.v1.worker.utils``). The two differ for a hybrid model, whose attention pages
    vLLM sizes to the Mamba state: the serve-jit Qwen3-Next's block of 2160 tokens runs
    kernels of 16, 135 to a block (H200, 0.26.0, run Z), and its drafter's helpers and slot
    mapping are keyed by those. Where the function or the backend is missing, the block
    itself: a miss costs the worker a compile, never a wrong result."""
    try:
        select = importlib.import_module(paths.WORKER_UTILS_MODULE).select_common_block_size
        backend = getattr(importlib.import_module(paths.BACKEND_MODULE), paths.BACKEND_CLASS)
        return int(select(block_size, [backend]))
    except (ImportError, AttributeError, ValueError):
        return block_size


def cpu_block_tables(
    block_size: int,
    max_model_len: int,
    max_num_reqs: int,
    max_num_batched_tokens: int,
    kernel_block: int | None = None,
) -> list[Any]:
    """The block tables vLLM's own ``MultiGroupBlockTable`` builds for one attention group
    of ``block_size``-token KV manager blocks, on the CPU: a worker's V1 runner makes it
    with ``cdiv(max_model_len, block_size)`` blocks a row, split into the kernel's blocks
    (``kernel_block``, by default :func:`kernel_block_size`; 0.20-0.31), and rounds the
    row itself (0.26+). Its constructor's keywords differ: 0.20-0.25 take
    ``max_model_len``, 0.33 dropped ``kernel_block_sizes``; each is passed only where the
    release's signature has it."""
    import inspect

    import torch

    cls = importlib.import_module(paths.BLOCK_TABLE_MODULE).MultiGroupBlockTable
    offered = dict(
        max_num_reqs=max_num_reqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        pin_memory=False,
        device=torch.device("cpu"),
        block_sizes=[block_size],
        kernel_block_sizes=[kernel_block or kernel_block_size(block_size)],
        max_num_blocks=[-(-max_model_len // block_size)],
    )
    accepted = inspect.signature(cls.__init__).parameters
    return list(cls(**{k: v for k, v in offered.items() if k in accepted}).block_tables)


def _mode(table: Any) -> object:
    """``SlotMappingMode`` value (0.26+ ``"token_to_kv_slot"`` / ``"none"``), None before."""
    mode = getattr(table, "slot_mapping_mode", None)
    return getattr(mode, "value", mode)


def spec_decode_metadata(draft_token_ids: list[list[int]], device: Any) -> Any:
    """vLLM's own ``SpecDecodeMetadata.make_dummy`` (all releases)."""
    cls = importlib.import_module(paths.SPEC_METADATA_MODULE).SpecDecodeMetadata
    return cls.make_dummy(draft_token_ids, device)


# The fields a sampling batch's mode is told by; every other field of vLLM's
# ``SamplingMetadata`` (all releases) gets its "nothing requested" value below.
_EMPTY_FIELDS: dict[str, Any] = {
    "top_p": None,
    "top_k": None,
    "max_num_logprobs": None,
    "logprob_token_ids": None,
    "no_penalties": True,
    "prompt_token_ids": None,
    "allowed_token_ids_mask": None,
    "bad_words_token_ids": {},
}


def sampling_metadata(
    num_reqs: int, all_greedy: bool, all_random: bool, device: Any, logprobs: int | None = None
) -> Any:
    """A real ``SamplingMetadata`` of ``num_reqs`` requests in one sampling mode.

    The rejection sampler's kernels read only the mode (``all_greedy``,
    ``all_random``), ``temperature`` and ``generators`` (all releases); the sampler also
    ``max_num_logprobs`` (``logprobs``). A field this
    table does not know and that has no default raises ``CompatError``.
    """
    import torch

    module = importlib.import_module(paths.SAMPLING_METADATA_MODULE)
    cls = module.SamplingMetadata
    # Greedy rows have temperature 0 (GREEDY_TEMPERATURE), random ones a positive one.
    temps = [
        0.0 if (all_greedy or (not all_random and i % 2 == 0)) else 0.7 for i in range(num_reqs)
    ]
    values: dict[str, Any] = dict(_EMPTY_FIELDS)
    values.update(
        temperature=None if all_greedy else torch.tensor(temps, device=device),
        all_greedy=all_greedy,
        all_random=all_random,
        max_num_logprobs=logprobs,
        generators={},
        frequency_penalties=torch.zeros(num_reqs, device=device),
        presence_penalties=torch.zeros(num_reqs, device=device),
        repetition_penalties=torch.ones(num_reqs, device=device),
        output_token_ids=[[] for _ in range(num_reqs)],
        spec_token_ids=[[] for _ in range(num_reqs)],
    )
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in values:
            kwargs[f.name] = values[f.name]
        elif f.name == "logitsprocs":
            kwargs[f.name] = importlib.import_module(
                paths.LOGITS_PROCESSOR_MODULE
            ).LogitsProcessors()
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise CompatError(f"SamplingMetadata has an unknown field {f.name!r}")
    return cls(**kwargs)


def top_k_top_p_function() -> Any:
    """``apply_top_k_top_p(logits, k, p)`` of ``v1/sample/ops/topk_topp_sampler.py``
    (all releases), which both runners' samplers and the rejection sampler call; on a GPU
    it takes ``_topk_topp_kernel`` from 8 rows (0.26:351)."""
    return importlib.import_module(paths.TOPK_TOPP_MODULE).apply_top_k_top_p


def topk_logprobs_function() -> Any:
    """The V2 sampler's logprobs launcher, ``(logits, num_logprobs, sampled_token_ids)``
    first: ``compute_topk_scores`` (0.26-0.33), ``compute_topk_logprobs`` (0.20-0.25)
    in ``v1/worker/gpu/sample/logprob.py``."""
    module = importlib.import_module(paths.V2_LOGPROB_MODULE)
    for name in ("compute_topk_scores", "compute_topk_logprobs"):
        if hasattr(module, name):
            return getattr(module, name)
    raise CompatError("the V2 logprob module has no top-k logprobs function")


def drafter_of(runner: Any) -> Any | None:
    """The V1 runner's model-based proposer (``drafter``, all releases), or None: ngram
    and suffix decoding have other drafters, and the V2 runner a ``speculator``."""
    drafter = getattr(runner, "drafter", None)
    needed = ("positions", "block_size", "max_model_len", "backup_next_token_ids")
    return drafter if all(hasattr(drafter, name) for name in needed) else None


def eagle_helper(name: str) -> Any | None:
    """A kernel or launcher of ``v1/spec_decode/utils.py`` by name (the EAGLE helpers:
    the same four kernels and signatures in 0.22 and 0.26-0.29), None where absent."""
    try:
        return getattr(importlib.import_module(paths.SPEC_UTILS_MODULE), name, None)
    except ImportError:
        return None


def logits_of(runner: Any, rows: int) -> Any:
    """``rows`` rows of logits as the live model computes them: its ``compute_logits``
    on zero hidden states, so dtype, vocabulary and stride are serving's (all releases:
    ``model.compute_logits(hidden_states)``, hidden size from ``model_config``)."""
    import torch

    model_config = runner.model_config
    hidden = torch.zeros(
        rows, model_config.get_hidden_size(), dtype=model_config.dtype, device=runner.device
    )
    with torch.inference_mode():
        return runner.model.compute_logits(hidden)
