"""The spec benchmark's issue-23 parts: guard kinds, MTP/EAGLE models, batches, speed table."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.tqbench import cli, spec, spec_child, spec_configs, spec_tables, verdicts


def _args(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["spec", *argv])


def test_every_kind_has_its_graph_mode_and_guard_value() -> None:
    names = {c.name: c for c in spec_configs.build_configs("all", [2], "ngram")}
    got = {n: (c.cudagraph_mode, c.spec_guard) for n, c in names.items()}
    full = "FULL_AND_PIECEWISE"
    assert got == {
        "ref-eager": (None, None),
        "nospec-full": (full, None),
        "ngram2-eager": (None, None),
        "ngram2-piecewise": ("PIECEWISE", None),
        "ngram2-full-batched": (full, None),
        "ngram2-full-guard": (full, "piecewise"),
        "ngram2-full-noguard": (full, "0"),
    }


def test_issue_23_selection_and_names() -> None:
    selection = "nospec-full,full-guard,full-noguard,full-batched"
    names = [c.name for c in spec_configs.build_configs(selection, [1, 2], "mtp")]
    assert names == [
        "ref-eager",
        "nospec-full",
        "mtp1-full-guard",
        "mtp2-full-guard",
        "mtp1-full-noguard",
        "mtp2-full-noguard",
        "mtp1-full-batched",
        "mtp2-full-batched",
    ]
    assert spec_configs.kind_of("eagle4-full-batched") == ("full-batched", 4)
    assert spec_configs.kind_of("draft12-eager") == ("eager", 12)
    assert spec_configs.kind_of("nospec-full") == ("nospec-full", None)


def test_mtp_and_eagle_speculative_configs() -> None:
    mtp = spec_configs.spec_config("mtp", 2, "full-batched")
    assert mtp.speculative_config("/m") == {"method": "mtp", "num_speculative_tokens": 2}
    eagle = spec_configs.spec_config("eagle", 3, "full-guard")
    assert eagle.name == "eagle3-full-guard"
    assert eagle.speculative_config("/m", "/head") == {
        "method": "eagle",
        "model": "/head",
        "num_speculative_tokens": 3,
    }
    with pytest.raises(ValueError, match="head"):
        eagle.speculative_config("/m")


def test_model_sizes_and_the_mimo_and_eagle_configs() -> None:
    big = spec_configs.MODEL_SIZES["llama3-8b"]
    llama = spec_configs.model_config("ngram", big, 2048)
    assert (llama["num_hidden_layers"], llama["hidden_size"]) == (32, 4096)
    assert (llama["num_attention_heads"], llama["num_key_value_heads"]) == (32, 8)
    assert (llama["head_dim"], llama["intermediate_size"]) == (128, 14336)
    assert llama["architectures"] == ["LlamaForCausalLM"]
    mimo = spec_configs.model_config("mtp", spec_configs.MODEL_SIZES["small"], 2048)
    assert mimo["architectures"] == ["MiMoForCausalLM"] and mimo["model_type"] == "qwen2"
    assert mimo["num_nextn_predict_layers"] == 1 and "head_dim" not in mimo
    head = spec_configs.eagle_head_config(big, 2048)
    assert head["num_hidden_layers"] == 1 and head["hidden_size"] == llama["hidden_size"]


def test_the_references_load_the_target_the_run_speculates_with(tmp_path: Path) -> None:
    """An MTP run's reference and no-spec engines load the MiMo target, not a Llama."""
    opts = {"model_size": vars(spec_configs.MODEL_SIZES["small"]), "max_model_len": 2048}
    for method, arch in (("mtp", "MiMoForCausalLM"), ("ngram", "LlamaForCausalLM")):
        for name in (spec_configs.REFERENCE, spec_configs.NOSPEC_FULL):
            cfg = spec_configs.SpecConfig(name)
            model_dir, _ = spec_child.write_models(cfg, {**opts, "method": method}, tmp_path / name)
            written = json.loads((model_dir / "config.json").read_text())
            assert written["architectures"] == [arch]


def test_model_size_options_and_overrides() -> None:
    assert spec.model_size(_args()) == spec_configs.MODEL_SIZES["small"]
    size = spec.model_size(_args("--model-size", "llama3-8b", "--layers", "6"))
    assert (size.geometry, size.layers, size.vocab_size) == ("128x32x8", 6, 128256)
    with pytest.raises(SystemExit, match="--layers must be >= 6"):
        spec.check(_args("--layers", "4"))
    with pytest.raises(SystemExit, match="below the largest batch 32"):
        spec.check(_args("--batch", "1,32"))
    with pytest.raises(SystemExit, match="--repeats"):
        spec.check(_args("--repeats", "0"))
    spec.check(_args("--batch", "1,8", "--method", "eagle", "--async-scheduling", "on"))


