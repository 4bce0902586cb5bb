"""The engine warmers' host and their declines: jobs run once, a raising job is one
error line (strict mode then fails startup), launches become compiles and the patch
is always undone. Runner objects are stand-ins; Triton is real (compile-only here)."""

from __future__ import annotations

import logging
from functools import partial
from types import SimpleNamespace
from typing import Any

import fakes
import pytest

from tq_warmup_plugin import compat, install
from tq_warmup_plugin.hookspecs import hookimpl
from tq_warmup_plugin.keys import next_pow2
from tq_warmup_plugin.settings import Settings
from tq_warmup_plugin.vllm_kernels import run as engine_warmup
from tq_warmup_plugin.vllm_kernels.jobs import Declined, Engine, Job
from tq_warmup_plugin.warmers import (
    vllm_draft_prefill,
    vllm_eagle,
    vllm_logprobs,
    vllm_rejection,
    vllm_slot_mapping,
    vllm_top_k_top_p,
    vllm_unwarmed,
)
from tq_warmup_plugin.worker import keyplan, warmup

BUILT_IN = (vllm_slot_mapping, vllm_rejection, vllm_logprobs, vllm_top_k_top_p)


def engine(version: compat.Version = (0, 26), **fields: Any) -> Engine:
    """A V1 engine with ngram k=3 on ``version``; ``fields`` replace any field."""
    values: dict[str, Any] = dict(
        features=compat.features(version),
        runner_v2=False,
        pooling=False,
        spec_method="ngram",
        spec_tokens=3,
        draft_probs=False,
        max_logprobs=20,
        runner=SimpleNamespace(
            input_batch=SimpleNamespace(block_table=SimpleNamespace(block_tables=[]))
        ),
    )
    values.update(fields)
    return Engine(**values)


manager = fakes.bare_manager


def families(items: list[Declined]) -> dict[str, str]:
    return {d.family: d.why for d in items}


def test_each_warmer_declines_in_one_line_where_its_kernel_is_not_reached() -> None:
    pm = manager(*BUILT_IN)
    _, declined = fakes.jobs_of(pm, engine(runner_v2=True, spec_method=None, spec_tokens=0))
    why = families(declined)
    assert set(why) == {"slot mapping", "rejection sampler"}
    assert all("\n" not in w and w for w in why.values())
    _, declined = fakes.jobs_of(pm, engine(pooling=True))
    assert set(families(declined)) == {"slot mapping", "logprobs", "top-k/top-p"}
    jobs, declined = fakes.jobs_of(pm, engine(max_logprobs=0))
    assert "logprobs" in families(declined) and {j.family for j in jobs} >= {"rejection sampler"}


@pytest.mark.parametrize(
    ("version", "registry"),
    [
        ((0, 28), set()),
        ((0, 29), {"slot mapping"}),
        ((0, 33), {"slot mapping", "rejection sampler"}),
    ],
)
def test_what_vllms_jit_registry_warms_is_not_warmed_twice(
    version: compat.Version, registry: set[str]
) -> None:
    _, declined = fakes.jobs_of(manager(*BUILT_IN), engine(version))
    assert {d.family for d in declined if "registry" in d.why} == registry


@pytest.mark.parametrize(
    ("fields", "warn", "says"),
    [
        (dict(spec_method=None, spec_tokens=0), False, "no speculative decoding"),
        (dict(spec_method="ngram"), False, "ngram drafts without the EAGLE helper kernels"),
        (dict(spec_method="eagle", runner_v2=True), False, "V2 runner's speculator"),
        (dict(spec_method="draft_model"), False, "no EAGLE helper kernels to warm"),
        (dict(spec_method="deepseek_mtp", jit_monitor_error=True), True, "no EAGLE helper"),
        (dict(version=(0, 30), spec_method="eagle3", jit_monitor_error=True), False, "registry"),
    ],
)
def test_the_eagle_helpers_decline_in_one_line(
    fields: dict[str, Any], warn: bool, says: str, caplog: pytest.LogCaptureFixture
) -> None:
    """One line each where nothing is warmed, a WARNING only where the JIT monitor will
    stop the engine core (error mode) on kernels no warmer reached (here: a runner
    without a model-based drafter)."""
    jobs, declined = fakes.jobs_of(manager(vllm_eagle), engine(**fields))
    assert jobs == [] and len(declined) == 1
    (item,) = declined
    assert (item.family, item.warn) == ("EAGLE helpers", warn) and says in item.why
    assert "\n" not in item.why
    pytest.importorskip("triton")  # the host's compile-only launches
    with caplog.at_level(logging.INFO, logger="vllm.tq_warmup_plugin"):
        engine_warmup.run(manager(vllm_eagle), engine(**fields), False)
    (record,) = [r for r in caplog.records if "EAGLE helpers" in r.getMessage()]
    assert record.levelno == (logging.WARNING if warn else logging.INFO)


