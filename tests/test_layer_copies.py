"""This process's copies of served Triton kernels (``layer_trust``): what a dead process
left is removed by the next one, and only that (never a link, another user's, another PID
namespace's, a live process's); a full or ``noexec`` ``/dev/shm`` sends the copies to ``TMPDIR``."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import fakes
import pytest

from tq_warmup_plugin.shipped import trust as layer_trust


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def left(base: Path, pid: int, namespace: str | None = None, name: str = "") -> Path:
    """A private directory as a process ``pid`` leaves it when it is killed."""
    d = base / f"{layer_trust.PREFIX}{pid}-{name or 'x'}"
    (d / "abc" / "key").mkdir(parents=True)
    (d / "abc" / "key" / "k.cubin").write_bytes(b"\0" * 10)
    ns = namespace if namespace is not None else layer_trust._pid_namespace()
    (d / layer_trust.OWNER).write_text(f"{ns} {pid}\n")
    return d


def test_a_dead_processs_copies_are_removed_and_nothing_else(tmp_path: Path) -> None:
    dead = dead_pid()
    stale = left(tmp_path, dead)
    live = left(tmp_path, os.getppid(), name="live")
    other_ns = left(tmp_path, dead, namespace="4026531836999", name="ns")
    old = tmp_path / f"{layer_trust.PREFIX}abcdef"  # an older release's: no marker
    old.mkdir()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep")
    link = tmp_path / f"{layer_trust.PREFIX}{dead}-link"
    link.symlink_to(victim)
    inner = left(tmp_path, dead, name="inner")
    (inner / "abc" / "out").symlink_to(victim)  # a link inside: removed, never followed
    removed = layer_trust.sweep(str(tmp_path))
    assert sorted(removed) == sorted([str(stale), str(inner)])
    assert not stale.exists() and not inner.exists()
    assert live.is_dir() and other_ns.is_dir() and old.is_dir() and link.is_symlink()
    assert (victim / "precious").read_text() == "keep"


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_another_users_copies_are_left_alone(tmp_path: Path) -> None:
    theirs = left(tmp_path, dead_pid())
    for p in [theirs, *theirs.rglob("*")]:
        os.chown(p, 65534, 65534, follow_symlinks=False)
    assert layer_trust.sweep(str(tmp_path)) == [] and theirs.is_dir()


def test_the_sweep_runs_when_a_process_makes_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(layer_trust, "SHM", str(tmp_path))
    monkeypatch.setattr(layer_trust, "_private_roots", {})
    stale = left(tmp_path, dead_pid())
    made = layer_trust._make_private_root()
    assert Path(made).parent == tmp_path and not stale.exists()
    owner = (Path(made) / layer_trust.OWNER).read_text().split()
    assert owner == [layer_trust._pid_namespace(), str(os.getpid()), layer_trust.LOCKED]
    assert (Path(made).stat().st_mode & 0o777) == 0o700
    assert layer_trust.sweep(str(tmp_path)) == [] and Path(made).is_dir()  # held: alive
    layer_trust._remove(os.getpid(), made)


FULL_SHM = """
import json, logging, os, sys
from tq_warmup_plugin.shipped import trust as layer_trust
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
layer_trust.SHM = sys.argv[1]
got = layer_trust._copy("/layer", "KEY", {"k.cubin": b"x" * 300_000, "k.json": b"{}"})
print("RESULT " + json.dumps({"path": got, "bytes": os.path.getsize(os.path.join(got, "k.cubin"))}))
"""


def _copy_beside_tmpfs(tmp_path: Path, options: str) -> tuple[dict[str, Any], list[str]]:
    """``FULL_SHM``'s copy with ``SHM`` a real tmpfs mounted with ``options`` in a private
    mount namespace and ``TMPDIR`` beside it: its result and its output lines."""
    import json

    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    tmp.mkdir()
    src = str(Path(__file__).parents[1] / "src")
    script = f'mount -t tmpfs -o {options} tmpfs \'{shm}\' && exec "$0" "$@"'
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": src}
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, sys.executable, "-c", FULL_SHM, str(shm)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    result: dict[str, Any] = json.loads(next(x for x in lines if x.startswith("RESULT "))[7:])
    return result, lines


@pytest.mark.skipif(
    not fakes.tmpfs_in_private_namespace(), reason="no private mount namespace with tmpfs here"
)
def test_a_full_dev_shm_sends_the_copies_to_tmpdir(tmp_path: Path) -> None:
    """A real full file system (a 64 KiB tmpfs in a private mount namespace): the
    private directory is made there, the copy's write fails, the copy is made in TMPDIR."""
    result, lines = _copy_beside_tmpfs(tmp_path, "size=64k")
    assert result["path"].startswith(str(tmp_path / "tmp")) and result["bytes"] == 300_000
    assert any(f"cannot write served kernel copies in {tmp_path / 'shm'}" in x for x in lines)


