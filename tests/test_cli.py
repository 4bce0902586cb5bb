"""``tq-warmup`` doctor, inspect and precompile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import fakes
import pytest

from tq_warmup_plugin import cli
from tq_warmup_plugin.geometry import Geometry

DATA = Path(__file__).parent / "data"
# The geometry vLLM 0.26.0 discovered on an H200 for this benchmark model (TQ_WARMUP_REPORT).
H200_REPORT = DATA / "h200-vllm0.26.0-4bit-report.json"
H200_FLAGS = [
    "--kv-cache-dtype",
    "turboquant_4bit_nc",
    "--head-size",
    "128",
    "--num-heads",
    "16",
    "--num-kv-heads",
    "8",
    "--max-model-len",
    "4096",
    "--max-num-seqs",
    "32",
    "--max-num-batched-tokens",
    "512",
    "--dtype",
    "bfloat16",
    "--vllm-version",
    "0.26.0",
]


def inspect_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    assert cli.main(["inspect", *argv, "--json"]) == 0
    out: dict[str, object] = json.loads(capsys.readouterr().out)
    return out


def test_inspect_plans_what_the_h200_startup_discovered(capsys: pytest.CaptureFixture[str]) -> None:
    planned = inspect_json(capsys, *H200_FLAGS)
    discovered = json.loads(H200_REPORT.read_text())
    assert planned["geometry"] == discovered["geometries"][0]
    assert planned["distinct"] == discovered["distinct"]
    from_report = inspect_json(capsys, "--geometry-json", str(H200_REPORT))
    assert from_report["paths"] == planned["paths"]


def test_inspect_reads_a_model_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "hidden_size": 4096,
                "num_hidden_layers": 32,
                "max_position_embeddings": 8192,
                "torch_dtype": "float16",
            }
        )
    )
    out = inspect_json(
        capsys,
        "--model",
        str(tmp_path),
        "--kv-cache-dtype",
        "turboquant_k8v4",
        "-tp",
        "2",
        "--vllm-version",
        "0.33.0",
    )
    geometry = out["geometry"]
    assert isinstance(geometry, dict)
    assert (geometry["head_size"], geometry["num_heads"], geometry["num_kv_heads"]) == (128, 16, 4)
    assert geometry["model_dtype"] == "float16" and geometry["max_model_len"] == 8192
    assert out["turboquant_layers"] == 28
    paths = out["paths"]
    assert isinstance(paths, dict) and set(paths) == {"decode", "continuation", "dequant", "store"}
    assert all("_tq_fused_store_fp8" in k for k in paths["store"])


def test_inspect_text_counts_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["inspect", *H200_FLAGS]) == 0
    text = capsys.readouterr().out
    assert text.startswith("6 distinct kernel keys for ")
    assert "\ncontinuation: 4\n" in text


def test_inspect_refuses_unsupported_release() -> None:
    with pytest.raises(SystemExit, match="outside the supported releases"):
        cli.main(["inspect", *H200_FLAGS[:-2], "--vllm-version", "0.34.0"])


def test_doctor_reports_versions_and_settings(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TQ_WARMUP", "0")
    monkeypatch.setenv("VLLM_PLUGINS", "other")
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "enabled=False" in out and "VLLM_PLUGINS  other" in out
    assert out.rstrip().endswith("will warm     no")


def test_effective_block_size_rule() -> None:
    from tq_warmup_plugin import compat

    new, old = compat.features((0, 26)), compat.features((0, 24))
    assert [compat.effective_block_size(new, b, 2) for b in (16, 32, 64, 128)] == [32, 32, 64, 128]
    assert compat.effective_block_size(new, 16, 4) == 64
    assert compat.effective_block_size(old, 16, 2) == 16


@pytest.mark.real_vllm
def test_precompile_builds_sm90_cubins(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # As many keys as inspect plans for the installed release (6 from 0.21 on, 4 in 0.20).
    n = inspect_json(capsys, *H200_FLAGS[:-2])["distinct"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    cmd = [
        sys.executable,
        "-m",
        "tq_warmup_plugin.cli",
        "precompile",
        *H200_FLAGS[:-2],
        "--cache-dir",
        str(tmp_path),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"{n} keys for sm90" in done.stdout
    assert f"{n} built, 0 already there, 0 failed" in done.stdout
    cubins = {p.stem for p in tmp_path.rglob("*.cubin")}
    assert cubins == {
        "_tq_decode_stage1",
        "_fwd_kernel_stage2",
        "_tq_full_dequant_kv",
        "_tq_fused_store_mse",
    }
    again = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert f"0 built, {n} already there" in again.stdout
    manifest = json.loads((tmp_path / "tq-warmup-manifest-turboquant_4bit_nc.json").read_text())
    assert len(manifest["keys"]) == n and manifest["arch"] == 90


@pytest.mark.real_vllm
def test_precompile_refuses_another_release(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "tq_warmup_plugin.cli",
        "precompile",
        *H200_FLAGS[:-2],
        "--cache-dir",
        str(tmp_path),
        "--image-vllm",
        "0.19.0",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 2 and "refusing: the image runs vllm 0.19.0" in done.stderr


@pytest.mark.real_vllm
def test_triton_key_of_an_installation_is_tritons_own() -> None:
    import site

    from triton.runtime.cache import triton_key

    from tq_warmup_plugin.precompile import triton_key_of

    roots = [p for p in site.getsitepackages() if (Path(p) / "triton").is_dir()]
    assert triton_key_of(roots[0]) == triton_key()


def test_geometry_round_trips_through_the_report() -> None:
    from tq_warmup_plugin import compat

    data = json.loads(H200_REPORT.read_text())["geometries"][0]
    g = Geometry.from_dict(data, compat.features((0, 26)))
    assert g.to_dict() == {**data, "kv_strides": tuple(data["kv_strides"])}


def test_inspect_lists_the_first_launches(capsys: pytest.CaptureFixture[str]) -> None:
    out = inspect_json(capsys, *H200_FLAGS)
    assert out["launches"] == [
        "gemm float32 16x128",
        "gemm float32 512x128",
        # the key un-rotation: 8 KV heads x cached 1, 8, 64, 512 and 4096 - 129 tokens
        "gemm float16 8x128",
        "gemm float16 64x128",
        "gemm float16 512x128",
        "gemm float16 4096x128",
        "gemm float16 31736x128",
        "attention bfloat16 512x512 (heads 16/8, d=128)",
        "attention bfloat16 512x1024 (heads 16/8, d=128)",
        "paged_decode bfloat16 1x2048 (heads 16/8, d=128)",
    ]


def test_precompile_reports_failures_with_the_workers_error_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """precompile compiles through the worker's path: a failure is the worker's line."""
    from tq_warmup_plugin import compat, precompile, warmup

    warmer = fakes.RecordingWarmer()
    for var in ("TRITON_CACHE_DIR", "CUDA_VISIBLE_DEVICES"):  # precompile sets both
        monkeypatch.setenv(var, "")
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "0.26.0")
    monkeypatch.setattr(precompile, "use_compile_only_target", lambda arch: None)
    monkeypatch.setattr(warmup, "plugin_manager", lambda: fakes.manager(warmer))
    monkeypatch.setattr(warmup, "CompileCounter", fakes.StubCounter)
    assert cli.main(["precompile", *H200_FLAGS[:-2], "--cache-dir", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert "6 keys for sm90" in out and "3 built, 4 already there, 1 failed" in out
    failed = [k for k in warmer.seen if k.kernel == fakes.FAILING][:1]
    worker_lines = warmup.compile_all(fakes.manager(fakes.RecordingWarmer()), failed, 1)
    assert worker_lines == ["_tq_full_dequant_kv: RuntimeError: ptxas died"]
    assert err.splitlines() == [f"  failed: {line}" for line in worker_lines]
