"""The ``serve-jit`` benchmark's pure parts: the HTTP mix and the JIT-line parser."""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks.tqbench import serve_jit, serve_jit_facts, serve_jit_workload, serve_prefix


def test_mix_holds_every_kind_of_request_the_issue_names() -> None:
    waves = serve_jit_workload.mix(0, 1000)
    bodies = [b for wave in waves for b in wave]
    assert any(len(b["prompt"]) == 3000 for b in bodies)
    assert max(len(w) for w in waves) == 16  # a burst
    assert {b.get("logprobs") for b in bodies} >= {1, 5, 20}
    assert any("prompt_logprobs" in b for b in bodies)
    assert any(b.get("n") == 2 for b in bodies)
    assert any("stop_token_ids" in b for b in bodies)
    temps = {b["temperature"] for b in bodies}
    assert 0 in temps and any(t > 0 for t in temps)
    shared = [b["prompt"][:640] for b in bodies if len(b["prompt"]) > 640]
    assert len(shared) != len({tuple(p) for p in shared})  # prefixes are shared
    assert serve_jit_workload.mix(0, 1000) == waves  # seeded


def test_jit_lines_reads_warn_and_error_forms() -> None:
    log = (
        "WARNING x Triton kernel JIT compilation during inference: "
        "_topk_log_softmax_kernel. This causes a latency spike\n"
        "RuntimeError: Triton kernel JIT compilation during inference: "
        "_compute_slot_mapping_kernel (detail). This causes\n"
        "INFO nothing here\n"
    )
    assert serve_prefix.jit_lines(log) == [
        "_topk_log_softmax_kernel",
        "_compute_slot_mapping_kernel",
    ]
    assert serve_prefix.jit_lines("INFO served\n") == []


def test_every_warmed_row_has_an_unwarmed_twin_or_is_a_reference() -> None:
    rows = serve_jit.ROWS
    for name, row in rows.items():
        if row.layer:  # its twin: the same server over an empty Triton cache
            assert not rows[name.replace("-layer", "")].layer
        elif row.kv == "tq" and row.warmers and row.ahead:
            assert f"{name}-off" in rows and not rows[f"{name}-off"].warmers
        if not row.ahead:  # the child's twin: the same server with it
            assert rows[name.replace("-noahead", "")].ahead


def test_a_long_report_line_keeps_its_start() -> None:
    """A hybrid worker's report line ran past 1,100 characters (H200, serve-jit run V); its
    first launches and total come first, and must reach ``row_facts``."""
    from benchmarks.tqbench.serve_prefix import plugin_lines

    report = (
        "(EngineCore pid=1) INFO 12-03 08:09:39 [install.py:31] tq-warmup: 7 TurboQuant "
        "layers, 10 distinct kernel keys: 10 compiled, 0 from the shipped cache; 1672 ms; "
        "21 first launches 201 ms; vLLM kernels: fused MoE 9, " + "EAGLE helpers 15, " * 60
    )
    text = "vLLM says hello\n" + report + "\n(EngineCore pid=1) INFO tq-warmup: guard on\n"
    lines = plugin_lines(text)
    assert [ln[:20] for ln in lines] == ["tq-warmup: 7 TurboQu", "tq-warmup: guard on"]
    facts = serve_jit_facts.row_facts(lines)
    assert facts["first_launches_ms"] == 201 and facts["vllm_kernels"].startswith("fused MoE 9")


def test_row_facts_reads_the_plugin_lines() -> None:
    lines = [
        "tq-warmup: driver cache /l/driver-cache: CUDA_CACHE_PATH set to a copy of the entry "
        "(5 files, 60.0 MiB); verified copy in 0.21 s",
        "tq-warmup: 6 keys: 0 compiled, 6 from the shipped cache; 4 first launches 357 ms; "
        "vLLM kernels: 49 launches, 12 jobs in 3.10 s",
    ]
    facts = serve_jit_facts.row_facts(lines)
    assert facts["first_launches"] == 4 and facts["first_launches_ms"] == 357
    assert facts["driver_cache_line"].startswith("tq-warmup: driver cache")
    assert facts["vllm_kernels"].startswith("49 launches")
    assert "warmup_ms" not in facts  # that line has no total
    report = ("tq-warmup: 4 TurboQuant layers, 6 distinct kernel keys (decode 2): 0 compiled, "
              "6 from the shipped cache, 0 from Triton's disk cache, 0 failed; workspace "
              "16.4 MiB; 212 ms; 22 first launches 466 ms")  # fmt: skip
    facts = serve_jit_facts.row_facts([report])
    assert (facts["from_layer"], facts["warmup_ms"], facts["first_launches_ms"]) == (6, 212, 466)
    assert serve_jit_facts.row_facts(["tq-warmup: disabled by TQ_WARMUP"]) == {}


