"""``tq-warmup precompile`` installing real sm90 kernels into a shared directory, and
``tq-warmup verify`` on it, with the installed vLLM and Triton (CPU only).

Several precompiles into one directory at once, of the same and of different plans,
leave a directory that verifies, no stage behind, and never a key directory that a
reader could see half-written (the test reads the directory while they run).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import fakes
import pytest
from test_cli import H200_FLAGS

from tq_warmup_plugin.cli import commands as cli
from tq_warmup_plugin.shipped import manifest, precompile

pytestmark = pytest.mark.real_vllm

PLAN = H200_FLAGS[:-2]  # for the installed release


def run_precompile(cache_dir: Path, *extra: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "tq_warmup_plugin.cli", "precompile", *PLAN, *extra]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.Popen(
        [*cmd, "--cache-dir", str(cache_dir)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache_dir = tmp_path_factory.mktemp("precompiled") / "cache"
    out, err = run_precompile(cache_dir).communicate(timeout=540)
    assert "0 failed" in out, (out, err[-3000:])
    return cache_dir


def verify(capsys: pytest.CaptureFixture[str], cache_dir: Path, *extra: str) -> tuple[int, str]:
    rc = cli.main(["verify", "--cache-dir", str(cache_dir), *extra])
    return rc, capsys.readouterr().out


def test_verify_checks_the_files_and_the_installed_stack(
    built: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out = verify(capsys, built, "--arch", "90")
    assert rc == 0 and out.endswith(": 0 problems\n"), out  # every field was checkable
    rc, out = verify(capsys, built)
    assert rc == 0 and out.endswith("0 problems; not checked (not known here): arch\n"), out

    corrupt = tmp_path / "corrupt"
    shutil.copytree(built, corrupt)
    cubin = sorted(corrupt.rglob("*.cubin"))[0]
    data = bytearray(cubin.read_bytes())
    data[len(data) // 2] ^= 0xFF
    cubin.write_bytes(bytes(data))
    sorted(corrupt.rglob("*.ptx"))[0].unlink()
    rc, out = verify(capsys, corrupt)
    lines = out.splitlines()
    assert rc == 1 and len(lines) == 3, out
    assert f": {cubin.parent.name}/{cubin.name}: the manifest says sha256 " in lines[0]
    assert lines[1].endswith(", found no such file") and ": 2 problems; " in lines[2]

    other = tmp_path / "other"
    shutil.copytree(built, other)
    (file,) = other.glob(f"{manifest.PREFIX}*.json")
    file.write_text(json.dumps({**json.loads(file.read_text()), "vllm": "0.0.1"}))
    rc, out = verify(capsys, other)
    installed = manifest.installed_stack().vllm
    assert rc == 1 and f"{file.name}: vllm: the manifest says 0.0.1, found {installed}\n" in out


def _image_wheel(into: Path) -> Path:
    """A Triton wheel of the installed release for another Python, as ``precompile`` and
    ``verify`` read one: Triton's ``runtime/cache.py`` and a ``libtriton`` of other bytes
    (what ``triton_key()`` hashes), so its build key differs from this host's."""
    import sysconfig
    import zipfile

    import triton
    from triton.runtime import cache

    ext = str(sysconfig.get_config_var("EXT_SUFFIX")).split(".")[-1]
    wheel = into / f"triton-{triton.__version__}-cp399-cp399-manylinux_2_27_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(cache.__file__, "triton/runtime/cache.py")
        archive.writestr(f"triton/_C/libtriton.{ext}", b"another build")
    return wheel


def test_verify_checks_a_layer_for_another_python_against_the_image_wheel(
    built: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``deploy/build-layer.sh`` builds for the image's Python on a host of another:
    ``verify`` judges the layer's stack against the image's wheel it is given, and
    against this host's without one (where the image's layer does not serve)."""
    image = tmp_path / "image"
    shutil.copytree(built, image)
    wheel = _image_wheel(tmp_path)
    key = precompile.triton_key_of_wheel(wheel, tmp_path / "unpacked")
    (file,) = image.glob(f"{manifest.PREFIX}*.json")
    data = json.loads(file.read_text())
    data |= {"triton_build": manifest.triton_build(key), "python_abi": "cp399"}
    file.write_text(json.dumps(data))
    rc, out = verify(capsys, image, "--arch", "90")
    assert rc == 1 and ": 2 problems" in out, out
    assert "python_abi: the manifest says cp399, found " in out, out
    rc, out = verify(capsys, image, "--arch", "90", "--image-triton-wheel", str(wheel))
    assert rc == 0 and out.endswith(": 0 problems\n"), out
    rc, out = verify(capsys, built, "--arch", "90", "--image-triton-wheel", str(wheel))
    assert rc == 1 and "triton_build: the manifest says " in out, out  # built for this host


def test_tritons_own_manager_finds_the_installed_kernels(
    built: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compiled in a stage and moved: the group files name the installed files, so
    ``TRITON_CACHE_DIR`` at the directory works without the layered cache."""
    from triton.runtime.cache import FileCacheManager

    monkeypatch.setenv("TRITON_CACHE_DIR", str(built))
    monkeypatch.delenv("TRITON_CACHE_MANAGER", raising=False)
    (file,) = manifest.manifest_files(built)
    for key, files in manifest.read(file).files.items():
        (group,) = [n.removeprefix("__grp__") for n in files if n.startswith("__grp__")]
        found = FileCacheManager(key).get_group(group)
        assert found is not None and set(found) == set(files) - {f"__grp__{group}"}, found


