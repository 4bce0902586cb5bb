"""What vLLM's own kernels specialize on in one worker, and the jobs that warm them.

TurboQuant's kernels are keyed by the layers (``Geometry``). The kernels vLLM itself
launches around them (slot mapping, the rejection sampler, top-k/top-p, logprobs) are
keyed by the engine: which model runner, the block tables it built, speculative
decoding, the vocabulary. A TurboQuant server on vLLM 0.26.0 with ngram died in JIT-monitor
``error`` mode on ``_compute_slot_mapping_kernel`` (``benchmarks/results/serve-jit``): vLLM's
warmup compiles that kernel for block sizes 3 and 16 only, and TurboQuant's bf16 block size
there is 32, a ``KV_CACHE_BLOCK_SIZE`` constexpr.

An ``Engine`` is read once from the live worker (``compat.engine_of``). Warmers turn
it into ``Job``s (a callable that runs vLLM's own launcher on a few bytes, under
``compat.compile_only_launches``: every launch compiles and loads, none runs) or
into one-line ``Declined`` reasons. The host (``vllm_kernels.run``) runs them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ..compat import Features, KvZeroing, MoeExperts

__all__ = ["Declined", "Engine", "EngineResult", "Job"]


@dataclass(frozen=True)
class Engine:
    """The engine-level inputs of vLLM's own kernel keys, as one worker has them."""

    features: Features
    runner_v2: bool
    """``Worker.use_v2_model_runner``: V2 warms its input kernels with real steps."""
    pooling: bool
    """A pooling model samples nothing and maps no slots."""
    spec_method: str | None
    """``speculative_config.method`` (ngram, eagle, eagle3, mtp, draft_model), else None."""
    spec_tokens: int
    """``num_speculative_tokens``, 0 without speculative decoding."""
    draft_probs: bool
    """The rejection sampler gets the draft's probabilities: ``rejection_sample_method
    == "standard"`` and ``draft_sample_method == "probabilistic"`` (0.26), as vLLM's
    own ``_dummy_sampler_run`` decides it."""
    max_logprobs: int
    """``model_config.max_logprobs``: the most logprobs a request may ask for."""
    moe: bool = False
    """``model_config.is_moe`` (all releases): the model runs ``fused_moe_kernel``."""
    hybrid: bool = False
    """``model_config.is_hybrid`` (all releases): Mamba or gated-delta-net layers."""
    jit_monitor_error: bool = False
    """``--jit-monitor-mode error`` (0.25+): a kernel compiled after startup stops the
    engine core, so a kernel no warmer reaches is a WARNING, not an INFO line."""
    max_tokens: int = 0
    """``scheduler_config.max_num_batched_tokens``: the most tokens one step runs."""
    graph_tokens: int = 0
    """The largest token count a CUDA graph runs (``cudagraph_capture_sizes``), 0 where
    graphs are off: a step of at most this many tokens is padded to a captured size, whose
    kernels capture compiled; a longer one runs eagerly at its own size."""
    full_decode_graphs: bool = False
    """``compat.full_decode_graphs``: decode steps replay FULL CUDA graphs, whose capture
    ran their kernels with real attention metadata (Mamba/GDN layers' included)."""
    micro_batches: bool = False
    """``compat.ubatching``: ``--enable-dbo`` or ``--ubatch-size`` over 1 splits a step into
    microbatches, so a layer runs at their sizes, not the step's."""
    planned_experts: tuple[MoeExperts, ...] = ()
    """The experts of an engine planned without a worker (``vllm_kernels.offline``), read from the
    model's config (``compat.moe_experts_of_config``): their keys build offline. Empty in
    a worker, whose MoE warmer reads its built model's."""
    kv_zeroing: KvZeroing | None = None
    """A planned hybrid's KV-block zeroing (``plan.request.kv_zeroing``), whose keys then build
    offline; None in a worker, whose warmer calls its runner's own zeroer."""
    planned: bool = False
    """Built without a worker (``vllm_kernels.offline.cpu_engine``: ``precompile``, ``inspect``, the
    compile-ahead child): what only the worker's own objects say (its scheduling, its KV
    cache) is not known here, and a warmer that needs it says so."""
    gpu_name: str = ""
    """The GPU an offline plan builds for, by vLLM's name (``compat.device_name``): the
    fused MoE config lookup reads that GPU's tuned JSONs."""
    vocab_size: int = 0
    """``model_config.get_vocab_size()``: the logits' width, which sets the split count of
    the split-row top-p kernels (``compat.topp_split_count``); 0 where not known."""
    device: Any = field(compare=False, default=None)
    runner: Any = field(compare=False, default=None)
    """The live model runner: its block tables and model are what serving launches with."""

    @cached_property
    def model_logits(self) -> Any:
        """Two rows of the model's logits (``logits.sample``), computed once, on the thread
        that first reads them: the host reads them on its own thread before its pool starts
        (``vllm_kernels.run``), so jobs copy rows of them (``logits.rows_like``) and no pool
        thread runs the model's GEMM."""
        from . import logits

        return logits.sample(self.runner)