_HYBRID = (
    "tq-warmup: 7 TurboQuant layers, 10 distinct kernel keys (decode 2): 0 compiled, 0 "
    "from the shipped cache, 10 from Triton's disk cache, 0 failed; workspace 48.9 MiB; "
    "71 ms; 22 first launches 12091 ms; vLLM kernels: fused MoE 9, KV block zeroing 3 (35 "
    "launches, 10 compiled: _zero_kv_blocks_kernel x3, triton_red_fused_ge_sum_0, 3318 "
    "ms); 9 warmup forwards 904 ms, 0 compiles in them; compile-ahead child: 44 jobs"
)


def test_the_plugins_cost_counts_the_warmup_forwards_once() -> None:
    """Run AR's hybrid line (H200, 0.26.0): 71 ms of TurboQuant warmup and 3318 ms of
    vLLM kernels, whose 904 ms of forwards are inside them: 3389 ms, not 4293."""
    line = _HYBRID
    facts = serve_jit_facts.row_facts([line])
    assert (facts["warmup_ms"], facts["vllm_kernels_ms"], facts["plugin_ms"]) == (71, 3318, 3389)
    plain = line.replace(
        "10 compiled: _zero_kv_blocks_kernel x3, triton_red_fused_ge_sum_0", "0 compiled"
    )
    assert serve_jit_facts.row_facts([plain])["plugin_ms"] == 3389
    most = line.replace("3318 ms)", "3318 ms, most job time: fused MoE 2210 ms)")
    facts = serve_jit_facts.row_facts([most])
    assert (facts["vllm_kernels_ms"], facts["vllm_most_time"]) == (3318, "fused MoE 2210 ms")
    split = most.replace("2210 ms)", "2210 ms, in Triton: lookups 120 ms, loads 300 ms)")
    facts = serve_jit_facts.row_facts([split])
    assert (facts["vllm_kernels_ms"], facts["vllm_most_time"]) == (3318, "fused MoE 2210 ms")
    assert (facts["triton_lookup_ms"], facts["triton_load_ms"]) == (120, 300)


def test_the_job_times_come_from_the_plugins_report(tmp_path: Path) -> None:
    """The in-process row reads every family's job time from ``TQ_WARMUP_REPORT``; a
    report that is missing or not the plugin's costs only those figures."""
    from tq_warmup_plugin.vllm_kernels.jobs import EngineResult
    from tq_warmup_plugin.worker.report import Report

    done = EngineResult(family_seconds={"EAGLE helpers": 0.7194}, triton_seconds=(0.12, 0.3))
    report = Report(vllm=done)
    path = tmp_path / "report.json"
    path.write_text(report.to_json())
    assert serve_jit_facts.job_times(path) == {"family_job_ms": {"EAGLE helpers": 719}}
    path.write_text("[1, 2]")
    assert serve_jit_facts.job_times(path) == {}
    assert serve_jit_facts.job_times(tmp_path / "missing.json") == {}