def test_sampled_widths_are_one_per_key() -> None:
    """1 sampled token (a step without drafts) is Triton's constant 1; 2 is its own
    power of two; 3 and 4 share the class and ``BLOCK_SIZE_TOKENS`` 4."""
    assert vllm_eagle.sampled_widths(1) == [1, 2]
    assert vllm_eagle.sampled_widths(3) == [1, 2, 3]
    assert vllm_eagle.sampled_widths(4) == [1, 2, 3, 5]


@pytest.mark.parametrize("new_slots", [0, 1, 3])
def test_expand_shapes_reach_every_token_block(new_slots: int) -> None:
    """Each ``BLOCK_SIZE_TOKENS`` from that of ``1 + new_slots`` to the cap, with a total
    that is a multiple of 16 and one that is not; a total of 1 only for a 1-token query."""

    def block(query: int) -> int:
        return min(256, 1 << (query + new_slots - 1).bit_length())

    shapes = vllm_eagle.expand_shapes(new_slots)
    by_block: dict[int, set[bool]] = {}
    for query, total in shapes:
        assert total >= query
        if total != 1:
            by_block.setdefault(block(query), set()).add(total % 16 == 0)
    first = 1 << new_slots.bit_length()
    assert sorted(by_block) == [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b >= first]
    assert all(kinds == {True, False} for kinds in by_block.values())
    assert [total for _, total in shapes].count(1) == 1


def test_eagle_jobs_follow_the_drafter(monkeypatch: pytest.MonkeyPatch) -> None:
    """A draft model (extra slots) k=3 gets every family; EAGLE k=1 no draft steps and
    no expansion. Batches past the drafter's ``max_batch_size`` are left out."""
    monkeypatch.setattr(compat, "eagle_helper", lambda name: object())
    table = SimpleNamespace(block_table=SimpleNamespace(gpu=SimpleNamespace(shape=(8, 128))))

    def runner(extra: bool, most: int) -> Any:
        drafter = SimpleNamespace(
            positions=None, block_size=32, max_model_len=4096, backup_next_token_ids=None,
            max_batch_size=most, needs_extra_input_slots=extra, net_num_new_slots_per_request=1,
        )  # fmt: skip
        batch = SimpleNamespace(vocab_size=1000, block_table=SimpleNamespace(block_tables=[table]))
        return SimpleNamespace(drafter=drafter, input_batch=batch)

    jobs, _ = fakes.jobs_of(
        manager(vllm_eagle), engine(spec_method="draft_model", runner=runner(True, 32))
    )
    kinds = {j.what.split(",")[0] for j in jobs}
    assert kinds == {"prepare inputs", "next token", "draft step", "expand inputs"}
    assert sum(j.what.startswith("next token") for j in jobs) == 3 * 3
    assert sum(j.what.startswith("draft step") for j in jobs) == 3
    jobs, _ = fakes.jobs_of(
        manager(vllm_eagle), engine(spec_method="eagle", spec_tokens=1, runner=runner(False, 8))
    )
    assert {j.what.split(",")[0] for j in jobs} == {"prepare inputs", "next token"}
    assert all("16 " not in j.what and "17 " not in j.what for j in jobs)