@dataclass(frozen=True)
class Job:
    """One warmup of vLLM's own kernels: ``run`` calls vLLM's launcher code."""

    family: str
    """A name for the report: ``slot mapping``, ``rejection sampler``, ``top-k/top-p``,
    ``logprobs``."""
    what: str
    """The configuration it covers, for error lines; with ``family`` it names the job,
    so equal jobs of two warmers run once (``vllm_kernels.run.plan``)."""
    run: Callable[[], object] = field(compare=False)
    real: bool = False
    """``run`` executes vLLM's code for real, on the caller's thread, before the others and
    outside ``compat.compile_only_launches``: a model forward (``compat.dummy_run``) can
    neither share vLLM's one forward context with another thread nor skip its launches
    (its routing would read memory no kernel wrote)."""
    graphs: bool = False
    """``run`` calls a ``torch.compile``d function (the V1 sampler's rank count, the async
    spec-decode correction). Such jobs run one at a time, after the others (Dynamo's
    traces beside them slowed their Triton lookups, ``vllm_kernels.run.run``): Dynamo and AOT
    autograd keep process-global state (``torch.fx``'s tracing flag): compiled on threads
    beside each other, such graphs failed with "Detected that you are using FX to symbolically
    trace a dynamo-optimized function" and compiled while serving instead (vLLM 0.26.0,
    ``benchmarks/results/serve-jit/SUMMARY.md``)."""
    offline: bool = True
    """Its keys can be built without the worker, on vLLM's CPU objects (``vllm_kernels.offline``:
    ``precompile``, the compile-ahead child): a launch of Triton kernels on a few bytes.
    Not a real job, nor one whose kernels ``torch.compile`` generates for the device."""


@dataclass(frozen=True)
class Declined:
    """A warmer with nothing to do here, and the one-line reason."""

    family: str
    why: str
    warn: bool = False
    """Logged as a WARNING: what is not warmed will compile while serving, and the
    engine's JIT monitor stops it there (``Engine.jit_monitor_error``)."""


@dataclass
class EngineResult:
    """What the engine warmers did in one worker."""

    jobs: dict[str, int] = field(default_factory=dict)
    """Jobs run per family (``slot mapping 1``, ``rejection sampler 3``)."""
    kernels: int = 0
    """Triton launches met, each compiled, found in memory or loaded from disk."""
    compiled: int = 0
    """Of them, the Triton compiles (the rest were in memory or on disk: a shipped layer,
    the compile-ahead child's keys, an earlier start)."""
    compiled_names: dict[str, int] = field(default_factory=dict)
    """Those compiles per kernel name."""
    declined: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    forwards: tuple[int, int, float] = (0, 0, 0.0)
    """The real jobs (``Job.real``): how many, the Triton compiles they made, their
    seconds."""
    family_seconds: dict[str, float] = field(default_factory=dict)
    """Each family's jobs' seconds, summed (jobs of a family may overlap on threads): where
    a warm start's time goes (``benchmarks/results/serve-jit/SUMMARY.md`` has a hybrid's)."""
    triton_seconds: tuple[float, float] = (0.0, 0.0)
    """Of the jobs' time, what Triton took (``compat.Launches``): its launches' lookups
    (a compile or a disk load among them) and ``_init_handles`` (launcher, module load)."""