def test_the_moe_row_is_a_mixtral_of_the_llamas_attention() -> None:
    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
             "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
             "intermediate_size": 1024, "mlp_bias": False}  # fmt: skip
    moe = serve_jit_workload.mixtral_config(llama)
    assert moe["architectures"] == ["MixtralForCausalLM"] and moe["model_type"] == "mixtral"
    assert (moe["num_local_experts"], moe["num_experts_per_tok"]) == (4, 2)
    assert {k: moe[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads")} == {
        "hidden_size": 2048,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
    }
    assert "mlp_bias" not in moe and llama["architectures"] == ["LlamaForCausalLM"]


def test_a_row_named_twice_restarts_only_one_after_another(tmp_path: Path) -> None:
    """The second start of a row reads its first start's Triton cache: side by side
    both would start cold, so that is refused before any server starts."""
    from benchmarks.tqbench import cli

    argv = ["serve-jit", "--rows", "tq,tq", "--side-by-side", "--out", str(tmp_path)]
    assert cli.main(argv) == 2
    assert not (tmp_path / "result.json").exists()


def test_in_process_sampling_is_what_the_http_body_asks_for() -> None:
    from benchmarks.tqbench.inproc_mix import sampling_of

    body = {"prompt": [1, 2], "max_tokens": 16, "logprobs": 5, "return_tokens_as_token_ids": True,
            "temperature": 0.8, "top_p": 0.9, "seed": 1, "n": 2}  # fmt: skip
    assert sampling_of(body) == {"ignore_eos": True, "max_tokens": 16, "logprobs": 5,
                                 "temperature": 0.8, "top_p": 0.9, "seed": 1, "n": 2}  # fmt: skip
    kinds = {k for wave in serve_jit_workload.mix(0, 1000) for b in wave for k in b}
    # every key of the mix reaches the engine, or is the server's own
    assert kinds - {"prompt", "return_tokens_as_token_ids"} <= set(sampling_of(
        {k: 1 for k in kinds}))  # fmt: skip


def test_in_process_drops_only_the_flags_a_release_does_not_know() -> None:
    from benchmarks.tqbench.inproc_mix import known_flags

    flags = ["--model", "/m", "--skip-tokenizer-init", "--jit-monitor-mode", "error",
             "--speculative-config", '{"method": "ngram"}', "--jit-monitor-verbose"]  # fmt: skip
    known = {"--model", "--skip-tokenizer-init", "--speculative-config"}
    kept, dropped = known_flags(flags, known)
    assert kept == ["--model", "/m", "--skip-tokenizer-init", "--speculative-config",
                    '{"method": "ngram"}']  # fmt: skip
    assert dropped == ["--jit-monitor-mode", "--jit-monitor-verbose"]


def test_the_shipped_torch_compile_artifacts_load_counts_in_the_plugins_cost() -> None:
    """The worker loads a driver-cache entry's artifacts before its warmers (its own note,
    timed apart from the TurboQuant warmup and the vLLM kernels): added once."""
    line = _HYBRID.replace("71 ms;", "69 ms;").replace(
        "; 9 warmup forwards 904 ms, 0 compiles in them; compile-ahead child: 44 jobs",
        "; torch.compile artifacts of NVIDIA_H200-580-fa2-x: 2 loaded (150 KiB) in 9 ms",
    )
    line = re.sub(r"\(35 launches.*3318 ms\)", "(17 launches, 0 compiled, 120 ms)", line)
    facts = serve_jit_facts.row_facts([line])
    assert (facts["compiled_loaded"], facts["compiled_kib"], facts["compiled_ms"]) == (2, 150, 9)
    assert facts["plugin_ms"] == 69 + 120 + 9
    failed = line.replace("2 loaded (150 KiB) in 9 ms", "not loaded (x): their graphs compile here")
    facts = serve_jit_facts.row_facts([failed])
    assert "compiled_ms" not in facts and "not loaded" in facts["compiled_line"]
    assert facts["plugin_ms"] == 69 + 120


def test_a_row_whose_engine_logged_no_plugin_line_is_not_the_plugins_row() -> None:
    served = {"row": "tq", "status": "ok", "plugin_lines": []}
    assert serve_jit.plugin_checked(served, {"TQ_WARMUP": "1"})["status"] == "no-plugin"
    assert serve_jit.plugin_checked(served, {"TQ_WARMUP": "0"})["status"] == "ok"
    line = ["tq-warmup: 12 TurboQuant layers, 6 distinct kernel keys"]
    assert serve_jit.plugin_checked({**served, "plugin_lines": line}, {})["status"] == "ok"
    failed = {"row": "tq", "status": "startup-failed", "plugin_lines": []}
    assert serve_jit.plugin_checked(failed, {})["status"] == "startup-failed"
