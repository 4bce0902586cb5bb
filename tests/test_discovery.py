"""Discovery on a mocked worker: which layers are TurboQuant, and what their kernels see."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import fakes
import pytest

from tq_warmup_plugin import compat
from tq_warmup_plugin.plan import rules as plan_rules
from tq_warmup_plugin.worker.discovery import discover

torch = pytest.importorskip("torch")

FEATS = compat.features((0, 26))


@pytest.fixture(autouse=True)
def fake_impl_class(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "turboquant_impl_class", lambda: fakes.TurboQuantAttentionImpl)


def test_only_exact_turboquant_impls_are_found() -> None:
    layers = {
        "tq": fakes.layer(FEATS),
        "ultra": fakes.layer(FEATS, fakes.UltraQuantAttentionImpl()),
        "boundary": fakes.layer(FEATS, fakes.FlashAttentionImpl()),
        "mamba": SimpleNamespace(),
    }
    worker = fakes.worker(layers, [fakes.table(64)], groups=[([*layers, "absent"], 0)])
    found = discover(worker, FEATS)
    assert found.refused == {}
    assert found.geometries == {"tq": fakes.geometry(version=(0, 26), width=64)}


def test_pooling_models_are_discovered(monkeypatch: pytest.MonkeyPatch) -> None:
    # Which paths they run is decided by compat.prefix_reused (test_pooling.py).
    worker = fakes.worker({"tq": fakes.layer(FEATS)}, [fakes.table(64)], runner_type="pooling")
    found = discover(worker, FEATS)
    assert (list(found.geometries), found.refused, found.paths) == (["tq"], {}, None)


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (fakes.layer(FEATS, heads=3), "ValueError: KV cache view of shape (4, 16, 3, 134)"),
        (
            fakes.layer(FEATS, fakes.TurboQuantAttentionImpl(num_heads=6, num_kv_heads=4), heads=4),
            "ValueError: 6 query heads vs 4 KV heads",
        ),
        (
            fakes.layer(FEATS, fakes.TurboQuantAttentionImpl(cache_dtype="fp8")),
            "ValueError: not a TurboQuant cache dtype",
        ),
    ],
)
def test_a_mismatched_layer_is_refused_and_the_others_found(bad: object, reason: str) -> None:
    worker = fakes.worker({"good": fakes.layer(FEATS), "bad": bad}, [fakes.table(64)])
    found = discover(worker, FEATS)
    assert list(found.geometries) == ["good"]
    assert list(found.refused) == ["bad"]
    assert found.refused["bad"].startswith(reason) and "\n" not in found.refused["bad"]


def test_a_missing_block_table_is_refused() -> None:
    worker = fakes.worker({"tq": fakes.layer(FEATS)}, [fakes.table(64)], groups=[(["tq"], 1)])
    assert discover(worker, FEATS).refused["tq"].startswith("IndexError")


@pytest.mark.parametrize(
    ("use_v2", "kernel_width", "width"),
    [(False, None, 48), (True, None, 80), (False, 96, 96), (True, 96, 96)],
)
def test_block_table_source(use_v2: bool, kernel_width: int | None, width: int) -> None:
    kernel_table = None if kernel_width is None else torch.zeros(2, 8, kernel_width)
    worker = fakes.worker(
        {"tq": fakes.layer(FEATS)},
        [fakes.table(48)],
        v2_tables=[fakes.table(80)],
        use_v2=use_v2,
        kernel_table=kernel_table,
    )
    assert discover(worker, FEATS).geometries["tq"].block_table_width == width


def test_block_table_width_is_the_row_stride() -> None:
    padded = fakes.table(128)[:, :80]
    worker = fakes.worker({"tq": fakes.layer(FEATS)}, [padded])
    assert discover(worker, FEATS).geometries["tq"].block_table_width == 128


def test_each_group_reads_its_own_block_table() -> None:
    layers = {"a": fakes.layer(FEATS), "b": fakes.layer(FEATS)}
    worker = fakes.worker(
        layers, [fakes.table(48), fakes.table(33)], groups=[(["a"], 0), (["b"], 1)]
    )
    found = discover(worker, FEATS).geometries
    assert (found["a"].block_table_width, found["b"].block_table_width) == (48, 33)


@pytest.mark.parametrize(
    ("version", "strides"),
    [
        ((0, 25), (4288, 268, 134)),
        ((0, 26), (4288, 134, 2144)),
        ((0, 28), (4288, 134, 2144)),
        ((0, 29), (4288, 268, 134)),
        ((0, 33), (4288, 268, 134)),
    ],
)
def test_kv_view_as_the_kernels_get_it(version: compat.Version, strides: tuple) -> None:
    feats = compat.features(version)
    worker = fakes.worker({"tq": fakes.layer(feats)}, [fakes.table(64)])
    g = discover(worker, feats).geometries["tq"]
    assert (g.block_size, g.kv_strides) == (16, strides)
    assert g.kv_strides == plan_rules.kv_view_strides(feats, 16, 2, 134)


def test_config_values_and_alignment_are_read() -> None:
    impl = fakes.TurboQuantAttentionImpl(4, 1, 64, splits=16, cache_dtype="turboquant_k8v4")
    layer = fakes.layer(FEATS, impl, aligned=False, block_size=32)
    worker = fakes.worker(
        {"tq": layer},
        [fakes.table(17)],
        dtype=torch.float16,
        max_num_seqs=4,
        max_model_len=333,
        max_num_batched_tokens=100,
    )
    g = discover(worker, FEATS).geometries["tq"]
    expected = fakes.geometry(
        cache_dtype="turboquant_k8v4",
        head_size=64,
        num_heads=4,
        num_kv_heads=1,
        block_size=32,
        model_dtype="float16",
        width=17,
        max_num_seqs=4,
        max_model_len=333,
        batched=100,
        splits=16,
    )
    assert g.kv_aligned is False
    assert g == dataclasses.replace(expected, kv_aligned=False)
