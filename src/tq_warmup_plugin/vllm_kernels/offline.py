"""vLLM's own kernels without a worker: the engine warmers' jobs on vLLM's CPU objects.

A worker's engine warmers (``vllm_kernels.run``) compile the keys vLLM's own kernels launch
with (slot mapping, the rejection sampler, top-k/top-p, logprobs). ``inspect`` and
``precompile --speculative-config`` list and build the same keys offline, so that a shipped
layer serves them, and the compile-ahead child (``ahead``) builds them beside a worker that
is still loading its model. All three describe the engine by vLLM's engine arguments
(``EngineRequest``) and run the very warmers a worker runs, on a runner of vLLM's own CPU
objects: its ``MultiGroupBlockTable``, ``Sampler`` and ``RejectionSampler``, and logits of the
model's vocabulary and dtype. A job that needs the live worker (a model forward, a graph
``torch.compile`` builds for the device) is declined in one line: it runs at startup, as
before. The V1 runner's drafter, whose EAGLE helpers' keys read its buffers and constants,
is rebuilt from the engine arguments (``offline_drafter``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from types import SimpleNamespace
from typing import Any

import pluggy

from .. import compat, patching
from ..compat import V2_SPEC_METHODS, Features, runs_v2  # compat re-exports them
from ..warmers import vllm_draft_prefill
from ..warmers.vllm_eagle import eagle_style
from . import run as engine_warmup
from .jobs import Declined, Engine, Job

__all__ = [
    "H100_SMS",
    "V2_SPEC_METHODS",
    "EngineRequest",
    "build",
    "cpu_engine",
    "jobs",
    "offline_drafter",
    "offline_speculator",
    "planned_request",
    "request_for",
    "runs_v2",
]

H100_SMS = 132
"""The SM count of an H100/H200, for launchers that size a grid by it (``_topk_topp_kernel``:
``min(SMs, batch)`` programs, the grid only, not the key) on a host without the GPU."""


@dataclasses.dataclass(frozen=True)
class EngineRequest:
    """The engine arguments vLLM's own kernel keys depend on, by vLLM's names."""

    features: Features
    runner_v2: bool
    vocab_size: int
    model_dtype: str
    """``bfloat16`` or ``float16``: the logits' dtype (the V2 sampler keeps it on 0.26)."""
    block_size: int
    """The KV manager's block size (``cache_config.block_size``): TurboQuant's effective one,
    or a hybrid's, sized to its Mamba state; its kernels' block follows from it
    (``compat.kernel_block_size``)."""
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    spec_method: str | None = None
    spec_tokens: int = 0
    draft_probs: bool = False
    max_logprobs: int = 20
    moe_experts: tuple[compat.MoeExperts, ...] = ()
    """The experts the model's config gives a rank (``compat.moe_experts_of_config``);
    empty for a dense model or one whose experts are not derived offline."""
    graph_tokens: int = 0
    """The largest CUDA graph's tokens: a MoE step past it runs eagerly at its own size."""
    gpu_name: str = ""
    """vLLM's name of the target GPU (``compat.device_name``), for the MoE config lookup."""
    zeroing: compat.KvZeroing | None = None
    """A hybrid's KV-block zeroing (``plan.request.kv_zeroing``); None: none planned."""

    def to_dict(self) -> dict[str, Any]:
        fields = dataclasses.asdict(self)
        fields["features"] = ".".join(map(str, self.features.version))
        return fields

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EngineRequest:
        """The inverse of ``to_dict``; a missing or mistyped field raises ValueError."""
        known = {f.name: f.type for f in dataclasses.fields(cls)}
        if set(data) != set(known):
            raise ValueError(f"engine request fields {sorted(data)} are not {sorted(known)}")
        values = dict(data)
        values["features"] = compat.release_features(str(values["features"]))
        for name in ("vocab_size", "block_size", "max_model_len", "max_num_seqs",
                     "max_num_batched_tokens", "spec_tokens", "max_logprobs",
                     "graph_tokens"):  # fmt: skip
            if type(values[name]) is not int:
                raise ValueError(f"engine request {name}={values[name]!r} is not an integer")
        values["moe_experts"] = _experts_of(values["moe_experts"])
        values["zeroing"] = _zeroing_of(values["zeroing"])
        return cls(**values)


