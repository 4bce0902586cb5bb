"""``tq-warmup`` doctor, inspect and precompile."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import fakes
import pytest

from tq_warmup_plugin import compat
from tq_warmup_plugin.cli import commands as cli
from tq_warmup_plugin.cli import flags as cli_flags
from tq_warmup_plugin.cli import inputs as cli_inputs
from tq_warmup_plugin.cli import plans
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


def test_inspect_says_what_it_waits_for_on_a_terminal_only(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's import takes tens of seconds on a CPU: a terminal sees a line first."""
    assert cli.main(["inspect", *H200_FLAGS]) == 0
    assert capsys.readouterr().err == ""  # a pipe or a log: nothing
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert cli.main(["inspect", *H200_FLAGS]) == 0
    assert capsys.readouterr().err == "tq-warmup: importing vLLM to plan the keys ...\n"


def test_a_draft_model_without_a_local_config_is_said(capsys: pytest.CaptureFixture[str]) -> None:
    """Its own layers are not planned, and the plan says so instead of nothing."""
    spec = '{"method": "draft_model", "model": "org/drafter", "num_speculative_tokens": 3}'
    alone = inspect_json(capsys, *H200_FLAGS)
    planned = inspect_json(capsys, *H200_FLAGS, "--speculative-config", spec)
    assert "; draft model org/drafter: not planned, no local config.json" in str(planned["source"])
    assert "draft model" not in str(alone["source"])


def test_inspect_text_counts_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["inspect", *H200_FLAGS]) == 0
    text = capsys.readouterr().out
    assert text.startswith("6 distinct kernel keys for ")
    assert "\ncontinuation: 4\n" in text
    # decode 2, continuation 4, dequant 1, store 1: 8 lines for 6 keys, and it says so.
    by_path = re.findall(r"\n(\w+): (\d+)\n", text)
    listed = sum(int(n) for path, n in by_path if path != "first")
    assert listed == 8
    assert (
        text.splitlines()[1]
        == f"paths share keys: {listed} listed by path below, each compiled once"
    )


def test_inspect_refuses_unsupported_release(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["inspect", *H200_FLAGS[:-2], "--vllm-version", fakes.BEYOND_RELEASE]) == 2
    err = capsys.readouterr().err
    assert err == f"tq-warmup: {fakes.OUTSIDE}\n"


