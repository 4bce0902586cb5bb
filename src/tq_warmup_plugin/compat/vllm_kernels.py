"""Where vLLM keeps the launchers of its own kernels around TurboQuant's (all releases; the
V1 runner's samplers, block tables and drafter 0.20-0.33, ``Features.v1_runner``).

``engine_warmup`` calls vLLM's own launcher functions (slot mapping, the rejection
sampler, top-k/top-p, logprobs) on a few bytes; this module finds them and builds their inputs,
each accessor naming the releases it serves.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from . import vllm_paths as paths
from .live import ubatching, worker_uses_v2
from .releases import Features

__all__ = [
    "CompatError",
    "KvZeroing",
    "async_spec_correction",
    "cpu_block_tables",
    "default_graph_tokens",
    "drafter_of",
    "dummy_run",
    "eagle_helper",
    "engine_of",
    "full_decode_graphs",
    "graph_tokens",
    "hybrid_block_size",
    "kernel_block_size",
    "kv_block_zeroer",
    "kv_zeroing_counts",
    "logits_of",
    "sampling_metadata",
    "slot_mapping_tables",
    "spec_decode_metadata",
    "speculative_config_of",
    "speculative_fields",
    "speculative_of",
    "top_k_top_p_function",
    "topk_logprobs_function",
    "topp_split_count",
    "zero_blocks_launch",
]


class CompatError(RuntimeError):
    """A vLLM object has a shape this release table does not know: the job that met it
    fails in one error line (``engine_warmup``)."""


def engine_of(worker: Any, feats: Features) -> dict[str, Any]:
    """The fields of a live worker's ``engine.Engine`` (``worker_uses_v2``; all releases:
    ``model_runner``, ``vllm_config.speculative_config``,
    ``model_config.max_logprobs``, ``get_vocab_size``, ``is_moe``, ``is_hybrid`` and
    ``is_pooling_model`` under the same names)."""
    config = worker.vllm_config
    method, tokens, probs = speculative_of(config)
    runner = worker.model_runner
    return dict(
        features=feats,
        runner_v2=worker_uses_v2(worker, feats),
        pooling=bool(getattr(runner, "is_pooling_model", False)),
        spec_method=method,
        spec_tokens=tokens,
        draft_probs=probs,
        max_logprobs=int(getattr(config.model_config, "max_logprobs", 20)),
        vocab_size=int(getattr(config.model_config, "get_vocab_size", lambda: 0)()),
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
    "method", "num_speculative_tokens", "rejection_sample_method", "draft_sample_method",
    "parallel_drafting",
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
    return speculative_fields(speculative_config_of(vllm_config))


def speculative_config_of(vllm_config: Any) -> dict[str, object] | None:
    """A ``VllmConfig``'s ``speculative_config`` as the ``--speculative-config`` fields the
    plugin reads (all releases; ``parallel_drafting`` where it has one), None without."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return None
    return {k: getattr(spec, k) for k in _SPEC_FIELDS if hasattr(spec, k)}


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


def default_graph_tokens(max_num_seqs: int, spec_tokens: int, max_num_batched_tokens: int) -> int:
    """The largest CUDA graph vLLM captures by default on Hopper: ``max_num_seqs`` decode
    steps of ``1 + k`` tokens, doubled, at most 512 and at most a step's tokens
    (``VllmConfig._set_cudagraph_sizes``: 0.22, 0.26; 0.30 and 0.33 alike below
    Blackwell). An offline plan's guess: a worker reads its own (:func:`graph_tokens`)."""
    return min(max_num_seqs * (1 + spec_tokens) * 2, 512, max_num_batched_tokens)


def dummy_run(runner: Any, tokens: int) -> None:
    """One forward of ``tokens`` tokens without attention, as the worker's own
    ``compile_or_warm_up_model`` runs its compile sizes (``_dummy_run(size,
    skip_eplb=True, remove_lora=False)``, V1 and V2 runners, all releases)."""
    runner._dummy_run(tokens, skip_eplb=True, remove_lora=False)


