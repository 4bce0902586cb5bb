"""The first-request benchmark's pure helpers (the benchmark itself needs a GPU)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from benchmarks.tqbench import (
    collect,
    engine,
    logs,
    phases,
    recorder,
    records,
    run,
    summary,
    tables,
)


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
    assert engine.jit_monitor_support(version) == expected


def test_first_request_extra_orders_by_growth() -> None:
    first = {"mm": 96000.0, "fa": 91000.0, "new": 300.0, "same": 50.0}
    steady = {"mm": 10000.0, "fa": 3800.0, "same": 50.0}
    rows = recorder.first_request_extra(first, steady, top=3)
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
    rows = recorder.slow_leaves(_Prof([attn, mm, load, quick]))
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
    merged = records.merge_records([{**rec, "series": "a"}], [{**rec, "series": "b"}])
    assert [r["series"] for r in merged] == ["a", "b"]
    assert records.merge_records(merged, [{**rec, "series": "b", "x": 1}])[-1]["x"] == 1


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
    recs: list[dict[str, Any]] = [
        {"phase": "long", "hooks_in_process": False},
        {"phase": "short_tail", "hooks_in_process": False},
        {"phase": "decode", "hooks_in_process": True, "tq_compiles_after_startup": ["kept"]},
    ]
    logs.apply_log(recs, log)
    assert recs[0]["tq_compiles_after_startup"] == ["_tq_full_dequant_kv"]
    assert recs[1]["tq_compiles_after_startup"] == ["_tq_decode_stage1"]
    assert recs[1]["other_jit_after_startup"] == ["other_kernel"]
    assert recs[2]["tq_compiles_after_startup"] == ["kept"]
    assert recs[0]["plugin_log"] == ["tq-warmup: 2 TurboQuant layers, 6 distinct kernel keys"]


def test_phase_plan_exercises_the_paths_it_is_named_after() -> None:
    plan = phases.plan_phases(512, block_size=32)
    assert phases.describe_chunks(plan.expected_chunks("long")) == "512, 512+c, 512+c"
    assert phases.describe_chunks(plan.expected_chunks("short_tail")) == "512, 100+c*"
    assert phases.describe_chunks(plan.expected_chunks("prefix_hit")) == "40+c*"
    assert plan.expected_cached("prefix_hit") == 1024
    assert phases.auto_max_model_len(plan.required_max_model_len) == 2048
    with pytest.raises(ValueError, match="budget"):
        phases.plan_phases(128)


def test_geometry_config_and_prompts() -> None:
    geom = phases.parse_geometry("64x16x2")
    assert geom == phases.Geometry(64, 16, 2)
    cfg = phases.build_model_config(geom, 6, 4096)
    assert (cfg["hidden_size"], cfg["num_key_value_heads"], cfg["vocab_size"]) == (1024, 2, 1024)
    with pytest.raises(ValueError, match="multiple"):
        phases.parse_geometry("128x16x3")
    prompts = phases.make_prompts(2, 5, seed=1, vocab_size=50)
    assert prompts == phases.make_prompts(2, 5, seed=1, vocab_size=50)
    assert all(3 <= t < 50 for p in prompts for t in p)
    assert "auto" in phases.PRESETS and "turboquant_k8v4" in phases.TQ_PRESETS


LLAMA4_ONLY = {"attention_chunk_size", "intermediate_size_mlp", "num_local_experts"}


def test_attention_chunk_makes_a_llama4_and_zero_keeps_the_llama() -> None:
    geom = phases.Geometry(128, 16, 8)
    llama = phases.build_model_config(geom, 8, 4096)
    assert llama == phases.build_model_config(geom, 8, 4096, attention_chunk=0)
    assert llama["architectures"] == ["LlamaForCausalLM"] and not LLAMA4_ONLY & set(llama)
    cfg = phases.build_model_config(geom, 8, 4096, attention_chunk=2048)
    assert (cfg["architectures"], cfg["model_type"]) == (["Llama4ForCausalLM"], "llama4_text")
    same = ("hidden_size", "head_dim", "num_attention_heads", "num_key_value_heads")
    assert [cfg[k] for k in same] == [llama[k] for k in same] == [2048, 128, 16, 8]
    assert (cfg["num_hidden_layers"], cfg["attention_chunk_size"]) == (8, 2048)
    assert (cfg["num_local_experts"], cfg["num_experts_per_tok"]) == (2, 1)
    assert 1 < cfg["interleave_moe_layer_step"] <= 8  # some layers MoE, not all
    assert cfg["intermediate_size"] == cfg["intermediate_size_mlp"] == 1024
    assert cfg["use_qk_norm"] is cfg["attn_temperature_tuning"] is False
    assert "mlp_bias" not in cfg
    for chunk in (100, -16):
        with pytest.raises(ValueError, match="multiple of the block size 16"):
            phases.build_model_config(geom, 8, 4096, attention_chunk=chunk)
    assert phases.config_id("p", "eager", geom, 8, 512, 1) == "p-eager-h128q16kv8-L8-b512-tp1"
    assert phases.config_id("p", "eager", geom, 8, 512, 1, 2048).endswith("-tp1-c2048")


def test_chunk_overrun_warns_only_where_vllm_mispairs_virtual_requests() -> None:
    plan = phases.plan_phases(512)  # longest prompt 1536 + 8 tokens
    warning = phases.chunk_overrun_warning(plan, 1024, "0.26.0")
    assert warning is not None and "(1544) exceeds the attention chunk (1024)" in warning
    assert phases.chunk_overrun_warning(plan, 1024, "0.21.0") is not None
    assert phases.chunk_overrun_warning(plan, 1024, "0.29.0") is not None
    for chunk, version in ((2048, "0.26.0"), (1024, "0.30.0"), (1024, "0.20.0"), (0, "0.26")):
        assert phases.chunk_overrun_warning(plan, chunk, version) is None, (chunk, version)
    assert phases.chunk_overrun_warning(plan, 1024, None) is None


def test_run_records_the_chunk_and_warns_of_an_overrun(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from benchmarks.tqbench import cli

    argv = ["run", "--plugin", "on", "--attention-chunk", "1024", "--work-dir", str(tmp_path)]
    ctx = run.prepare(cli.build_parser().parse_args(argv))
    assert ctx.base["attention_chunk"] == 1024 and ctx.base["config_id"].endswith("-c1024")
    ctx.base["vllm_version"] = "0.26.0"
    vcfg = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_batched_tokens=512, enable_chunked_prefill=True),
        cache_config=SimpleNamespace(enable_prefix_caching=True, block_size=16),
    )
    (warning,) = run._config_warnings(ctx, vcfg, {})
    assert warning.startswith("the longest prompt + max_tokens (1544) exceeds")
    ctx.base["vllm_version"] = "0.30.0"
    assert run._config_warnings(ctx, vcfg, {}) == []


def test_run_and_matrix_refuse_a_chunk_off_the_block_size_and_pass_it_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.tqbench import cli, matrix

    assert cli.main(["run", "--plugin", "on", "--attention-chunk", "100"]) == 2
    assert "multiple of the block size" in capsys.readouterr().err
    argv = ["matrix", "--presets", "turboquant_4bit_nc", "--modes", "cudagraph"]
    argv += ["--geometries", "128x16x8", "--variants", "on-cold", "--no-auto"]
    argv += ["--work-dir", str(tmp_path), "--results-dir", str(tmp_path), "--layers", "8"]
    with pytest.raises(SystemExit, match="attention-chunk"):
        matrix.cmd_matrix(cli.build_parser().parse_args([*argv, "--attention-chunk", "100"]))
    m = matrix.Matrix(cli.build_parser().parse_args([*argv, "--attention-chunk", "2048"]))
    spec = m.specs()[0][0]
    assert spec.config_id == "turboquant_4bit_nc-cudagraph-h128q16kv8-L8-b512-tp1-c2048"
    assert m.child_options(spec)["attention_chunk"] == 2048
    assert m.base_record(spec)["attention_chunk"] == 2048


def vllm_layers(hf_config: Any, monkeypatch: pytest.MonkeyPatch) -> dict[int, tuple[str, Any]]:
    """What vLLM's own ``Llama4DecoderLayer`` builds for each layer: its attention class
    and that one's ``attention_chunk_size``. Only the choice runs: the modules it would
    construct (linear layers, RoPE, norms, attention, MLP and MoE) are stand-ins that
    keep their arguments, so no device, process group or weights are needed."""
    from types import SimpleNamespace

    from vllm.model_executor.models import llama4

    class StandIn:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.kwargs = kwargs

    modules = ("Attention", "ChunkedLocalAttention", "QKVParallelLinear", "RowParallelLinear")
    for name in (*modules, "get_rope", "RMSNorm", "LlamaMLP", "Llama4MoE"):
        monkeypatch.setattr(llama4, name, type(name, (StandIn,), {}))
    monkeypatch.setattr(llama4, "get_tensor_model_parallel_world_size", lambda: 1)
    vllm_config = SimpleNamespace(cache_config=None, quant_config=None)
    built = {}
    for i in range(hf_config.num_hidden_layers):
        layer = llama4.Llama4DecoderLayer(vllm_config, f"model.layers.{i}", hf_config)
        attn = layer.self_attn.attn
        built[i] = (type(attn).__name__, attn.kwargs.get("attention_chunk_size"))
    return built


@pytest.mark.real_vllm
def test_vllm_builds_the_chunked_local_layers_the_docstring_claims(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's reading of the written config.json (``EngineArgs`` with a dummy load, as
    ``run`` starts it): a Llama 4 whose TurboQuant layers (vLLM's boundary skip) are
    2, 4, 5 chunked local and 3 global, as ``build_model_config`` says."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.quantization.turboquant import config as tq

    geom = phases.Geometry(128, 16, 8)
    cfg = phases.build_model_config(geom, 8, 4096, attention_chunk=2048)
    (tmp_path / "config.json").write_text(json.dumps(cfg, indent=1))
    engine = EngineArgs(
        model=str(tmp_path), load_format="dummy", skip_tokenizer_init=True, max_model_len=4096
    )
    model = engine.create_model_config()
    assert model.architectures == ["Llama4ForCausalLM"] and not model.is_hybrid
    assert model.attention_chunk_size == 2048
    assert (model.get_head_size(), model.get_total_num_kv_heads()) == (128, 8)
    local = ("ChunkedLocalAttention", 2048)
    built = vllm_layers(model.hf_config, monkeypatch)
    assert built == {i: ("Attention", None) if i in (3, 7) else local for i in range(8)}
    skipped = {int(i) for i in tq.TurboQuantConfig.get_boundary_skip_layers(model)}
    compressed = {i: kind for i, (kind, _) in built.items() if i not in skipped}
    assert compressed == {
        2: "ChunkedLocalAttention",
        3: "Attention",
        4: "ChunkedLocalAttention",
        5: "ChunkedLocalAttention",
    }


def test_render_pads_columns() -> None:
    text = tables.render(("a", "long header"), [("xyz", "1"), ("q", "22")])
    assert text.splitlines() == ["a    long header", "---  -----------", "xyz  1", "q    22"]


def test_write_run_stores_run_fields_once_and_reads_back(tmp_path: Path) -> None:
    run_fields = {"run_id": "r1", "config_id": "c", "plugin": "on", "gpu": "NVIDIA H200"}
    rows = [{"phase": "decode", "first_s": 0.1}, {"phase": "long", "first_s": 2.0}]
    path = tmp_path / "raw" / "r1.jsonl"
    records.write_run(path, run_fields, rows)
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and lines[0].startswith('{"run": {')
    assert "NVIDIA H200" not in "".join(lines[1:])
    assert records.read_run(path) == (run_fields, rows)
    flat = records.join_run(run_fields, rows)
    assert records.split_records(flat) == (run_fields, rows)
    assert [p.name for p in path.parent.iterdir()] == ["r1.jsonl"]  # no temporary left


def _run_records(
    series: str, preset: str, plugin: str, ratios: dict[str, tuple[float, float]], **extra: Any
) -> list[dict[str, Any]]:
    base = {
        "series": series,
        "run_id": f"{series}-{preset}-{plugin}",
        "config_id": f"{preset}-eager",
        "vllm_version": "0.26.0",
        "gpu": "NVIDIA H200",
        "kv_cache_dtype": preset,
        "mode": "eager",
        "head_size": 128,
        "q_heads": 16,
        "kv_heads": 8,
        "tp": 1,
        "plugin": plugin,
        "triton_cache": "cold",
        "startup_s": 30.0,
        "warmup_s": 1.2 if plugin == "on" else None,
        **extra,
    }
    return [
        {**base, "phase": p, "status": "ok", "first_s": f, "steady_s": s}
        for p, (f, s) in ratios.items()
    ]


def test_summary_puts_the_auto_ratio_beside_each_turboquant_row(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    off = _run_records(
        "s1", "turboquant_4bit_nc", "off", {"long": (1.0, 0.1)}, tq_compiles_after_startup=[]
    )
    off[0]["tq_compiles_after_startup"] = ["_tq_full_dequant_kv"]
    auto = _run_records("s1", "auto", "on", {"long": (0.3, 0.1)}, tq_compiles_after_startup=None)
    collect.file_runs(raw, off + auto)
    # a second run of the same group widens the range
    again = _run_records("s1", "turboquant_4bit_nc", "off", {"long": (1.5, 0.1)})
    again[0]["run_id"] = "second"
    collect.file_runs(raw, again)
    result = collect.regenerate(tmp_path)
    long_off = next(r for r in result["phases"] if r["preset"] == "4bit_nc")
    assert long_off["ratio"] == [10.0, 15.0]
    assert long_off["first_s"] == [1.0, 1.5]
    assert long_off["auto_ratio"] == [3.0]
    assert long_off["tq_compiles_after_startup"] == ["_tq_full_dequant_kv"]
    assert long_off["run_ids"] == ["s1-turboquant_4bit_nc-off", "second"]
    auto_row = next(r for r in result["phases"] if r["preset"] == "auto")
    assert auto_row["tq_compiles_after_startup"] is None and auto_row["auto_ratio"] is None
    md = (tmp_path / "SUMMARY.md").read_text()
    assert "## vLLM 0.26.0: s1" in md
    assert (
        "| 4bit_nc | eager | 128x16x8 | 1 | off-cold | long | 2 | ok | 1.000-1.500 | 0.100 |" in md
    )
    assert "| 10.0-15.0 | 12.50 | 3.0 | +9.50 | _tq_full_dequant_kv |" in md
    startup = next(r for r in result["startup"] if r["preset"] == "4bit_nc")
    assert startup["runs"] == 2 and startup["startup_s"] == [30.0, 30.0]


def test_summary_keeps_series_that_have_no_raw_run_any_more(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    collect.file_runs(raw, _run_records("old", "turboquant_k8v4", "on", {"decode": (0.3, 0.1)}))
    collect.regenerate(tmp_path)
    for path in raw.rglob("*.jsonl"):
        path.unlink()
    collect.file_runs(raw, _run_records("new", "turboquant_k8v4", "on", {"decode": (0.2, 0.1)}))
    rows = collect.regenerate(tmp_path)["phases"]
    assert {(r["series"], tuple(r["ratio"])) for r in rows} == {("old", (3.0,)), ("new", (2.0,))}
    assert summary.span([2.0], "{:.1f}") == "2.0"


def test_summary_pairs_a_warm_run_with_the_warm_auto_run(tmp_path: Path) -> None:
    """Warm beside warm: the cold auto run's ratio is not the baseline of a warm row."""
    raw = tmp_path / "raw"
    runs = [
        *_run_records("w", "auto", "on", {"long": (0.4, 0.1)}),
        *_run_records("w", "auto", "on", {"long": (0.12, 0.1)}, triton_cache="warm"),
        *_run_records("w", "turboquant_4bit_nc", "on", {"long": (0.8, 0.1)}),
        *_run_records("w", "turboquant_4bit_nc", "on", {"long": (0.13, 0.1)}, triton_cache="warm"),
    ]
    for r in runs:
        r["run_id"] += f"-{r['triton_cache']}"
    collect.file_runs(raw, runs)
    rows = {
        r["variant"]: r["auto_ratio"]
        for r in collect.regenerate(tmp_path)["phases"]
        if r["preset"] == "4bit_nc"
    }
    assert rows == {"on-cold": [4.0], "on-warm": [1.2]}


