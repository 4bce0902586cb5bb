"""``serve-jit --in-process`` gives a row's engine the flags its server gets, through vLLM's
own ``EngineArgs`` parser: what the in-process count judges is the served configuration."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks.tqbench import serve_jit
from benchmarks.tqbench.serve_prefix import engine_flags

pytestmark = pytest.mark.real_vllm


def _args(tmp_path: Path) -> argparse.Namespace:
    stub = tmp_path / "stub"
    stub.mkdir()
    return argparse.Namespace(max_model_len=4096, kv_cache_gib=4.0, jit_mode="error",
                              side_by_side=False, jit_verbose=False, driver_cache="",
                              preset="turboquant_4bit_nc", stub=str(stub),
                              weight_scale=100.0)  # fmt: skip


@pytest.mark.parametrize("name", ["tq-ngram", "tq-draft", "tq-hybrid-mtp", "tq-moe-off"])
def test_a_rows_flags_parse_to_its_engine(
    tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm
    from vllm.platforms import current_platform

    from benchmarks.tqbench.inproc_mix import engine_args_of

    # vLLM's parser builds a DeviceConfig for its defaults: on this GPU-less host, as the
    # H200 worker would
    monkeypatch.setattr(current_platform, "device_type", "cuda")
    args = _args(tmp_path)
    row = serve_jit.prepare_row(args, name, tmp_path)
    flags = ["--model", str(row.model_dir), *engine_flags(args, row.kv, "error"), *row.extra]
    engine_args, dropped = engine_args_of(flags)
    monitor = tuple(int(x) for x in vllm.__version__.split(".")[:2]) >= (0, 25)
    assert dropped == ([] if monitor else ["--jit-monitor-mode"])
    assert engine_args.model == str(row.model_dir)
    assert engine_args.kv_cache_dtype == "turboquant_4bit_nc"
    assert engine_args.kv_cache_memory_bytes == 4 << 30
    assert engine_args.load_format == "dummy" and engine_args.skip_tokenizer_init
    assert engine_args.max_model_len == 4096
    spec = engine_args.speculative_config
    assert (json.loads(json.dumps(spec)) if spec else None) == row.spec
    if monitor:
        assert engine_args.jit_monitor_mode == "error"
    if serve_jit.ROWS[name].hybrid:
        assert engine_args.max_num_seqs == 32
    assert row.env["TQ_WARMUP_VLLM_KERNELS"] == ("0" if name.endswith("-off") else "1")