def slot_mapping_tables(runner: Any) -> list[Any]:
    """The V1 runner's ``BlockTable`` objects that map tokens to slots:
    ``input_batch.block_table.block_tables`` (``MultiGroupBlockTable``, 0.20-0.33).
    0.26+ mark mamba-like groups ``slot_mapping_mode == NONE``; they map nothing."""
    tables = runner.input_batch.block_table.block_tables
    return [t for t in tables if _mode(t) != "none"]


def hybrid_block_size(
    model_config: Any,
    tp: int,
    cache_dtype: str,
    block_size: int,
    spec_tokens: int,
    prefix_caching: bool = False,
    mamba_cache_mode: str = "none",
) -> int:
    """The attention block vLLM gives a hybrid (attention + Mamba) model: its own
    ``Platform._align_hybrid_block_size`` over TurboQuant's backend (0.21-0.33), which grows
    the block until a TurboQuant page covers the model's Mamba state, on a ``VllmConfig`` of
    the model (a CPU device: the method reads the model, cache, parallel and speculative
    configs only). The state grows with the draft tokens, and so does the block: 2096, 2160 and
    2224 tokens at k = 0, 2 and 4 for the serve-jit Qwen3-Next (vLLM 0.22-0.33), as a 0.26.0
    server logged with MTP k=2 (``benchmarks/results/serve-jit/SUMMARY.md``). A worker does
    this after loading its model, so an offline plan that skipped it would plan such a model
    at TurboQuant's own 32.

    Prefix caching (opt-in for hybrids, 0.22-0.33) picks the ``mamba_cache_mode`` first, by
    vLLM's own ``HybridAttentionMambaModelConfig`` as ``VllmConfig`` runs it: ``all`` for
    a model that declares Mamba prefix caching on 0.22-0.26, whose block then aligns to the
    Mamba chunk (Jamba: 2048 tokens where it is 304 without, on a CPU), ``align`` on
    0.30+ and for other models, which keeps the block. Raises CompatError where vLLM cannot
    say (a model class that does not import)."""
    from types import SimpleNamespace

    try:  # a release without the method (0.20) or the backend is one line too
        config_module = importlib.import_module(paths.MODEL_CONFIG_MODULE)
        hybrid = importlib.import_module(paths.MODEL_CONFIGS_MODULE).HybridAttentionMambaModelConfig
        platform = importlib.import_module(paths.PLATFORM_INTERFACE_MODULE).Platform
        backend = getattr(importlib.import_module(paths.BACKEND_MODULE), paths.BACKEND_CLASS)
        cache = config_module.CacheConfig(
            cache_dtype=cache_dtype,
            block_size=block_size,
            enable_prefix_caching=prefix_caching,
            mamba_cache_mode=mamba_cache_mode,
        )
        config = config_module.VllmConfig(
            device_config=config_module.DeviceConfig(device="cpu"),
            cache_config=cache,
            parallel_config=config_module.ParallelConfig(tensor_parallel_size=tp),
        )
        object.__setattr__(config, "model_config", model_config)  # not re-validated
        cache.block_size = block_size  # whatever the platform's own checks made of it
        spec = SimpleNamespace(num_speculative_tokens=spec_tokens) if spec_tokens else None
        object.__setattr__(config, "speculative_config", spec)
        hybrid.verify_and_update_config(config)
        platform._align_hybrid_block_size(config, backend)
    except Exception as exc:  # vLLM raises anything from a model class or a config
        why = f"{type(exc).__name__}: {exc}"
        raise CompatError(f"vLLM could not size the hybrid block: {why}"[:300]) from None
    return int(cache.block_size)