def _zeroing_of(item: Any) -> compat.KvZeroing | None:
    """``EngineRequest.zeroing`` from JSON; a malformed one raises ValueError."""
    if item is None:
        return None
    names = [f.name for f in dataclasses.fields(compat.KvZeroing)]
    if not isinstance(item, dict) or sorted(item) != sorted(names):
        raise ValueError(f"engine request zeroing {item!r} is not {names}")
    if not all(type(item[n]) is int and item[n] > 0 for n in names):
        raise ValueError(f"engine request zeroing {item!r}: not positive integers")
    return compat.KvZeroing(**item)


def _experts_of(items: Any) -> tuple[compat.MoeExperts, ...]:
    """``EngineRequest.moe_experts`` from JSON; a malformed item raises ValueError."""
    try:
        return tuple(
            compat.MoeExperts(tuple(map(int, e["w13"])), tuple(map(int, e["w2"])),
                              int(e["experts"]), int(e["top_k"]), str(e["dtype"]))
            for e in items
        )  # fmt: skip
    except (TypeError, KeyError, ValueError) as exc:
        raise ValueError(f"engine request moe_experts: {type(exc).__name__}: {exc}") from None


def planned_request(
    planned: Any,
    spec: Mapping[str, object] | None,
    max_logprobs: int,
    gpu_name: str = "",
    runner: str | None = None,
) -> EngineRequest:
    """The engine arguments of a plan's worker (``planning.Planned``): its geometry,
    vocabulary, experts and zeroing, and the runner vLLM picks for them
    (``compat.runs_v2``; ``runner`` is ``--runner``, None for vLLM's default)."""
    method = None if spec is None else str(spec["method"])
    v2 = compat.runs_v2(planned.geometry.features, method, planned.moe, runner)
    return request_for(planned.geometry, planned.vocab_size, spec, max_logprobs, v2,
                       planned.experts, gpu_name, planned.zeroing)  # fmt: skip


def request_for(
    geometry: Any,
    vocab_size: int,
    spec: Mapping[str, object] | None,
    max_logprobs: int,
    runner_v2: bool,
    moe_experts: tuple[compat.MoeExperts, ...] = (),
    gpu_name: str = "",
    zeroing: compat.KvZeroing | None = None,
) -> EngineRequest:
    """The engine arguments of a planned TurboQuant geometry (``planning.Planned``); its
    CUDA graphs are vLLM's default ones (``compat.default_graph_tokens``)."""
    method, tokens, probs = compat.speculative_fields(spec)
    graphs = compat.default_graph_tokens(
        geometry.max_num_seqs, tokens, geometry.max_num_batched_tokens
    )
    return EngineRequest(
        features=geometry.features,
        runner_v2=runner_v2,
        vocab_size=vocab_size,
        model_dtype=geometry.model_dtype,
        block_size=geometry.block_size,
        max_model_len=geometry.max_model_len,
        max_num_seqs=geometry.max_num_seqs,
        max_num_batched_tokens=geometry.max_num_batched_tokens,
        spec_method=method,
        spec_tokens=tokens,
        draft_probs=probs,
        max_logprobs=max_logprobs,
        moe_experts=moe_experts,
        graph_tokens=graphs,
        gpu_name=gpu_name,
        zeroing=zeroing,
    )


class _Logits:
    """The model as the warmers see it: ``compute_logits`` of the vocabulary's width."""

    def __init__(self, vocab: int, dtype: Any) -> None:
        self.vocab, self.dtype = vocab, dtype

    def compute_logits(self, hidden: Any) -> Any:
        import torch

        return torch.zeros(hidden.shape[0], self.vocab, dtype=self.dtype, device=hidden.device)


DRAFT_HIDDEN_STATES = frozenset({"eagle", "eagle3", "mtp"})
"""Drafters fed the target's hidden states: EAGLE's proposer (``EagleProposer``,
``pass_hidden_states_to_model=True``, 0.22 and 0.26), which also runs ``mtp`` and a model's
own MTP method (``*_mtp``). A draft model's (``DraftModelProposer``) is not."""


