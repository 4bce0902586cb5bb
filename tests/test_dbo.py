"""Microbatching (``--enable-dbo``): which metadata views lose alignment, the keys that
adds, and where the setting is read (the real slicing: ``test_contract_dbo.py``)."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace
from typing import Any

import fakes
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_cli import H200_FLAGS, inspect_json
from test_keys import geometries

from tq_warmup_plugin import compat, keys
from tq_warmup_plugin.cli import commands as cli
from tq_warmup_plugin.geometry import Geometry
from tq_warmup_plugin.keys import KernelKey, Ptr
from tq_warmup_plugin.warmers.turboquant import turboquant_contributions
from tq_warmup_plugin.worker.warmup import Plan

V1 = ("block_table", "seq_lens", "slot_mapping")
V2 = ("block_table", "slot_mapping")


@pytest.mark.parametrize(
    ("version", "ubatching", "runner_v2", "views"),
    [
        ((0, 26), False, False, ()),
        ((0, 20), True, False, V1),
        ((0, 33), True, False, V1),
        ((0, 29), True, True, ()),  # V2 refuses DBO before 0.30: it runs on V1
        ((0, 30), True, True, V2),  # V2 copies seq_lens per microbatch
        ((0, 33), True, True, V2),
        ((0, 33), False, True, ()),
    ],
)
def test_sliced_views_per_release_and_runner(
    version: compat.Version, ubatching: bool, runner_v2: bool, views: tuple[str, ...]
) -> None:
    assert compat.ubatch_sliced(compat.features(version), ubatching, runner_v2) == views


@pytest.mark.parametrize(
    ("parallel", "on"),
    [
        (SimpleNamespace(use_ubatching=True), True),
        (SimpleNamespace(use_ubatching=False), False),
        (SimpleNamespace(), False),
        (None, False),
    ],
)
def test_ubatching_is_read_from_the_parallel_config(parallel: Any, on: bool) -> None:
    assert compat.ubatching(SimpleNamespace(parallel_config=parallel)) is on


def pointers(key: KernelKey) -> dict[str, Ptr]:
    return {name: arg for name, arg in key.args if isinstance(arg, Ptr)}


def aligned(key: KernelKey, names: set[str]) -> KernelKey:
    """The key with these pointers aligned."""
    args = tuple(
        (name, dataclasses.replace(arg, aligned=True) if name in names else arg)
        for name, arg in key.args
    )
    return dataclasses.replace(key, args=args)


SLICED_POINTERS = {
    "block_table": {"Block_table_ptr"},
    "seq_lens": {"Seq_lens_ptr", "B_Seqlen"},
    "slot_mapping": {"Slot_mapping_ptr"},
}


@given(geometries(), st.sampled_from([V1, V2]))
def test_microbatching_only_adds_unaligned_views_of_the_sliced_tensors(
    g: Geometry, views: tuple[str, ...]
) -> None:
    plain = set(Plan.of(turboquant_contributions({"l": g})).keys)
    sliced_g = dataclasses.replace(g, ubatch_sliced=views)
    sliced = set(Plan.of(turboquant_contributions({"l": sliced_g})).keys)
    assert plain <= sliced
    movable = set().union(*(SLICED_POINTERS[v] for v in views))
    for key in sliced - plain:
        assert aligned(key, movable) in {aligned(k, movable) for k in plain}


def by_kernel(ks: tuple[KernelKey, ...], kernel: str) -> list[dict[str, Ptr]]:
    return [pointers(k) for k in ks if k.kernel == kernel]


def test_v1_decode_and_store_keys_in_every_alignment() -> None:
    g = dataclasses.replace(fakes.geometry(width=63), ubatch_sliced=V1)
    stage1 = by_kernel(keys.decode_keys(g), "_tq_decode_stage1")
    assert {(p["Block_table_ptr"].aligned, p["Seq_lens_ptr"].aligned) for p in stage1} == {
        (True, True),
        (True, False),
        (False, True),
        (False, False),
    }
    stage2 = by_kernel(keys.decode_keys(g), "_fwd_kernel_stage2")
    assert sorted(p["B_Seqlen"].aligned for p in stage2) == [False, True]
    store = [pointers(k)["Slot_mapping_ptr"].aligned for k in keys.store_keys(g)]
    assert sorted(store) == [False, True]


def test_v2_decode_keeps_seq_lens_aligned() -> None:
    g = dataclasses.replace(fakes.geometry(width=64, version=(0, 33)), ubatch_sliced=V2)
    decode = keys.decode_keys(g)
    assert len(decode) == 2  # width 64: every row aligned; seq_lens copied
    assert len(keys.store_keys(g)) == 2


def test_one_sequence_has_no_later_request_but_a_later_table() -> None:
    # Microbatch 1 of a one-sequence batch starts at request 0 (seq_lens aligned) but
    # 0.32+ give it its own kernel_block_table[1], one odd-width row further on.
    g = dataclasses.replace(fakes.geometry(width=63, max_num_seqs=1), ubatch_sliced=V1)
    stage1 = by_kernel(keys.decode_keys(g), "_tq_decode_stage1")
    assert {p["Seq_lens_ptr"].aligned for p in stage1} == {True}
    assert {p["Block_table_ptr"].aligned for p in stage1} == {True, False}


@pytest.mark.parametrize(
    ("version", "use_v2", "views"), [((0, 26), False, V1), ((0, 33), True, V2), ((0, 29), True, ())]
)
def test_discovery_reads_microbatching_and_the_runner(
    monkeypatch: pytest.MonkeyPatch, version: compat.Version, use_v2: bool, views: tuple[str, ...]
) -> None:
    from tq_warmup_plugin.worker.discovery import discover

    pytest.importorskip("torch")
    monkeypatch.setattr(compat, "turboquant_impl_class", lambda: fakes.TurboQuantAttentionImpl)
    feats = compat.features(version)
    table = fakes.table(64)
    worker = fakes.worker({"tq": fakes.layer(feats)}, [table], v2_tables=[table], use_v2=use_v2)
    assert discover(worker, feats).geometries["tq"].ubatch_sliced == ()
    worker.vllm_config.parallel_config = SimpleNamespace(use_ubatching=True)
    assert discover(worker, feats).geometries["tq"].ubatch_sliced == views


FLAGS = [*H200_FLAGS, "--runner", "v1"]


def test_cli_plans_microbatches_and_reads_them_back(
    capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    plain = inspect_json(capsys, *FLAGS)
    assert "ubatch_sliced" not in plain["geometry"]  # type: ignore[operator]  # as before
    dbo: dict[str, Any] = inspect_json(capsys, *FLAGS, "--enable-dbo")
    assert dbo["geometry"]["ubatch_sliced"] == list(V1)
    assert dbo["distinct"] > plain["distinct"]  # type: ignore[operator]
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"vllm_version": "0.26.0", "geometries": [dbo["geometry"]]}))
    assert inspect_json(capsys, "--geometry-json", str(report))["distinct"] == dbo["distinct"]
    report.write_text(
        json.dumps(
            {"vllm_version": "0.26.0", "geometries": [{**dbo["geometry"], "ubatch_sliced": "x"}]}
        )
    )
    assert cli.main(["inspect", "--geometry-json", str(report)]) == 2
    assert "ubatch_sliced 'x' is not valid" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("moe", "method", "runner_v2"),
    [(False, None, True), (True, None, False), (False, "ngram", False), (False, "mtp", True)],
)
def test_a_plan_slices_microbatches_as_the_runner_vllm_picks(
    moe: bool, method: str | None, runner_v2: bool
) -> None:
    """On 0.30-0.33 V1 slices ``seq_lens`` per microbatch and V2 does not; vLLM runs a MoE
    model, ngram and draft_model on V1 where V2 is the default (``compat.runs_v2``). Before
    session 29 ``precompile --enable-dbo`` planned V2 for those (the release's default
    alone) while their workers ran V1: another decode key, compiled in each worker."""
    from tq_warmup_plugin.plan import model as plan_model
    from tq_warmup_plugin.plan import request as plan_request

    shape = plan_model.ModelShape("M", 128, 16, 8, 16, 8, 8, tuple(range(8)), False, "bfloat16",
                                None, 4096, None, vocab_size=32000, moe=moe)  # fmt: skip
    spec = {"method": method, "num_speculative_tokens": 2} if method else None
    request = plan_request.PlanRequest(kv_cache_dtype="turboquant_4bit_nc", vllm_version="0.30.0",
                                   enable_dbo=True, speculative_config=spec)  # fmt: skip
    sliced = plan_request.plan_shape(request, shape).geometry.ubatch_sliced
    assert sliced == compat.ubatch_sliced(compat.features((0, 30)), True, runner_v2)
    assert ("seq_lens" in sliced) is not runner_v2