def test_matrix_runs_the_auto_baseline_in_each_cache_state(tmp_path: Path) -> None:
    from benchmarks.tqbench import cli, matrix

    def auto_units(variants: str) -> list[list[str]]:
        argv = [
            "matrix",
            "--presets",
            "turboquant_4bit_nc",
            "--modes",
            "cudagraph",
            "--geometries",
            "128x16x8",
        ]
        argv += ["--variants", variants, "--results-dir", str(tmp_path)]
        args = cli.build_parser().parse_args([*argv, "--work-dir", str(tmp_path)])
        units = matrix.Matrix(args).specs()
        return [[s.variant for s in unit] for unit in units if unit[0].preset == "auto"]

    assert auto_units("on-cold,on-warm") == [["on-cold", "on-warm"]]
    assert auto_units("on-cold,off-cold") == [["on-cold"]]
    assert auto_units("off-cold") == [["on-cold"]]


def test_matrix_repeats_warm_runs_and_alternates_them_with_auto(tmp_path: Path) -> None:
    from benchmarks.tqbench import cli, matrix

    argv = ["matrix", "--presets", "turboquant_4bit_nc", "--modes", "cudagraph"]
    argv += ["--geometries", "128x16x8", "--variants", "on-cold,on-warm", "--repeats", "3"]
    args = cli.build_parser().parse_args([*argv, "--work-dir", str(tmp_path)])
    units = matrix.Matrix(args).specs()
    order = [(s.preset, s.variant, s.repeat) for u in matrix.interleave(units) for s in u]
    tq, auto = "turboquant_4bit_nc", "auto"
    assert order == [
        (tq, "on-cold", 0),
        (auto, "on-cold", 0),
        *[(p, "on-warm", k) for k in range(3) for p in (tq, auto)],
    ]
    specs = [s for u in units for s in u]
    # every repeat has its own raw file, log and work dir; all share the warm caches
    for attr in ("out", "log", "work_dir"):
        assert len({getattr(s, attr) for s in specs}) == len(specs)
    assert len({s.cache_root for s in specs if s.preset == tq}) == 1
    names = {records.run_file_name({**matrix.Matrix(args).base_record(s)}) for s in specs}
    assert len(names) == len(specs)
    with pytest.raises(SystemExit, match="--repeats"):
        matrix.cmd_matrix(cli.build_parser().parse_args([*argv[:-1], "0", "--entry-point-stub"]))