def test_random_prompts_do_not_repeat_a_pattern() -> None:
    prompts = spec_configs.spec_prompts(4, 0, (300, 300), kind="random")
    assert [len(p) for p in prompts] == [300] * 4
    assert all(p[:24] != p[24:48] for p in prompts)
    with pytest.raises(ValueError, match="prompt kind"):
        spec_configs.spec_prompts(1, kind="bogus")


def test_bench_gives_each_child_its_batches_and_extra_prompts(tmp_path: Path) -> None:
    argv = ["--model-size", "llama3-8b", "--batch", "1,8", "--prompts", "4", "--repeats", "3"]
    argv += ["--prompt-len", "1000", "--max-tokens", "256", "--ks", "1,2,4"]
    bench = spec.SpecBench(_args(*argv, "--work-dir", str(tmp_path)))
    assert [len(p) for p in bench.speed_prompts] == [1000] * 8
    assert bench.speed_prompts[:4] == bench.prompts
    assert bench.max_model_len == 2048  # 1000 + 256 + 4, rounded up
    cfg = bench.configs[1]
    child = bench.child_spec(cfg, tmp_path / cfg.name)
    opts = child["options"]
    assert (opts["batches"], opts["repeats"], opts["layers"]) == ([1, 8], 3, 32)
    assert opts["model_size"]["intermediate_size"] == 14336 and len(child["speed_prompts"]) == 8
    assert json.loads(json.dumps(child)) == child  # what the spec file holds


def _fake_generate(walls: list[float]) -> tuple[Any, list[tuple[int, str]]]:
    calls: list[tuple[int, str]] = []

    def generate(prompts: Any, part: str) -> tuple[float, dict[str, list[Any]]]:
        calls.append((len(prompts), part))
        tokens = [[7] * 4 for _ in prompts]
        return walls.pop(0), {"tokens": tokens, "logprobs": [[-1.0] * 4 for _ in prompts]}

    return generate, calls


def test_generate_all_times_each_batch_best_of_repeats() -> None:
    prompts = [[1, 2], [3, 4]]
    spec_file = {"prompts": prompts, "speed_prompts": [*prompts, [5, 6], [7, 8]]}
    # compared; b1: untimed + 2 timed; b2 (= the compared prompts): 2 timed only; b4: 1 + 2
    generate, calls = _fake_generate([9.0, 5.0, 0.5, 0.4, 0.8, 1.0, 3.0, 2.0, 4.0])
    saved: dict[str, Any] = {}
    res = spec_child.generate_all(
        spec_file, {"batches": [1, 2, 4], "repeats": 2}, generate, saved.update
    )
    assert calls == [
        (2, "first"),
        (1, "untimed-b1"),
        (1, "timed-b1"),
        (1, "timed-b1"),
        (2, "timed-b2"),
        (2, "timed-b2"),
        (4, "untimed-b4"),
        (4, "timed-b4"),
        (4, "timed-b4"),
    ]
    assert saved["warm_s"] == 9.0
    assert res["throughput"] == {
        "1": {"tok_s": 10.0, "timed_s": [0.5, 0.4], "out_tokens": 4},
        "2": {"tok_s": 10.0, "timed_s": [0.8, 1.0], "out_tokens": 8},
        "4": {"tok_s": 8.0, "timed_s": [2.0, 4.0], "out_tokens": 16},
    }
    assert (res["tok_s"], res["timed_s"], res["status"]) == (10.0, 0.4, "ok")
    assert res["timed_tokens"] == [[7] * 4] * 2  # from the pass over the compared prompts


def test_generate_all_default_is_one_untimed_then_one_timed_generate() -> None:
    generate, calls = _fake_generate([2.0, 1.0])
    res = spec_child.generate_all({"prompts": [[1], [2]]}, {}, generate, lambda **_: None)
    assert calls == [(2, "first"), (2, "timed-b2")]
    assert (res["tok_s"], res["out_tokens"]) == (8.0, 8)


def _speed_rows() -> list[dict[str, Any]]:
    def row(name: str, **tok_s: float) -> dict[str, Any]:
        by_batch = {b[1:]: {"tok_s": v} for b, v in tok_s.items()}
        first = next(iter(by_batch.values()))["tok_s"]
        return {"name": name, "status": "ok", "tok_s": first, "throughput": by_batch}

    return [
        row("ref-eager", b1=50.0, b8=300.0),
        row("nospec-full", b1=132.0, b8=1029.0),
        row("ngram2-full-guard", b1=175.0, b8=458.0),
        row("ngram2-full-noguard", b1=344.0, b8=1639.0),
        row("ngram2-full-batched", b1=330.0, b8=1600.0),
        {"name": "ngram4-full-batched", "status": "crashed (rc -6)"},
    ]