def test_rejection_jobs_cover_every_sampling_mode() -> None:
    jobs, _ = fakes.jobs_of(manager(vllm_rejection), engine(spec_tokens=4))
    assert sorted(j.what for j in jobs) == [
        "greedy batch, k=4",
        "mixed batch, k=4",
        "random batch, k=4",
    ]


def test_logprob_counts_take_one_count_per_kernel_key() -> None:
    assert vllm_logprobs.logprob_counts(20) == [0, 1, 2, 4, 8, 15, 16]
    assert vllm_logprobs.logprob_counts(0) == [0]
    unlimited = vllm_logprobs.logprob_counts(-1)
    assert unlimited[-1] < vllm_logprobs.TOPK_BLOCK_CAP and len(unlimited) == len(set(unlimited))


def test_top_k_top_p_jobs_per_runner() -> None:
    v1, _ = fakes.jobs_of(manager(vllm_top_k_top_p), engine())
    v2, _ = fakes.jobs_of(manager(vllm_top_k_top_p), engine(runner_v2=True, spec_method=None))
    v2_spec, _ = fakes.jobs_of(manager(vllm_top_k_top_p), engine(runner_v2=True))
    assert len(v1) == len(v2) == 6 and len(v2_spec) == 12
    assert all("float32" in j.what for j in v1) and all("model dtype" in j.what for j in v2)


class Warmers:
    """Two jobs (one raising), one of them contributed twice, and a decline."""

    def __init__(self) -> None:
        self.ran: list[str] = []

    def _ok(self) -> None:
        self.ran.append("ok")

    def _bad(self) -> None:
        raise ValueError("no such buffer\nsecond line")

    @hookimpl
    def tq_warmup_engine_jobs(self, engine: Engine) -> list[Job | Declined]:
        return [
            Job("mine", "fine", self._ok),
            Job("mine", "broken", self._bad),
            Declined("x", "n/a"),
        ]


class Again:
    def __init__(self, warmers: Warmers) -> None:
        self.warmers = warmers

    @hookimpl
    def tq_warmup_engine_jobs(self, engine: Engine) -> list[Job | Declined]:
        return [Job("mine", "fine", self.warmers._ok)]


def test_host_runs_each_job_once_and_a_raising_job_is_one_error_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pytest.importorskip("triton")  # the host turns launches into compiles around its jobs
    warmers = Warmers()
    with caplog.at_level(logging.INFO, logger="vllm.tq_warmup_plugin"):
        result = engine_warmup.run(manager(warmers, Again(warmers)), engine(), False, threads=2)
    assert warmers.ran == ["ok"]
    assert result.jobs == {"mine": 1}
    assert result.errors == ["mine (broken): ValueError: no such buffer"]
    assert result.declined == ["x: n/a"]
    assert "tq-warmup: x: not warmed: n/a" in caplog.text


def test_launches_inside_become_compiles_and_the_patch_is_undone() -> None:
    pytest.importorskip("triton")
    import torch
    from triton.runtime.jit import JITFunction
    from unrelated_kernel import add_one

    from tq_warmup_plugin.shipped.precompile import use_compile_only_target

    use_compile_only_target(90)
    original = JITFunction.run
    x = torch.zeros(64)
    with pytest.raises(RuntimeError, match="boom"), compat.compile_only_launches(False) as met:
        add_one[(1,)](x, 64, BLOCK=64)  # would fail to launch on a compile-only driver
        raise RuntimeError("boom")
    assert met == ["add_one"]
    assert met.lookup_s > 0.0  # the compile was the launch's lookup, timed
    assert JITFunction.run is original
    assert add_one.device_caches  # compiled for sm90, nothing launched
    assert torch.equal(x, torch.zeros(64))


