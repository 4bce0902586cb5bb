"""The compile-ahead child's lifecycle in the worker (``ahead``): what it is told, that its
failures are one line each and never an exception, and that its hook is undone.

The child here is forked for real and runs a stand-in for its work (``ahead_child.run_child``);
the real child's keys are held to the warmers' in ``contract/test_contract_ahead.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from tq_warmup_plugin import compat, patching, settings
from tq_warmup_plugin.vllm_kernels import ahead, ahead_child
from tq_warmup_plugin.vllm_kernels.offline import EngineRequest


def vllm_config(cache_dtype: str = "turboquant_4bit_nc", spec: Any = None) -> Any:
    return SimpleNamespace(
        cache_config=SimpleNamespace(cache_dtype=cache_dtype, block_size=32),
        model_config=SimpleNamespace(
            runner_type="generate",
            get_vocab_size=lambda: 128256,
            dtype="torch.bfloat16",
            max_model_len=4096,
            max_logprobs=20,
        ),
        scheduler_config=SimpleNamespace(max_num_seqs=256, max_num_batched_tokens=8192),
        speculative_config=spec,
    )


def worker(**kwargs: Any) -> Any:
    return SimpleNamespace(vllm_config=vllm_config(**kwargs), use_v2_model_runner=False)


FEATS = compat.release_features("0.26.0")


def test_the_request_is_the_workers_engine_arguments() -> None:
    spec = SimpleNamespace(method="ngram", num_speculative_tokens=3)
    req = ahead.request_of(worker(spec=spec), FEATS)
    assert req == EngineRequest(
        features=FEATS,
        runner_v2=False,
        vocab_size=128256,
        model_dtype="bfloat16",
        block_size=32,
        max_model_len=4096,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        spec_method="ngram",
        spec_tokens=3,
    )
    assert EngineRequest.from_dict(json.loads(json.dumps(req.to_dict()))) == req


def test_a_moe_workers_request_has_its_experts_graphs_and_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The experts come from the config (tensor parallel 2 halves their width), the eager
    range from the captured graphs, and the GPU's name from vLLM's platform."""
    monkeypatch.setattr(compat, "device_name", lambda: "NVIDIA H200")
    w = worker()
    text = SimpleNamespace(num_experts_per_tok=2, intermediate_size=1024, hidden_size=2048,
                           hidden_act="silu")  # fmt: skip
    vars(w.vllm_config.model_config).update(get_num_experts=lambda: 4, hf_text_config=text)
    w.vllm_config.parallel_config = SimpleNamespace(tensor_parallel_size=2)
    w.vllm_config.compilation_config = SimpleNamespace(cudagraph_capture_sizes=[1, 8, 512])
    req = ahead.request_of(w, FEATS)
    assert req is not None and req.gpu_name == "NVIDIA H200" and req.graph_tokens == 512
    assert req.moe_experts == (
        compat.MoeExperts((4, 1024, 2048), (4, 2048, 512), 4, 2, "bfloat16"),
    )
    assert EngineRequest.from_dict(json.loads(json.dumps(req.to_dict()))) == req
    # a config of another shape costs the child its MoE keys, never the worker's start
    text.hidden_act = "gelu"
    assert ahead.request_of(w, FEATS).moe_experts == ()  # type: ignore[union-attr]


def test_a_planned_hybrids_zeroing_round_trips() -> None:
    req = ahead.request_of(worker(), FEATS)
    assert req is not None
    hybrid = dataclasses.replace(req, zeroing=compat.KvZeroing(7, 2160 * 1088, 16 * 1088))
    assert EngineRequest.from_dict(json.loads(json.dumps(hybrid.to_dict()))) == hybrid


def test_no_child_without_turboquant() -> None:
    assert ahead.request_of(worker(cache_dtype="auto"), FEATS) is None


@pytest.mark.parametrize(
    "bad",
    [
        {},
        {"vocab_size": "1"},
        {"vocab_size": True},
        {"extra": 1},
        {"moe_experts": [{"w13": 1}]},
        {"moe_experts": 3},
        {"graph_tokens": 1.5},
        {"zeroing": {"segments": 7}},
        {"zeroing": {"segments": 7, "page_bytes": "1", "kernel_page_bytes": 1}},
        {"zeroing": {"segments": 0, "page_bytes": 1, "kernel_page_bytes": 1}},
        {"zeroing": [7, 1, 1]},
    ],
    ids=repr,
)
def test_a_mangled_request_is_refused(bad: dict[str, Any]) -> None:
    req = ahead.request_of(worker(), FEATS)
    assert req is not None
    data = req.to_dict()
    data = {} if not bad else {**data, **bad}
    with pytest.raises(ValueError):
        EngineRequest.from_dict(data)


