"""warmup.run end to end with discovery, the compiler and the workspace faked."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Hashable, Mapping
from typing import Any

import fakes
import pytest
from fakes import FAILING, RecordingWarmer, StubCounter, manager

from tq_warmup_plugin import compat
from tq_warmup_plugin.geometry import Geometry
from tq_warmup_plugin.hookspecs import hookimpl
from tq_warmup_plugin.keys import Const, Int, KernelKey, Ptr
from tq_warmup_plugin.settings import Settings
from tq_warmup_plugin.warmers import triton_jit
from tq_warmup_plugin.warmers.turboquant import turboquant_contributions
from tq_warmup_plugin.worker import keyplan, warmup
from tq_warmup_plugin.worker.discovery import Discovery

GEOMETRIES = {
    "model.layers.0.attn": fakes.geometry(),
    "model.layers.1.attn": fakes.geometry(),
    "model.layers.2.attn": fakes.geometry(head_size=64, width=63),
}


class ExtraWarmer:
    """A third-party warmer with its own keys and compiler."""

    def __init__(self) -> None:
        self.compiled: list[Hashable] = []

    @hookimpl
    def tq_warmup_keys(self, geometries: Mapping[str, Geometry]) -> list[tuple]:
        return [(name, "extra", ("extra", g.head_size)) for name, g in geometries.items()]

    @hookimpl
    def tq_warmup_compile(self, key: Hashable) -> bool | None:
        if not (isinstance(key, tuple) and key[0] == "extra"):
            return None
        self.compiled.append(key)
        return True


@pytest.fixture
def found(monkeypatch: pytest.MonkeyPatch) -> Discovery:
    """vLLM 0.26 with three discovered layers, no workspace and no Triton."""
    found = Discovery(geometries=dict(GEOMETRIES))

    def discover(worker: Any, feats: compat.Features) -> Discovery:
        assert feats == compat.features((0, 26))
        return found

    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "0.26.0")
    monkeypatch.setattr(compat, "workspace_manager", lambda feats: None)
    monkeypatch.setattr(keyplan, "CompileCounter", StubCounter)
    monkeypatch.setattr(warmup, "discover", discover)
    monkeypatch.setattr(compat, "preallocate_prefill_buffers", PREALLOCATED.record)
    PREALLOCATED.calls.clear()
    return found


class _Preallocations:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, Any, int]] = []

    def record(self, impl: Any, device: Any, max_model_len: int) -> int:
        self.calls.append((impl, device, max_model_len))
        return 0


PREALLOCATED = _Preallocations()


@pytest.mark.parametrize("device", [None, "cuda:0"])
def test_prefill_buffers_are_made_for_every_layer_before_capture(
    found: Discovery, device: str | None
) -> None:
    found.device = device
    found.impls = {name: f"impl of {name}" for name in found.geometries}
    warmup.run(object(), Settings(vllm_kernels=False, launch=False), manager(RecordingWarmer(None)))
    expected = [(f"impl of {n}", device, g.max_model_len) for n, g in GEOMETRIES.items()]
    assert PREALLOCATED.calls == (expected if device else [])


@pytest.mark.parametrize("version", ["0.19.0", fakes.BEYOND_RELEASE, "", None])
def test_unsupported_release_is_declined(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: version)
    monkeypatch.setattr(warmup, "discover", None)  # must not be reached
    report = warmup.run(object(), Settings(vllm_kernels=False))
    assert report.status == "unsupported" and report.vllm_version == (version or "")
    assert report.reason == compat.support_problem(compat.parse_version(version))
    assert report.line() == f"tq-warmup: unsupported: {report.reason}"
    assert report.is_problem


def test_each_distinct_key_compiles_once_and_failures_are_counted(found: Discovery) -> None:
    warmer = RecordingWarmer()
    report = warmup.run(object(), Settings(vllm_kernels=False, threads=1), manager(warmer))
    expected = warmup.Plan.of(turboquant_contributions(GEOMETRIES))
    failing = [k for k in expected.keys if k.kernel == FAILING]
    assert report.status == "ok" and report.layers == 3
    assert Counter(warmer.seen) == Counter(expected.keys)
    assert report.distinct == len(expected.keys) < len(list(turboquant_contributions(GEOMETRIES)))
    assert report.keys == expected.count_by_path()
    assert failing and report.failed == len(failing) == len(report.errors)
    assert set(report.errors) == {f"{FAILING}: RuntimeError: ptxas died"}
    assert (report.compiled, report.shipped, report.loaded, report.workspace_bytes) == (3, 2, 4, 0)


def test_threads_compile_the_same_set() -> None:
    todo = warmup.Plan.of(turboquant_contributions(GEOMETRIES)).keys
    serial, threaded = RecordingWarmer(), RecordingWarmer()
    errors_serial = warmup.compile_all(manager(serial), todo, 1)
    errors_threaded = warmup.compile_all(manager(threaded), todo, 2)
    assert Counter(serial.seen) == Counter(todo)
    # Keys that failed on a pool thread are tried once more on the caller's thread.
    failing = [k for k in todo if k.kernel == FAILING]
    assert failing and Counter(threaded.seen) == Counter(todo) + Counter(failing)
    assert Counter(errors_serial) == Counter(errors_threaded) and errors_serial
    main = threading.get_ident()
    assert serial.threads == {main} and threaded.threads - {main}


def test_a_compile_that_fails_on_a_pool_thread_is_retried_on_the_caller() -> None:
    main = threading.get_ident()

    class ThreadShy(RecordingWarmer):
        @hookimpl
        def tq_warmup_compile(self, key: Hashable) -> bool | None:
            super().tq_warmup_compile(key)
            if threading.get_ident() != main:
                raise SystemError("AST constructor recursion depth mismatch")
            return True

    todo = warmup.Plan.of(turboquant_contributions(GEOMETRIES)).keys
    warmer = ThreadShy(failing=None)
    assert warmup.compile_all(manager(warmer), todo, 2) == []
    assert Counter(warmer.seen) == Counter(todo) + Counter(todo)


def test_a_key_nobody_handles_is_an_error() -> None:
    assert warmup.compile_all(manager(), ["mystery"], 1) == ["no warmer handles 'mystery'"]


def test_third_party_warmer_contributes_and_compiles_its_keys(found: Discovery) -> None:
    extra = ExtraWarmer()
    report = warmup.run(
        object(), Settings(vllm_kernels=False, threads=2), manager(RecordingWarmer(None), extra)
    )
    tq_only = warmup.Plan.of(turboquant_contributions(GEOMETRIES))
    assert Counter(extra.compiled) == Counter([("extra", 128), ("extra", 64)])
    assert report.keys == {**tq_only.count_by_path(), "extra": 2}
    assert report.distinct == len(tq_only.keys) + 2
    assert (report.failed, report.errors) == (0, [])


def test_refused_layers_are_errors_not_failures(found: Discovery) -> None:
    found.refused["model.layers.3.attn"] = "ValueError: odd cache"
    report = warmup.run(object(), Settings(vllm_kernels=False), manager(RecordingWarmer(None)))
    assert report.status == "ok" and report.failed == 0
    assert report.errors == ["layer model.layers.3.attn: ValueError: odd cache"]


def test_no_turboquant_layers_is_skipped(found: Discovery) -> None:
    found.geometries.clear()
    assert warmup.run(object(), Settings(vllm_kernels=False), manager()).reason == (
        "no TurboQuant attention layers in this worker"
    )
    found.refused["l"] = "ValueError: bad"
    report = warmup.run(object(), Settings(vllm_kernels=False), manager())
    assert report.status == "skipped"
    assert report.reason.endswith("(1 refused: layer l: ValueError: bad)")


def test_triton_warmer_passes_the_key_through(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, dict]] = []

    class Kernel:
        def __init__(self, name: str) -> None:
            self.name = name

        def warmup(self, **kwargs: Any) -> None:
            calls.append((self.name, kwargs))

    monkeypatch.setattr(compat, "kernel_function", Kernel)
    monkeypatch.setattr(triton_jit, "_gpu_driver_active", lambda: True)
    key = KernelKey("_tq_decode_stage1", (("n", Int.of(48)), ("C", Const(0.5))), 4, 2)
    assert triton_jit.tq_warmup_compile(key) is True
    assert calls == [
        ("_tq_decode_stage1", {"grid": (1,), "n": 16, "C": 0.5, "num_warps": 4, "num_stages": 2})
    ]
    assert triton_jit.tq_warmup_compile(("extra", 1)) is None


def test_warmup_arguments_reproduce_dtype_and_alignment() -> None:
    torch = pytest.importorskip("torch")
    key = KernelKey("k", (("a", Ptr("bf16")), ("b", Ptr("i32", aligned=False))), 8)
    out = triton_jit.warmup_arguments(key)
    assert (out["a"].dtype, out["a"].data_ptr() % 16) == (torch.bfloat16, 0)
    assert out["b"].dtype == torch.int32 and out["b"].data_ptr() % 16 != 0
    assert out["num_warps"] == 8 and "num_stages" not in out


def test_compile_threads_run_on_the_callers_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton caches kernels per current device; pool threads must use the caller's
    (tensor-parallel rank 1 warmed device 0 before this was pinned)."""
    pytest.importorskip("triton")
    from triton.runtime import driver

    seen: dict[int, int] = {}
    devices = fakes.ThreadDevices(caller=1)  # the worker thread of rank 1
    monkeypatch.setattr(driver, "_active", devices, raising=False)

    class DeviceWarmer:
        @hookimpl
        def tq_warmup_compile(self, key: Hashable) -> bool:
            seen[threading.get_ident()] = devices.get_current_device()
            return True

    assert warmup.compile_all(manager(DeviceWarmer()), ["a", "b", "c", "d"], 2) == []
    assert seen and set(seen.values()) == {1}
    assert threading.get_ident() not in seen