def test_a_reports_layers_are_counted(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["inspect", "--geometry-json", str(H200_REPORT)]) == 0
    assert capsys.readouterr().out.startswith("6 distinct kernel keys for 2 TurboQuant layers ")


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["-tp", "3"], "32 query heads do not divide over tensor parallel size 3"),
        (["-tp", "64"], "32 query heads do not divide over tensor parallel size 64"),
        (["-tp", "-2"], "argument --tensor-parallel-size/-tp: -2 is less than 1"),
        (["-tp", "0"], "argument --tensor-parallel-size/-tp: 0 is less than 1"),
        (["--max-model-len", "0"], "argument --max-model-len: 0 is less than 1"),
        (["--max-model-len", "-5"], "argument --max-model-len: -5 is less than 1"),
        (["--block-size", "0"], "argument --block-size: 0 is less than 1"),
        (["--kv-splits", "0"], "argument --kv-splits: 0 is less than 1"),
        (["--num-heads", "-32"], "argument --num-heads: -32 is less than 1"),
        (["--scale", "nan"], "argument --scale: nan is not a positive finite number"),
        (["--arch", "0"], "argument --arch: sm0 is not a target Triton compiles for"),
        (["--num-kv-heads", "5"], "32 query heads are not a multiple of 5 KV heads"),
        (
            ["--vllm-version", "0.19.0"],
            f"vLLM 0.19 is outside the supported releases {compat.SUPPORTED}",
        ),
    ],
)
def test_nonsense_flags_are_refused_in_one_line(
    argv: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = [
        *H200_FLAGS[:4],
        "--num-heads",
        "32",
        "--num-kv-heads",
        "8",
        "--vllm-version",
        "0.26.0",
    ]
    try:
        rc = cli.main(["inspect", *flags, *argv])
    except SystemExit as exc:  # argparse
        rc = exc.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"tq-warmup: {line}") and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("content", "line"),
    [
        (None, "no such file"),
        ("{", "not valid JSON"),
        ("[]", "not a tq-warmup report"),
        ('{"geometries": [{"head_size": 128}], "vllm_version": "0.26.0"}', "lacks block_size"),
    ],
)
def test_bad_geometry_json_is_one_line(
    content: str | None, line: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tmp_path / "report.json"
    if content is not None:
        file.write_text(content)
    assert cli.main(["inspect", "--geometry-json", str(file)]) == 2
    err = capsys.readouterr().err
    assert line in err and err.count("\n") == 1, err


def test_a_report_may_lack_any_field_with_a_default_and_only_those() -> None:
    """Reports written before a field existed, or that leave it at its default
    (``Geometry.to_dict``), still read: each defaulted field has a check of its own."""
    import dataclasses as dc

    from tq_warmup_plugin import compat, geometry

    defaulted = {f.name for f in dc.fields(Geometry) if f.default is not dc.MISSING}
    assert set(geometry._OPTIONAL) == defaulted
    assert set(geometry.LATER_FIELDS) <= defaulted
    plain = json.loads(H200_REPORT.read_text())["geometries"][0]
    feats = compat.features((0, 26))
    assert Geometry.from_report(plain, feats) == Geometry.from_dict(plain, feats)
    for name in sorted(set(plain) - defaulted):
        with pytest.raises(ValueError, match=f"lacks {name}"):
            Geometry.from_report({k: v for k, v in plain.items() if k != name}, feats)


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> Any:
    """doctor's GPU list, as the driver would give it."""
    from tq_warmup_plugin.cli import doctor

    def use(*names: str) -> None:
        monkeypatch.setattr(doctor, "_gpus", lambda: names)

    use("NVIDIA H200")
    return use


def rows_of(out: str) -> dict[str, list[str]]:
    rows: dict[str, list[str]] = {}
    for line in out.splitlines():
        key = line[:12].strip()
        if key and not line.startswith("tq-warmup:"):
            rows.setdefault(key, []).append(line[14:])
    return rows


def test_doctor_reports_versions_and_settings(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, gpu: Any
) -> None:
    monkeypatch.setenv("TQ_WARMUP", "0")
    monkeypatch.setenv("VLLM_PLUGINS", "other")
    assert cli.main(["doctor"]) == 1  # will not warm: a script can gate on it
    out = capsys.readouterr().out
    assert "enabled=off" in out and "VLLM_PLUGINS  other" in out
    assert "None" not in out and "False" not in out  # no Python repr for a person
    assert rows_of(out)["GPU"] == ["NVIDIA H200"]
    assert rows_of(out)["will warm"][0].startswith("no: ")


@pytest.mark.parametrize(
    ("vllm", "env", "step"),
    [
        (None, {}, f"install vLLM {compat.SUPPORTED} (none found): pip install vllm=="),
        (
            fakes.BEYOND_RELEASE,
            {},
            f"install vLLM {compat.SUPPORTED} (found {fakes.BEYOND_RELEASE}): pip install",
        ),
        ("0.26.0", {"TQ_WARMUP": "off"}, "unset TQ_WARMUP (it turns the plugin off)"),
        ("0.26.0", {"VLLM_PLUGINS": "other"}, "add tq_warmup to VLLM_PLUGINS, or unset it"),
    ],
)
def test_doctor_says_the_next_step_when_the_plugin_will_not_warm(
    vllm: str | None,
    env: dict[str, str],
    step: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    gpu: Any,
) -> None:
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: vllm)
    monkeypatch.setattr(cli, "_entry_point_visible", lambda: True)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["doctor"]) == 1
    rows = rows_of(capsys.readouterr().out)
    assert rows["will warm"][0].startswith("no: ")
    assert rows["next step"][0].startswith(step) and "then" not in rows


