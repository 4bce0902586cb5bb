"""The ``tokens`` and ``serve-prefix`` benchmarks' pure parts (no vLLM, no GPU): the steps
force upstream #46460's trigger, the verdicts see a lost prefix and only that, the
tables, the re-judging of saved runs, the benchmark-only weight scaler, the spawned
server's process group."""

from __future__ import annotations

import json
import os
import re
import sys
import time
import types
from importlib.metadata import distributions
from pathlib import Path
from typing import Any

import pytest

from benchmarks.tqbench import cli, dummy_scale, entry_point, serve_prefix, tokens
from benchmarks.tqbench.children import Children
from benchmarks.tqbench.tokens_judge import judge_oracle, judge_prefix_mixed
from benchmarks.tqbench.tokens_table import cost_figures, render
from benchmarks.tqbench.tokens_workload import (
    ORACLE_ROWS,
    PREFIX_LEN,
    oracle_requests,
    prefix_mixed_steps,
)
from tq_warmup_plugin.guards.prefix_fast_path import first_chunks_only

VOCAB = 1024


def step_lengths(requests: list[Any], warm: list[int]) -> tuple[list[int], list[int]]:
    """Query and sequence lengths of the step with ``warm``'s full 32-token blocks cached."""
    cached = len(warm) // 32 * 32
    q, s = [], []
    for r in requests:
        hit = cached if r.prompt[:cached] == warm[:cached] and len(r.prompt) > cached else 0
        q.append(len(r.prompt) - hit)
        s.append(len(r.prompt))
    return q, s


def test_the_mixed_step_meets_vllms_fast_path_test_with_cached_context() -> None:
    steps = {s.name: s for s in prefix_mixed_steps(0, VOCAB)}
    q, s = step_lengths(steps["mixed-off"].requests, steps["mixed-off"].warm)
    assert max(q) == max(s)  # the fast path fires ...
    qsl = [0, *[sum(q[: i + 1]) for i in range(len(q))]]
    assert not first_chunks_only(qsl, s)  # ... over requests with cached context
    assert [x - y for x, y in zip(s, q, strict=True)][1:] == [PREFIX_LEN] * 4
    q, s = step_lengths(steps["control-off"].requests, steps["control-off"].warm)
    assert max(q) != max(s)  # the control: vLLM's loop, no lost prefix
    assert steps["alone-on"].alone and steps["mixed-on"].guard == "on"


def test_the_oracle_workload_has_the_trigger_and_a_prompt_near_the_limit() -> None:
    reqs = {r.name: r for r in oracle_requests(0, VOCAB, 2048, 32)}
    assert len(reqs["near-max"].prompt) + 32 < 2048 <= len(reqs["near-max"].prompt) + 33
    assert reqs["n2"].n == 2
    assert len(reqs["C"].prompt) >= max(len(reqs[f"B{j}"].prompt) for j in range(4))
    assert [r.name for r in ORACLE_ROWS if r.reference] == ["ref", "ref-nocache", "ref-mtp"]


def out(tokens_: list[int], lps: list[float], margins: list[float] | None = None) -> dict[str, Any]:
    return {"tokens": tokens_, "logprobs": lps, "margins": margins or [0.05] * len(tokens_)}


def test_the_prefix_mixed_verdicts(capsys: pytest.CaptureFixture[str]) -> None:
    ref = {"B0": out([1, 2, 3], [-6.45, -6.45, -6.45])}
    noisy = {"B0": out([1, 2, 3], [-6.452, -6.45, -6.45])}  # 0.002 off: the floor
    lost = {"B0": out([1, 2, 3], [-6.42, -6.45, -6.45])}  # 0.03 off at token 0
    steps: dict[str, Any] = {}
    for g, mixed in (("off", lost), ("on", noisy)):
        steps[f"alone-{g}"] = {"outputs": ref}
        steps[f"control-{g}"] = {"outputs": noisy, "guard_in_place": g == "on"}
        steps[f"mixed-{g}"] = {"outputs": mixed, "guard_in_place": g == "on"}
    judged = judge_prefix_mixed(steps, 2**-9)
    assert judged["mixed-off"]["verdict"] == "WRONG"
    assert judged["mixed-on"]["verdict"] == judged["control-off"]["verdict"] == "within-noise"
    assert judged["mixed-off"]["noise_floor"] == pytest.approx(0.002)
    table = render("prefix-mixed", {"vllm_version": "0.26.0"}, judged, {})
    assert "| mixed-off | off | B0 | no | - | - | 0.0300 | WRONG |" in table