def test_summary_compares_medians_over_repeats_with_auto(tmp_path: Path) -> None:
    """Repeats of one run id stay separate runs; the verdict column is median - auto median."""
    raw = tmp_path / "raw"
    runs = []
    for k, (tq, base) in enumerate([(0.13, 0.12), (0.16, 0.11), (0.12, 0.15)]):
        for preset, first in (("turboquant_4bit_nc", tq), ("auto", base)):
            rs = _run_records("r", preset, "on", {"short_tail": (first, 0.1)}, repeat=k)
            for r in rs:
                r["triton_cache"] = "warm"
            runs += rs
    collect.file_runs(raw, runs)
    assert len(list(raw.rglob("*.jsonl"))) == 6
    result = collect.regenerate(tmp_path)
    row = next(r for r in result["phases"] if r["preset"] == "4bit_nc")
    assert row["runs"] == 3 and row["ratio"] == [1.2, 1.3, 1.6]
    assert row["over_auto_median"] == pytest.approx(1.3 - 1.2)
    assert summary.median([1.6, 1.2, 1.3]) == 1.3 and summary.median([]) is None
    md = (tmp_path / "SUMMARY.md").read_text()
    assert "| 1.2-1.6 | 1.30 | 1.1-1.5 | +0.10 | 0 |" in md
    startup = next(r for r in result["startup"] if r["preset"] == "4bit_nc")
    assert startup["runs"] == 3