@pytest.fixture
def one_layer_worker(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A worker of one TurboQuant layer whose keys compile to nothing, on 0.26, whose
    engine is ``engine()``: what ``warmup.run`` does around the engine warmers."""
    pytest.importorskip("triton")
    from tq_warmup_plugin.worker.discovery import Discovery

    found = Discovery(geometries={"layers.0.attn": fakes.geometry()})
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "0.26.0")
    monkeypatch.setattr(compat, "workspace_manager", lambda feats: None)
    monkeypatch.setattr(warmup, "discover", lambda worker, feats: found)
    monkeypatch.setattr(keyplan, "compile_all", lambda pm, todo, threads, progress: [])
    monkeypatch.setattr(keyplan, "CompileCounter", fakes.StubCounter)
    monkeypatch.setattr(compat, "engine_of", lambda worker, feats: engine().__dict__)
    return SimpleNamespace(use_v2_model_runner=False, vllm_config=None)


def test_strict_mode_fails_startup_on_a_failed_engine_job(
    one_layer_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(warmup, "plugin_manager", lambda: manager(Warmers()))
    worker = one_layer_worker
    report = warmup.run(worker, Settings(launch=False))
    assert report.status == "ok" and report.errors == ["mine (broken): ValueError: no such buffer"]
    assert report.vllm.jobs == {"mine": 1} and "vLLM kernels: mine 1" in report.line()
    with pytest.raises(RuntimeError, match="strict mode"):
        install.warm_worker(worker, Settings(launch=False, strict=True))
    off = warmup.run(worker, Settings(launch=False, vllm_kernels=False))
    assert off.errors == [] and off.vllm.jobs == {}


class _Raises:
    @hookimpl
    def tq_warmup_engine_jobs(self, engine: Engine) -> list[Job]:
        raise KeyError("no such buffer")


def test_a_warmer_that_raises_while_planning_costs_only_its_own_jobs() -> None:
    """One line names the warmer; the other warmers' jobs are planned and run."""
    pm = manager(vllm_rejection)
    pm.register(_Raises(), name="raises")
    jobs, declined, errors = engine_warmup.plan(pm, engine())
    assert sorted(j.what for j in jobs) == [
        "greedy batch, k=3",
        "mixed batch, k=3",
        "random batch, k=3",
    ]
    assert declined == [] and errors == ["engine warmer raises: KeyError: 'no such buffer'"]


def test_the_host_runs_the_other_warmers_when_one_raises_while_planning() -> None:
    """Before, one warmer raising in ``tq_warmup_engine_jobs`` lost every warmer's jobs."""
    pytest.importorskip("triton")  # the host's compile-only launches
    warmers = Warmers()
    pm = manager(warmers)
    pm.register(_Raises(), name="raises")
    result = engine_warmup.run(pm, engine(), False)
    assert warmers.ran == ["ok"] and result.jobs == {"mine": 1}
    assert result.errors == [
        "engine warmer raises: KeyError: 'no such buffer'",
        "mine (broken): ValueError: no such buffer",
    ]


@pytest.mark.parametrize("error_mode", [False, True])
def test_hybrid_kernels_nobody_warms_are_named_in_one_line(error_mode: bool) -> None:
    """A hybrid model: one decline, a WARNING only in error mode; a dense or MoE-only
    model: nothing said (``vllm_fused_moe`` warms MoE layers)."""
    pm = manager(vllm_unwarmed)
    jobs, declined = fakes.jobs_of(pm, engine(moe=True, hybrid=True,
                                                      jit_monitor_error=error_mode))  # fmt: skip
    assert jobs == []
    assert [(d.family, d.warn) for d in declined] == [("Mamba/GDN layers", error_mode)]
    assert ("error stops the engine core" in declined[0].why) is error_mode
    assert "conv1d" in declined[0].why and "\n" not in declined[0].why
    assert fakes.jobs_of(pm, engine()) == ([], [])
    assert fakes.jobs_of(pm, engine(moe=True)) == ([], [])
    # vLLM's default FULL_AND_PIECEWISE graphs: its startup ran them (H200, 0.26.0, runs U-V)
    _, full = fakes.jobs_of(pm, engine(hybrid=True, jit_monitor_error=error_mode,
                                       full_decode_graphs=True))  # fmt: skip
    assert [(d.family, d.warn) for d in full] == [("Mamba/GDN layers", False)]
    assert "FULL decode-graph capture ran their kernels" in full[0].why


def test_the_draft_prefill_blocks_are_each_power_of_two_a_step_reaches() -> None:
    """``min(512, next_power_of_2(longest query + 2))``: a query of 1 gives 4, a budget of
    126 tokens reaches 128 but not 256, and 2,048 reaches the cap."""
    assert vllm_draft_prefill.blocks(1) == vllm_draft_prefill.blocks(2) == [4]
    assert vllm_draft_prefill.blocks(6) == [4, 8]
    assert vllm_draft_prefill.blocks(126) == [4, 8, 16, 32, 64, 128]
    assert vllm_draft_prefill.blocks(127) == [4, 8, 16, 32, 64, 128, 256]
    assert vllm_draft_prefill.blocks(2048) == [4, 8, 16, 32, 64, 128, 256, 512]


def test_the_v2_draft_speculators_inputs_are_warmed_per_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """draft_model on the V2 runner (0.31+): one job per block, each calling vLLM's launcher
    with one request whose longest query lands in that block (the launcher's own rule), on
    the speculator's buffers and constants."""
    torch = pytest.importorskip("torch")

    calls: list[dict[str, Any]] = []
    i32, i64 = torch.int32, torch.int64
    buffers = SimpleNamespace(
        input_ids=torch.zeros(100, dtype=i32),
        positions=torch.zeros(100, dtype=i64),
        query_start_loc=torch.zeros(9, dtype=i32),
        seq_lens=torch.zeros(8, dtype=i32),
    )
    speculator = SimpleNamespace(
        input_buffers=buffers,
        expanded_input_ids=torch.zeros(108, dtype=i32),
        expanded_positions=torch.zeros(108, dtype=i64),
        last_token_indices=torch.zeros(8, dtype=i64),
        max_num_tokens=100,
        max_num_reqs=8,
        max_model_len=4096,
    )
    monkeypatch.setattr(compat, "draft_prefill", lambda runner: (calls.append, speculator))
    monkeypatch.setattr(
        vllm_draft_prefill, "warm_block", _keyword_call(vllm_draft_prefill.warm_block)
    )
    pm = manager(vllm_draft_prefill)
    jobs, declined = fakes.jobs_of(pm, engine((0, 34), runner_v2=True, spec_method="draft_model"))
    assert declined == [] and all(j.offline for j in jobs)
    assert [j.what for j in jobs] == [f"block {b}" for b in (4, 8, 16, 32, 64, 128)]
    for job in jobs:
        job.run()
    launched = []
    for call in calls:
        batch = call["input_batch"]
        query = int(batch.query_start_loc_np[1] - batch.query_start_loc_np[0])
        assert batch.num_reqs == 1 and batch.num_tokens == query <= 100
        assert batch.input_ids.data_ptr() == buffers.input_ids.data_ptr()
        assert (call["max_num_reqs"], call["max_model_len"]) == (8, 4096)
        assert call["expanded_input_ids"] is speculator.expanded_input_ids
        launched.append(min(512, next_pow2(query + 2)))
    assert launched == [4, 8, 16, 32, 64, 128]


def _keyword_call(warm_block: Any) -> Any:
    """``warm_block`` with a launcher that takes its keywords as one dict."""

    def call(launcher: Any, speculator: Any, block: int) -> None:
        warm_block(lambda **kw: launcher(kw), speculator, block)

    return call


@pytest.mark.parametrize("error_mode", [False, True])
def test_the_draft_prefill_warmer_declines_in_one_line(
    error_mode: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No draft_model speculator on the runner: one decline, a WARNING in error mode;
    another method, the V1 runner or 0.30 and older: nothing said."""
    monkeypatch.setattr(compat, "draft_prefill", lambda runner: None)
    pm = manager(vllm_draft_prefill)
    draft = {"runner_v2": True, "spec_method": "draft_model", "jit_monitor_error": error_mode}
    jobs, declined = fakes.jobs_of(pm, engine((0, 34), **draft))
    assert jobs == [] and [(d.family, d.warn) for d in declined] == [
        ("draft speculator inputs", error_mode)
    ]
    assert "\n" not in declined[0].why
    assert fakes.jobs_of(pm, engine((0, 30), **draft)) == ([], [])
    assert fakes.jobs_of(pm, engine((0, 34), **{**draft, "spec_method": "eagle"})) == ([], [])
    assert fakes.jobs_of(pm, engine((0, 33), **{**draft, "runner_v2": False})) == ([], [])


def test_real_jobs_run_first_on_the_callers_thread_with_launches_running() -> None:
    """A model forward (``Job.real``) runs serially before the compile-only pool, on the
    caller's thread, with Triton's launch unpatched; the others inside the patch."""
    pytest.importorskip("triton")
    import threading

    from triton.runtime.jit import JITFunction

    seen: list[tuple[str, bool, bool]] = []
    original_run = JITFunction.run

    def note(name: str) -> None:
        patched = JITFunction.run is not original_run
        seen.append((name, threading.current_thread() is threading.main_thread(), patched))

    class _Warmer:
        @hookimpl
        def tq_warmup_engine_jobs(self, engine: Engine) -> list[Job]:
            return [
                Job("launcher", "a", lambda: note("launcher")),
                Job("forward", "512 tokens", lambda: note("forward 512"), real=True),
                Job("forward", "600 tokens", lambda: note("forward 600"), real=True),
            ]

    result = engine_warmup.run(manager(_Warmer()), engine(), False, threads=2)
    assert seen[:2] == [("forward 512", True, False), ("forward 600", True, False)]
    assert seen[2][0] == "launcher" and seen[2][2] is True
    assert result.jobs == {"forward": 2, "launcher": 1} and result.errors == []
    assert result.forwards[:2] == (2, 0)


def test_engine_warmer_threads_run_on_the_callers_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine warmers' pool, like the TurboQuant keys' one: a new thread starts on
    device 0, and Triton keys its kernels by the current device, so tensor-parallel rank
    1's jobs warmed device 0 before this pool was pinned too."""
    pytest.importorskip("triton")
    import threading

    from triton.runtime import driver

    devices = fakes.ThreadDevices(caller=1)  # the worker thread of rank 1
    monkeypatch.setattr(driver, "_active", devices, raising=False)
    seen: dict[int, int] = {}

    class OnDevice:
        @hookimpl
        def tq_warmup_engine_jobs(self, engine: Engine) -> list[Job]:
            def record() -> None:
                seen[threading.get_ident()] = devices.get_current_device()

            return [Job("device", str(i), record) for i in range(4)]

    result = engine_warmup.run(manager(OnDevice()), engine(), False, threads=2)
    assert result.errors == [] and result.jobs == {"device": 4}
    assert seen and set(seen.values()) == {1} and threading.get_ident() not in seen


def test_the_models_logits_are_computed_once_on_the_callers_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Jobs on the pool read ``Engine.model_logits``; the model's GEMM behind them
    (``compat.logits_of``) runs once, on the caller's thread, before the pool starts: a
    GEMM on a pool thread gives that thread a cuBLAS workspace torch keeps for the
    process's life, which vLLM 0.34 counts against the KV cache."""
    pytest.importorskip("triton")
    import threading

    computed: list[tuple[int, int]] = []

    def logits_of(runner: Any, rows: int) -> object:
        computed.append((threading.get_ident(), rows))
        return object()

    monkeypatch.setattr(compat, "logits_of", logits_of)
    got: list[object] = []

    class Sampling:
        @hookimpl
        def tq_warmup_engine_jobs(self, engine: Engine) -> list[Job]:
            return [
                Job("sampler", str(i), lambda: got.append(engine.model_logits)) for i in range(4)
            ]

    result = engine_warmup.run(manager(Sampling()), engine(), False, threads=4)
    assert result.errors == [] and result.jobs == {"sampler": 4}
    assert computed == [(threading.get_ident(), 2)]
    assert len(got) == 4 and len({id(x) for x in got}) == 1


def test_rows_like_the_sample_are_what_the_model_gives_for_that_many_rows() -> None:
    """dtype, width, row stride and values as ``compute_logits`` returns them, here a
    padded vocabulary trimmed to its width (row stride 136, width 130)."""
    torch = pytest.importorskip("torch")
    from tq_warmup_plugin.vllm_kernels import logits as warm_logits

    class Model:
        def compute_logits(self, hidden: Any) -> Any:
            padded = torch.full((hidden.shape[0], 136), 1.5, dtype=torch.bfloat16)
            return padded[:, :130]

    config = SimpleNamespace(get_hidden_size=lambda: 8, dtype=torch.bfloat16)
    runner = SimpleNamespace(model=Model(), model_config=config, device="cpu")
    sample = warm_logits.sample(runner)
    for rows in (1, 2, 17):
        got = warm_logits.rows_like(sample, rows)
        want = runner.model.compute_logits(torch.zeros(rows, 8))
        assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride())
        assert torch.equal(got, want) and got.data_ptr() != sample.data_ptr()


def test_the_engine_reads_the_step_sizes_and_microbatching_from_the_config() -> None:
    """``max_num_batched_tokens``, the largest captured size and ``use_ubatching``: what
    the fused MoE warmer's eager range and its microbatch decline read."""
    config = SimpleNamespace(
        model_config=SimpleNamespace(max_logprobs=20, enforce_eager=False),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=8192),
        compilation_config=SimpleNamespace(cudagraph_capture_sizes=[1, 2, 512]),
        parallel_config=SimpleNamespace(use_ubatching=True),
        speculative_config=None,
    )
    worker = SimpleNamespace(vllm_config=config, model_runner=SimpleNamespace())
    read = Engine(**compat.engine_of(worker, compat.features((0, 26))))
    assert (read.max_tokens, read.graph_tokens, read.micro_batches) == (8192, 512, True)
    config.parallel_config.use_ubatching = False
    config.model_config.enforce_eager = True
    read = Engine(**compat.engine_of(worker, compat.features((0, 26))))
    assert (read.max_tokens, read.graph_tokens, read.micro_batches) == (8192, 0, False)