def kernel_block_size(block_size: int) -> int:
    """The block TurboQuant's kernels run on for a KV manager block of ``block_size``
    tokens: vLLM's own ``select_common_block_size`` over TurboQuant's backend, as the V1
    runner's ``prepare_kernel_block_sizes`` picks it for an attention group (0.22-0.33,
    ``vllm.v1.worker.utils``). The two differ for a hybrid model, whose attention pages vLLM
    sizes to the Mamba state: the serve-jit Qwen3-Next's block of 2160 tokens runs kernels of
    16, 135 to a block (vLLM 0.26.0, ``benchmarks/results/serve-jit/SUMMARY.md``), and its
    drafter's helpers and slot mapping are keyed by those. Where the function or the backend is
    missing, the block itself: a miss costs the worker a compile, never a wrong result."""
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
    """vLLM's own ``SpecDecodeMetadata.make_dummy`` (0.20-0.33, the V1 runner's)."""
    cls = importlib.import_module(paths.SPEC_METADATA_MODULE).SpecDecodeMetadata
    return cls.make_dummy(draft_token_ids, device)


# The fields a sampling batch's mode is told by; every other field of vLLM's
# ``SamplingMetadata`` (0.20-0.33, the V1 runner's) gets its "nothing requested" value below.
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
    ``all_random``), ``temperature`` and ``generators`` (0.20-0.33); the sampler also
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
    (all releases), which the V2 sampler calls, and V1's samplers (0.20-0.33); on a GPU
    it takes ``_topk_topp_kernel`` from 8 rows (0.26:351)."""
    return importlib.import_module(paths.TOPK_TOPP_MODULE).apply_top_k_top_p


def topp_split_count(device_index: int | None) -> tuple[Callable[[int, int], int], int] | None:
    """vLLM's split-row top-p pipeline (``_apply_topp_split``, 0.30-0.34; none on 0.26):
    a batch of at most ``_SPLIT_MAX_BATCH`` rows with top-p goes through three kernels
    whose constexpr ``S`` is ``_topp_split_count(rows, vocab, SMs)``, so each batch size
    class compiles its own binaries. Returns ``(rows, vocab) -> S`` for this device (its
    SM count as the launcher reads it, ``num_compute_units``) and that most rows; None
    where the release has no such pipeline or the platform no SM count."""
    try:
        module = importlib.import_module(paths.TOPK_TOPP_TRITON_MODULE)
    except ImportError:  # 0.20-0.25: no Triton top-k/top-p module
        return None
    count = getattr(module, "_topp_split_count", None)
    most = getattr(module, "_SPLIT_MAX_BATCH", None)
    sms = getattr(module, "num_compute_units", None)
    if not (callable(count) and callable(sms) and isinstance(most, int)):
        return None
    try:
        num_sm = int(sms(device_index))
    except (NotImplementedError, RuntimeError):  # a platform without an SM count
        return None
    if "vocab_size" in inspect.signature(count).parameters:  # 0.33-0.34
        return (lambda rows, vocab: int(count(rows, vocab, num_sm))), most
    return (lambda rows, vocab: int(count(rows, num_sm))), most  # 0.30: (batch, SMs)


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
    """The V1 runner's model-based proposer (``drafter``, 0.20-0.33), or None: ngram
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


def kv_block_zeroer(runner: Any) -> Any | None:
    """The runner's ``KVBlockZeroer`` where it zeroes attention blocks (a model with Mamba
    layers: ``KVCacheConfig.needs_kv_cache_zeroing``), else None: the V1 runner's
    ``_kv_block_zeroer`` (0.22-0.33, set by ``_init_kv_zero_meta``), the V2 runner's
    ``kv_block_zeroer`` (0.26-0.34, ``gpu/model_runner.py`` 0.34:1363); one whose segment
    table is empty (``_meta`` None, no attention layer) zeroes nothing.
    ``zero_block_ids(ids)`` in all of them."""
    zeroer = getattr(runner, "kv_block_zeroer", None) or getattr(runner, "_kv_block_zeroer", None)
    if zeroer is None or getattr(zeroer, "_meta", None) is None:
        return None
    return zeroer