def test_matrix_refuses_plugin_on_runs_vllm_could_not_load_the_plugin_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks.tqbench import cli, entry_point, matrix

    monkeypatch.setattr(entry_point, "found", lambda: False)
    argv = ["matrix", "--presets", "turboquant_4bit_nc", "--modes", "eager"]
    argv += ["--geometries", "128x16x8", "--work-dir", str(tmp_path)]
    with pytest.raises(SystemExit, match="entry point is not installed"):
        matrix.cmd_matrix(cli.build_parser().parse_args([*argv, "--variants", "on-cold"]))
    # with the stub, each child finds the entry point first on its path
    args = cli.build_parser().parse_args([*argv, "--entry-point-stub"])
    m = matrix.Matrix(args)
    env = m.child_env(m.specs()[0][0])
    stub = Path(env["PYTHONPATH"].split(os.pathsep)[0])
    assert (stub / "tq_warmup_plugin_stub-0.dist-info" / "entry_points.txt").is_file()


def test_gemm_shapes_reads_rows_and_times_each_shape_twice() -> None:
    from benchmarks.tqbench import gemm_shapes

    assert gemm_shapes.parse_rows("8, 100-102,8,4096") == [8, 100, 101, 102, 4096]
    with pytest.raises(ValueError, match="bad rows"):
        gemm_shapes.parse_rows("5-3")
    pytest.importorskip("torch")
    got = gemm_shapes.time_shapes([4, 12], 16, "float32", "cpu", warm=[8])
    assert [r["rows"] for r in got] == [4, 12]
    assert all(r["first_ms"] >= 0 and r["second_ms"] >= 0 for r in got)