def offline_drafter(request: EngineRequest, device: Any) -> SimpleNamespace | None:
    """The state of the V1 runner's model-based proposer that its EAGLE helpers' keys read
    (``warmers/vllm_eagle``), as ``SpecDecodeBaseProposer.__init__`` and
    ``initialize_attn_backend`` set it (0.22, 0.26): int64 positions and slots, int32 input
    ids and backup tokens, bool masks, ``max_num_seqs`` requests, one extra input slot per
    request without parallel drafting, less one where hidden states are passed, no
    parallel-drafting token. Its ``block_size`` is the kernel block of the drafting layers'
    KV group (``initialize_attn_backend`` reads it from the metadata builder, which takes
    the group's kernel block), the group taken as the target's: vLLM gives every group one
    page size (0.25+, ``plan.rules.effective_block_size``), and the kernel block is vLLM's
    own choice for it (``compat.kernel_block_size``: 16 for a hybrid's 2160). A guess
    that misses costs the worker a compile, never a wrong result. None without such a
    drafter (ngram, suffix, the V2 runner's)."""
    method = request.spec_method
    if method is None or request.runner_v2 or not eagle_style(method):
        return None
    import torch

    hidden = method in DRAFT_HIDDEN_STATES or method.endswith("_mtp")
    tokens = request.max_num_batched_tokens + request.max_num_seqs

    def buffer(dtype: Any, n: int = tokens) -> Any:
        return torch.zeros(n, dtype=dtype, device=device)

    extra = 1  # without parallel drafting
    new_slots = extra - (1 if hidden else 0)
    return SimpleNamespace(
        method=method,
        block_size=compat.kernel_block_size(request.block_size),
        max_model_len=request.max_model_len,
        max_batch_size=request.max_num_seqs,
        pass_hidden_states_to_model=hidden,
        extra_slots_per_request=extra,
        net_num_new_slots_per_request=new_slots,
        needs_extra_input_slots=new_slots > 0,
        parallel_drafting_token_id=0,
        input_ids=buffer(torch.int32),
        positions=buffer(torch.int64),
        _slot_mapping_buffer=buffer(torch.int64, request.max_model_len),
        is_rejected_token_mask=buffer(torch.bool),
        is_masked_token_mask=buffer(torch.bool),
        backup_next_token_ids=SimpleNamespace(gpu=buffer(torch.int32, request.max_num_seqs)),
    )


def offline_speculator(request: EngineRequest, device: Any) -> SimpleNamespace | None:
    """The V2 draft_model speculator's state that its first-pass input kernel's keys read
    (``warmers/vllm_draft_prefill``), as its ``__init__`` sets it (0.31-0.34): vLLM's own
    ``InputBuffers`` of ``max_num_seqs`` requests and ``max_num_batched_tokens`` tokens,
    int32 and int64 expanded inputs one slot longer per request, int64 last-token indices.
    None for any other drafter or runner, or a release without that speculator."""
    if not vllm_draft_prefill.reaches(request.features, request.runner_v2, request.spec_method):
        return None
    import torch

    buffers_cls = importlib.import_module(compat.V2_INPUT_BATCH_MODULE).InputBuffers
    reqs, tokens = request.max_num_seqs, request.max_num_batched_tokens
    return SimpleNamespace(
        input_buffers=buffers_cls(reqs, tokens, device),
        expanded_input_ids=torch.zeros(tokens + reqs, dtype=torch.int32, device=device),
        expanded_positions=torch.zeros(tokens + reqs, dtype=torch.int64, device=device),
        last_token_indices=torch.zeros(reqs, dtype=torch.int64, device=device),
        max_num_reqs=reqs,
        max_model_len=request.max_model_len,
        max_num_tokens=tokens,
    )