ChildBody = Callable[[dict[str, Any], int], int]


@pytest.fixture
def child(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[ChildBody], None]]:
    """Sets a stand-in for the forked child's work (``ahead_child.run_child``): the fork
    runs it with what the worker gives it (the worker's ``VllmConfig`` under ``"config"``)
    and the result pipe, and exits with what it returns."""
    monkeypatch.setattr(ahead, "_arch", lambda: 90)
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "0.26.0")
    monkeypatch.setattr(ahead, "_child", None)

    def stand_in(body: ChildBody) -> None:
        def run_child(given: dict[str, Any], out: int, config: Any = None) -> int:
            return body({**given, "config": config}, out)

        monkeypatch.setattr(ahead_child, "run_child", run_child)

    yield stand_in
    ahead.wait(1)


def says(result: dict[str, Any], code: int = 0) -> ChildBody:
    def body(given: dict[str, Any], out: int) -> int:
        os.write(out, (json.dumps(result) + "\n").encode())
        return code

    return body


def test_the_childs_result_is_one_line(child: Callable[[ChildBody], None]) -> None:
    w = worker(spec=SimpleNamespace(method="ngram", num_speculative_tokens=4))

    def body(given: dict[str, Any], out: int) -> int:
        assert given["arch"] == 90 and given["processes"] >= 1
        assert given["config"] is w.vllm_config and given["verify"] is True  # the defaults
        built = given["request"]["spec_tokens"]
        result = {"built": built, "errors": [], "seconds": 1.5, "keys": 3}
        os.write(out, json.dumps(result).encode())
        return 0

    child(body)
    ahead.start(w)
    assert ahead._child is not None and ahead._child.pid not in (None, os.getpid())
    line = ahead.wait(60)
    assert line == "compile-ahead child: 4 jobs (3 TurboQuant keys) in 1.5 s"
    assert ahead.wait() == ""  # reaped once


def test_the_child_is_a_fork_that_touches_nothing_of_the_worker(
    child: Callable[[ChildBody], None], tmp_path: Path
) -> None:
    """The child has the worker's modules without importing them (a fork, not a fresh
    interpreter), writes nothing on the worker's streams, and ends in ``os._exit``: no
    exit handler of the worker (pytest's here) runs in it."""
    marker = tmp_path / "atexit-ran"
    sentinel = object()
    sys.modules["tq_test_only_in_the_worker"] = sentinel  # type: ignore[assignment]
    import atexit

    ran = lambda: marker.write_text("yes")  # noqa: E731
    atexit.register(ran)
    try:

        def body(given: dict[str, Any], out: int) -> int:
            seen = sys.modules.get("tq_test_only_in_the_worker") is sentinel
            print("not on the worker's stdout")
            print("nor on its stderr", file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
            os.write(out, json.dumps({"built": int(seen), "errors": [], "seconds": 0}).encode())
            return 0

        child(body)
        ahead.start(worker())
        assert ahead.wait(60) == "compile-ahead child: 1 jobs in 0.0 s"
        assert not marker.exists()
    finally:
        atexit.unregister(ran)
        del sys.modules["tq_test_only_in_the_worker"]


def test_a_v2_worker_starts_one_too(child: Callable[[ChildBody], None]) -> None:
    """A fork has vLLM imported, so a V2 worker's child is done before its warmup: its
    vLLM-kernel warmers took 0.12 s with it and 10.8 s without (H200, 0.26.0, serve-jit run
    AK). Only ``TQ_WARMUP_AHEAD=0`` keeps it off, before the hook is installed."""
    child(says({"built": 1, "errors": [], "seconds": 0.5}))
    v2 = worker()
    v2.use_v2_model_runner = True
    ahead.start(v2)
    assert ahead.wait(60) == "compile-ahead child: 1 jobs in 0.5 s"
    assert not settings.load({"TQ_WARMUP_AHEAD": "0"}).ahead
    assert settings.load({}).ahead


def test_a_child_that_has_ended_is_read_without_waiting(
    child: Callable[[ChildBody], None],
) -> None:
    """The warmers reap the child with ``wait(0)``: one that ended before them has its
    result read, not reported stopped (``communicate(timeout=0)`` did that to every child:
    "stopped after 108.7 s" on the H200 for a child long done)."""
    child(says({"built": 2, "errors": [], "seconds": 0.5, "plan": 0.25}))
    ahead.start(worker())
    assert ahead._child is not None and ahead._child.pid is not None
    _ended(ahead._child.pid)
    assert ahead.wait(0) == "compile-ahead child: 2 jobs in 0.5 s (plan 0.2 s)"
    child(says({"built": 2, "errors": [], "seconds": 0.5, "plan": "x"}))
    ahead.start(worker())  # a plan that is not a number is left out
    assert ahead.wait(60) == "compile-ahead child: 2 jobs in 0.5 s"


def _ended(pid: int) -> None:
    """Wait, without reaping it, until the process has exited (a zombie)."""
    deadline = time.monotonic() + 60
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)


