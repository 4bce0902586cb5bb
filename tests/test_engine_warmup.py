"""The engine warmers' host and their declines: jobs run once, a raising job is one
error line (strict mode then fails startup), launches become compiles and the patch
is always undone. Runner objects are stand-ins; Triton is real (compile-only here)."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from tq_warmup_plugin import compat, engine_warmup, install, warmup
from tq_warmup_plugin.engine import Declined, Engine, Job
from tq_warmup_plugin.hookspecs import hookimpl
from tq_warmup_plugin.settings import Settings
from tq_warmup_plugin.warmers import (
    vllm_eagle,
    vllm_logprobs,
    vllm_rejection,
    vllm_slot_mapping,
    vllm_top_k_top_p,
)

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


def manager(*plugins: object) -> Any:
    import pluggy

    from tq_warmup_plugin import hookspecs

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for plugin in plugins:
        pm.register(plugin)
    return pm


def families(items: list[Declined]) -> dict[str, str]:
    return {d.family: d.why for d in items}


def test_each_warmer_declines_in_one_line_where_its_kernel_is_not_reached() -> None:
    pm = manager(*BUILT_IN)
    _, declined = engine_warmup.jobs_of(pm, engine(runner_v2=True, spec_method=None, spec_tokens=0))
    why = families(declined)
    assert set(why) == {"slot mapping", "rejection sampler"}
    assert all("\n" not in w and w for w in why.values())
    _, declined = engine_warmup.jobs_of(pm, engine(pooling=True))
    assert set(families(declined)) == {"slot mapping", "logprobs", "top-k/top-p"}
    jobs, declined = engine_warmup.jobs_of(pm, engine(max_logprobs=0))
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
    _, declined = engine_warmup.jobs_of(manager(*BUILT_IN), engine(version))
    assert {d.family for d in declined if "registry" in d.why} == registry


@pytest.mark.parametrize(
    ("fields", "warn", "says"),
    [
        (dict(spec_method=None, spec_tokens=0), False, "no speculative decoding"),
        (dict(spec_method="ngram"), False, "ngram drafts without the EAGLE helper kernels"),
        (dict(spec_method="draft_model"), False, "compile on the first draft steps"),
        (dict(spec_method="deepseek_mtp", jit_monitor_error=True), True, "stops the engine"),
        (dict(version=(0, 30), spec_method="eagle3", jit_monitor_error=True), False, "registry"),
    ],
)
def test_the_eagle_helpers_are_named_where_they_will_compile(
    fields: dict[str, Any], warn: bool, says: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Not warmed yet: one line each, a WARNING only where the JIT monitor will stop
    the engine core on them (error mode, a release without vLLM's own warmup of them)."""
    jobs, declined = engine_warmup.jobs_of(manager(vllm_eagle), engine(**fields))
    assert jobs == [] and len(declined) == 1
    (item,) = declined
    assert (item.family, item.warn) == ("EAGLE helpers", warn) and says in item.why
    assert "\n" not in item.why
    pytest.importorskip("triton")  # the host's compile-only launches
    with caplog.at_level(logging.INFO, logger="vllm.tq_warmup_plugin"):
        engine_warmup.run(manager(vllm_eagle), engine(**fields), False)
    (record,) = [r for r in caplog.records if "EAGLE helpers" in r.getMessage()]
    assert record.levelno == (logging.WARNING if warn else logging.INFO)


def test_rejection_jobs_cover_every_sampling_mode() -> None:
    jobs, _ = engine_warmup.jobs_of(manager(vllm_rejection), engine(spec_tokens=4))
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
    v1, _ = engine_warmup.jobs_of(manager(vllm_top_k_top_p), engine())
    v2, _ = engine_warmup.jobs_of(
        manager(vllm_top_k_top_p), engine(runner_v2=True, spec_method=None)
    )
    v2_spec, _ = engine_warmup.jobs_of(manager(vllm_top_k_top_p), engine(runner_v2=True))
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
    assert JITFunction.run is original
    assert add_one.device_caches  # compiled for sm90, nothing launched
    assert torch.equal(x, torch.zeros(64))


def test_strict_mode_fails_startup_on_a_failed_engine_job(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    import fakes

    from tq_warmup_plugin.discovery import Discovery

    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "0.26.0")
    monkeypatch.setattr(compat, "workspace_manager", lambda feats: None)
    monkeypatch.setattr(warmup, "discover", lambda worker, feats: found)
    monkeypatch.setattr(warmup, "compile_all", lambda pm, todo, threads, progress: [])
    monkeypatch.setattr(warmup, "CompileCounter", fakes.StubCounter)
    monkeypatch.setattr(compat, "engine_of", lambda worker, feats: engine().__dict__)
    monkeypatch.setattr(warmup, "plugin_manager", lambda: manager(Warmers()))
    found = Discovery(geometries={"layers.0.attn": fakes.geometry()})
    worker = SimpleNamespace(use_v2_model_runner=False, vllm_config=None)
    report = warmup.run(worker, Settings(launch=False))
    assert report.status == "ok" and report.errors == ["mine (broken): ValueError: no such buffer"]
    assert report.vllm_jobs == {"mine": 1} and "vLLM kernels: mine 1" in report.line()
    with pytest.raises(RuntimeError, match="strict mode"):
        install.warm_worker(worker, Settings(launch=False, strict=True))
    off = warmup.run(worker, Settings(launch=False, vllm_kernels=False))
    assert off.errors == [] and off.vllm_jobs == {}