def _half_written(cache_dir: Path) -> list[str]:
    """Visible key directories whose group names a file that is not there."""
    seen = []
    for group in cache_dir.glob("[!.]*/__grp__*.json"):
        try:
            children = json.loads(group.read_text())["child_paths"]
        except FileNotFoundError:  # replaced while reading: a whole directory at a time
            continue
        missing = [n for n in children if not (group.parent / n).exists()]
        if missing and group.parent.exists():
            seen.append(f"{group.parent.name}: {missing}")
    keys = [p for p in cache_dir.iterdir() if p.is_dir() and not p.name.startswith(".")]
    seen += [f"{p.name}: no group" for p in keys if not list(p.glob("__grp__*.json"))]
    return seen


@pytest.mark.once_per_triton
def test_concurrent_precompiles_into_one_directory_leave_it_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache_dir = tmp_path / "cache"
    plans = [[], [], ["--kv-cache-dtype", "turboquant_k8v4"], ["--dtype", "float16"]]
    procs = [run_precompile(cache_dir, *extra) for extra in plans]
    half: list[str] = []
    while any(p.poll() is None for p in procs):
        if cache_dir.is_dir():
            half += _half_written(cache_dir)
        time.sleep(0.01)
    outs = [p.communicate() for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert half == []
    assert [p.name for p in cache_dir.iterdir() if p.name.startswith(".")] == [
        precompile.LOCK_FILE
    ], "a stage or temporary file was left behind"
    rc, out = verify(capsys, cache_dir, "--arch", "90")
    assert rc == 0 and "3 manifests" in out and out.endswith(": 0 problems\n"), out
    # The two of the same plan wrote one manifest; each found or built every key.
    for out_, _ in outs[:2]:
        keys, built, there = (
            int(out_.split(word)[0].rsplit(" ", 1)[1])
            for word in (" keys for", " built, ", " already there")
        )
        assert built + there == keys > 0, out_


# Run inside the private mount namespace, after the precompile: what a reader of the
# full directory would find (the tmpfs is gone once the namespace exits).
_LISTING = """
import json, sys
from pathlib import Path
from tq_warmup_plugin.shipped import manifest
root = Path(sys.argv[1])
listed = set()
for path in manifest.manifest_files(root):
    listed |= set(manifest.read(path).files)
print("LISTING " + json.dumps({"entries": sorted(p.name for p in root.iterdir()),
                               "listed": sorted(listed)}))
"""


def _tmpfs_kib(built: Path, part: str) -> int:
    """A tmpfs size that fills in the ``part`` of a build like ``built``: ``early`` at 40%
    of its pages, ``late`` one page short of them all. Paths inside Triton's files change
    their sizes (a 1360 KiB tmpfs held a whole build from a shorter venv path), so the
    sizes follow the real build, not fixed numbers."""
    pages = sum(-(-p.stat().st_size // 4096) for p in built.rglob("*") if p.is_file())
    return pages * 4 * 2 // 5 if part == "early" else (pages - 1) * 4


@pytest.mark.once_per_triton
@pytest.mark.parametrize("part", ["early", "late"])
def test_a_full_disk_is_one_line_and_leaves_nothing_unlisted(
    part: str, built: Path, tmp_path: Path
) -> None:
    """Before (issue 20, vLLM 0.33.0): late in the build, the six key directories were
    installed, the manifest was not (a traceback), and the layered cache then served
    them unverified; earlier, a traceback."""
    if not fakes.tmpfs_in_private_namespace():
        pytest.skip("no private mount namespace here (unshare -m and mount tmpfs)")
    size = f"{_tmpfs_kib(built, part)}k"
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    cmd = [sys.executable, "-m", "tq_warmup_plugin.cli", "precompile", *PLAN]
    script = (
        f"mount -t tmpfs -o size={size} tmpfs '{mnt}' && "
        f'"$0" "$@" --cache-dir {mnt}/cache > {tmp_path}/out 2> {tmp_path}/err; '
        f"echo RC $?; '{sys.executable}' -c '{_LISTING}' {mnt}/cache"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, *cmd],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    out, err = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
    assert "RC 1\n" in done.stdout, (done.stdout, done.stderr[-2000:], out, err[-2000:])
    assert "Traceback" not in err and err.count("\n") == 1, err[-3000:]
    assert err.startswith("tq-warmup: ") and "No space left on device" in err, err
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("LISTING ")]
    found = json.loads(line[len("LISTING ") :])
    key_dirs = [n for n in found["entries"] if not n.startswith((".", manifest.PREFIX))]
    assert set(key_dirs) <= set(found["listed"]), found  # nothing a reader would not check
    assert [n for n in found["entries"] if n.startswith(".")] == [precompile.LOCK_FILE], found


@pytest.mark.once_per_triton
def test_a_precompile_killed_with_sigkill_is_named_by_verify_and_cleaned_by_the_next(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: the killed precompile's stage stayed, and neither verify nor a later
    precompile mentioned or removed it."""
    cache_dir = tmp_path / "cache"
    proc = run_precompile(cache_dir)
    deadline = time.monotonic() + 300
    stages: list[Path] = []
    while not stages and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
        if cache_dir.is_dir():
            stages = [
                p
                for p in cache_dir.glob(f"{precompile.STAGE_PREFIX}*")
                if (p / precompile.ALIVE_FILE).exists()
            ]
    assert stages, proc.communicate()
    time.sleep(0.5)  # compiling into the stage
    proc.kill()  # SIGKILL
    proc.communicate()
    assert proc.returncode == -9 and stages[0].is_dir()
    rc, out = verify(capsys, cache_dir)
    assert rc == 1 and f"{stages[0].name}: left by a precompile that did not finish" in out, out
    out, err = run_precompile(cache_dir).communicate(timeout=540)
    assert "0 failed" in out, (out, err[-3000:])
    assert not stages[0].exists()
    rc, out = verify(capsys, cache_dir, "--arch", "90")
    assert rc == 0 and out.endswith(": 0 problems\n"), out
