"""The ``free-guards`` benchmark on the CPU: its workloads, its figures, its serving loop
against a stand-in for vLLM's ``LLMEngine``, its verify part's ``spec`` command line and a
summary written from a saved run."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from benchmarks.tqbench import free_guards
from benchmarks.tqbench.cli import build_parser, main
from benchmarks.tqbench.free_guards_child import serve
from benchmarks.tqbench.free_guards_workload import (
    Turn,
    Workload,
    percentile,
    prefix_ratios,
    verify_ratios,
    workload,
)

VOCAB = 128256


def test_the_hits_workload_is_the_cost_case() -> None:
    load = workload("hits", 0, VOCAB)
    hits = [t for t in load.turns if not t.fresh]
    fresh = [t for t in load.turns if t.fresh]
    assert (len(hits), len(fresh), load.in_flight) == (32, 8, 40)
    (prefix,) = load.warm
    assert all(t.prompt[: len(prefix)] == prefix for t in hits)
    assert min(len(t.prompt) for t in fresh) > max(len(t.prompt) for t in hits)  # #46460's trigger


@pytest.mark.parametrize(
    ("name", "shared", "question", "outputs", "fresh_len", "in_flight"),
    [
        ("chat", {1000, 1500, 2000}, (50, 500), {128, 256, 512}, 2100, 64),
        ("long", {8000}, (20, 60), {64}, 8200, 16),
    ],
)
def test_a_shared_prefix_workload_has_the_shapes_it_names(
    name: str,
    shared: set[int],
    question: tuple[int, int],
    outputs: set[int],
    fresh_len: int,
    in_flight: int,
) -> None:
    load = workload(name, 3, VOCAB)
    assert load.in_flight == in_flight and len(load.turns) == 3 * in_flight
    assert {len(w) for w in load.warm} == shared
    for i, turn in enumerate(load.turns):
        assert turn.fresh == (i % 8 == 7) and turn.max_tokens in outputs
        if turn.fresh:
            assert len(turn.prompt) == fresh_len
            assert not any(turn.prompt[: len(w)] == w for w in load.warm)
            continue
        (prefix,) = [w for w in load.warm if turn.prompt[: len(w)] == w]
        assert question[0] <= len(turn.prompt) - len(prefix) <= question[1]
    assert workload(name, 3, VOCAB) == load and workload(name, 4, VOCAB) != load  # the seed's


def test_a_workload_survives_its_json_and_an_unknown_name_is_refused() -> None:
    load = workload("chat", 0, VOCAB, turns=16)
    assert Workload.from_dict(json.loads(json.dumps(load.to_dict()))) == load
    assert load.longest() == max(len(t.prompt) + t.max_tokens for t in load.turns)
    with pytest.raises(ValueError, match="unknown workload 'bogus'"):
        workload("bogus", 0, VOCAB)


def test_percentile_is_the_nearest_rank() -> None:
    values = [float(v) for v in range(100, 0, -1)]
    assert (percentile(values, 50), percentile(values, 99), percentile(values, 100)) == (
        50.0,
        99.0,
        100.0,
    )
    assert percentile([7.0], 99) == 7.0 and percentile([], 50) is None


def _pass(guard: str, tok_s: float | None, p99: float, mixed: int = 0) -> dict[str, Any]:
    return {"guard": guard, "tok_s": tok_s, "ttft_p99_ms": p99, "mixed": mixed}


def test_prefix_ratios_pair_each_on_with_its_off() -> None:
    passes = [
        _pass("on", 90.0, 110.0, 4),
        _pass("off", 100.0, 100.0, 4),
        _pass("off", 100.0, 100.0, 4),
        _pass("on", 99.0, 100.0, 4),
        _pass("on", 95.0, 105.0, 4),
        _pass("off", 100.0, 100.0, 4),
    ]
    got = prefix_ratios(passes)
    assert got == {
        "ratio": 0.95,
        "pairs": [0.9, 0.99, 0.95],
        "ttft_p99_ratio": 1.05,
        "mixed_steps": 4,
    }
    failed = prefix_ratios([_pass("on", None, 1.0), _pass("off", 100.0, 1.0)])
    assert failed["ratio"] is None and failed["pairs"] == []


def test_verify_ratios_are_keyed_by_k_then_batch() -> None:
    got = verify_ratios({2: {"16": 1.1, "1": 0.91, "8": 0.98}, 1: {"1": 0.96}})
    assert got == {"k=1": {"bs1": 0.96}, "k=2": {"bs1": 0.91, "bs8": 0.98, "bs16": 1.1}}
    assert list(got["k=2"]) == ["bs1", "bs8", "bs16"]


@dataclass
class _Out:
    request_id: str
    outputs: list[Any]
    finished: bool


@dataclass
class _Completion:
    token_ids: list[int]


@dataclass
class FakeEngine:
    """vLLM's ``LLMEngine`` as ``serve`` uses it: each step gives every running request one
    token (as DELTA outputs do); ``add_request`` returns its own id (0.34) or None (older)."""

    own_ids: bool
    clock: list[float]
    running: dict[str, int] = field(default_factory=dict)
    peak: int = 0

    def add_request(self, name: str, prompt: dict[str, Any], params: Turn) -> str | None:
        rid = f"{name}-x1" if self.own_ids else name
        self.running[rid] = params.max_tokens
        self.peak = max(self.peak, len(self.running))
        return rid if self.own_ids else None

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def step(self) -> list[_Out]:
        self.clock[0] += 1.0
        outs = []
        for rid in list(self.running):
            self.running[rid] -= 1
            done = self.running[rid] == 0
            outs.append(_Out(rid, [_Completion([5])], done))
            if done:
                del self.running[rid]
        return outs


@pytest.mark.parametrize("own_ids", [True, False])
def test_serve_keeps_the_in_flight_count_and_times_each_first_token(own_ids: bool) -> None:
    turns = [Turn(f"t{i}", [1, 2, 3], 2 + i % 3) for i in range(10)]
    now = [0.0]
    fake = FakeEngine(own_ids, now)
    got = serve(fake, turns, 4, lambda t: t, clock=lambda: now[0])
    assert fake.peak == 4
    assert got["out_tokens"] == sum(t.max_tokens for t in turns)
    assert len(got["ttft_s"]) == 10 and all(v == 1.0 for v in got["ttft_s"])  # one step each
    assert got["wall_s"] == now[0] > 0


def _args(**over: Any) -> argparse.Namespace:
    args = build_parser().parse_args(["free-guards"])
    vars(args).update(over)
    return args


def test_the_verify_part_is_a_spec_command_line_spec_accepts(tmp_path: Path) -> None:
    from benchmarks.tqbench import spec

    argv = free_guards.verify_argv(_args(), Path("/tmp/x"))
    parsed = build_parser().parse_args(argv)
    spec.check(parsed)  # refuses, in one line, options no child could run
    assert parsed.configs == "full-batched,full-noguard" and parsed.ks == "1,2,3,4"
    assert parsed.batch == "1,8,16" and parsed.max_num_seqs == 16
    assert parsed.model_size == "llama3-8b" and parsed.method == "ngram" and parsed.no_reference
    parsed.work_dir = str(tmp_path)
    names = {c.name for c in spec.SpecBench(parsed).configs}  # no reference engine
    assert names == {f"ngram{k}-full-{x}" for k in (1, 2, 3, 4) for x in ("batched", "noguard")}


def test_a_saved_run_is_summarized_again(tmp_path: Path) -> None:
    passes = [_pass("on", 98.0, 101.0, 3), _pass("off", 100.0, 100.0, 3)]
    parts = {
        "prefix": {"status": "ok", "vllm_version": "0.34.0", "workloads": {"chat": passes}},
        "spec": {
            "configs": {
                "ngram1-full-batched": {"over_noguard_by_batch": {"1": 0.96, "8": 1.02}},
                "ngram1-full-noguard": {"over_noguard_by_batch": None},
            }
        },
    }
    saved = tmp_path / "parts.json"
    saved.write_text(json.dumps(parts))
    out = tmp_path / "summary"
    argv = ["free-guards", "--from-result", str(saved), "--summary-dir", str(out)]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["prefix_ratio"]["chat"]["ratio"] == 0.98
    assert summary["verify"] == {"k=1": {"bs1": 0.96, "bs8": 1.02}}
    table = (out / "SUMMARY.md").read_text()
    assert "chat" in table and "0.98" in table and "bs8" in table


def test_an_unknown_part_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["free-guards", "--parts", "prefix,bogus"]) == 2
    assert capsys.readouterr().err.strip() == (
        "free-guards: --parts: ['bogus']: some of prefix, verify"
    )


def test_a_profiled_stretch_names_its_host_work() -> None:
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.tqbench import recorder

    a = torch.ones(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as session:
        for _ in range(3):
            a = a @ a / 64
    got = recorder.breakdown(session, top=5)
    assert got["kernels"] == [] and got["gpu_us"] == 0  # no GPU here
    mm = [row for row in got["host"] if row["name"] == "aten::mm"]
    assert mm and mm[0]["calls"] == 3 and got["cpu_us"] >= mm[0]["us"] > 0
    assert len(got["host"]) <= 5


def test_the_prefix_attention_batches_meet_vllms_fast_path_test() -> None:
    """Each random batch is upstream #46460's trigger: its longest query is its longest
    sequence, with short hits (the shared launches), one long hit and fresh prompts."""
    import random

    from benchmarks.tqbench import prefix_attention

    rng = random.Random(0)
    for _ in range(50):
        reqs = prefix_attention.batch(rng)
        assert max(q for q, _ in reqs) == max(q + c for q, c in reqs)
        hits = [q for q, c in reqs if c]
        assert sum(q <= 128 for q in hits) >= 2 and sum(q > 128 for q in hits) == 1
        assert sum(c == 0 for _, c in reqs) >= 2 and len(reqs) <= prefix_attention.MAX_SEQS
        assert max(q + c for q, c in reqs) <= prefix_attention.MAX_LEN


def test_the_prefix_attention_summary_takes_the_worst_difference() -> None:
    from benchmarks.tqbench import prefix_attention

    rows = [
        {"guarded": 0.0, "floor": 0.01, "unguarded": 0.5, "us_loop": 900.0,
         "us_guarded": 330.0, "us_unguarded": 300.0},
        {"guarded": 0.002, "floor": 0.02, "unguarded": 0.7, "us_loop": 1100.0,
         "us_guarded": 420.0, "us_unguarded": 400.0},
    ]  # fmt: skip
    got = prefix_attention.summary(rows)
    assert (got["guarded"], got["floor"], got["unguarded"], got["cases"]) == (0.002, 0.02, 0.7, 2)
    assert got["us_loop"] == 1000.0 and got["guarded_over_unguarded"] == pytest.approx(1.075)
    text = prefix_attention.table(got)
    assert "| 2 | 0.002 | 0.02 | 0.7 |" in text and "| 1000 | 375 | 350 | 1.07" in text


def test_serve_ends_when_a_request_is_dropped_without_a_final_output() -> None:
    """An engine that aborts a request says nothing more of it: the loop still ends."""

    class Dropping(FakeEngine):
        def add_request(self, name: str, prompt: dict[str, Any], params: Turn) -> str | None:
            got = super().add_request(name, prompt, params)
            if name == "t0":
                self.running.pop(got or name)
            return got

        def step(self) -> list[_Out]:
            assert now[0] < 100, "the loop spins on a request the engine dropped"
            return super().step()

    turns = [Turn(f"t{i}", [1], 2) for i in range(6)]
    now = [0.0]
    got = serve(Dropping(False, now), turns, 1, lambda t: t, clock=lambda: now[0])
    assert got["out_tokens"] == 10 and len(got["ttft_s"]) == 5