def test_a_child_that_fails_or_hangs_is_one_line(child: Callable[[ChildBody], None]) -> None:
    def hangs(given: dict[str, Any], out: int) -> int:
        time.sleep(30)
        return 0

    child(hangs)
    ahead.start(worker())
    line = ahead.wait(0.5)
    assert line.startswith("compile-ahead child stopped after ")
    assert line.endswith(" s: the worker's own warmers were done")

    def garbles(given: dict[str, Any], out: int) -> int:
        os.write(out, b"not json\n")
        return 3

    child(garbles)
    ahead.start(worker())
    assert ahead.wait(60) == "compile-ahead child exited 3 without its result"

    def raises(given: dict[str, Any], out: int) -> int:
        raise RuntimeError("boom")  # still ends in os._exit, never in the worker's code

    child(raises)
    ahead.start(worker())
    assert ahead.wait(60) == "compile-ahead child exited 1 without its result"
    child(says({"built": 1, "errors": ["top-k/top-p: boom"], "seconds": 2, "failed": 9}, 1))
    ahead.start(worker())
    assert ahead.wait(60).endswith(", 9 failed (first: top-k/top-p: boom)")


def test_a_child_reaped_by_another_is_one_line(
    child: Callable[[ChildBody], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host whose SIGCHLD handler reaps every child takes ours too: its line is read."""
    child(says({"built": 1, "errors": [], "seconds": 0.5}))
    ahead.start(worker())
    assert ahead._child is not None and ahead._child.pid is not None
    os.waitpid(ahead._child.pid, 0)  # the other reaper
    assert ahead.wait(60) == "compile-ahead child: 1 jobs in 0.5 s"


def test_no_child_without_a_cuda_target(
    child: Callable[[ChildBody], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ahead, "_arch", lambda: None)  # ROCm
    ahead.start(worker())
    assert ahead.wait() == ""


def test_a_stopped_child_takes_its_compile_processes_with_it(
    child: Callable[[ChildBody], None], tmp_path: Path
) -> None:
    """The real child's ``die_with_parent`` in a stand-in that forks a compile process the
    way ``engine_plan.build`` does (a Pool initializer) and hangs: stopping the child
    kills that process too."""
    pid_file = tmp_path / "grandchild.pid"

    def body(given: dict[str, Any], out: int) -> int:
        import multiprocessing

        ahead_child.die_with_parent()
        context = multiprocessing.get_context("fork")
        with context.Pool(1, initializer=ahead_child.die_with_parent) as pool:
            pool.map(functools.partial(_hang_writing_pid, pid_file), [0])
        return 0

    child(body)
    ahead.start(worker())
    deadline = time.monotonic() + 30
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    assert ahead.wait(0.1).startswith("compile-ahead child stopped after ")
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


def _hang_writing_pid(pid_file: Path, _: int) -> None:
    # Whole or not at all: the test reads the file as soon as it exists.
    partial = pid_file.with_suffix(".partial")
    partial.write_text(str(os.getpid()))
    partial.rename(pid_file)
    time.sleep(60)


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for its reaper)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def test_a_child_that_cannot_start_is_one_line(
    child: Callable[[ChildBody], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_fork() -> int:
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(os, "fork", no_fork)
    ahead.start(worker())
    assert ahead.wait().startswith("compile-ahead child did not start: BlockingIOError")
    monkeypatch.delattr(os, "fork")  # a platform without fork: still a line, never a raise
    ahead.start(worker())
    assert ahead.wait().startswith("compile-ahead child did not start: AttributeError")


def test_a_child_gone_before_it_is_stopped_is_one_line(
    child: Callable[[ChildBody], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child still running at ``wait`` is killed; one that vanished just then (another
    reaper) makes the kill fail, and the worker's warmup goes on with one line."""

    def hangs(given: dict[str, Any], out: int) -> int:
        time.sleep(30)
        return 0

    child(hangs)
    ahead.start(worker())
    assert ahead._child is not None and ahead._child.pid is not None
    pid = ahead._child.pid

    real_kill = os.kill

    def lost(target: int, sig: int) -> None:
        real_kill(target, sig)
        os.waitpid(target, 0)  # the other reaper, just before
        raise ProcessLookupError(3, "No such process")

    monkeypatch.setattr(os, "kill", lost)
    assert ahead.wait(0.2) == "compile-ahead child was reaped elsewhere, without its result"
    assert not _alive(pid)


def test_load_model_starts_it_and_the_hook_is_undone(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[Any] = []
    monkeypatch.setattr(ahead, "start", started.append)

    class Worker:
        vllm_config = vllm_config()

        def load_model(self, *, load_dummy_weights: bool = False) -> str:
            return f"loaded {load_dummy_weights}"

        def determine_available_memory(self) -> int:
            return 7

    module = ModuleType("fake_gpu_worker")
    module.Worker = Worker  # type: ignore[attr-defined]
    ahead.install(module)
    ahead.install(module)  # idempotent: one wrapper
    w = Worker()
    assert w.load_model(load_dummy_weights=True) == "loaded True"
    assert w.determine_available_memory() == 7
    assert started == [w]  # a dense model's starts as its model loads
    # a hybrid's block is final after load_model: its child starts at the memory profile
    hybrid = Worker()
    hybrid.vllm_config = vllm_config()
    hybrid.vllm_config.model_config.is_hybrid = True
    hybrid.load_model()
    assert started == [w]
    assert hybrid.determine_available_memory() == 7
    assert started == [w, hybrid]
    assert patching.original_of(Worker.__dict__["load_model"]) is not None
    ahead.remove(module)
    assert not patching.is_ours(Worker.__dict__["load_model"])
    assert not patching.is_ours(Worker.__dict__[ahead.LATE])
    w.load_model()
    hybrid.determine_available_memory()
    assert started == [w, hybrid]


def test_a_turboquant_plan_that_fails_costs_its_line_not_the_engine_jobs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The child's own work (not forked here): the worker's config that ``planning`` cannot
    read is one error line among the results, and the engine jobs are built all the same,
    the TurboQuant keys first where the plan works."""
    from tq_warmup_plugin.shipped import precompile
    from tq_warmup_plugin.vllm_kernels import offline as engine_plan
    from tq_warmup_plugin.vllm_kernels.jobs import Job

    built: list[list[str]] = []
    engine_job = Job("slot mapping", "block 32", lambda: None)
    monkeypatch.setattr(precompile, "use_compile_only_target", lambda arch: None)
    monkeypatch.setattr(ahead_child, "die_with_parent", lambda: None)  # not this process
    engines: list[EngineRequest] = []
    monkeypatch.setattr(engine_plan, "cpu_engine", lambda request: engines.append(request))
    monkeypatch.setattr(engine_plan, "jobs", lambda pm, engine, sms=0: ([engine_job], [], []))

    def build(todo: list[Job], **kwargs: Any) -> tuple[list[Job], list[str]]:
        built.append([f"{job.family}: {job.what}" for job in todo])
        return todo, []

    monkeypatch.setattr(engine_plan, "build", build)
    req = ahead.request_of(worker(), FEATS)
    assert req is not None
    given = {"request": req.to_dict(), "arch": 90, "processes": 1, "verify": True}

    def result(config: Any) -> dict[str, Any]:
        read, write = os.pipe()
        code = ahead_child.run_child(given, write, config)
        os.close(write)
        out = json.loads(os.read(read, ahead_child.OUTPUT_LIMIT))
        os.close(read)
        return {**out, "code": code}

    broken = result(SimpleNamespace())  # no model config: nothing to plan from
    assert (broken["code"], broken["built"], broken["keys"], broken["failed"]) == (1, 1, 0, 1)
    assert broken["errors"][0].startswith("TurboQuant keys not planned: AttributeError")
    assert built[-1] == ["slot mapping: block 32"]
    assert engines[-1].zeroing is None  # nothing planned: the worker zeroes as before

    key = Job(ahead_child.FAMILY, "decode", lambda: None)
    zeroing = compat.KvZeroing(7, 2160 * 1088 // 16, 1088)
    plan = SimpleNamespace(zeroing=zeroing)
    monkeypatch.setattr(ahead_child, "worker_plan", lambda config, given, feats: plan)
    monkeypatch.setattr(
        ahead_child, "key_jobs", lambda pm, planned: [key] if planned is plan else []
    )
    planned = result(SimpleNamespace())
    assert (planned["code"], planned["built"], planned["keys"], planned["errors"]) == (0, 2, 1, [])
    assert built[-1] == ["TurboQuant: decode", "slot mapping: block 32"]  # the worker's order
    assert engines[-1].zeroing == zeroing  # a hybrid's zeroing keys: the plan's, built too
