"""The shipped driver cache's entries: manifest, node facts from /proc, match, hostile
files, verify, copy and atomic install (no GPU: the cache files are stand-ins; what the
driver writes is the GPU proof's, ``benchmarks/tqbench/driver_cache_proof.py``)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import fakes
import pytest

from tq_warmup_plugin.cli import commands as cli
from tq_warmup_plugin.driver import entry as dc
from tq_warmup_plugin.driver import host
from tq_warmup_plugin.driver import verify as driver_verify
from tq_warmup_plugin.driver.entry import DriverManifest, EntryError, Node
from tq_warmup_plugin.worker import launches

NVRM = (
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build  "
    "(dvs-builder@U16-I3-B03-4-3)  Thu Jan 16 07:39:21 UTC 2025\nGCC version:  gcc 12.3.0\n"
)
FA2 = b"\x7fELF fa2 library stand-in"


def fake_proc(root: Path, nvrm: str = NVRM, gpus: tuple[str, ...] = ("NVIDIA H200",)) -> Path:
    base = root / "proc" / "driver" / "nvidia"
    base.mkdir(parents=True)
    (base / "version").write_text(nvrm)
    for i, name in enumerate(gpus):
        info = base / "gpus" / f"0000:{i:02x}:00.0" / "information"
        info.parent.mkdir(parents=True)
        info.write_text(f"Model: \t\t {name}\nIRQ:   \t\t 34\nBus Type: \t PCIe\n")
    return root / "proc"


def make_entry(root: Path, files: dict[str, bytes] | None = None, **fields: object) -> Path:
    """An entry as the build writes it, with real hashes of stand-in cache files."""
    files = {"index": b"idx", "ab/cd/1234": b"sass" * 100} if files is None else files
    entry = root / str(fields.pop("key", "NVIDIA_H200-570.86.15-fa2-x"))
    for name, data in files.items():
        (entry / dc.CACHE_DIR / name).parent.mkdir(parents=True, exist_ok=True)
        (entry / dc.CACHE_DIR / name).write_bytes(data)
    listed = {n: (hashlib.sha256(d).hexdigest(), len(d)) for n, d in files.items()}
    values: dict[str, object] = {
        "driver": "570.86.15",
        "gpu": "NVIDIA H200",
        "fa2_sha256": hashlib.sha256(FA2).hexdigest(),
        "fa2_size": len(FA2),
        "files": listed,
        "compute_capability": "9.0",
        "launches": ("attention bfloat16 512x512",),
        **fields,
    }
    (entry / dc.MANIFEST).write_text(DriverManifest(**values).to_json())  # type: ignore[arg-type]
    return entry


def test_the_manifest_round_trips(tmp_path: Path) -> None:
    entry = make_entry(tmp_path)
    shipped = dc.read(entry)
    assert shipped.driver == "570.86.15" and shipped.gpu == "NVIDIA H200"
    assert shipped.files["ab/cd/1234"] == (hashlib.sha256(b"sass" * 100).hexdigest(), 400)
    assert shipped.size == 403 and shipped.launches == ("attention bfloat16 512x512",)
    assert dc.parse(shipped.to_json()) == shipped
    assert dc.file_problems(entry, shipped) == []


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(kind="other"), "not a tq-warmup-driver-cache manifest"),
        (lambda d: d.update(schema=2), "schema 2, this tq-warmup reads 1"),
        (lambda d: d.update(driver=5), "driver 5 is not a string"),
        (lambda d: d.update(fa2_sha256="abc"), "fa2_sha256 is not a sha256"),
        (lambda d: d.update(fa2_size=-1), "fa2_size -1 is not a size"),
        (lambda d: d["files"].update({"../x": d["files"]["index"]}), "files['../x']"),
        (lambda d: d["files"].update({"/etc/x": d["files"]["index"]}), "files['/etc/x']"),
        (lambda d: d["files"]["index"].update(size=True), "files['index'].size True"),
        (lambda d: d.update(launches="x"), "launches is not a list of strings"),
    ],
)
def test_a_bad_field_is_one_line(tmp_path: Path, change: object, message: str) -> None:
    data = json.loads((make_entry(tmp_path) / dc.MANIFEST).read_text())
    change(data)  # type: ignore[operator]
    with pytest.raises(EntryError) as raised:
        dc.parse(json.dumps(data))
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_hostile_manifests_cost_one_line(tmp_path: Path) -> None:
    entry = make_entry(tmp_path)
    manifest = entry / dc.MANIFEST
    good = manifest.read_text()
    manifest.write_text("[" * 100_000 + "]" * 100_000)  # deep: RecursionError in json
    with pytest.raises(EntryError, match="nested too deeply"):
        dc.read(entry)
    manifest.write_bytes(b" " * (dc.MAX_MANIFEST_BYTES + 1))
    with pytest.raises(EntryError, match="more than the"):
        dc.read(entry)
    manifest.unlink()
    os.mkfifo(manifest)  # would block an open() without O_NONBLOCK
    with pytest.raises(EntryError, match="a FIFO"):
        dc.read(entry)
    manifest.unlink()
    (tmp_path / "elsewhere.json").write_text(good)
    manifest.symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(EntryError, match="a symlink"):
        dc.read(entry)


def test_file_problems_name_each_file_the_driver_would_load_unvouched(tmp_path: Path) -> None:
    entry = make_entry(tmp_path)
    shipped = dc.read(entry)
    cache = entry / dc.CACHE_DIR
    (cache / "index").write_bytes(b"IDX")  # same size, other content
    (cache / "planted").write_bytes(b"x")
    (tmp_path / "outside").write_bytes(b"sass" * 100)
    (cache / "ab/cd/1234").unlink()
    (cache / "ab/cd/1234").symlink_to(tmp_path / "outside")
    os.mkfifo(cache / "fifo")
    problems = dc.file_problems(entry, shipped)
    assert problems == [
        "cache/ab/cd/1234: not a plain file (a symlink, or too deep)",
        "cache/fifo: not a plain file (a symlink, or too deep)",
        "cache/planted: not in the manifest",
        "cache/ab/cd/1234: listed by the manifest, no such file",
        f"cache/index: the manifest says sha256 {hashlib.sha256(b'idx').hexdigest()[:12]}, "
        f"found {hashlib.sha256(b'IDX').hexdigest()[:12]}",
    ]


def test_the_node_is_read_from_proc_without_cuda(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, gpus=("NVIDIA H200", "NVIDIA H200"))
    (tmp_path / "fa2.so").write_bytes(FA2)
    node = host.read_node(proc, tmp_path / "fa2.so")
    assert node == Node("570.86.15", ("NVIDIA H200", "NVIDIA H200"), len(FA2), None)
    hashed = host.read_node(proc, tmp_path / "fa2.so", hash_fa2=True)
    assert hashed.fa2_sha256 == hashlib.sha256(FA2).hexdigest()
    old = (
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
    )
    assert host.read_node(fake_proc(tmp_path / "b", old, ())).driver == "550.54.15"
    assert host.read_node(tmp_path / "no-proc") == Node()


def test_match_names_each_difference_and_what_it_cannot_know(tmp_path: Path) -> None:
    shipped = dc.read(make_entry(tmp_path))
    same = Node("570.86.15", ("NVIDIA  h200",), len(FA2))
    assert host.match(shipped, same) == []
    other = Node("580.95.05", ("NVIDIA H100 80GB HBM3", "NVIDIA H200"), len(FA2) + 1, "0" * 64)
    assert host.match(shipped, other) == [
        "driver: the manifest says 570.86.15, found 580.95.05",
        "gpu: the manifest says NVIDIA H200, found NVIDIA H100 80GB HBM3, NVIDIA H200",
        f"fa2 library size: the manifest says {len(FA2)}, found {len(FA2) + 1}",
        f"fa2 library sha256: the manifest says {shipped.fa2_sha256[:12]}, found 000000000000",
    ]
    assert host.match(shipped, Node(fa2_size=len(FA2)), strict=False) == []
    assert host.match(shipped, Node(fa2_size=len(FA2))) == [
        "driver: the manifest says 570.86.15, not known here",
        "gpu: the manifest says NVIDIA H200, not known here",
    ]


def test_copy_hashes_what_it_copies_and_copies_only_what_is_listed(tmp_path: Path) -> None:
    entry = make_entry(tmp_path / "layer")
    (entry / dc.CACHE_DIR / "planted").write_bytes(b"x")
    shipped = dc.read(entry)
    dc.copy_entry(entry, shipped, tmp_path / "copy")
    assert sorted(
        str(p.relative_to(tmp_path / "copy")) for p in (tmp_path / "copy").rglob("*")
    ) == [
        "ab",
        "ab/cd",
        "ab/cd/1234",
        "index",
    ]
    (entry / dc.CACHE_DIR / "index").write_bytes(b"IDX")
    with pytest.raises(EntryError, match=r"cache/index: sha256 .*, the manifest says"):
        dc.copy_entry(entry, shipped, tmp_path / "copy2")


def test_install_replaces_an_entry_in_one_rename(tmp_path: Path) -> None:
    root = tmp_path / dc.DRIVER_DIR
    old = make_entry(root, {"index": b"old"}, key="k")
    staged = dc.stage(root)
    (staged / "marker").write_text("new")
    assert dc.install(staged, old) == old
    assert (old / "marker").read_text() == "new" and not staged.exists()
    assert [p.name for p in root.iterdir()] == ["k"]  # the replaced one is gone
    assert dc.entries(root) == [old]


def test_entries_skip_stages_symlinks_and_files(tmp_path: Path) -> None:
    root = tmp_path / dc.DRIVER_DIR
    real = make_entry(root, key="b")
    dc.stage(root)
    (root / "a-link").symlink_to(real)
    (root / "c-file").write_text("x")
    assert dc.entries(root) == [real]
    assert dc.entries(tmp_path / "none") == []


def test_verify_layer_checks_files_and_the_node(tmp_path: Path) -> None:
    assert driver_verify.verify_layer(tmp_path, Node()) is None
    root = tmp_path / dc.DRIVER_DIR
    make_entry(root)
    make_entry(root, key="h100", gpu="NVIDIA H100 80GB HBM3")
    here = Node("570.86.15", ("NVIDIA H200",), len(FA2))
    assert driver_verify.verify_layer(tmp_path, here) == (
        f"tq-warmup: {root}: 2 driver cache entries, 4 files: 0 problems; "
        "1 for another GPU or driver",
        [],
    )
    summary, problems = driver_verify.verify_layer(tmp_path, Node()) or ("", [])
    assert problems == [] and summary.endswith("not checked (not known here): driver, gpu")
    newer = Node("580.95.05", ("NVIDIA H200",), len(FA2))
    _, problems = driver_verify.verify_layer(tmp_path, newer) or ("", [])
    assert problems == [
        "driver-cache/NVIDIA_H200-570.86.15-fa2-x: driver: the manifest says 570.86.15, "
        "found 580.95.05",
        "driver-cache/h100: driver: the manifest says 570.86.15, found 580.95.05",
        "driver-cache/h100: gpu: the manifest says NVIDIA H100 80GB HBM3, found NVIDIA H200",
    ]
    (root / "h100" / dc.MANIFEST).write_text("{")
    _, problems = driver_verify.verify_layer(tmp_path, here) or ("", [])
    assert problems[0].startswith("driver-cache/h100: not a usable manifest: not JSON")


def test_entry_keys_are_simple_names() -> None:
    key = dc.entry_key("570.86.15", "NVIDIA H100 80GB HBM3", "869c73f37150" + "0" * 52)
    assert key == "NVIDIA_H100_80GB_HBM3-570.86.15-fa2-869c73f37150"
    assert "/" not in dc.entry_key("1/../2", "../../x", "0" * 64)


def test_the_driver_plan_is_the_fa2_launches_and_the_boundary_prefill() -> None:
    g = fakes.geometry(batched=512, max_model_len=4096)
    heads = {"b": (8, 2, 128)}
    todo = launches.driver_plan({"l0": g}, heads)
    assert [x.label for x in todo] == [
        "attention bfloat16 512x512",
        "attention bfloat16 512x1024",
        "paged_decode bfloat16 1x2048",
        "paged_prefill bfloat16 512x512",
    ]
    assert all(x.kind != "gemm" for x in todo)
    assert launches.driver_plan({}, heads) == {}


def test_verify_checks_a_layer_of_driver_cache_entries(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "fa2.so").write_bytes(FA2)  # this machine's FA2 library: the one built with
    monkeypatch.setattr(host, "fa2_library", lambda: tmp_path / "fa2.so")
    entry = make_entry(tmp_path / dc.DRIVER_DIR)
    assert cli.main(["verify", "--cache-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith(f"tq-warmup: {tmp_path / dc.DRIVER_DIR}: 1 driver")
    (entry / dc.CACHE_DIR / "index").write_bytes(b"IDX")
    assert cli.main(["verify", "--cache-dir", str(tmp_path)]) == 1
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"driver-cache/{entry.name}: cache/index: the manifest says sha256")


def test_verify_prints_the_pin_of_a_layer_of_driver_cache_entries_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A layer that holds only ``driver-cache/`` (what ``tq-warmup driver-cache`` builds)
    gets its pin too: on the H200 (0.26.0, 2026-12-02) ``verify --print-pin`` printed none."""
    from tq_warmup_plugin.shipped import pins

    (tmp_path / "fa2.so").write_bytes(FA2)
    monkeypatch.setattr(host, "fa2_library", lambda: tmp_path / "fa2.so")
    entry = make_entry(tmp_path / dc.DRIVER_DIR)
    assert cli.main(["verify", "--cache-dir", str(tmp_path), "--print-pin"]) == 0
    lines = capsys.readouterr().out.splitlines()
    digest = pins.digest((entry / dc.MANIFEST).read_bytes())
    assert lines[-1] == f"{pins.PIN_ENV}=sha256:{digest}"


