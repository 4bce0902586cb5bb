"""The pure key derivation: properties over presets, shapes, releases and TP sizes."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import fakes
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tq_warmup_plugin import compat, keys
from tq_warmup_plugin.geometry import PRESETS, Geometry, preset
from tq_warmup_plugin.keys import Const, Int, KernelKey, Ptr
from tq_warmup_plugin.warmers.turboquant import turboquant_contributions
from tq_warmup_plugin.worker.warmup import Plan

VERSIONS = [(0, 20), (0, 21), (0, 24), (0, 26), (0, 28), (0, 29), (0, 33)]
INT_CLASSES = {Int.of(v) for v in (1, 0, 3, 2**32, 2**32 + 1)}


def args(key: KernelKey) -> dict[str, Any]:
    return dict(key.args)


def by_kernel(ks: tuple[KernelKey, ...], kernel: str) -> list[KernelKey]:
    return [k for k in ks if k.kernel == kernel]


@st.composite
def geometries(draw: st.DrawFn) -> Geometry:
    kv_total = draw(st.sampled_from([1, 2, 4, 8]))
    q_total = kv_total * draw(st.sampled_from([1, 2, 4, 8]))
    tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if q_total % t == 0]))
    return fakes.geometry(
        version=draw(st.sampled_from(VERSIONS)),
        cache_dtype=draw(st.sampled_from(sorted(PRESETS))),
        head_size=draw(st.sampled_from([64, 80, 96, 128, 256])),
        num_heads=q_total // tp,
        num_kv_heads=max(1, kv_total // tp),  # vLLM replicates KV heads past their count
        block_size=draw(st.sampled_from([16, 32, 64, 128])),
        model_dtype=draw(st.sampled_from(["bfloat16", "float16"])),
        width=draw(st.integers(1, 8192)),
        max_num_seqs=draw(st.integers(1, 1024)),
        max_model_len=draw(st.integers(1, 1 << 20)),
        batched=draw(st.integers(1, 1 << 15)),
        splits=draw(st.sampled_from([1, 4, 8, 16, 32, 64])),
    )


@given(geometries())
def test_every_key_is_a_known_kernel_with_canonical_ints(g: Geometry) -> None:
    g.check()
    for derive in keys.PATHS.values():
        for key in derive(g):
            assert key.kernel in compat.KERNEL_MODULES
            hash(key)
            assert {a for _, a in key.args if isinstance(a, Int)} <= INT_CLASSES
            assert len({name for name, _ in key.args}) == len(key.args)


@given(geometries())
def test_decode_keys_use_the_configured_splits(g: Geometry) -> None:
    stage1, stage2 = keys.decode_keys(g)
    assert (stage1.kernel, stage2.kernel) == ("_tq_decode_stage1", "_fwd_kernel_stage2")
    assert args(stage1)["NUM_KV_SPLITS"] == args(stage2)["NUM_KV_SPLITS"] == Const(g.num_kv_splits)
    assert args(stage1)["stride_bt_b"] == Int.of(g.block_table_width)
    assert args(stage1)["KV_GROUP_SIZE"] == Const(g.num_heads // g.num_kv_heads)
    scale = args(stage1)["ATTN_SCALE"].value
    assert type(scale) is float and scale == g.scale


@given(geometries())
def test_continuation_variants(g: Geometry) -> None:
    ks = keys.short_continuation_keys(g)
    seqs = (True, False) if g.features.version >= (0, 21) else (True,)
    rows = (True, False) if g.block_table_width % 4 and g.max_num_seqs >= 2 else (True,)
    stage1 = by_kernel(ks, "_tq_decode_stage1")
    stage2 = by_kernel(ks, "_fwd_kernel_stage2")
    assert len(ks) == len(set(ks)) == len(stage1) + len(stage2)
    assert {
        (args(k)["Block_table_ptr"].aligned, args(k)["Seq_lens_ptr"].aligned) for k in stage1
    } == {(r, s) for r in rows for s in seqs}
    assert {args(k)["B_Seqlen"].aligned for k in stage2} == set(seqs)
    assert len(stage2) == len(seqs)
    assert {args(k)["NUM_KV_SPLITS"] for k in ks} == {Const(32)}
    assert {args(k)["stride_bt_b"] for k in stage1} == {Int.of(0)}


@given(geometries())
def test_dequant_keys_only_past_the_fast_path_threshold(g: Geometry) -> None:
    ks = keys.long_continuation_keys(g)
    if g.max_num_batched_tokens <= 128:
        assert ks == ()
    else:
        assert ks and {k.kernel for k in ks} == {"_tq_full_dequant_kv"}
        rows = 2 if g.block_table_width % 4 and g.max_num_seqs >= 2 else 1
        assert len(ks) <= 2 * rows
        assert {args(k)["stride_bt_b"] for k in ks} == {Int.of(g.block_table_width)}


@given(geometries(), st.integers(1, 1024))
def test_a_local_layer_reads_its_virtual_table(plain: Geometry, pages: int) -> None:
    """Chunked local attention: every block-table key follows the virtual batch's
    ``pages``-column table; decode reads it and its fresh ``seq_lens`` from the base."""
    g = dataclasses.replace(plain, attention_chunk=pages * plain.block_size)
    g.check()
    decode = by_kernel(keys.decode_keys(g), "_tq_decode_stage1")
    assert {args(k)["stride_bt_b"] for k in decode} == {Int.of(pages)}
    assert {
        (args(k)["Block_table_ptr"].aligned, args(k)["Seq_lens_ptr"].aligned) for k in decode
    } == {(True, True)}
    many = g.max_num_seqs >= 2 or g.features.local_prefill_real_lens
    rows = {True, False} if pages % 4 and many else {True}
    short = by_kernel(keys.short_continuation_keys(g), "_tq_decode_stage1")
    assert {args(k)["Block_table_ptr"].aligned for k in short} == rows
    dequant = keys.long_continuation_keys(g)
    if g.max_num_batched_tokens <= 128 or g.attention_chunk <= 128:
        assert dequant == ()
    else:
        assert {args(k)["stride_bt_b"] for k in dequant} == {Int.of(pages)}
        assert {args(k)["Block_table_ptr"].aligned for k in dequant} == rows


@given(geometries())
def test_store_key_has_exact_constexpr_strides(g: Geometry) -> None:
    (key,) = keys.store_keys(g)
    fp8 = g.cache_dtype == "turboquant_k8v4"
    assert key.kernel == ("_tq_fused_store_fp8" if fp8 else "_tq_fused_store_mse")
    a = args(key)
    strides = (a["stride_cache_block"], a["stride_cache_pos"], a["stride_cache_head"])
    assert strides == tuple(Const(s) for s in g.kv_strides)
    assert (a["D"], a["H"], a["BLOCK_SIZE"]) == (
        Const(g.head_size),
        Const(g.num_kv_heads),
        Const(g.block_size),
    )


@given(geometries())
def test_stage2_output_dtype_per_release(g: Geometry) -> None:
    a = args(keys.decode_keys(g)[1])
    if g.features.version >= (0, 21):
        assert a["OUTPUT_FP16"] == Const(int(g.model_dtype == "float16"))
        assert a["o"] == Ptr({"bfloat16": "bf16", "float16": "fp16"}[g.model_dtype])
    else:
        assert "OUTPUT_FP16" not in a
        assert a["o"] == Ptr("fp32")


@given(geometries())
def test_count_by_path_counts_distinct_keys_of_each_path(g: Geometry) -> None:
    the_plan = Plan.of(turboquant_contributions({"layer": g}))
    per_path = {path: set(derive(g)) for path, derive in keys.PATHS.items()}
    assert the_plan.count_by_path() == {p: len(ks) for p, ks in per_path.items() if ks}
    assert set(the_plan.keys) == set().union(*per_path.values())


@given(geometries())
def test_identical_layers_share_every_key(g: Geometry) -> None:
    one = Plan.of(turboquant_contributions({"a": g}))
    two = Plan.of(turboquant_contributions({"a": g, "b": g}))
    assert two.keys == one.keys
    assert all(layers == ["a", "b"] for layers in two.layers.values())


@pytest.mark.parametrize(("w1", "w2"), [(32, 48), (64, 4096), (63, 127), (18, 34)])
def test_layers_differing_in_a_same_class_stride_dedupe(w1: int, w2: int) -> None:
    one = Plan.of(turboquant_contributions({"a": fakes.geometry(width=w1)}))
    two = Plan.of(
        turboquant_contributions({"a": fakes.geometry(width=w1), "b": fakes.geometry(width=w2)})
    )
    assert two.keys == one.keys


def test_layers_differing_in_scale_do_not_share_stage1() -> None:
    g = fakes.geometry()
    other = dataclasses.replace(g, scale=math.nextafter(g.scale, 1.0))
    one = Plan.of(turboquant_contributions({"a": g}))
    two = Plan.of(turboquant_contributions({"a": g, "b": other}))
    stage1 = [k for k in one.keys if k.kernel == "_tq_decode_stage1"]
    assert stage1 and len(two.keys) == len(one.keys) + len(stage1)
    assert sorted(map(tuple, two.layers.values())) == sorted(
        [("a",)] * len(stage1)
        + [("b",)] * len(stage1)
        + [("a", "b")] * (len(one.keys) - len(stage1))
    )


def test_plan_dedupes_and_keeps_first_seen_order() -> None:
    p = Plan.of(
        [("a", "p", "k2"), ("b", "p", "k2"), ("a", "q", "k2"), ("a", "q", "k1"), ("a", "q", "k1")]
    )
    assert p.keys == ["k2", "k1"]
    assert p.layers == {"k2": ["a", "b"], "k1": ["a"]}
    assert p.paths == {"k2": ["p", "q"], "k1": ["q"]}
    assert p.count_by_path() == {"p": 1, "q": 2}


@given(st.integers(-(2**31), 2**31 - 1))
def test_int_classes_within_32_bits(value: int) -> None:
    if value == 1:
        assert Int.of(value) == Int(1)
    elif value % 16 == 0:
        assert Int.of(value) == Int.of(0) != Int.of(1)
    else:
        assert Int.of(value) == Int.of(3) not in {Int.of(0), Int.of(1)}


@given(st.one_of(st.integers(2**31, 2**62), st.integers(-(2**62), -(2**31) - 1)))
def test_wide_ints_form_their_own_classes(value: int) -> None:
    narrow = {Int.of(0), Int.of(1), Int.of(3)}
    assert Int.of(value) not in narrow
    assert Int.of(value) == Int.of(2**32 if value % 16 == 0 else 2**32 + 1)


def test_const_keeps_the_exact_scale() -> None:
    scale = 128**-0.5
    assert Const(scale) != Const(math.nextafter(scale, 1.0))
    assert Const(scale).value is scale


def test_preset_layout() -> None:
    p = preset("turboquant_4bit_nc", 128)
    assert (p.key_packed_size, p.slot_size_aligned, p.key_mse_bits) == (66, 134, 4)
    assert preset("turboquant_k8v4", 128).key_mse_bits == 0
    with pytest.raises(ValueError, match="not a TurboQuant cache dtype"):
        preset("fp8", 128)


@pytest.mark.parametrize(
    "overrides",
    [
        {"num_heads": 6, "num_kv_heads": 4},
        {"num_kv_heads": 0},
        {"model_dtype": "float32"},
        {"cache_dtype": "auto"},
        {"block_size": 0},
        {"attention_chunk": 24},  # not a multiple of the 16-token block
    ],
)
def test_check_rejects_impossible_geometry(overrides: dict[str, Any]) -> None:
    g = dataclasses.replace(fakes.geometry(), **overrides)
    with pytest.raises(ValueError):
        g.check()


def test_describe_renders_pointers_int_classes_and_constexprs() -> None:
    g = fakes.geometry(width=63)
    text = next(
        k for k in keys.short_continuation_keys(g) if not args(k)["Block_table_ptr"].aligned
    ).describe()
    assert text.startswith("_tq_decode_stage1[warps=1,stages=1](Q_rot_ptr=*fp32, ")
    assert "Block_table_ptr=*i32~" in text and "Seq_lens_ptr=*i32," in text
    assert "stride_bt_b=%16" in text and "stride_mid_s=i32" in text
    assert "NUM_KV_SPLITS=32" in text and f"ATTN_SCALE={g.scale}" in text
    dequant = keys.long_continuation_keys(g)[0].describe()
    assert dequant.startswith("_tq_full_dequant_kv[warps=4](")
    wide = KernelKey("k", (("a", Int.of(2**33)), ("b", Int.of(2**33 + 1)), ("c", Int.of(1))), 2)
    assert wide.describe() == "k[warps=2](a=i64%16, b=i64, c=1)"
