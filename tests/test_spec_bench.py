"""The ``spec`` benchmark's pure parts: configurations, prompts, comparison, table (no vLLM)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.tqbench import (  # noqa: E402
    entry_point,
    logs,
    records,
    spec,
    spec_child,
    spec_configs,
    spec_tables,
    tables,
    verdicts,
)


def _row(
    tokens: list[list[int]], lps: list[list[float]] | None = None, **kw: Any
) -> dict[str, Any]:
    lps = lps if lps is not None else [[-1.0] * len(t) for t in tokens]
    margins = [[0.5] * len(t) for t in tokens]
    return {"tokens": tokens, "logprobs": lps, "margins": margins, **kw}


def test_all_configs_reference_first_then_each_k() -> None:
    names = [c.name for c in spec_configs.build_configs("all", [1, 3], "ngram")]
    assert names == [
        "ref-eager",
        "nospec-full",
        *(f"ngram{k}-{kind}" for k in (1, 3) for kind in spec_configs.SPEC_KINDS),
    ]


def test_config_fields() -> None:
    by_name = {c.name: c for c in spec_configs.build_configs("all", [3], "ngram")}
    ref, off = by_name["ref-eager"], by_name["ngram3-full-noguard"]
    assert (ref.method, ref.cudagraph_mode, ref.speculative_config("/m")) == (None, None, None)
    assert (off.cudagraph_mode, off.spec_guard, off.k) == ("FULL_AND_PIECEWISE", "0", 3)
    guard, batched = by_name["ngram3-full-guard"], by_name["ngram3-full-batched"]
    assert (guard.cudagraph_mode, guard.spec_guard) == ("FULL_AND_PIECEWISE", "piecewise")
    assert (batched.cudagraph_mode, batched.spec_guard) == ("FULL_AND_PIECEWISE", None)
    assert by_name["ngram3-piecewise"].cudagraph_mode == "PIECEWISE"
    assert by_name["ngram3-eager"].cudagraph_mode is None
    assert off.speculative_config("/m") == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    }
    draft = spec_configs.build_configs("full-guard", [2], "draft_model")[1]
    assert draft.name == "draft2-full-guard"
    assert draft.speculative_config("/m") == {
        "method": "draft_model",
        "model": "/m",
        "num_speculative_tokens": 2,
    }


def test_selection_by_kind_and_name_keeps_reference() -> None:
    names = [
        c.name for c in spec_configs.build_configs("full-noguard,ngram5-eager", [1, 3], "ngram")
    ]
    assert names == ["ref-eager", "ngram1-full-noguard", "ngram3-full-noguard", "ngram5-eager"]
    assert [c.name for c in spec_configs.build_configs("nospec-full", [1], "ngram")] == [
        "ref-eager",
        "nospec-full",
    ]


@pytest.mark.parametrize(
    ("selection", "ks", "method"),
    [
        ("bogus", [1], "ngram"),
        ("all", [0], "ngram"),
        ("all", [1], "medusa"),
        ("draft1-eager", [1], "ngram"),
    ],
)
def test_bad_selection(selection: str, ks: list[int], method: str) -> None:
    with pytest.raises(ValueError):
        spec_configs.build_configs(selection, ks, method)


def test_prompts_repeat_a_pattern_over_the_length_range() -> None:
    prompts = spec_configs.spec_prompts()
    assert [len(p) for p in prompts] == [150 + 40 * i for i in range(8)]
    for p in prompts:
        assert p[24:48] == p[:24] and p[: len(p) - 24] == p[24:]
        assert all(3 <= t < 1024 for t in p)
    assert len({tuple(p[:24]) for p in prompts}) == 8
    assert spec_configs.spec_prompts(seed=1) != prompts and spec_configs.spec_prompts() == prompts


def test_identical_sequences_compare_as_zero() -> None:
    ref = _row([[5, 6, 7], [8, 9]])
    cmp = verdicts.compare(ref, ref)
    assert cmp == {
        "exact": True,
        "prompts_divergent": 0,
        "first_divergence": [None, None],
        "tokens_differing": 0,
        "tokens_compared": 5,
        "max_lp_delta": 0.0,
        "ref_margin_at_divergence": None,
        "divergence_margins": [],
    }


def test_divergent_sequence_reports_index_count_and_prefix_logprob_delta() -> None:
    ref = _row([[1, 2, 3, 4, 5, 6], [7, 8]], [[-1.0, -1.0, -1.0, -1.0, -1.0, -1.0], [-2.0, -2.0]])
    ref["margins"][0][3] = 0.001
    # diverges at index 3, then emits token 0; the logprob at index 5 (after it) is ignored
    got = _row([[1, 2, 3, 0, 0, 6], [7, 8]], [[-1.0, -1.25, -1.0, -9.0, -9.0, -50.0], [-2.0, -2.0]])
    cmp = verdicts.compare(ref, got)
    assert cmp["exact"] is False
    assert cmp["first_divergence"] == [3, None]
    assert cmp["prompts_divergent"] == 1
    assert (cmp["tokens_differing"], cmp["tokens_compared"]) == (2, 8)
    assert cmp["max_lp_delta"] == pytest.approx(0.25)
    assert cmp["ref_margin_at_divergence"] == pytest.approx(0.001)
    assert cmp["divergence_margins"] == [pytest.approx(0.001)]


def test_shorter_output_and_missing_prompt_count_as_divergent() -> None:
    ref = _row([[1, 2, 3], [4, 5]])
    cmp = verdicts.compare(ref, _row([[1, 2]]))
    assert cmp["first_divergence"] == [2, 0]
    assert (cmp["tokens_differing"], cmp["prompts_divergent"], cmp["exact"]) == (3, 2, False)


def test_chosen_logprobs_and_margins() -> None:
    class Logprob:
        def __init__(self, logprob: float) -> None:
            self.logprob = logprob

    positions: list[dict[int, Any] | None] = [
        {7: Logprob(-0.5), 9: Logprob(-1.5)},
        {3: -2.0},
        None,
    ]
    lps, margins = verdicts.chosen_logprobs([7, 3, 4, 5], positions)
    assert lps == [-0.5, -2.0, None, None]
    assert margins == [1.0, None, None, None]
    assert verdicts.chosen_logprobs([1], None) == ([None], [None])


def _finished_rows() -> list[dict[str, Any]]:
    ref = _row([[1, 2, 3, 4]], name="ref-eager", status="ok", tok_s=100.0)
    on = _row([[1, 2, 3, 4]], [[-1.0, -1.0005, -1.0, -1.0]], name="ngram3-full-guard", status="ok")
    off = _row([[1, 2, 3, 0]], name="ngram3-full-noguard", status="ok", tok_s=250.0)
    crash = {"name": "ngram1-full-noguard", "status": "crashed (rc -6)"}
    for r in (ref, on, off):
        r["timed_tokens"], r["timed_logprobs"] = r["tokens"], r["logprobs"]
    on.update(tok_s=200.0, tq_compiles_after_startup=[], cudagraph_mode="FULL_AND_PIECEWISE")
    on["cudagraph_mode_asked"] = "FULL_AND_PIECEWISE"
    off["spec_counters"] = {"drafts": 10, "draft_tokens": 30, "accepted_tokens": 15}
    crash["error_line"] = "RuntimeError: CUDA error: an illegal memory access was encountered"
    return [ref, on, off, crash]


def test_comparisons_verdicts_and_speedup() -> None:
    rows = _finished_rows()
    verdicts.add_comparisons(rows, lp_tol=1e-3)
    assert [r["verdict"] for r in rows] == ["equal", "equal", "WRONG", "crashed (rc -6)"]
    assert rows[2]["cmp"]["first_divergence"] == [3] and rows[3]["cmp"] is None
    assert [r["speedup_vs_ref"] for r in rows] == [1.0, 2.0, 2.5, None]
    verdicts.add_comparisons(rows, lp_tol=1e-4)  # equal tokens, logprobs off, no floor
    assert rows[1]["verdict"] == "WRONG"
    verdicts.add_comparisons(rows[1:], lp_tol=1e-3)  # no reference: nothing is compared
    assert rows[1]["verdict"] == "no-reference" and rows[1]["speedup_vs_ref"] is None


def test_noise_floor_from_the_nospec_graph_engine() -> None:
    """Divergences at exact ties within the no-spec graph engine's own distance from the
    reference are noise; a decided token, or logprobs further off, are WRONG."""
    ref = _row([[1, 2, 3, 4]], [[-1.0] * 4], name="ref-eager", status="ok")
    ref["margins"][0][2] = 0.0078  # one bf16 ulp: a near-tie the floor explains
    tie = [[1, 2, 9, 9]]
    nospec = _row(tie, [[-1.0, -1.02, -1.0, -1.0]], name="nospec-full", status="ok")
    guard = _row(tie, [[-1.0, -1.0205, -1.0, -1.0]], name="ngram1-full-guard", status="ok")
    off = _row(tie, [[-1.0, -1.3, -1.0, -1.0]], name="ngram1-full-noguard", status="ok")
    decided = _row([[1, 9, 9, 9]], name="ngram2-full-noguard", status="ok")
    ref["margins"][0][1] = 0.05  # the reference was sure of token 2
    rows = [ref, nospec, guard, off, decided]
    verdicts.add_comparisons(rows, lp_tol=1e-3)
    assert [r["verdict"] for r in rows] == [
        "equal",
        "within-noise",
        "within-noise",
        "WRONG",
        "WRONG",
    ]
    assert guard["noise_floor"] == pytest.approx(0.02)
    summary = verdicts.summarize({}, rows)
    assert (summary["guard_on_right"], summary["guard_off_wrong_or_crashed"]) == (True, True)
    # Without a no-spec graph engine there is no floor: any difference is WRONG.
    verdicts.add_comparisons([ref, guard], lp_tol=1e-3)
    assert guard["verdict"] == "WRONG"


def test_report_from_a_raw_run(tmp_path: Path) -> None:
    rows = _finished_rows()
    records.write_run(tmp_path / "r.jsonl", {"kind": "spec", "lp_tol": 1e-3}, rows)
    table, summary = spec.report(tmp_path / "r.jsonl")
    assert "ngram3-full-noguard" in table and summary["guard_off_wrong_or_crashed"] is True


def test_table_rows_and_summary() -> None:
    rows = _finished_rows()
    verdicts.add_comparisons(rows, lp_tol=1e-3)
    table = spec_tables.table_rows(rows)
    assert all(len(r) == len(spec_tables.TABLE_HEADER) for r in table)
    ref, on, off, crash = table
    assert ref[:2] == ("ref-eager", "equal") and ref[2] == "eager"
    assert on[2] == "FULL_AND_PIECEWISE -> FULL_AND_PIECEWISE" and on[6] == "0/1"
    assert on[5] == "0.80" and off[5] == "1.00" and ref[5] == "-"  # tok/s over noguard's
    assert on[8] == "5.00e-04" and on[10] == "0" and off[10] == "-"
    assert off[6:8] == ("1/1 @3", "1/4") and off[11] == "0.50"
    assert crash[1] == "crashed (rc -6)" and "illegal memory access" in crash[-1]
    assert "ngram3-full-noguard" in tables.render(spec_tables.TABLE_HEADER, table)
    summary = verdicts.summarize({"vllm_version": "0.22.0"}, rows)
    assert summary["guard_off_wrong_or_crashed"] is True
    assert summary["guard_on_right"] is True
    assert summary["tq_compiles_after_startup"] == 0
    assert summary["configs"]["ngram3-full-noguard"]["first_divergence"] == [3]


def test_raw_run_round_trip(tmp_path: Path) -> None:
    rows = _finished_rows()
    verdicts.add_comparisons(rows, lp_tol=1e-3)
    records.write_run(tmp_path / "r.jsonl", {"kind": "spec"}, rows)
    run, back = records.read_run(tmp_path / "r.jsonl")
    assert run == {"kind": "spec"} and back == rows


@pytest.mark.parametrize(
    ("log", "expected"),
    [
        (
            "INFO x\nTraceback (most recent call last):\n  File 'a'\n"
            "RuntimeError: CUDA error: an illegal memory access was encountered\nINFO bye\n",
            "RuntimeError: CUDA error: an illegal memory access was encountered",
        ),
        (
            "ValueError: Unknown TurboQuant cache dtype: 'auto'\n",
            "ValueError: Unknown TurboQuant cache dtype: 'auto'",
        ),
        (
            "ok\nERROR 11-30 core.py: EngineCore failed to start.\nlast\n",
            "ERROR 11-30 core.py: EngineCore failed to start.",
        ),
        ("nothing here\n", None),
    ],
)
def test_last_error_line(log: str, expected: str | None) -> None:
    assert logs.last_error_line(log) == expected


def test_child_env_and_engine_kwargs(tmp_path: Path) -> None:
    cfgs = {c.name: c for c in spec_configs.build_configs("all", [3], "ngram")}
    parent = {"TQ_WARMUP_SPEC_GUARD": "piecewise", "HOME": "/h"}
    env = spec_child.child_env(cfgs["ngram3-full-noguard"], tmp_path, False, parent)
    assert env["TQ_WARMUP_SPEC_GUARD"] == "0" and env["TQ_WARMUP"] == "1" and env["HOME"] == "/h"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "triton") and "VLLM_CACHE_ROOT" in env
    guard = spec_child.child_env(cfgs["ngram3-full-guard"], tmp_path, False, parent)
    assert guard["TQ_WARMUP_SPEC_GUARD"] == "piecewise"
    # unset is the plugin's auto: the parent's value must not leak into the batched row
    batched = spec_child.child_env(cfgs["ngram3-full-batched"], tmp_path, True, parent)
    assert "TQ_WARMUP_SPEC_GUARD" not in batched and "VLLM_CACHE_ROOT" not in batched
    shared = spec_child.child_env(cfgs["ref-eager"], tmp_path, True, {})
    assert "TQ_WARMUP_SPEC_GUARD" not in shared and "VLLM_CACHE_ROOT" not in shared
    opts = {
        "preset": "turboquant_4bit_nc",
        "max_model_len": 1024,
        "max_num_seqs": 16,
        "gpu_mem_util": 0.2,
        "kv_cache_gib": 2.0,
    }
    kw = spec_child.engine_kwargs(cfgs["ngram3-full-guard"], opts, "/m", "error")
    assert kw["enforce_eager"] is False and kw["kv_cache_memory_bytes"] == 2 << 30
    assert kw["compilation_config"] == {"cudagraph_mode": "FULL_AND_PIECEWISE"}
    assert kw["speculative_config"]["num_speculative_tokens"] == 3
    assert kw["jit_monitor_mode"] == "error" and kw["load_format"] == "dummy"
    assert "async_scheduling" not in kw
    ref = spec_child.engine_kwargs(cfgs["ref-eager"], {**opts, "kv_cache_gib": 0}, "/m", None)
    assert ref["enforce_eager"] is True
    assert not {"compilation_config", "speculative_config", "jit_monitor_mode"} & set(ref)
    assert "kv_cache_memory_bytes" not in ref
    for value, expected in (("on", True), ("off", False)):
        kw = spec_child.engine_kwargs(
            cfgs["ref-eager"], {**opts, "async_scheduling": value}, "/m", None
        )
        assert kw["async_scheduling"] is expected


def test_entry_point_stub_is_discoverable(tmp_path: Path) -> None:
    root = entry_point.write_stub(tmp_path / "ep")
    code = (
        "from importlib.metadata import entry_points; "
        "print([e.value for e in entry_points(group='vllm.general_plugins') "
        "if e.name == 'tq_warmup'])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "tq_warmup_plugin:register" in out


def test_help_works_without_vllm() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.tqbench", "spec", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--deadline-s" in out and "--child CHILD" not in out
