"""ROCm gfx950 with FlyDSL (vLLM 0.28+): TurboQuant layers whose impl stores the SoA
layout run none of the warmed kernels, so discovery leaves them out with one note."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import fakes
import pytest
from fakes import RecordingWarmer, StubCounter, manager

from tq_warmup_plugin import compat
from tq_warmup_plugin.settings import Settings
from tq_warmup_plugin.worker import keyplan, warmup
from tq_warmup_plugin.worker.discovery import discover

torch = pytest.importorskip("torch")

NOTE = (
    "ROCm gfx950 with FlyDSL (vLLM 0.28+): 2 TurboQuant layers store the SoA layout and "
    "run FlyDSL/SoA Triton kernels, which the plugin does not warm: skipped"
)


def soa_impl() -> fakes.TurboQuantAttentionImpl:
    impl = fakes.TurboQuantAttentionImpl()
    impl._soa_store = True  # type: ignore[attr-defined]  # what 0.28+ set on gfx950 + FlyDSL
    impl._use_flydsl = True  # type: ignore[attr-defined]
    return impl


@pytest.fixture(autouse=True)
def fake_impl_class(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "turboquant_impl_class", lambda: fakes.TurboQuantAttentionImpl)


def mixed_worker(feats: compat.Features) -> Any:
    plain = fakes.TurboQuantAttentionImpl()
    plain._soa_store = False  # type: ignore[attr-defined]  # 0.28+ elsewhere
    layers = {
        "fly.0": fakes.layer(feats, soa_impl()),
        "plain": fakes.layer(feats, plain),
        "fly.1": fakes.layer(feats, soa_impl()),
    }
    return fakes.worker(layers, [fakes.table(64)])


@pytest.mark.parametrize("version", [(0, 28), (0, 33)])
def test_flydsl_layers_are_left_out_with_one_note(version: compat.Version) -> None:
    feats = compat.features(version)
    found = discover(mixed_worker(feats), feats)
    assert list(found.geometries) == ["plain"] and found.refused == {}
    assert found.flydsl == ["fly.0", "fly.1"]
    assert found.note == NOTE


def test_before_028_the_attribute_means_nothing() -> None:
    feats = compat.features((0, 27))
    found = discover(mixed_worker(feats), feats)
    assert list(found.geometries) == ["fly.0", "plain", "fly.1"] and found.note == ""


def test_a_worker_of_flydsl_layers_is_skipped_not_warmed(monkeypatch: pytest.MonkeyPatch) -> None:
    feats = compat.features((0, 30))
    worker = fakes.worker(
        {"fly.0": fakes.layer(feats, soa_impl()), "fly.1": fakes.layer(feats, soa_impl())},
        [fakes.table(64)],
    )
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "0.30.0")
    monkeypatch.setattr(keyplan, "CompileCounter", StubCounter)
    warmer = RecordingWarmer(None)
    report = warmup.run(worker, Settings(), manager(warmer))
    assert warmer.seen == [] and report.distinct == 0
    assert (report.status, report.reason, report.notes) == ("skipped", NOTE, [NOTE])
    assert not report.is_problem  # by design, not a failure: strict mode lets it start
    assert report.line() == f"tq-warmup: skipped: {NOTE}"


def test_beside_plain_layers_the_note_is_on_the_report_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    feats = compat.features((0, 30))
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "0.30.0")
    monkeypatch.setattr(compat, "workspace_manager", lambda feats: None)
    monkeypatch.setattr(keyplan, "CompileCounter", StubCounter)
    report = warmup.run(
        mixed_worker(feats), Settings(vllm_kernels=False), manager(RecordingWarmer(None))
    )
    assert report.status == "ok" and report.layers == 1 and report.notes == [NOTE]
    assert report.line().endswith(f"; {NOTE}")


@pytest.mark.real_vllm
def test_real_impl_with_flydsl_is_left_out_and_launches_no_warmed_kernel(
    vllm_env: compat.Features,
) -> None:
    """vLLM's real impl built as gfx950 with FlyDSL builds it (``is_flydsl_available``
    answering True): discovery's test holds, and the real backend, driven over every
    path, launches none of the kernels the plugin warms."""
    from realvllm import layer_kv_cache, make_impl, recorded_keys, run_backend
    from vllm.v1.attention.backends import turboquant_attn

    if not vllm_env.rocm_flydsl:
        impl = make_impl("turboquant_4bit_nc", 128, 8, 2, 32, 1008)
        assert not hasattr(impl, "_soa_store")
        pytest.skip("vLLM before 0.28 has no FlyDSL path")
    # GQA 4: FlyDSL's own decode is ineligible, so decode runs the SoA Triton kernel
    # (the FlyDSL one needs the flydsl package); the store and continuations are SoA.
    with mock.patch.object(turboquant_attn, "is_flydsl_available", return_value=True):
        impl = make_impl("turboquant_4bit_nc", 128, 8, 2, 32, 1008)
    assert compat.flydsl_layer(vllm_env, impl)
    assert not compat.flydsl_layer(vllm_env, make_impl("turboquant_4bit_nc", 128, 8, 2, 32, 1008))
    kv = layer_kv_cache(vllm_env, 4, 16, 2, impl.tq_config.slot_size_aligned)
    with recorded_keys(), launched_kernels() as launched:
        run_backend(impl, kv, 63, torch.bfloat16)
    # The SoA modules reuse two of the names (_tq_full_dequant_kv, _tq_fused_store_mse).
    warmed = {(module, name) for name, module in compat.KERNEL_MODULES.items()}
    assert launched and not launched & warmed, sorted(launched)
    assert {module.split(".")[-2] for module, _ in launched} == {"turboquant_soa"}


@contextlib.contextmanager
def launched_kernels() -> Iterator[set[tuple[str, str]]]:
    """``(module, kernel)`` of every launch inside ``recorded_keys`` (which skips them),
    told apart by the module that defines the kernel."""
    from triton import knobs

    seen: set[tuple[str, str]] = set()
    inner = knobs.runtime.jit_cache_hook

    def hook(*, fn: Any, **kwargs: Any) -> bool:
        seen.add((fn.module, fn.name))  # Triton's JitFunctionInfo (3.6-3.8)
        return bool(inner(fn=fn, **kwargs))

    knobs.runtime.jit_cache_hook = hook
    try:
        yield seen
    finally:
        knobs.runtime.jit_cache_hook = inner