def test_the_compile_ahead_child_is_reaped_after_the_warmers(
    one_layer_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warmers do not wait for the child: they run first (finding on disk what it
    built), and a child still running is stopped after them (``ahead``)."""
    from tq_warmup_plugin.vllm_kernels import ahead

    order: list[str] = []

    class Records:
        @hookimpl
        def tq_warmup_engine_jobs(self, engine: Engine) -> list[Job]:
            return [Job("mine", "one", lambda: order.append("job"))]

    def reaped(timeout: float = 0.0) -> str:
        order.append("reaped")
        return "compile-ahead child: 1 jobs in 1.0 s"

    monkeypatch.setattr(ahead, "wait", reaped)
    report = warmup.run(one_layer_worker, Settings(launch=False), manager(Records()))
    assert order == ["job", "reaped"]
    assert report.line().endswith("; compile-ahead child: 1 jobs in 1.0 s")


def test_graph_jobs_run_one_at_a_time_after_the_others() -> None:
    """``torch.compile`` keeps process-global tracing state: on the H100 (vLLM 0.26.0) 3 of
    4 async-correction graphs compiled on threads at once failed ("Detected that you are
    using FX to symbolically trace a dynamo-optimized function"). Beside the Triton jobs,
    Dynamo's traces, Python under the same GIL, slowed their lookups 6x (serve-jit runs
    BD-BE). Graph jobs overlap nothing; Triton jobs still overlap each other."""
    pytest.importorskip("triton")
    import threading
    import time

    lock = threading.Lock()
    running = {"graphs": 0, "all": 0}
    peak = {"graphs": 0, "all": 0, "beside a graph": 0}

    def job(graph: bool) -> None:
        with lock:
            for name in ("graphs", "all") if graph else ("all",):
                running[name] += 1
                peak[name] = max(peak[name], running[name])
            if running["graphs"]:
                peak["beside a graph"] = max(peak["beside a graph"], running["all"])
        time.sleep(0.05)
        with lock:
            for name in ("graphs", "all") if graph else ("all",):
                running[name] -= 1

    class _Warmer:
        @hookimpl
        def tq_warmup_engine_jobs(self, engine: Engine) -> list[Job]:
            return [Job("graph", str(i), partial(job, True), graphs=True) for i in range(4)] + [
                Job("triton", str(i), partial(job, False)) for i in range(4)
            ]

    result = engine_warmup.run(manager(_Warmer()), engine(), False, threads=4)
    assert result.errors == [] and result.jobs == {"graph": 4, "triton": 4}
    assert peak["graphs"] == 1 and peak["all"] >= 3  # the Triton jobs side by side
    assert peak["beside a graph"] == 1  # a graph job alone
    # each family's jobs' time, summed: 4 sleeps of 50 ms each (the report names the most)
    assert set(result.family_seconds) == {"graph", "triton"}
    assert all(0.2 <= s < 2.0 for s in result.family_seconds.values()), result.family_seconds


def test_the_warmers_that_torch_compile_mark_their_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    from tq_warmup_plugin.warmers import vllm_async_spec, vllm_logprobs

    # vLLM's correction where the release has it (the V1 runner's, 0.22-0.33)
    monkeypatch.setattr(compat, "async_spec_correction", lambda runner: lambda *a: None)

    runner = SimpleNamespace(use_async_spec_decode=True)
    base: dict[str, Any] = dict(features=None, runner_v2=False, pooling=False,
                                spec_method="mtp", spec_tokens=2, draft_probs=False,
                                max_logprobs=20, runner=runner)  # fmt: skip
    v1 = Engine(**base)
    graphs = [
        *vllm_async_spec.tq_warmup_engine_jobs(engine=v1),
        *vllm_logprobs.tq_warmup_engine_jobs(engine=v1),
    ]
    assert len(graphs) == 5 and all(isinstance(j, Job) and j.graphs for j in graphs)
    v2 = Engine(**{**base, "runner_v2": True})
    assert not any(
        getattr(j, "graphs", True) for j in vllm_logprobs.tq_warmup_engine_jobs(engine=v2)
    )


def test_async_spec_correction_says_why_it_is_not_warmed() -> None:
    """An offline plan cannot know the worker's scheduling; a synchronous worker has
    nothing to correct; a V2 runner or no drafter is not its path at all."""
    from tq_warmup_plugin.warmers import vllm_async_spec

    def lines(**fields: object) -> list[object]:
        base: dict[str, object] = dict(features=None, runner_v2=False, pooling=False,
                                       spec_method="mtp", spec_tokens=2, draft_probs=False,
                                       max_logprobs=20, runner=SimpleNamespace())  # fmt: skip
        engine = Engine(**{**base, **fields})  # type: ignore[arg-type]
        return list(vllm_async_spec.tq_warmup_engine_jobs(engine=engine))

    (planned,) = lines(planned=True)
    assert isinstance(planned, Declined) and planned.why == vllm_async_spec.PLANNED
    (sync,) = lines(runner=SimpleNamespace(use_async_spec_decode=False))
    assert isinstance(sync, Declined) and "synchronously" in sync.why
    assert lines(runner_v2=True) == [] and lines(spec_method=None) == []


def test_the_moe_warmer_tells_a_plan_by_engine_planned() -> None:
    """An offline plan is ``Engine.planned``, as for the async correction: a planned MoE
    engine without derived experts says so and never reads a runner's model; a worker's
    reads its built model."""
    from tq_warmup_plugin.warmers import vllm_fused_moe

    def lines(runner: object, **fields: object) -> list[object]:
        base: dict[str, object] = dict(features=None, runner_v2=False, pooling=False,
                                       spec_method=None, spec_tokens=0, draft_probs=False,
                                       max_logprobs=20, moe=True, runner=runner)  # fmt: skip
        engine = Engine(**{**base, **fields})  # type: ignore[arg-type]
        return list(vllm_fused_moe.tq_warmup_engine_jobs(engine=engine))

    (planned,) = lines(None, planned=True)  # no model to read: only the plan's experts
    assert isinstance(planned, Declined) and "derived from the config" in planned.why
    worker = SimpleNamespace(model=SimpleNamespace(modules=lambda: []))
    (live,) = lines(worker)
    assert isinstance(live, Declined) and "no layer holds MoE expert weights" in live.why
