"""The GPU proof's pure parts: its one-launch probe is one of the launches the build
made (the plugin's ``driver_plan`` for the proof's model), the slowest one, and the
table says each step's result. The GPU steps themselves run only on the GPU machine."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import fakes
import pytest

from benchmarks.tqbench import driver_cache_parts as parts
from benchmarks.tqbench import driver_cache_proof as proof
from tq_warmup_plugin.worker import launches


def test_the_candidates_are_the_plugins_driver_plan_for_the_proofs_model() -> None:
    g = fakes.geometry(num_heads=16, num_kv_heads=8, head_size=128, batched=512, max_model_len=4096)
    plan = launches.driver_plan({"l2": g}, {"boundary": (16, 8, 128)})
    candidates = parts.candidate_launches(128, 16, 8, 512, 4096)
    assert [launches.Launch(**c) for c in candidates] == list(plan)


def test_the_probe_is_the_launch_the_build_spent_most_on() -> None:
    candidates = parts.candidate_launches(128, 16, 8, 512, 4096)
    seconds = {"attention bfloat16 512x512": 40.0, "paged_decode bfloat16 1x2048": 61.5}
    assert parts.slowest_launch(seconds, candidates) == candidates[2]
    assert parts.slowest_launch({}, candidates) is None


def test_the_table_says_each_steps_result() -> None:
    rows = [
        {"step": "build", "rc": 0, "wall_s": 150.0, "files": 9, "du": "41M", "mib": 40.2},
        {"step": "shipped", "status": "ok", "startup_s": 31.2, "first_launches": 4,
         "first_launches_ms": 310},
        {"step": "auto", "preset": "auto", "status": "ok", "startup_s": 20.5},
        {"step": "decision-other", "warnings": ["WARNING tq-warmup: ... driver ..."],
         "cuda_cache_path": None},
        {"step": "variants", "rc": 0, "seconds": {"attention bfloat16 1x1": 30.2},
         "files_added_or_changed": 2},
        {"step": "read-only", "launch": "paged_decode bfloat16 1x2048", "probe_s": 0.2,
         "build_s": 61.5, "writable": False, "rc": 0},
    ]  # fmt: skip
    cells = dict(map(tuple, parts.table_rows(rows)))
    assert cells["build"].startswith("rc 0, 150.0 s; 9 files, 41M (40.2 MiB)")
    assert cells["shipped"].startswith(
        "turboquant_4bit_nc: ok, startup 31.2 s, first launches 4 in 310 ms"
    )
    assert cells["auto"].startswith("auto: ok, startup 20.5 s, first launches None in None ms")
    assert cells["decision-other"].startswith("1 WARNING, CUDA_CACHE_PATH=None; WARNING")
    assert cells["variants"].startswith(
        "rc 0: seconds {'attention bfloat16 1x1': 30.2}, files added/changed 2"
    )
    assert cells["read-only"] == (
        "paged_decode bfloat16 1x2048: 0.2 s (build 61.5 s), cache dir writable False, rc 0"
    )


def test_the_variants_are_calls_the_plan_does_not_make() -> None:
    plan = {tuple(sorted(c.items())) for c in parts.candidate_launches(128, 16, 8, 512, 4096)}
    variants = parts.variant_launches(128, 16, 8)
    assert variants and not plan & {tuple(sorted(v.items())) for v in variants}
    assert {v["kind"] for v in variants} == {"attention", "paged_prefill", "paged_decode"}
    for v in variants:  # each one the plugin's launcher accepts
        launches.Launch(**v)


def test_a_kept_work_dir_with_an_entry_is_reused_and_build_only_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks.tqbench.cli import build_parser

    def args(*extra: str) -> argparse.Namespace:
        argv = ["driver-cache-proof", "--work-dir", str(tmp_path / "w"), "--out"]
        return build_parser().parse_args([*argv, str(tmp_path / "out"), *extra])

    built: list[str] = []
    monkeypatch.setattr(proof.Proof, "build", lambda self: built.append("build"))
    assert proof.Proof(args("--build-only", "--skip-fresh")).go() == 1  # the build made no entry
    assert built == ["build"]

    entry = tmp_path / "w" / "layer" / "driver-cache" / "k1"
    (entry / "cache").mkdir(parents=True)
    (entry / "cache" / "module").write_bytes(b"x" * 2048)
    extra = {"launch_s": {"attention bfloat16 512x512": 61.5}, "engine_s": {"startup_s": 40.0}}
    (entry / "manifest.json").write_text(json.dumps({"driver": "580.1", "extra": extra}))
    ran: list[str] = []
    monkeypatch.setattr(proof.Proof, "decision", lambda self: ran.append("decision"))
    monkeypatch.setattr(proof.Proof, "probe", lambda self, name, *a, **k: ran.append(name))
    monkeypatch.setattr(proof.Proof, "variants", lambda self: ran.append("variants"))
    monkeypatch.setattr(
        proof.Proof, "engine", lambda self, name, *a: {"step": name, "status": "ok"}
    )

    assert proof.Proof(args("--build-only", "--skip-fresh")).go() == 1  # builds again: no entry yet
    assert built == ["build", "build"] and ran == []
    p = proof.Proof(args("--skip-fresh"))
    assert p.go() == 0
    assert built == ["build", "build"]  # reused, not built
    assert ran == ["decision", "writable", "read-only", "late-env", "variants"]
    row = p.rows[0]
    assert row["step"] == "build" and row["reused"] == str(entry) and row["files"] == 1
    assert dict(map(tuple, parts.table_rows([row])))["build"].startswith(f"reused {entry}; 1 files")
    assert [r["step"] for r in p.rows[1:]] == ["shipped", "warm"]
    two = proof.Proof(args("--skip-fresh", "--pairs", "2"))
    assert two.go() == 0
    assert [r["step"] for r in two.rows[1:]] == ["shipped", "warm", "shipped-2", "warm-2"]
    cells = dict(map(tuple, parts.table_rows(two.rows)))
    assert cells["warm-2"].startswith("turboquant_4bit_nc: ok, startup None s")  # an engine's row


def test_the_verdict_pairs_each_shipped_engine_with_its_warm_one() -> None:
    def eng(step: str, s: float, ms: int | None = 400, status: str = "ok") -> dict[str, object]:
        return {"step": step, "status": status, "startup_s": s, "first_launches_ms": ms}

    # Startups of the H200 runs of 2026-12-01 (the first run's pair is ``missed`` below).
    rows = [eng("shipped", 49.55), eng("warm", 48.27), eng("shipped-b", 45.26)]
    rows += [eng("warm-b", 42.66), eng("shipped-c", 42.61), eng("warm-c", 44.26)]
    met = parts.verdict(rows)
    assert [x["gap_s"] for x in met["pairs"]] == [1.28, 2.6, -1.65]
    assert met["met"] and met["mean_gap_s"] == 0.74
    missed = parts.verdict([eng("shipped", 46.25), eng("warm", 40.71)])
    assert missed["pairs"][0]["gap_s"] == 5.54 and not missed["met"]
    slow = parts.verdict([eng("shipped", 41.0, ms=1200), eng("warm", 40.7)])
    assert not slow["met"]
    unfinished = parts.verdict([eng("shipped", 0, status="no result"), eng("warm", 40.7)])
    assert unfinished == {"pairs": [], "mean_gap_s": None, "met": False}