def test_gemm_shapes_summary_is_a_row_per_run_file(tmp_path: Path) -> None:
    from benchmarks.tqbench import cli

    def run(warm: str, extras: list[float]) -> dict[str, object]:
        shapes = [
            {"rows": 8 * (i + 1), "first_ms": e + 0.01, "second_ms": 0.01, "extra_ms": e}
            for i, e in enumerate(extras)
        ]
        doc = {"device": "GPU", "torch": "2.11", "dtype": "float32", "warm": warm}
        return {**doc, "rows": "8-24", "cols": 128, "shapes": shapes, "extra_ms": sum(extras)}

    (tmp_path / "b-ladder.json").write_text(json.dumps(run("1,2,4", [0.01, 0.02, 0.01])))
    (tmp_path / "a-none.json").write_text(json.dumps(run("", [60.0, 0.01, 11.5])))
    (tmp_path / "notes.txt").write_text("not a run")
    assert cli.main(["gemm-shapes", "--summarize", str(tmp_path)]) == 0
    lines = (tmp_path / "SUMMARY.md").read_text().splitlines()
    assert len(lines) == 4
    assert lines[2] == (
        "| a-none | GPU (torch 2.11) | float32 | - | 3 | 71.5 | 11.500 | 2 | 8 rows +60.00 ms |"
    )
    assert lines[3].startswith(
        "| b-ladder | GPU (torch 2.11) | float32 | 1,2,4 | 3 | 0.0 | 0.010 | 0 |"
    )
    with pytest.raises(SystemExit, match="no run files"):
        cli.main(["gemm-shapes", "--summarize", str(tmp_path / "empty")])


