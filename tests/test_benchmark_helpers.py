"""The first-request benchmark's pure helpers (the script itself needs a GPU)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "first_request.py"
_spec = importlib.util.spec_from_file_location("first_request", _PATH)
assert _spec is not None and _spec.loader is not None
bench: Any = importlib.util.module_from_spec(_spec)
sys.modules["first_request"] = bench
_spec.loader.exec_module(bench)


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("0.22.0", ("vllm.triton_utils.jit_monitor", False)),
        ("0.24.1", ("vllm.triton_utils.jit_monitor", False)),
        ("0.25.0", ("vllm.utils.jit_monitor", True)),
        ("0.26.0", ("vllm.utils.jit_monitor", True)),
    ],
)
def test_jit_monitor_support(version: str, expected: tuple[str, bool]) -> None:
    assert bench.jit_monitor_support(version) == expected


def test_first_request_extra_orders_by_growth() -> None:
    first = {"mm": 96000.0, "fa": 91000.0, "new": 300.0, "same": 50.0}
    steady = {"mm": 10000.0, "fa": 3800.0, "same": 50.0}
    rows = bench.first_request_extra(first, steady, top=3)
    assert [r["op"] for r in rows] == ["fa", "mm", "new"]
    assert rows[0] == {"op": "fa", "first_us": 91000, "steady_us": 3800}


class _Event:
    def __init__(
        self, name: str, us: float, parent: _Event | None = None, shapes: object = None
    ) -> None:
        self.name, self.cpu_time_total, self.cpu_parent = name, us, parent
        self.input_shapes, self.cpu_children = shapes or [], list[_Event]()
        if parent is not None:
            parent.cpu_children.append(self)


class _Prof:
    def __init__(self, events: list[_Event]) -> None:
        self._events = events

    def events(self) -> list[_Event]:
        return self._events


def test_slow_leaves_name_the_op_and_shapes_that_paid() -> None:
    attn = _Event("vllm::unified_attention_with_output", 95000.0)
    mm = _Event("aten::mm", 90000.0, attn, [[4096, 128], [128, 128]])
    load = _Event("Runtime Triggered Module Loading", 87000.0, mm)
    quick = _Event("cudaLaunchKernel", 10.0, mm)
    rows = bench.slow_leaves(_Prof([attn, mm, load, quick]))
    assert rows == [
        {
            "leaf": "Runtime Triggered Module Loading",
            "us": 87000,
            "callers": ["aten::mm", "vllm::unified_attention_with_output"],
            "shapes": "[[4096, 128], [128, 128]]",
        }
    ]


def test_series_keep_records_of_concurrent_runs_apart() -> None:
    rec = {"run_id": "r", "config_id": "c", "plugin": "on", "triton_cache": "warm", "phase": "long"}
    merged = bench.merge_records([{**rec, "series": "a"}], [{**rec, "series": "b"}])
    assert [r["series"] for r in merged] == ["a", "b"]
    assert bench.merge_records(merged, [{**rec, "series": "b", "x": 1}])[-1]["x"] == 1


def test_apply_log_takes_tp_compiles_from_the_monitor_lines() -> None:
    log = "\n".join(
        [
            "(Worker_TP0) INFO tq-warmup: 2 TurboQuant layers, 6 distinct kernel keys",
            "[tq-bench] startup done",
            "[tq-bench] phase=long part=first begin",
            "(Worker_TP0) WARNING Triton kernel JIT compilation during inference: "
            "_tq_full_dequant_kv. This causes a latency spike",
            "[tq-bench] phase=short_tail part=first begin",
            "(Worker_TP1) WARNING Triton kernel JIT compilation during inference: "
            "_tq_decode_stage1. This causes a latency spike",
            "WARNING Triton kernel JIT compilation during inference: other_kernel.",
        ]
    )
    records = [
        {"phase": "long", "hooks_in_process": False},
        {"phase": "short_tail", "hooks_in_process": False},
        {"phase": "decode", "hooks_in_process": True, "tq_compiles_after_startup": ["kept"]},
    ]
    bench.apply_log(records, log)
    assert records[0]["tq_compiles_after_startup"] == ["_tq_full_dequant_kv"]
    assert records[1]["tq_compiles_after_startup"] == ["_tq_decode_stage1"]
    assert records[1]["other_jit_after_startup"] == ["other_kernel"]
    assert records[2]["tq_compiles_after_startup"] == ["kept"]
    assert records[0]["plugin_log"] == ["tq-warmup: 2 TurboQuant layers, 6 distinct kernel keys"]
