"""The compile-ahead child: TurboQuant's and vLLM's own kernel keys built while the worker
loads its model.

Why: from a cold Triton cache the engine warmers' compiles cost a TurboQuant worker several
seconds of startup, over the 5 s a worker may add. Triton holds the GIL for most of a compile
(its AST walk and MLIR passes), so the worker's threads help little, and processes do. But
those keys depend only on engine arguments a worker knows before it loads its model
(``vllm_kernels.offline.EngineRequest``), and the worker then spends seconds to minutes on weights,
``torch.compile``, profiling and the KV cache; and so do TurboQuant's own keys, whose layers
the child plans from the worker's config (``plan.request.worker_plan``) as ``precompile`` plans
them from a model's. So ``Worker.load_model`` (a hybrid model's
``determine_available_memory``, where its block is final: ``LATE``) forks one child
(``spawn``, ``ahead_child.run_child``): vLLM already imported, CPU only (Triton's
compile-only target: no CUDA call, no GPU memory), with the worker's own environment, so it
compiles into the Triton cache the worker reads (its ``TRITON_CACHE_DIR``,
``TRITON_CACHE_MANAGER`` and shipped layers), for the worker's GPU architecture, the very
keys ``precompile`` builds, in forked processes, last job first.

The worker's warmup does not wait for it. Its TurboQuant keys and engine warmers run as
before and find on disk what it has built; what it has not, they compile, first job first,
so the two meet in the middle; then a child still running is killed. The warmers' time is
thus at most what it was without the child (and the CPUs it shares). Over a warm cache (a
restart, a shipped layer) it finds everything built and ends. Nothing it does can stop vLLM
starting: a child that fails or cannot start costs its one line in the report.
``TQ_WARMUP_AHEAD=0`` turns it off.

Evidence: the child took a V2 worker's vLLM-kernel warmers from over ten seconds to about a
tenth of one (vLLM 0.26.0, ``benchmarks/results/serve-jit/SUMMARY.md``; its CPU cost in
``benchmarks/results/ahead-cost.json``).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from .. import compat, patching

if TYPE_CHECKING:  # register() imports this module: the rest comes when a worker starts
    from .offline import EngineRequest

__all__ = [
    "LATE",
    "MODULE",
    "PROCESSES",
    "Child",
    "install",
    "remove",
    "request_of",
    "spawn",
    "start",
    "wait",
]

MODULE = compat.WORKER_MODULE
"""The module whose ``Worker.load_model`` starts the child (all releases)."""
PROCESSES = 4
"""The child's compile processes, at most half the CPUs: the worker beside it is loading
its model (the same bound the worker's own compile threads have, ``DEFAULT_THREADS``)."""


@dataclass
class Child:
    """The child of this worker process, while it runs and once it has ended."""

    pid: int | None
    out: int | None
    """The read end of the pipe its result line comes on."""
    started: float
    why: str = ""
    """Why there is no child (it could not start), else empty."""


_child: Child | None = None


def request_of(worker: Any, feats: compat.Features) -> EngineRequest | None:
    """The engine arguments of a worker that is about to load its model, or None where the
    engine warmers would warm nothing (no TurboQuant KV cache, a pooling model). The block
    size is final here: vLLM aligns TurboQuant's in the engine's config (0.25+
    ``Platform._align_heterogeneous_kv_block_size``, before the workers start)."""
    from .offline import EngineRequest

    config = worker.vllm_config
    cache = config.cache_config
    if not str(getattr(cache, "cache_dtype", "")).startswith(compat.TQ_DTYPE_PREFIX):
        return None
    model = config.model_config
    if getattr(model, "runner_type", "generate") == "pooling":
        return None
    method, tokens, probs = compat.speculative_of(config)
    scheduler = config.scheduler_config
    experts = _experts(config)
    return EngineRequest(
        features=feats,
        runner_v2=compat.worker_uses_v2(worker, feats),
        vocab_size=int(model.get_vocab_size()),
        model_dtype=str(model.dtype).removeprefix("torch."),
        block_size=int(cache.block_size),
        max_model_len=int(model.max_model_len),
        max_num_seqs=int(scheduler.max_num_seqs),
        max_num_batched_tokens=int(scheduler.max_num_batched_tokens),
        spec_method=method,
        spec_tokens=tokens,
        draft_probs=probs,
        max_logprobs=int(getattr(model, "max_logprobs", 20)),
        moe_experts=experts,
        graph_tokens=compat.graph_tokens(config),
        gpu_name=compat.device_name() if experts else "",
    )


def _experts(config: Any) -> tuple[compat.MoeExperts, ...]:
    """The experts the worker is about to build, from its config; none where they are not
    derived offline (the worker's own forwards then compile their keys, as before)."""
    parallel = getattr(config, "parallel_config", None)
    try:
        return compat.moe_experts_of_config(
            config.model_config,
            int(getattr(parallel, "tensor_parallel_size", 1)),
            bool(getattr(parallel, "enable_expert_parallel", False)),
        )
    except (compat.CompatError, AttributeError, TypeError, ValueError):  # a config unlike 0.22+
        return ()


def _arch() -> int | None:
    """The current GPU's SM as one number (90 for an H200): the child's compile target;
    None on ROCm, whose targets the compile-only driver does not build."""
    import torch

    if getattr(torch.version, "hip", None):
        return None
    major, minor = torch.cuda.get_device_capability()
    return int(major) * 10 + int(minor)


def _sms() -> int | None:
    """The current GPU's SM count: the top-k/top-p launchers key their split-row top-p
    kernels on it (``compat.topp_split_count``); None where torch cannot say (the child
    then builds for an H100's)."""
    try:
        import torch

        props = torch.cuda.get_device_properties(torch.cuda.current_device())
    except (ImportError, AssertionError, RuntimeError):  # no torch, or no CUDA in it
        return None
    return int(props.multi_processor_count)


def start(worker: Any) -> None:
    """Start this worker's child, once; any failure is its one line, never an exception."""
    global _child
    if _child is not None:
        return
    from ..worker.report import error_line

    started = time.perf_counter()
    try:
        feats = compat.release_features(compat.installed_vllm_version() or "")
        request = request_of(worker, feats)
        arch = _arch() if request is not None else None
        if request is None or arch is None:
            return
        sms = _sms()
        processes = max(1, min(PROCESSES, (os.cpu_count() or 1) // 2))
        verify = _verify_rows()
    except Exception as exc:
        _child = Child(None, None, started, f"did not start: {error_line(exc)}")
        return
    given = {
        "request": request.to_dict(),
        "arch": arch,
        "sms": sms,
        "processes": processes,
        "verify": verify,
    }
    spawn(given, worker.vllm_config)


def _verify_rows() -> bool:
    """Whether this process's settings serve verify batches as decode rows (the batched
    verify guard, ``guards.active``): the geometry the worker discovers then has them."""
    from ..settings import load

    chosen = load()
    return chosen.spec_guard and not chosen.spec_piecewise


def spawn(given: dict[str, Any], config: Any = None) -> None:
    """Fork this process's child for ``given`` (``{"request", "arch", "sms", "processes",
    "verify"}``) and the worker's ``config`` (what ``ahead_child.run_child`` takes);
    ``wait`` reaps it. A fork that fails is its one line.

    The child runs ``ahead_child.run_child`` and exits, never returning here; the worker keeps
    its pid and the pipe its result line comes on.

    Why a fork and not a fresh interpreter: a fresh child's own import of vLLM outlasted
    the time a V2 worker takes from ``load_model`` to its warmup (vLLM 0.26.0,
    ``benchmarks/results/serve-jit/SUMMARY.md``); the worker has vLLM imported.
    The fork has the worker's memory and none of its threads or its CUDA context: it runs
    Triton's compiler on the compile-only target (``use_compile_only_target``) and vLLM's CPU
    objects, and touches no GPU. Its standard streams go to ``/dev/null`` (the worker's log
    is the worker's); the exit is ``os._exit``, so none of the worker's exit handlers run."""
    import warnings

    from ..worker.report import error_line
    from . import ahead_child  # imported here, not in the fork: no import lock to inherit

    global _child
    started = time.perf_counter()
    pipe: tuple[int, ...] = ()
    try:
        pipe = read, write = os.pipe()
        with warnings.catch_warnings():  # Python 3.12+: a fork of a threaded process warns
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except Exception as exc:  # no descriptor or process left (EMFILE, EAGAIN), no fork at all
        for fd in pipe:
            os.close(fd)
        _child = Child(None, None, started, f"did not start: {error_line(exc)}")
        return
    if pid == 0:  # pragma: no cover - the child's side, which ends in os._exit
        code = 1
        try:
            os.close(read)
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 1)
            os.dup2(null, 2)
            code = ahead_child.run_child(given, write, config)
        finally:
            os._exit(code)
    os.close(write)
    _child = Child(pid, read, started)


def wait(timeout: float = 0.0) -> str:
    """Reap the child and say in one line what it did (empty where none was started). One
    still running after ``timeout`` seconds is killed: the engine warmers ran first and
    compiled whatever it had not built yet, so what is left of its work is theirs twice."""
    global _child
    child, _child = _child, None
    if child is None:
        return ""
    if child.pid is None or child.out is None:
        return f"compile-ahead child {child.why}"
    try:
        code = _reap(child.pid, timeout)
        if code is None:
            ran = time.perf_counter() - child.started
            return (
                f"compile-ahead child stopped after {ran:.1f} s: the worker's own warmers were done"
            )
        out = _written(child.out)
    finally:
        with contextlib.suppress(OSError):
            os.close(child.out)
    try:
        result = json.loads(out.decode("utf-8", "replace") or "null")
        built, errors, seconds = int(result["built"]), list(result["errors"]), result["seconds"]
        failed = int(result.get("failed", len(errors)))
    except (ValueError, TypeError, KeyError):
        if isinstance(code, str):
            return f"compile-ahead child was {code}, without its result"
        return f"compile-ahead child exited {code} without its result"
    keys = result.get("keys")
    of = f" ({keys} TurboQuant keys)" if isinstance(keys, int) and keys else ""
    text = f"compile-ahead child: {built} jobs{of} in {float(seconds):.1f} s"
    if isinstance(result.get("plan"), int | float):
        text += f" (plan {result['plan']:.1f} s)"
    if failed:
        first = str(errors[0])[:200] if errors else "?"
        text += f", {failed} failed (first: {first})"
    return text


def _reap(pid: int, timeout: float) -> int | str | None:
    """The child's exit code once it has ended (within ``timeout`` seconds), else None after
    killing and reaping it. Where another reaper took it first, ``"reaped elsewhere"``."""
    import signal

    deadline = time.monotonic() + timeout
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            if time.monotonic() >= deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return None
            time.sleep(0.01)
    except OSError:  # gone: e.g. a SIGCHLD handler of the host reaped it
        return "reaped elsewhere"


def _written(fd: int) -> bytes:
    """What an ended child left in its pipe, at most ``ahead_child.OUTPUT_LIMIT`` bytes, without
    blocking: a compile process it forked may still hold the pipe open for a moment.
    (Not ``communicate(timeout=0)``: it raises ``TimeoutExpired`` even where the child has
    long exited and written its line, so every child read as stopped.)"""
    from .ahead_child import OUTPUT_LIMIT

    out = b""
    try:
        os.set_blocking(fd, False)
        while len(out) < OUTPUT_LIMIT:
            chunk = os.read(fd, OUTPUT_LIMIT - len(out))
            if not chunk:
                break
            out += chunk
    except (BlockingIOError, OSError):
        pass
    return out


LATE = "determine_available_memory"
"""Where a hybrid model's worker starts its child: its KV manager block is final only there.
vLLM sizes a hybrid's attention block to its Mamba state after ``load_model`` (the
executor's ``update_block_size_for_backend``, 0.22-0.33: "Setting attention block size
to 2160 tokens" comes after the model loaded), so a child started at ``load_model`` plans
slot mapping and the EAGLE helpers at TurboQuant's own block (32), and the worker compiles
them again. The next call, the memory profile, runs the model's first ``torch.compile``,
which leaves the child time (``benchmarks/results/serve-jit/SUMMARY.md``)."""


def _hybrid(worker: Any) -> bool:
    model = getattr(getattr(worker, "vllm_config", None), "model_config", None)
    return bool(getattr(model, "is_hybrid", False))


def install(module: ModuleType) -> None:
    """Wrap ``Worker.load_model`` to start the child first, and for a hybrid model
    ``Worker.determine_available_memory`` instead (``LATE``)."""
    cls = getattr(module, "Worker", None)
    original = getattr(cls, "load_model", None)
    late = getattr(cls, LATE, None)
    if cls is None or original is None or patching.is_ours(original):
        return

    @patching.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _hybrid(self):
            start(self)
        return original(self, *args, **kwargs)

    patching.replace(cls, "load_model", load_model)
    if late is None:
        return

    @patching.wraps(late)
    def determine_available_memory(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _hybrid(self):
            start(self)
        return late(self, *args, **kwargs)

    patching.replace(cls, LATE, determine_available_memory)


def remove(module: ModuleType) -> None:
    cls = getattr(module, "Worker", None)
    if cls is not None:
        patching.restore(cls, "load_model")
        patching.restore(cls, LATE)