def test_ahead_cost_table_gives_each_child_its_ratio_to_one_process() -> None:
    from benchmarks.tqbench.ahead_cost import table

    rows = [
        {"engine": "V1", "processes": 1, "built": 10, "seconds": 20.0},
        {"engine": "V1", "processes": 4, "built": 10, "seconds": 10.0},
    ]
    lines = table(7.25, rows).splitlines()
    assert lines[1].split()[-1] == "7.2"  # the import, no ratio
    assert lines[2].split()[-2:] == ["20.0", "1.00"]
    assert lines[3].split()[-2:] == ["10.0", "0.50"]


def test_ahead_cost_table_gives_each_fork_its_ratio_to_the_engine_jobs_alone() -> None:
    from benchmarks.tqbench.ahead_cost import table

    rows = [
        {"engine": "V1", "processes": 2, "fork": "engine jobs", "built": 10, "keys": 0,
         "seconds": 8.0},
        {"engine": "V1", "processes": 2, "fork": "engine jobs and TurboQuant keys",
         "built": 40, "keys": 30, "seconds": 20.0},
    ]  # fmt: skip
    lines = table(7.25, rows).splitlines()
    assert lines[2].startswith("fork, vLLM imported")  # no fresh-interpreter rows
    assert "V1, engine jobs, 10 jobs (0 keys)" in lines[3]
    assert lines[3].split()[-2:] == ["8.0", "1.00"]
    assert "40 jobs (30 keys)" in lines[4] and lines[4].split()[-2:] == ["20.0", "2.50"]