def engine(step: str, outputs: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {"status": "ok", "steps": {step: {"outputs": outputs, "branches": {}}}, **kw}


def test_the_oracle_judges_against_the_right_reference_and_leaves_unstable_requests_out() -> None:
    base = {"A": out([1, 2], [-6.0, -6.0]), "S": out([5, 6], [-6.0, -6.0], [0.5, 0.5])}
    flipped = {**base, "S": out([5, 7], [-6.0, -6.0])}  # a decided token the noise row changes
    rows = {
        "ref": engine("alone", base),
        "ref-nocache": engine("alone", base),
        "ref-mtp": engine("alone", {"A": out([9, 9], [-6.0, -6.0]), "S": base["S"]}),
        "noise": engine("batch-on", flipped),
        "prefix": {
            "status": "ok",
            "steps": {
                "batch-on": {"outputs": flipped},
                "batch-off": {"outputs": {**flipped, "A": out([1, 3], [-6.0, -6.0])}},
            },
        },
        "mtp2": engine("batch-on", {"A": out([9, 9], [-6.0, -6.0]), "S": base["S"]}),
    }
    judged = judge_oracle(rows, 2**-9)
    assert judged["unjudged"] == ["S"]
    assert judged["rows"]["prefix"]["on"]["verdict"] == "equal"  # S left out
    assert judged["rows"]["prefix"]["off"]["verdict"] == "WRONG"  # A's decided token
    assert judged["rows"]["mtp2"]["reference"] == "ref-mtp"
    assert judged["rows"]["mtp2"]["on"]["verdict"] == "equal"
    assert judged["rows"]["noise"]["reference"] == "ref-nocache"


def test_cost_figures_pair_the_alternating_steps() -> None:
    def step(wall: float, lost: int) -> dict[str, Any]:
        return {
            "outputs": {"a": {"tokens": [1] * 100}},
            "wall_s": wall,
            "branches": {"fast_with_cached": lost},
        }

    figures = cost_figures(
        {
            "cost-on-0": step(1.0, 0),
            "cost-off-0": step(0.9, 4),
            "cost-off-1": step(1.0, 4),
            "cost-on-1": step(1.0, 0),
        }
    )
    assert [p["on_over_off"] for p in figures["pairs"]] == [0.9, 1.0]
    assert figures["min_on_over_off"] == 0.9 and figures["pairs"][0]["fast_with_cached_off"] == 4


def test_cost_steps_alternate_and_hit_eighty_percent() -> None:
    steps = tokens.cost_steps(0, VOCAB, 2)
    assert [s.name for s in steps] == ["cost-on-0", "cost-off-0", "cost-off-1", "cost-on-1"]
    hits = [r for r in steps[0].requests if r.prompt[:PREFIX_LEN] == steps[0].warm]
    assert len(hits) / len(steps[0].requests) == 0.8


def test_from_result_merges_engines_and_writes_only_summaries(tmp_path: Path) -> None:
    base = {"A": out([1, 2], [-6.0, -6.0])}
    first = {
        "run": {"case": "oracle", "run_id": "r1"},
        "engines": {
            "ref": engine("alone", base),
            "ref-nocache": engine("alone", base),
            "prefix": {"status": "starting"},
        },
    }
    second = {
        "run": {"case": "oracle", "run_id": "r2"},
        "engines": {"prefix": engine("batch-on", base), "noise": engine("batch-on", base)},
    }
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for p, data in zip(paths, (first, second), strict=True):
        p.write_text(json.dumps(data))
    args = cli.build_parser().parse_args(
        ["tokens", "--from-result", ",".join(map(str, paths)), "--out", str(tmp_path / "o")]
    )
    assert args.func(args) == 0
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["verdicts"]["rows"]["prefix"]["on"]["verdict"] == "equal"
    assert not (tmp_path / "o" / "result.json").exists()
    assert "tokens" not in json.dumps(summary["engines"])


def test_an_unknown_oracle_row_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown rows"):
        tokens.select_rows("prefix,nope")


def test_serve_bursts_put_hits_beside_a_longer_fresh_prompt_and_judge_counts() -> None:
    prefix, bursts = serve_prefix.bursts(0, VOCAB, 2)
    fresh, *hits = bursts[0]["batched"]
    assert all(h[:PREFIX_LEN] == prefix for h in hits + bursts[0]["single"])
    assert len(fresh) >= max(len(h) for h in hits) and bursts[0] != bursts[1]
    judged = serve_prefix.judge({"a": [1, 2], "b": [1, 3, 4]}, {"a": [1, 2], "b": [1, 2]})
    assert judged == {"requests": 2, "differing": 1, "first_divergence": {"b": 1}}


def test_the_weight_scaler_wraps_vllms_dummy_loader_once(monkeypatch: pytest.MonkeyPatch) -> None:
    class Param:
        def __init__(self) -> None:
            self.data = self

        def mul_(self, x: float) -> None:
            self.scaled = x

    class DummyModelLoader:
        def load_weights(self, model: Any, model_config: Any) -> None:
            model.loaded = True

    module = types.ModuleType("fake_dummy_loader")
    module.DummyModelLoader = DummyModelLoader  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, dummy_scale._LOADER, module)
    monkeypatch.delenv(dummy_scale.ENV, raising=False)
    dummy_scale.register()
    assert DummyModelLoader.load_weights.__name__ == "load_weights"
    assert not hasattr(DummyModelLoader.load_weights, "__tqbench_scaled__")  # unset: nothing
    monkeypatch.setenv(dummy_scale.ENV, "100")
    dummy_scale.register()
    dummy_scale.register()
    p = Param()
    model = types.SimpleNamespace(parameters=lambda: [p])
    DummyModelLoader().load_weights(model, None)
    assert model.loaded and p.scaled == 100.0