def test_ratios_over_noguard_of_the_same_k() -> None:
    rows = _speed_rows()
    verdicts.add_throughput_ratios(rows)
    by = {r["name"]: r for r in rows}
    assert by["ngram2-full-guard"]["over_noguard"] == pytest.approx(0.509, abs=1e-3)
    assert by["ngram2-full-guard"]["over_noguard_by_batch"] == {"1": 0.509, "8": 0.279}
    assert by["ngram2-full-noguard"]["over_noguard"] == 1.0
    assert by["nospec-full"]["over_noguard"] is None
    assert by["ngram4-full-batched"]["over_noguard"] is None


def test_speed_table_rows_are_kinds_and_columns_batch_by_k() -> None:
    rows = _speed_rows()
    verdicts.add_throughput_ratios(rows)
    header, cells = spec_tables.speed_table(rows)
    assert header == ["configuration", "b1 k2", "b1 k4", "b8 k2", "b8 k4"]
    assert [c[0].split()[0] for c in cells] == [
        "nospec-full",
        "full-guard",
        "full-noguard",
        "full-batched",
    ]
    assert cells[0][1:] == ["132", "132", "1029", "1029"]
    assert cells[1][1:] == ["175 (0.51x)", "-", "458 (0.28x)", "-"]
    assert cells[2][1:] == ["344", "-", "1639", "-"]
    crashed = "crashed (rc -6)"
    assert cells[3][1:] == ["330 (0.96x)", crashed, "1600 (0.98x)", crashed]


def test_speed_table_reads_rows_from_before_batches() -> None:
    """A row with only ``tok_s`` (older summaries) counts at the run's prompt count."""
    old = [
        {"name": "ngram1-full-guard", "status": "ok", "tok_s": 100.0},
        {"name": "ngram1-full-noguard", "status": "ok", "tok_s": 200.0},
    ]
    header, cells = spec_tables.speed_table(old, default_batch=8)
    assert header == ["configuration", "b8 k1"]
    assert cells == [
        ["full-guard (guard on: verify batches PIECEWISE)", "100 (0.50x)"],
        ["full-noguard (guard off: FULL graphs of verify batches)", "200"],
    ]


def test_summary_answers_whether_the_batched_path_is_right_and_fast() -> None:
    rows = _speed_rows()
    for r in rows:
        if r.get("status") == "ok":
            r.update(tokens=[[1, 2]], logprobs=[[-1.0, -1.0]], margins=[[0.5, 0.5]])
            r.update(timed_tokens=r["tokens"], timed_logprobs=r["logprobs"])
    verdicts.add_comparisons(rows, lp_tol=1e-3)
    summary = spec.run_summary({"prompts": {"n": 8}}, rows)
    assert summary["batched_right"] is False  # k=4 crashed
    assert summary["batched_min_over_noguard"] == pytest.approx(0.959, abs=1e-3)
    assert summary["configs"]["ngram2-full-batched"]["tok_s_by_batch"] == {"1": 330.0, "8": 1600.0}
    assert summary["speed_table"]["header"] == ["configuration", "b1 k2", "b1 k4", "b8 k2", "b8 k4"]
    table = spec.render({"prompts": {"n": 8}}, rows)
    assert "x noguard" in table and "speed (output tok/s):" in table


@pytest.mark.real_vllm
def test_vllm_resolves_the_mtp_and_eagle_drafts_from_the_written_configs(
    tmp_path: Path,
) -> None:
    """vLLM's own ``SpeculativeConfig`` reads the config.json files a child writes: the
    MiMo target's MTP layer becomes ``MiMoMTPModel`` with ``n_predict`` 1, the one-layer
    Llama head ``EagleLlamaForCausalLM``."""
    from vllm.config import ParallelConfig, SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs

    opts = {"model_size": vars(spec_configs.MODEL_SIZES["small"]), "max_model_len": 2048}
    want = {"mtp": ("MiMoMTPModel", 1), "eagle": ("EagleLlamaForCausalLM", None)}
    for method, (arch, n_predict) in want.items():
        cfg = spec_configs.spec_config(method, 1, "full-batched")
        model_dir, head_dir = spec_child.write_models(cfg, opts, tmp_path / method)
        target = EngineArgs(
            model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, max_model_len=2048
        ).create_model_config()
        sc = SpeculativeConfig(
            **(cfg.speculative_config(str(model_dir), head_dir) or {}),
            target_model_config=target,
            target_parallel_config=ParallelConfig(),
        )
        assert (sc.method, sc.draft_model_config.architectures) == (method, [arch])
        assert getattr(sc.draft_model_config.hf_config, "n_predict", None) == n_predict