@dataclasses.dataclass(frozen=True)
class KvZeroing:
    """What ``_zero_kv_blocks_kernel``'s key is made of in a hybrid's worker, planned without
    it (``plan.request.kv_zeroing``): vLLM builds the kernel's constants from the allocated
    KV cache (``KVBlockZeroer``, ``v1/worker/utils.py``), which only a worker has."""

    segments: int
    """The distinct KV tensors of the attention layers: one segment each, TurboQuant's
    cache being blocks-first (``get_kv_cache_block_dim`` 0, 0.22-0.34)."""
    page_bytes: int
    """One KV manager block of one layer: its kernel blocks' bytes together."""
    kernel_page_bytes: int
    """One kernel block of one layer (the KV view's block stride, contiguous in it)."""


def _zeroing_kernel() -> Any:
    return importlib.import_module(paths.WORKER_UTILS_MODULE)._zero_kv_blocks_kernel


def kv_zeroing_counts() -> tuple[int, ...]:
    """Block counts with one ``_zero_kv_blocks_kernel`` key each: where the kernel takes
    ``n_blocks`` (0.22-0.26) Triton keys it as 1, a multiple of 16 or other, so 1, 2 and
    16; where it grids over the blocks (0.30-0.34) every count is one key, so 1."""
    return (1, 2, 16) if "n_blocks" in _zeroing_kernel().arg_names else (1,)


def zero_blocks_launch(zeroing: KvZeroing, n_blocks: int, device: Any) -> None:
    """Launch vLLM's ``_zero_kv_blocks_kernel`` for ``n_blocks`` blocks as
    ``KVBlockZeroer.zero_block_ids`` would with ``zeroing``'s cache, on empty tensors of
    its argument dtypes: under ``compile_only_launches`` it compiles that key and zeroes
    nothing. The constants are the zeroer's own arithmetic on the cache:
    - 0.22-0.26 (``N_SEGS``, ``PAGE_SIZE_EL``, ``BLOCK_SIZE``): the manager page in int32
      words and its largest power-of-2 divisor, at most 1024;
    - 0.30-0.34 (``BLOCK_SIZE`` only): the kernel page in words rounded up to a power of
      2, at most 1024 (the segments are virtual blocks, their count not in the key)."""
    import torch

    kernel = _zeroing_kernel()
    ids = torch.empty(n_blocks, dtype=torch.int64, device=device)
    addrs = torch.empty(zeroing.segments, dtype=torch.uint64, device=device)
    if "n_blocks" in kernel.arg_names:
        page = zeroing.page_bytes // 4
        kernel[(1,)](addrs, ids, n_blocks, N_SEGS=zeroing.segments, PAGE_SIZE_EL=page,
                     BLOCK_SIZE=min(page & -page, 1024))  # fmt: skip
        return
    page = zeroing.kernel_page_bytes // 4
    sizes = torch.empty(zeroing.segments, dtype=torch.int64, device=device)
    kernel[(1, 1, 1)](addrs, sizes, sizes, ids, BLOCK_SIZE=min(1 << (page - 1).bit_length(), 1024))


def async_spec_correction(runner: Any) -> Any | None:
    """vLLM's ``update_num_computed_tokens_for_batch_change`` (``v1/spec_decode/utils.py``,
    ``torch.compile(dynamic=True)``; read in 0.22, 0.26, 0.30 and 0.33, called with the
    same buffers in each) where this runner calls it: a V1 runner with async scheduling
    and speculative decoding (``use_async_spec_decode``), else None."""
    if not getattr(runner, "use_async_spec_decode", False):
        return None
    module = importlib.import_module(paths.SPEC_UTILS_MODULE)
    return getattr(module, "update_num_computed_tokens_for_batch_change", None)