def cpu_engine(request: EngineRequest) -> Engine:
    """The ``Engine`` a worker of these arguments reads, on a runner of vLLM's own CPU
    objects and the drafter's state (``offline_drafter``).

    Its device, where the launchers' tensors live, is ``meta``: a GPU's tensor without the
    GPU. Not the CPU: vLLM's top-k/top-p launcher picks its tiles by the device type
    (``BLOCK_SIZE`` 256 on a CPU, 8192 on a GPU, ``topk_topp_triton.py`` 0.26:940), so CPU
    logits built keys no GPU asks for (the child's top-k/top-p keys all compiled again in
    the worker, vLLM 0.26.0). A meta tensor's address is 0, which Triton classes as aligned,
    as a GPU allocation is."""
    import torch

    dtype = getattr(torch, request.model_dtype)
    sampler = rejection = tables = None
    if not request.runner_v2:  # V1's objects, which 0.34 removed with the V1 runner
        sampler = importlib.import_module(compat.SAMPLER_MODULE).Sampler()
        if request.spec_method:
            rejection = importlib.import_module(compat.REJECTION_MODULE).RejectionSampler(sampler)
        tables = compat.cpu_block_tables(
            request.block_size, request.max_model_len, request.max_num_seqs,
            request.max_num_batched_tokens,
        )  # fmt: skip
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(
            block_table=SimpleNamespace(block_tables=tables), vocab_size=request.vocab_size
        ),
        sampler=sampler,
        rejection_sampler=rejection,
        model=_Logits(request.vocab_size, dtype),
        model_config=SimpleNamespace(get_hidden_size=lambda: 1, dtype=dtype),
        device=torch.device("meta"),
        drafter=offline_drafter(request, torch.device("meta")),
        speculator=offline_speculator(request, torch.device("meta")),
    )
    shared = ("features", "runner_v2", "spec_method", "spec_tokens", "draft_probs", "max_logprobs")
    return Engine(
        **{name: getattr(request, name) for name in shared},
        pooling=False,
        moe=bool(request.moe_experts),
        graph_tokens=request.graph_tokens,
        planned_experts=request.moe_experts,
        kv_zeroing=request.zeroing,
        planned=True,
        gpu_name=request.gpu_name,
        vocab_size=request.vocab_size,
        max_tokens=request.max_num_batched_tokens,
        device=runner.device,
        runner=runner,
    )


def jobs(
    pm: pluggy.PluginManager, engine: Engine, sms: int = H100_SMS
) -> tuple[list[Job], list[Declined], list[str]]:
    """The warmers' offline jobs for ``engine`` on a GPU of ``sms`` SMs (the top-k/top-p
    warmer's split-row batch sizes follow from it); a job that needs the worker is one
    decline per family (it runs at startup)."""
    with _sm_count(sms):
        planned, declined, errors = engine_warmup.plan(pm, engine)
    offline = [job for job in planned if job.offline and not job.real]
    later = Counter(job.family for job in planned if job.real or not job.offline)
    declined += [
        Declined(family, f"{n} job{'s' * (n > 1)} need the worker: warmed at startup")
        for family, n in later.items()
    ]
    return offline, declined, errors


@contextlib.contextmanager
def _sm_count(count: int) -> Iterator[None]:
    """``num_compute_units`` answers ``count`` for the top-k/top-p launcher, which reads it
    for its grid (0.26+; absent before), where the CPU platform cannot say it."""
    try:
        module = importlib.import_module(compat.TOPK_TOPP_TRITON_MODULE)
    except ImportError:
        yield
        return
    if getattr(module, "num_compute_units", None) is None:
        yield
        return
    with patching.swapped(module, {"num_compute_units": lambda index=None: count}):
        yield


_FORKED: list[Job] = []
"""The jobs a forked compile process runs by index (a job does not pickle; a fork has it)."""


def _run_forked(index: int) -> str | None:
    return engine_warmup.run_job(_FORKED[index])


def build(
    todo: list[Job],
    sms: int = H100_SMS,
    processes: int = 1,
    each: Callable[[], None] | None = None,
) -> tuple[list[Job], list[str]]:
    """Compile the keys of offline jobs (``jobs``) into Triton's cache (``TRITON_CACHE_DIR``);
    the jobs done and one error line per job that failed. ``processes`` over 1 forks that many
    (the compile-ahead child, which has no GPU and no thread but its own): Triton holds the
    GIL for most of a compile, so only processes compile side by side; ``each`` runs first
    in each of them."""
    with _sm_count(sms), compat.compile_only_launches(load=False):
        if processes > 1 and len(todo) > 1:
            import multiprocessing

            _FORKED[:] = todo[::-1]  # last first: a worker's warmers start at the first
            try:
                context = multiprocessing.get_context("fork")
                with context.Pool(min(processes, len(todo)), initializer=each) as pool:
                    outcomes = pool.map(_run_forked, range(len(todo)), chunksize=1)
            finally:
                _FORKED.clear()
            outcomes = outcomes[::-1]
        else:
            outcomes = [engine_warmup.run_job(job) for job in todo]
    errors = [line for line in outcomes if line is not None]
    return [job for job, line in zip(todo, outcomes, strict=True) if line is None], errors
