"""The non-Triton first launches: which ones a geometry needs (pure), and that
launch_all runs them through the impl without ever raising."""

from __future__ import annotations

from typing import Any

import fakes
import pytest

from tq_warmup_plugin import compat
from tq_warmup_plugin.worker import launches
from tq_warmup_plugin.worker.launches import Launch


def kinds(g: Any) -> list[tuple[str, str]]:
    return [(x.kind, x.dtype) for x in launches.launches(g)]


@pytest.mark.parametrize(
    ("version", "unrotate"), [((0, 20), "float32"), ((0, 21), "float16"), ((0, 33), "float16")]
)
def test_mse_keys_add_the_query_rotation_and_the_key_unrotation(
    version: compat.Version, unrotate: str
) -> None:
    g = fakes.geometry(
        version=version,
        num_heads=8,
        num_kv_heads=2,
        max_num_seqs=4,
        batched=512,
        max_model_len=4096,
    )
    assert launches.launches(g) == [
        # the fp32 rotations: powers of two up to 512 tokens x 2 KV heads = 128 x 8 heads
        *[Launch("gemm", "float32", 2**k, 128) for k in range(11)],
        *[Launch("gemm", unrotate, 2 * c, 128) for c in (1, 8, 64, *range(512, 3585, 512), 3967)],
        Launch("attention", "bfloat16", 512, 512, 8, 2, 128),
        Launch("attention", "bfloat16", 512, 1024, 8, 2, 128),
    ]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "seqs", "batched", "top"),
    [
        (32, 8, 256, 8192, 65536),
        (32, 8, 1024, 512, 32768),
        (8, 1, 2, 64, 1024),
        (40, 8, 48, 512, 5120),
    ],
)
def test_rotation_rows_are_a_ladder_to_the_most_a_step_rotates_under_the_cap(
    heads: int, kv_heads: int, seqs: int, batched: int, top: int
) -> None:
    g = fakes.geometry(
        num_heads=heads,
        num_kv_heads=kv_heads,
        max_num_seqs=seqs,
        batched=batched,
        max_model_len=32768,
    )
    rows = launches.rotation_rows(g)
    assert rows[0] == 1 and rows[-1] == min(top, launches.GEMM_SCRATCH_BYTES // (128 * 4))
    assert {heads, min(rows[-1], heads * seqs)} <= set(rows)
    ladder = [r for r in rows if r & (r - 1) == 0]
    assert ladder == [2**k for k in range(len(ladder))] and 2 * ladder[-1] >= rows[-1]


def test_fp8_keys_need_no_gemm() -> None:
    g = fakes.geometry(cache_dtype="turboquant_k8v4", model_dtype="float16")
    assert {k for k, _ in kinds(g)} == {"attention"}
    assert {d for _, d in kinds(g)} == {"float16"}


def test_no_long_continuation_without_chunks_over_128_tokens() -> None:
    g = fakes.geometry(batched=128, max_model_len=4096)
    assert ("gemm", "float16") not in kinds(g)
    assert [x for x in launches.launches(g) if x.kind == "attention"] == [
        Launch("attention", "bfloat16", 128, 128, 8, 2, 128)
    ]


def test_continuation_attention_needs_room_for_two_chunks() -> None:
    g = fakes.geometry(batched=2048, max_model_len=3000)
    assert [(x.rows, x.cols) for x in launches.launches(g) if x.kind == "attention"] == [
        (2048, 2048)
    ]


def test_plan_dedupes_across_layers_and_keeps_the_first_layer() -> None:
    a = fakes.geometry()
    b = fakes.geometry(cache_dtype="turboquant_k8v4")
    todo = launches.plan({"l0": a, "l1": a, "l2": b})
    assert set(todo.values()) == {"l0"}  # k8v4's launches are a subset of 4bit's here
    assert len(todo) == len(launches.launches(a))


class FakeImpl:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fail = fail

    def _flash_attn_varlen(
        self, q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, max_q: int, max_k: int
    ) -> Any:
        if self.fail:
            raise RuntimeError("no kernel image\nsecond line")
        self.calls.append(
            (tuple(q.shape), tuple(k.shape), cu_q.tolist(), cu_k.tolist(), max_q, max_k, q.dtype)
        )
        return q


def test_launch_all_runs_gemms_and_attention_through_the_impl(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(compat, "flash_attn_available", lambda: True)
    impl = FakeImpl()
    todo = launches.plan({"l0": fakes.geometry(batched=512, max_model_len=4096)})
    done, seconds, errors = launches.launch_all(todo, {"l0": impl}, torch.device("cpu"))
    assert (done, errors) == (len(todo), [])
    assert seconds > 0
    assert impl.calls == [
        ((512, 8, 128), (512, 2, 128), [0, 512], [0, 512], 512, 512, torch.bfloat16),
        ((512, 8, 128), (1024, 2, 128), [0, 512], [0, 1024], 512, 1024, torch.bfloat16),
    ]


def test_without_flash_attention_only_gemms_run(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(compat, "flash_attn_available", lambda: False)
    impl = FakeImpl()
    todo = launches.plan({"l0": fakes.geometry(batched=512, max_model_len=4096)})
    done, _, errors = launches.launch_all(todo, {"l0": impl}, torch.device("cpu"))
    # 11 rotations (1-1024 rows); un-rotations at cached 1, 8, 64, the 7 chunk multiples
    # 512-3584, 3967
    assert (done, errors, impl.calls) == (22, [], [])


def test_a_failing_launch_is_one_error_line(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(compat, "flash_attn_available", lambda: True)
    todo = launches.plan({"l0": fakes.geometry(cache_dtype="turboquant_k8v4")})
    done, _, errors = launches.launch_all(todo, {"l0": FakeImpl(fail=True)}, torch.device("cpu"))
    assert done == 0
    assert errors == [
        "launch attention bfloat16 1024x1024: RuntimeError: no kernel image",
    ]


def test_attention_scratch_is_capped_for_large_chunk_budgets() -> None:
    g = fakes.geometry(batched=8192, max_model_len=32768)
    cap = launches.ATTENTION_TOKENS
    assert [(x.rows, x.cols) for x in launches.launches(g) if x.kind == "attention"] == [
        (cap, cap),
        (cap, 2 * cap),
    ]
    assert max(x.rows for x in launches.launches(g) if x.kind == "gemm") == 2 * (32768 - 129)


def test_boundary_decode_is_one_launch_per_head_shape() -> None:
    g = fakes.geometry(max_model_len=1000)
    heads = {"layers.0.attn": (8, 2, 128), "layers.1.attn": (8, 2, 128), "x": (8, 2, 64)}
    todo = launches.plan({"l2": g}, heads)
    paged = {x: name for x, name in todo.items() if x.kind == "paged_decode"}
    assert paged == {
        Launch("paged_decode", "bfloat16", 1, 1000, 8, 2, 128): "layers.0.attn",
        Launch("paged_decode", "bfloat16", 1, 1000, 8, 2, 64): "x",
    }
    assert launches.boundary_decode(fakes.geometry(max_model_len=32768), (8, 2, 128)).cols == (
        launches.ATTENTION_TOKENS
    )
    assert launches.plan({}, heads) == {}  # no TurboQuant layer, nothing to warm


def test_paged_decode_runs_on_a_scratch_paged_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    seen: list[tuple[Any, ...]] = []

    def decode(impl: Any) -> Any:
        def call(q: Any, cache: Any, cu_q: Any, used: Any, table: Any, max_k: int) -> None:
            seen.append(
                (
                    impl,
                    tuple(q.shape),
                    tuple(cache.shape),
                    cu_q.tolist(),
                    used.tolist(),
                    tuple(table.shape),
                    table[0, -1].item(),
                    max_k,
                )
            )

        return call

    monkeypatch.setattr(compat, "flash_attn_paged_decode", decode)
    todo = {Launch("paged_decode", "bfloat16", 1, 1000, 8, 2, 128): "b"}
    done, _, errors = launches.launch_all(todo, {"b": "impl"}, torch.device("cpu"))
    assert (done, errors) == (1, [])
    # 1000 tokens on 16-token pages: 63 pages, the last one partly used.
    assert seen == [("impl", (1, 8, 128), (63, 16, 2, 128), [0, 1], [1000], (1, 63), 62, 1000)]


@pytest.mark.parametrize(
    ("hk", "d", "max_len", "version", "rows"),
    [
        # cached 1, 8, 64, 512, 4096, 32768 and the longest, 131072 - 129, and the
        # multiples of the 2048-token chunk budget (fakes.geometry) under the cap
        (8, 128, 131072, (0, 26), [8, 64, 512, 4096, 16384, 32768, 49152, 65536]),
        (1, 128, 131072, (0, 26), sorted({1, 8, 64, 512, *range(2048, 65537, 2048)})),
        (2, 64, 1000, (0, 26), [2, 16, 128, 1024, 2 * 871]),  # the chunk is the whole prompt
        (2, 128, 4096, (0, 20), [2, 16, 128, 1024, 2 * 2048, 2 * 3967]),  # fp32 cap: 32768
        (4, 128, 130, (0, 26), [4]),  # one cached token at most
        (4, 128, 129, (0, 26), []),  # no room for a cached prefix
    ],
)
def test_unrotation_rows_span_the_cached_lengths(
    hk: int, d: int, max_len: int, version: compat.Version, rows: list[int]
) -> None:
    g = fakes.geometry(
        version=version, num_heads=hk, num_kv_heads=hk, head_size=d, max_model_len=max_len
    )
    assert launches.unrotate_rows(g) == rows
    itemsize = 2 if g.features.unrotate_fp16 else 4
    assert max(rows, default=0) * d * itemsize <= launches.GEMM_SCRATCH_BYTES