@pytest.mark.parametrize(
    ("device", "enabled", "called"),
    [("cuda", True, True), ("cuda", False, False), ("cpu", True, False), (None, True, False)],
)
def test_first_launches_only_on_cuda_and_when_enabled(
    monkeypatch: pytest.MonkeyPatch,
    found: Discovery,
    device: str | None,
    enabled: bool,
    called: bool,
) -> None:
    from types import SimpleNamespace

    from tq_warmup_plugin.worker import launches

    found.device = SimpleNamespace(type=device) if device else None
    found.impls = {name: object() for name in found.geometries}
    calls: list[tuple[Any, ...]] = []

    def launch_all(todo: Any, impls: Any, dev: Any) -> tuple[int, float, list[str]]:
        calls.append((todo, impls, dev))
        return len(todo) - 1, 0.25, ["launch gemm float16 258x128: RuntimeError: x"]

    monkeypatch.setattr(launches, "launch_all", launch_all)
    report = warmup.run(
        object(), Settings(vllm_kernels=False, launch=enabled), manager(RecordingWarmer(None))
    )
    assert bool(calls) is called
    if called:
        assert calls[0] == (launches.plan(found.geometries), found.impls, found.device)
        assert (report.launches, report.launch_s) == (len(calls[0][0]) - 1, 0.25)
        assert report.failed == 1 and report.errors[-1].startswith("launch gemm")
        assert report.line().endswith("first error: launch gemm float16 258x128: RuntimeError: x")
    else:
        assert (report.launches, report.failed) == (0, 0)


@pytest.mark.parametrize("gpu", [True, False])
def test_compiled_kernels_are_loaded_only_on_a_gpu(
    monkeypatch: pytest.MonkeyPatch, gpu: bool
) -> None:
    loaded: list[str] = []

    class Compiled:
        def _init_handles(self) -> None:
            loaded.append("launcher and module")

    class Kernel:
        def __init__(self, name: str) -> None:
            pass

        def warmup(self, **kwargs: Any) -> Compiled:
            return Compiled()

    monkeypatch.setattr(compat, "kernel_function", Kernel)
    monkeypatch.setattr(triton_jit, "_gpu_driver_active", lambda: gpu)
    assert triton_jit.tq_warmup_compile(KernelKey("_tq_decode_stage1", (), 4)) is True
    assert loaded == (["launcher and module"] if gpu else [])