@pytest.mark.skipif(
    not fakes.tmpfs_in_private_namespace(), reason="no private mount namespace with tmpfs here"
)
@pytest.mark.parametrize("noexec", [True, False])
def test_a_noexec_dev_shm_sends_the_copies_to_tmpdir(tmp_path: Path, noexec: bool) -> None:
    """Docker mounts /dev/shm ``noexec``: a host launcher (``__triton_launcher*.so``) copied
    there would not load, so the private directory goes to TMPDIR (a real noexec tmpfs in
    a private mount namespace); the same tmpfs without ``noexec`` holds it."""
    result, _ = _copy_beside_tmpfs(tmp_path, "noexec,size=64m" if noexec else "size=64m")
    want = tmp_path / ("tmp" if noexec else "shm")
    assert result["path"].startswith(str(want)), result


@pytest.mark.parametrize("mode", [0o755, 0o777])
def test_copies_never_go_into_another_users_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int
) -> None:
    """``/dev/shm`` and ``TMPDIR`` both another user's. Before: the 0700 private
    directory was made there, and that user could rename it away and put one of theirs
    at its name, whose files Triton then loaded. Now no copy is made (the caller's one
    WARNING: the kernels compile instead)."""
    import tempfile

    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chown(shared, 65534, 65534)
    shared.chmod(mode)
    monkeypatch.setattr(layer_trust, "SHM", str(shared))
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    monkeypatch.setattr(layer_trust, "_private_roots", {})
    with pytest.raises(PermissionError, match=f"directory {shared} belongs to another user"):
        layer_trust._make_private_root()
    assert list(shared.iterdir()) == []


@pytest.mark.parametrize("mode", [0o777, 0o775])
def test_a_directory_of_ours_others_may_write_gets_the_sticky_bit_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int, caplog: pytest.LogCaptureFixture
) -> None:
    """``deploy/kubernetes.yaml`` mounts emptyDirs (the pod user's, 0777) at ``/dev/shm``
    and ``/tmp``. Before: the private directory was made there as it was, and any other
    user could rename it away and put one of theirs at its name. Now the directory gets
    the sticky bit first (one INFO line), and the copies go there."""
    import logging

    shared = tmp_path / "shm"
    shared.mkdir()
    shared.chmod(mode)
    monkeypatch.setattr(layer_trust, "SHM", str(shared))
    monkeypatch.setattr(layer_trust, "_executable_mount", lambda path: True)
    monkeypatch.setattr(layer_trust, "_private_roots", {})
    with caplog.at_level(logging.INFO, "vllm.tq_warmup_plugin"):
        made = layer_trust._make_private_root()
    assert Path(made).parent == shared and stat.S_IMODE(shared.stat().st_mode) == mode | 0o1000
    assert [r.getMessage() for r in caplog.records] == [
        f"tq-warmup: set the sticky bit on {shared} (others could write it)"
    ]
    shutil.rmtree(made)