def test_warm_cost_takes_each_familys_median_and_keeps_setup_apart() -> None:
    from benchmarks.tqbench.warm_cost import medians, table

    runs = [{"a (setup)": 400.0, "b": 10.0}, {"a (setup)": 380.0, "b": 30.0},
            {"a (setup)": 390.0, "b": 20.0, "c": 9.0}]  # fmt: skip
    warm = medians(runs)
    assert warm == {"a (setup)": 390.0, "b": 20.0, "c": 0.0}  # c missing twice: 0, 0, 9
    lines = table({"a (setup)": 500.0, "b": 2000.0, "c": 40.0}, warm).splitlines()
    assert lines[2].split()[-2:] == ["2000", "20"]
    assert lines[-1].split()[-2:] == ["2040", "20"]  # the setup rows out of the totals
    # the order before cf87a9b: b's jobs beside the graphs, warm only, out of the totals
    lines = table({"b": 2000.0}, {"b": 20.0, "b (beside the graphs)": 50.0}).splitlines()
    assert lines[2].split()[-2:] == ["-", "50"]
    assert lines[-2].split()[-2:] == ["2000", "20"]
    assert lines[-1] == "Triton jobs beside the graphs: 50 ms warm, alone 20 ms (2.5x)"


@pytest.mark.parametrize("version", ["0.22.0", "0.26.0", "0.33.0"])
def test_ahead_cost_asks_the_child_what_it_takes(version: str) -> None:
    """Each engine's request is one the child accepts (``EngineRequest.from_dict``)."""
    from benchmarks.tqbench.ahead_cost import ENGINES, engine_request
    from tq_warmup_plugin.vllm_kernels.offline import EngineRequest

    for args in ENGINES.values():
        request = EngineRequest.from_dict(json.loads(json.dumps(engine_request(args, version))))
        assert (request.spec_method, request.runner_v2) == (args["spec_method"], args["runner_v2"])