def test_doctor_names_what_a_newer_release_leaves_unguarded(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, gpu: Any
) -> None:
    """A release after ``NEWEST``: the wrong tokens the guards prevent on the releases
    the plugin knows, and the flags that avoid them; a supported one has no such row."""
    monkeypatch.setattr(cli, "_entry_point_visible", lambda: True)
    for version, row in ((fakes.BEYOND_RELEASE, True), ("0.26.0", False)):
        monkeypatch.setattr(compat, "installed_vllm_version", lambda v=version: v)
        cli.main(["doctor"])
        rows = rows_of(capsys.readouterr().out)
        assert ("unguarded" in rows) is row
        if row:
            text = " ".join(rows["unguarded"])
            assert "#46460" in text and "--no-enable-prefix-caching" in text
            assert "PIECEWISE" in text


def test_doctor_on_a_cpu_host_names_the_cpu_recipe_and_exits_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, gpu: Any
) -> None:
    """No GPU, no vLLM: it will not warm, says why, and names CI's CPU recipe, which is
    in the checkout, then the GPU host; ``--json`` says the same to a machine."""
    gpu()
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: None)
    monkeypatch.setattr(cli, "_entry_point_visible", lambda: True)
    assert cli.main(["doctor"]) == 1
    rows = rows_of(capsys.readouterr().out)
    assert rows["GPU"] == ["none found"] and "no GPU" in rows["will warm"][0]
    recipe = rows["next step"][0]
    # the README's own recipe, word for word: one recommended release
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    step = f"bash .ci/vllm-env.sh {compat.RECOMMENDED} {compat.RECOMMENDED_TRITON} .venv-vllm"
    assert step in recipe and step in readme
    assert (Path(__file__).parents[1] / ".ci" / "vllm-env.sh").is_file()
    assert rows["then"] == ["serve on a GPU host: the plugin warms vLLM's GPU workers"]
    assert cli.main(["doctor", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["will_warm"] is False and data["next_steps"][0] == recipe
    assert data["rows"]["GPU"] == "none found"


def test_doctor_says_no_next_step_when_the_plugin_will_warm(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, gpu: Any
) -> None:
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "0.26.0")
    monkeypatch.setattr(cli, "_entry_point_visible", lambda: True)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.delenv("TQ_WARMUP", raising=False)
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1].split() == ["will", "warm", "yes"] and "next step" not in out
    assert cli.main(["doctor", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["will_warm"] is True


def test_a_model_file_of_another_name_is_read_from_a_directory_removed_after(
    tmp_path: Path,
) -> None:
    file = tmp_path / "llama.json"
    file.write_text('{"model_type": "llama"}')
    with cli_inputs.model_dir(str(file)) as directory:
        copied = Path(directory) / "config.json"
        assert directory != str(tmp_path) and json.loads(copied.read_text()) == {
            "model_type": "llama"
        }
    assert not Path(directory).exists()
    (tmp_path / "config.json").write_text("{}")
    with cli_inputs.model_dir(str(tmp_path)) as directory:
        assert directory == str(tmp_path)
    assert tmp_path.is_dir()


def test_doctor_prints_the_settings_problems(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TQ_WARMUP_LAUNCH", "maybe")
    assert cli.main(["doctor"]) in (0, 1)  # whether it warms depends on this host
    assert "tq-warmup: TQ_WARMUP_LAUNCH='maybe' is not one of" in capsys.readouterr().out


def test_effective_block_size_rule() -> None:
    from tq_warmup_plugin import compat
    from tq_warmup_plugin.plan import rules as plan_rules

    # turboquant_4bit_nc, head size 128: a packed slot of 134 bytes a KV head (0.28+)
    packed, uint8, old = (compat.features(v) for v in ((0, 34), (0, 26), (0, 24)))
    rule = plan_rules.effective_block_size
    assert [rule(uint8, b, 2, 128, 134) for b in (16, 32, 64, 128)] == [32, 32, 64, 128]
    assert rule(uint8, 16, 4, 128, 134) == 64
    assert [rule(packed, b, 2, 128, 134) for b in (16, 32, 64, 128)] == [64, 64, 64, 128]
    assert rule(packed, 16, 2, 128, 196) == 48  # turboquant_k8v4
    assert rule(packed, 16, 2, 128, 512) == 16  # equal pages: the requested block
    assert rule(old, 16, 2, 128, 134) == 16


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
    (manifest_file,) = tmp_path.glob("tq-warmup-manifest-*.json")
    manifest = json.loads(manifest_file.read_text())
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

    from tq_warmup_plugin.shipped.precompile import triton_key_of

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
        # the fp32 rotations: powers of two up to 512 tokens x 8 KV heads
        *(f"gemm float32 {2**k}x128" for k in range(13)),
        # the key un-rotation: 8 KV heads x cached 1, 8, 64, 512, 4096 - 129 tokens, and
        # each multiple of the 512-token chunk budget a fresh prompt's chunks cache
        "gemm float16 8x128",
        "gemm float16 64x128",
        "gemm float16 512x128",
        *(f"gemm float16 {8 * 512 * k}x128" for k in range(1, 8)),
        "gemm float16 31736x128",
        "attention bfloat16 512x512 (heads 16/8, d=128)",
        "attention bfloat16 512x1024 (heads 16/8, d=128)",
        "paged_decode bfloat16 1x2048 (heads 16/8, d=128)",
    ]


@pytest.fixture
def stubbed_precompile(monkeypatch: pytest.MonkeyPatch) -> fakes.RecordingWarmer:
    """precompile without vLLM or Triton: vLLM 0.26.0 and Triton 3.6.0 'installed', the
    fake warmer compiling."""
    from tq_warmup_plugin import compat
    from tq_warmup_plugin.shipped import manifest, precompile
    from tq_warmup_plugin.worker import keyplan, warmup

    warmer = fakes.RecordingWarmer()
    for var in ("TRITON_CACHE_DIR", "CUDA_VISIBLE_DEVICES"):  # precompile sets both
        monkeypatch.setenv(var, "")
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "0.26.0")
    monkeypatch.setattr(compat, "distribution_version", lambda name: "3.6.0")
    monkeypatch.setattr(
        manifest, "installed_stack", lambda arch=None: dataclasses.replace(fakes.STACK, arch=arch)
    )
    monkeypatch.setattr(precompile, "use_compile_only_target", lambda arch: None)
    monkeypatch.setattr(warmup, "plugin_manager", lambda: fakes.manager(warmer))
    monkeypatch.setattr(keyplan, "CompileCounter", fakes.StubCounter)
    return warmer


def test_precompile_reports_failures_with_the_workers_error_lines(
    tmp_path: Path, stubbed_precompile: fakes.RecordingWarmer, capsys: pytest.CaptureFixture[str]
) -> None:
    """precompile compiles through the worker's path: a failure is the worker's line."""
    from tq_warmup_plugin.worker import warmup

    assert cli.main(["precompile", *H200_FLAGS[:-2], "--cache-dir", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert "6 keys for sm90" in out and "3 built, 4 already there, 1 failed" in out
    failed = [k for k in stubbed_precompile.seen if k.kernel == fakes.FAILING][:1]
    worker_lines = warmup.compile_all(fakes.manager(fakes.RecordingWarmer()), failed, 1)
    assert worker_lines == ["_tq_full_dequant_kv: RuntimeError: ptxas died"]
    assert err.splitlines() == [f"  failed: {line}" for line in worker_lines]


def test_one_manifest_per_plan(
    tmp_path: Path, stubbed_precompile: fakes.RecordingWarmer, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = [*H200_FLAGS[:-2], "--cache-dir", str(tmp_path), "--image-vllm", "v0.26.0"]
    for extra in ([], ["--arch", "80"], [], ["--dtype", "float16"]):
        cli.main(["precompile", *flags, *extra])
    manifests = [json.loads(p.read_text()) for p in tmp_path.glob("tq-warmup-manifest-*.json")]
    assert sorted((m["arch"], m["geometries"][0]["model_dtype"]) for m in manifests) == [
        (80, "bfloat16"),
        (90, "bfloat16"),
        (90, "float16"),
    ]
    # no temporary file or stage left behind (the lock file stays)
    assert [p.name for p in tmp_path.glob(".tq-warmup*")] == [".tq-warmup.lock"]
    out = capsys.readouterr().out
    assert "(compile " in out and " s in all with the vLLM import;" in out


def test_precompile_counts_kernels_as_verify_does(
    tmp_path: Path,
    stubbed_precompile: fakes.RecordingWarmer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """precompile's keys and jobs are not what verify counts: both name the manifest's
    kernels and files, the same numbers."""
    from tq_warmup_plugin import compat

    def two_launchers(root: str) -> set[str]:  # the stub compiles nothing: two key dirs
        for name in ("A" * 52, "B" * 52):
            (Path(root) / name).mkdir(exist_ok=True)
            (Path(root) / name / f"{compat.LAUNCHER_NAME}.so").write_bytes(b"elf")
        return {"A" * 52, "B" * 52}

    monkeypatch.setattr(compat, "launcher_dirs", two_launchers)
    counted = re.compile(r"(\d+) kernels, (\d+) files")
    cli.main(["precompile", *H200_FLAGS[:-2], "--cache-dir", str(tmp_path)])
    built = counted.findall(capsys.readouterr().out)
    cli.main(["verify", "--cache-dir", str(tmp_path)])
    checked = counted.findall(capsys.readouterr().out)
    assert built == checked == [("2", "2")]


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["--vllm-version", "0.33.0"],
            "refusing: --vllm-version 0.33.0 but vLLM 0.26.0 is installed",
        ),
        (
            ["--image-vllm", "0.33.0"],
            "refusing: the image runs vllm 0.33.0 but 0.26.0 is installed",
        ),
        (["--image-triton", "3.8.0"], "refusing: the image runs triton 3.8.0 but 3.6.0"),
        (["--image-triton-wheel", "/nonexistent/triton-3.6.0-cp312.whl"], "no such file"),
        (["--image-triton-wheel", "WHEEL:odd.whl"], "not a Triton wheel name"),
        (["--image-triton-wheel", "WHEEL:triton-3.6.0-cp312-cp312-linux.whl"], "not a readable"),
        (["--geometry-json", "REPORT033"], "comes from vLLM 0.33.0 but vLLM 0.26.0 is installed"),
        (["--cache-dir", "FILE"], "exists and is not a directory"),
    ],
)
def test_precompile_refuses_in_one_line(
    argv: list[str],
    line: str,
    tmp_path: Path,
    stubbed_precompile: fakes.RecordingWarmer,
    capsys: pytest.CaptureFixture[str],
) -> None:
    report = json.loads(H200_REPORT.read_text())
    (tmp_path / "r.json").write_text(json.dumps({**report, "vllm_version": "0.33.0"}))
    (tmp_path / "file").write_text("")
    args = []
    for arg in argv:
        if arg.startswith("WHEEL:"):
            arg = str(tmp_path / arg.removeprefix("WHEEL:"))
            Path(arg).write_text("not a zip")
        args.append(
            {"REPORT033": str(tmp_path / "r.json"), "FILE": str(tmp_path / "file")}.get(arg, arg)
        )
    geometry = [] if "--geometry-json" in args else H200_FLAGS[:-2]  # the report is it
    flags = [*geometry, "--cache-dir", str(tmp_path / "cache"), *args]
    assert cli.main(["precompile", *flags]) == 2
    err = capsys.readouterr().err
    assert line in err and err.count("\n") == 1, err
    assert not stubbed_precompile.seen  # refused before compiling anything
    assert not (tmp_path / "cache").exists()  # and before creating anything


def test_a_refused_plan_creates_no_cache_dir(
    tmp_path: Path,
    stubbed_precompile: fakes.RecordingWarmer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The plan comes after --cache-dir is checked; refusing it leaves no directory."""

    def refused(args: object) -> None:
        raise cli.CliError("--model nowhere: no config.json")

    monkeypatch.setattr(plans, "geometries", refused)
    cache = tmp_path / "new" / "cache"
    assert cli.main(["precompile", *H200_FLAGS[:-2], "--cache-dir", str(cache)]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert not (tmp_path / "new").exists() and list(tmp_path.iterdir()) == []


def test_an_unwritable_cache_dir_is_refused_before_the_plan(
    tmp_path: Path, stubbed_precompile: fakes.RecordingWarmer, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("")
    cache = tmp_path / "file" / "cache"  # under a file: nothing can create it
    assert cli.main(["precompile", *H200_FLAGS[:-2], "--cache-dir", str(cache)]) == 2
    assert "not writable" in capsys.readouterr().err and not stubbed_precompile.seen


def test_an_image_wheel_sets_the_manifests_triton_build_and_python_abi(
    tmp_path: Path, stubbed_precompile: fakes.RecordingWarmer
) -> None:
    import zipfile

    from tq_warmup_plugin.shipped import manifest, precompile

    wheel = tmp_path / "triton-3.6.0-cp312-cp312-manylinux_2_27_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("triton/runtime/cache.py", "")
    target = precompile.target_stack(90, str(wheel), "the wheel's triton_key()")
    assert target == dataclasses.replace(
        fakes.STACK,
        arch=90,
        python_abi="cp312",
        triton_build=manifest.digest("the wheel's triton_key()"),
    )
    assert precompile.target_stack(80, None, None) == dataclasses.replace(fakes.STACK, arch=80)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ({}, None),
        ({"installed": {"vllm": None, "triton": "3.6.0"}}, "vllm not installed"),
        ({"image_vllm": "0.22.0"}, "the image runs vllm 0.22.0 but 0.26.0 is installed"),
        ({"image_triton": "3.7.1"}, "the image runs triton 3.7.1 but 3.6.0"),
        ({"image_triton": "3.6.0", "wheel": "3.7.1"}, "but the wheel is Triton 3.7.1"),
        ({"wheel": "3.7.1"}, "the image runs triton 3.7.1"),
        ({"vllm_version": "0.30.0"}, "--vllm-version 0.30.0 but vLLM 0.26.0 is installed"),
        ({"report": ("r.json", "0.26.0", True)}, "comes from a ROCm (HIP) startup"),
        ({"report": ("r.json", "0.22.0", False)}, "comes from vLLM 0.22.0 but vLLM 0.26.0"),
        ({"report": ("r.json", "0.26.0", False), "image_vllm": "0.26"}, None),
    ],
)
def test_precompile_refuses_what_the_image_cannot_use(
    args: dict[str, Any], expected: str | None
) -> None:
    from tq_warmup_plugin.shipped.precompile import refusal

    installed = args.get("installed", {"vllm": "0.26.0", "triton": "3.6.0"})
    found = refusal(
        installed,
        args.get("image_vllm"),
        args.get("image_triton"),
        args.get("wheel"),
        args.get("vllm_version"),
        args.get("report"),
    )
    assert found == expected if expected is None else found is not None and expected in found


@pytest.mark.parametrize("text", ["90", "sm90", "sm_90", "9.0", " 90 "])
def test_arch_accepts_a_compute_capability_or_an_sm_name(text: str) -> None:
    assert cli_flags.arch(text) == 90


def test_geometry_json_beside_a_flag_it_would_ignore_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / "r.json"
    report.write_text("{}")
    argv = ["inspect", "--geometry-json", str(report), "--kv-cache-dtype", "turboquant_4bit_nc"]
    assert cli.main([*argv, "--vllm-version=0.26.0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--kv-cache-dtype, --vllm-version: drop them" in err


def test_a_reader_that_goes_away_is_no_traceback() -> None:
    """``tq-warmup doctor | head -0`` (or a closed pipe), in a real process: exit 2 and
    one line, as every way the CLI cannot do what was asked (issue 53; it was exit 141,
    as a shell reports SIGPIPE, and nothing said), and nothing from the interpreter's
    own flush at exit."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tq_warmup_plugin.cli", "doctor"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
            timeout=120,
        )
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (
        2,
        "tq-warmup: doctor: standard output was closed before the answer was printed\n",
    )


@pytest.mark.parametrize(
    ("name", "line"),
    [("odd.whl", "not a Triton wheel name"), ("triton-3.6.0-cp312-cp312-linux.whl", "readable")],
)
def test_verify_refuses_a_bad_image_wheel_in_one_line(
    name: str, line: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wheel = tmp_path / name
    wheel.write_text("not a zip")
    rc = cli.main(["verify", "--cache-dir", str(tmp_path), "--image-triton-wheel", str(wheel)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and line in err, err