def test_driver_cache_without_a_gpu_node_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ["--kv-cache-dtype", "turboquant_4bit_nc", "--head-size", "128", "--num-heads", "16"]
    layer = tmp_path / "layer"
    flags += ["--num-kv-heads", "8", "--vllm-version", "0.26.0", "--cache-dir", str(layer)]
    assert cli.main(["driver-cache", *flags]) == 2
    note, line = capsys.readouterr().err.splitlines()
    assert note.startswith("tq-warmup: driver-cache without an engine (no --model, or --plan-only)")
    if host.fa2_library() is None:  # the lint venv: no vLLM
        assert "FlashAttention-2 library" in line and "is not installed here" in line
    else:  # vLLM's wheel on a machine without the NVIDIA driver
        assert "no NVIDIA driver version in /proc/driver/nvidia/version" in line
    assert not layer.exists()  # a refusal creates nothing


def test_engine_without_a_model_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ["--kv-cache-dtype", "turboquant_4bit_nc", "--head-size", "128", "--num-heads", "16"]
    flags += ["--num-kv-heads", "8", "--cache-dir", str(tmp_path), "--engine"]
    assert cli.main(["driver-cache", *flags]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == "tq-warmup: --engine starts an engine of --model: give --model"


@pytest.mark.real_vllm  # the model's geometry comes from vLLM's ModelConfig
@pytest.mark.parametrize(
    ("flag", "engine"), [((), True), (("--engine",), True), (("--plan-only",), False)]
)
def test_with_a_model_the_build_starts_an_engine_unless_plan_only(
    flag: tuple[str, ...],
    engine: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The plan's launches alone left out one of four FA2 modules on the H200, so an
    engine is the default wherever there is a model to start."""
    from tq_warmup_plugin.driver import build as driver_build

    got: list[object] = []
    monkeypatch.setattr(driver_build, "build", lambda *a: got.append(a[4]) or 0)
    model = Path(__file__).parent / "data" / "models" / "llama-3-8b"
    flags = ["--model", str(model), "--kv-cache-dtype", "turboquant_4bit_nc", *flag]
    assert cli.main(["driver-cache", *flags, "--cache-dir", str(tmp_path)]) == 0
    (passed,) = got
    err = capsys.readouterr().err
    if engine:
        assert isinstance(passed, tuple) and passed[0] == model.resolve()
        assert passed[1]["engine"]["kv_cache_dtype"] == "turboquant_4bit_nc"
        assert "without an engine" not in err
    else:
        assert passed is None and "without an engine (no --model, or --plan-only)" in err


def test_the_engine_spec_is_the_models_engine_on_dummy_weights() -> None:
    from tq_warmup_plugin.driver.build import engine_spec

    spec = engine_spec("turboquant_4bit_nc", "bfloat16", 4096, 16, 8192, True)
    kw = spec["engine"]
    assert (kw["load_format"], kw["skip_tokenizer_init"]) == ("dummy", True)
    assert "model" not in kw  # the build gives it: the directory, or a copy of the file
    assert (kw["kv_cache_dtype"], kw["dtype"], kw["max_model_len"]) == (
        "turboquant_4bit_nc",
        "bfloat16",
        4096,
    )
    assert (kw["max_num_seqs"], kw["max_num_batched_tokens"], kw["trust_remote_code"]) == (
        16,
        8192,
        True,
    )
    assert spec["prompt_lens"] == [1, 2048]  # one token, then one chunk within the budget
    short = engine_spec("turboquant_3bit_nc", None, 1024, 4, 512)
    assert "dtype" not in short["engine"] and short["prompt_lens"] == [1, 512]
    assert "max_model_len" not in engine_spec("turboquant_3bit_nc", None, None, 4, 512)["engine"]


def test_children_write_into_the_stage_and_not_a_shipped_cache(tmp_path: Path) -> None:
    from tq_warmup_plugin.driver.build import child_env

    base = {
        "HOME": "/h",
        "CUDA_CACHE_DISABLE": "1",
        "CUDA_CACHE_PATH": "/elsewhere",
        "TQ_WARMUP_DRIVER_CACHE": "/opt/layer/driver-cache",
        "TQ_WARMUP_DRIVER_CACHE_COPY_TO": "/var/cache/nv",
        "PYTHONPATH": "/p",
    }
    env = child_env(tmp_path / "cache", base)
    assert env["CUDA_CACHE_PATH"] == str(tmp_path / "cache") and env["HOME"] == "/h"
    assert env["CUDA_CACHE_MAXSIZE"] == str(4 << 30)
    assert not {"CUDA_CACHE_DISABLE", "TQ_WARMUP_DRIVER_CACHE"} & set(env)
    assert "TQ_WARMUP_DRIVER_CACHE_COPY_TO" not in env
    assert env["PYTHONPATH"].endswith(os.pathsep + "/p")


@pytest.mark.real_vllm
def test_an_engine_that_cannot_start_is_one_line(tmp_path: Path) -> None:
    """The real engine child, on a machine where vLLM's engine cannot start (no GPU
    here): the build gets one line with the child's last error, never a traceback."""
    from tq_warmup_plugin.driver import build as driver_build

    cache = tmp_path / "stage" / "cache"
    cache.mkdir(parents=True)
    model = Path(__file__).parent / "data" / "models" / "llama-3-8b" / "config.json"
    spec = driver_build.engine_spec("turboquant_4bit_nc", "bfloat16", 1024, 4, 512)
    with pytest.raises(driver_build.BuildError) as err:
        driver_build._run_engine(model, spec, cache, timeout=300)
    line = str(err.value)
    assert line.startswith("the engine process failed (exit ") and "\n" not in line
    assert not list(cache.parent.glob("engine*.json"))  # spec and result removed
    assert not list(cache.parent.glob("model*"))  # the file's copy was not in the stage


def test_verify_names_the_entries_past_the_limit(tmp_path: Path) -> None:
    root = tmp_path / dc.DRIVER_DIR
    make_entry(root, key="ZZ_H200-570.86.15-fa2-x")
    for i in range(dc.MAX_ENTRIES + 1):
        make_entry(root, key=f"A100-{i:03d}-535.0.0-fa2-x", driver="535.0.0", gpu="NVIDIA A100")
    here = Node("570.86.15", ("NVIDIA H200",), len(FA2))
    summary, problems = driver_verify.verify_layer(tmp_path, here) or ("", [])
    assert problems == [f"driver-cache: 2 entries past the first {dc.MAX_ENTRIES} not checked"]
    assert f"{dc.MAX_ENTRIES} driver cache entries" in summary  # this node's among them


@pytest.mark.real_vllm  # the model's geometry comes from vLLM's ModelConfig
def test_engine_args_reach_the_engine_and_cannot_override_the_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A hybrid fleet serves with ``--gdn-prefill-backend triton`` (no FlashInfer in the
    image): the build's engine must too, or it loads other kernels than the fleet's."""
    from tq_warmup_plugin.cli import commands as cli
    from tq_warmup_plugin.driver import build as driver_build

    got: list[Any] = []
    monkeypatch.setattr(driver_build, "build", lambda *a: got.append(a[4]) or 0)
    model = Path(__file__).parent / "data" / "models" / "llama-3-8b"
    base = ["driver-cache", "--model", str(model), "--kv-cache-dtype", "turboquant_4bit_nc",
            "--cache-dir", str(tmp_path)]  # fmt: skip
    extra = '{"gdn_prefill_backend": "triton", "enforce_eager": true}'
    assert cli.main([*base, "--engine-args", extra]) == 0
    kw = got[0][1]["engine"]
    assert (kw["gdn_prefill_backend"], kw["enforce_eager"]) == ("triton", True)
    assert kw["load_format"] == "dummy"
    for bad, said in (
        ('{"load_format": "auto"}', "load_format: set by driver-cache or its flags"),
        ('{"kv_cache_dtype": "auto", "seed": 1}', "kv_cache_dtype, seed: set by"),
        ('["gdn_prefill_backend"]', "not a JSON object of EngineArgs field names"),
        ('{"not a name": 1}', "not a JSON object of EngineArgs field names"),
        ("{", "is not JSON"),
    ):
        with pytest.raises(SystemExit):
            cli.main([*base, "--engine-args", bad])
        assert said in capsys.readouterr().err
    assert len(got) == 1


KILLED_STAGE = """
import os, sys
from tq_warmup_plugin.driver import entry
staged = entry.stage(sys.argv[1])
(staged / "half-written").write_bytes(b"x" * 1000)
print(staged, flush=True)
os.kill(os.getpid(), 9)
"""


def test_a_killed_builds_stage_is_named_by_verify_and_removed_by_the_next(
    tmp_path: Path,
) -> None:
    """A real ``driver-cache`` build SIGKILLed mid-stage. Before: ``verify`` did not name
    its stage (``listing`` skips dot names) and nothing ever removed it. Now the stage's
    maker holds its ``flock``: an unheld stage is named, and the next ``stage`` there
    removes it; a live maker's (held) is neither."""
    import subprocess
    import sys

    root = tmp_path / dc.DRIVER_DIR
    make_entry(root)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    done = subprocess.run(
        [sys.executable, "-c", KILLED_STAGE, str(root)],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == -9, done.stderr[-2000:]
    killed = Path(done.stdout.split()[0])
    live = dc.stage(root)  # this process's, held
    try:
        here = Node("570.86.15", ("NVIDIA H200",), len(FA2))
        summary, problems = driver_verify.verify_layer(tmp_path, here) or ("", [])
        assert problems == [
            f"driver-cache/{killed.name}: left by a driver-cache build that did not finish "
            "(the next one removes it)"
        ]
        assert summary.startswith(f"tq-warmup: {root}: 1 driver cache entry, 2 files: 1 problem")
        os.utime(killed, (1, 1))  # older than a stage between mkdtemp and its flock
        older = root / f"{dc.STAGE_PREFIX}abc"  # an older release's: maybe building
        older.mkdir()
        os.utime(older, (1, 1))
        dc.discard(dc.stage(root))
        assert not killed.exists() and live.is_dir() and older.is_dir()
    finally:
        dc.discard(live)
    assert not live.exists()