def test_a_pin_closes_the_unverified_door(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: ``TQ_WARMUP_CACHE_UNVERIFIED=1`` served a layer without a manifest
    unchecked even with ``TQ_WARMUP_CACHE_PIN`` set, which none of its files could match."""
    import logging

    from tq_warmup_plugin.shipped import pins

    key = "ab" * 26
    (tmp_path / "layer" / key).mkdir(parents=True)
    (tmp_path / "layer" / key / "k.cubin").write_bytes(b"\0" * 10)
    monkeypatch.setenv("TQ_WARMUP_CACHE_UNVERIFIED", "1")
    monkeypatch.delenv(pins.PIN_ENV, raising=False)
    assert layer_trust._read_layer(str(tmp_path / "layer"), object()).listed is None  # opted in
    monkeypatch.setenv(pins.PIN_ENV, "sha256:" + "0" * 64)
    caplog.set_level(logging.WARNING, logger="vllm.tq_warmup_plugin")
    caplog.clear()
    pinned = layer_trust._read_layer(str(tmp_path / "layer"), object())
    assert pinned.listed == {} and pinned.serves(key) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"tq-warmup: Triton cache layer {tmp_path / 'layer'} has no tq-warmup manifest: nothing "
        "in it is used (TQ_WARMUP_CACHE_PIN is set: TQ_WARMUP_CACHE_UNVERIFIED=1 serves nothing "
        "unpinned)"
    ]


@pytest.mark.parametrize("limit", ["count", "time"])
def test_a_layers_manifests_are_read_under_a_count_and_time_budget(
    limit: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: every manifest of a layer was read at its first lookup, without bound, each
    bad one a WARNING: 10,000 planted manifests held the compile behind that lookup."""
    import logging

    from tq_warmup_plugin.shipped import manifest, pins

    monkeypatch.delenv(pins.PIN_ENV, raising=False)
    for n in range(6):
        (tmp_path / f"{manifest.PREFIX}{n}.json").write_text("{")
    if limit == "count":
        monkeypatch.setattr(layer_trust, "MAX_MANIFESTS", 3)
    else:
        monkeypatch.setattr(layer_trust, "READ_BUDGET_S", 0.0)
    caplog.set_level(logging.WARNING, logger="vllm.tq_warmup_plugin")
    assert layer_trust._read_layer(str(tmp_path), object()).listed == {}
    said = [r.getMessage() for r in caplog.records]
    read = 3 if limit == "count" else 1
    assert sum("is not a usable manifest" in line for line in said) == read
    past = "the first 3" if limit == "count" else "0 s of reading (the first 1)"
    assert said[read] == (
        f"tq-warmup: Triton cache layer {tmp_path}: {6 - read} manifests past {past} not read; "
        "what they list compiles (ship one layer per fleet)"
    )
    assert len(said) == read + 1 or "stack" in said[-1]


HOLDER = """
import os, sys, time
from tq_warmup_plugin.shipped import trust as layer_trust
layer_trust.SHM = sys.argv[1]
print(layer_trust._make_private_root(), os.getpid(), flush=True)
time.sleep(120)
"""


def test_a_killed_containers_copies_are_removed_by_the_next_and_a_live_ones_never(
    tmp_path: Path,
) -> None:
    """A real process in a new PID namespace (another container over the same
    ``/dev/shm``; it is PID 1 there) makes its private directory and is SIGKILLed.
    Before: its marker named another namespace, so no later process ever removed it;
    PIDs prove nothing across namespaces. Now the directory's ``flock`` is the proof:
    left alone while the holder lives, removed once it is dead."""
    import signal
    import time

    shm = tmp_path / "shm"
    shm.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    argv = [sys.executable, "-c", HOLDER, str(shm)]
    if os.geteuid() == 0 and shutil.which("unshare"):
        argv = ["unshare", "-p", "-f", *argv]
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert proc.stdout is not None
        made, pid = proc.stdout.readline().split()
        assert Path(made).is_dir() and Path(made).parent == shm
        if argv[0] == "unshare":
            assert pid == "1"  # another PID namespace: its PID says nothing here
        assert layer_trust.sweep(str(shm)) == [] and Path(made).is_dir()  # alive: kept
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    deadline = time.monotonic() + 5
    while layer_trust.sweep(str(shm)) != [made] and time.monotonic() < deadline:
        time.sleep(0.02)  # the namespace's init reaps its child a moment later
    assert not Path(made).exists()


def test_a_full_dev_shm_never_removes_copies_handed_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the move to ``TMPDIR`` removed the ``/dev/shm`` directory at once, with
    the copies other threads had been handed and Triton had yet to open. Now it stays
    (held) until exit, and the exit removes both."""
    monkeypatch.setattr(layer_trust, "SHM", str(tmp_path / "shm"))
    monkeypatch.setattr(layer_trust, "_private_roots", {})
    monkeypatch.setattr(layer_trust, "_executable_mount", lambda path: True)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setattr(layer_trust.tempfile, "tempdir", None)
    (tmp_path / "shm").mkdir()
    (tmp_path / "tmp").mkdir()
    handed = layer_trust._copy("/layer", "KEY", {"k.cubin": b"x"})
    shm_root = layer_trust.private_root()
    assert shm_root is not None and handed.startswith(shm_root)
    moved = layer_trust._to_tmpdir(shm_root, OSError(28, "No space left on device"))
    assert moved.startswith(str(tmp_path / "tmp"))
    assert (Path(handed) / "k.cubin").read_bytes() == b"x"  # still there for its reader
    assert layer_trust.sweep(str(tmp_path / "shm")) == []  # and held: no sweep takes it
    layer_trust._remove(os.getpid(), shm_root)
    layer_trust._remove(os.getpid(), moved)
    assert not Path(shm_root).exists() and not Path(moved).exists()