def _declared(root: Path) -> list[str]:
    """The ``vllm.general_plugins`` names found with ``root`` first on the path and a
    plugin-only stub after it (as a GPU call's environment has), the first distribution
    of a name only, as ``importlib.metadata.entry_points`` keeps them from Python 3.12."""
    other = entry_point.write_stub(root.parent / "plugin-only")
    seen: set[str] = set()
    names: list[str] = []
    for dist in distributions(path=[str(root), str(other)]):
        name = re.sub(r"[-_.]+", "_", dist.metadata["Name"]).lower()
        if name not in seen:
            seen.add(name)
            names += [e.name for e in dist.entry_points if e.group == "vllm.general_plugins"]
    return sorted(names)


def test_the_stub_declares_the_weight_scaler_only_when_asked(tmp_path: Path) -> None:
    assert _declared(entry_point.write_stub(tmp_path / "a")) == ["tq_warmup"]
    scaler = entry_point.write_stub(tmp_path / "b", plugin=False, weight_scale=True)
    # A scaler-only stub first on the path hid a plugin stub after it while both had one
    # distribution name: the plugin must stay found beside it.
    assert _declared(scaler) == ["tq_warmup", "tqbench_weight_scale"]
    assert not (scaler / "tq_warmup_plugin_stub-0.dist-info").exists()


def test_a_reused_stub_root_declares_only_what_it_is_asked(tmp_path: Path) -> None:
    root = entry_point.write_stub(tmp_path / "c", weight_scale=True)
    entry_point.write_stub(root, plugin=False, weight_scale=True)
    assert sorted(d.name for d in root.iterdir()) == ["tqbench_weight_scale_stub-0.dist-info"]


def test_a_spawned_server_is_stopped_with_its_group(tmp_path: Path) -> None:
    children = Children()
    proc = children.spawn(
        [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
        tmp_path / "s.log",
        os.environ,
    )
    for _ in range(50):
        if "up" in (tmp_path / "s.log").read_text():
            break
        time.sleep(0.1)
    assert proc.pid in children.procs
    children.stop(proc)
    assert proc.returncode is not None and proc.returncode < 0 and not children.procs


def test_tokens_refuses_engines_vllm_could_not_load_the_plugin_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The H200 oracle of 2026-12-02 ran its engines without the plugin, silently."""
    monkeypatch.setattr(entry_point, "found", lambda: False)
    monkeypatch.setattr(tokens, "TokensBench", lambda args: pytest.fail("an engine started"))
    argv = ["tokens", "--case", "oracle", "--work-dir", str(tmp_path)]
    with pytest.raises(SystemExit, match="tokens: the plugin's entry point is not installed"):
        tokens.cmd_tokens(cli.build_parser().parse_args(argv))
