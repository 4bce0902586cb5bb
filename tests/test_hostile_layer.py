"""A shipped Triton cache layer turned against the server (issue 20), with real files:
FIFOs, symlinks in and out of the layer, ``/dev/zero``, deeply nested manifests, bytes
swapped after the first lookup, unlisted files, a layer that is ``TRITON_CACHE_DIR``,
the stage of a killed precompile. Through Triton's own ``get_cache_manager`` and
``tq-warmup verify``; every lookup runs in a thread with a timeout, so a hang is a
failure, not a stuck test run. The real sm90 layer is in ``test_layered_cache``."""

from __future__ import annotations

import contextlib
import fcntl
import io
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import fakes
import pytest
from test_layered_cache import KEY, _build_layer, _key_dir, _manager, _warnings, lc

from tq_warmup_plugin import safe_io
from tq_warmup_plugin.cli import commands as cli
from tq_warmup_plugin.shipped import manifest, precompile

__all__ = ["lc"]  # the fixture, shared with test_layered_cache

T = TypeVar("T")
OTHER = "cd" * 32


def layer(root: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """Two kernels built by Triton, each listed by its own manifest: the key
    directories by key."""
    dirs = {}
    for key in (KEY, OTHER):
        _build_layer(root, monkeypatch, key)
        dirs[key] = root / _key_dir(key)
        fakes.write_manifest(root, {dirs[key].name: manifest.key_dir_hashes(dirs[key])})
    return dirs


def served(key: str = KEY) -> dict[str, str] | None:
    group: dict[str, str] | None = fakes.within(20, lambda: _manager(key).get_group("k.json"))
    return group


@pytest.fixture
def hostile(lc: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    dirs = layer(tmp_path / "layer", monkeypatch)
    monkeypatch.setenv(lc.LAYERS_ENV, str(tmp_path / "layer"))
    return dirs


def _manifest_of(key_dir: Path) -> Path:
    (path,) = [p for p in manifest.manifest_files(key_dir.parent) if key_dir.name in p.read_text()]
    return path


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda p: (p.unlink(), os.mkfifo(p)), id="fifo"),
        pytest.param(lambda p: (p.unlink(), p.symlink_to("/dev/zero")), id="dev-zero"),
        pytest.param(lambda p: p.write_text("[" * 100_000 + "]" * 100_000), id="nested"),
    ],
)
def test_a_hostile_manifest_costs_only_itself_once(
    make: Callable[[Path], object],
    hostile: dict[str, Path],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before: a FIFO blocked every compile forever, ``/dev/zero`` raised MemoryError
    and deep nesting RecursionError into Triton on every compile; the good manifest
    beside it was not used."""
    bad = _manifest_of(hostile[OTHER])
    make(bad)
    caplog.set_level(logging.WARNING, logger="vllm.tq_warmup_plugin")
    assert served(KEY) is not None  # the other manifest's kernel
    assert served(OTHER) is None and served(OTHER) is None
    (warning,) = _warnings(caplog)  # remembered for the process
    assert warning.startswith(f"tq-warmup: Triton cache layer {bad.parent}: {bad.name} is not")
    assert warning.endswith("nothing it lists is used")


@pytest.mark.parametrize(
    ("make", "why"),
    [
        pytest.param(lambda p, out: (p.unlink(), os.mkfifo(p)), "found a FIFO", id="fifo"),
        pytest.param(lambda p, out: (p.unlink(), p.symlink_to("/dev/zero")), "symlink", id="zero"),
        pytest.param(
            lambda p, out: (out.write_bytes(p.read_bytes()), p.unlink(), p.symlink_to(out)),
            "found a symlink",
            id="symlink-out",
        ),
        pytest.param(lambda p, out: p.write_bytes(b"EVIL"), "found a file of 4 bytes", id="size"),
    ],
)
def test_a_listed_file_that_is_not_the_regular_file_hashed_is_not_served(
    make: Callable[[Path, Path], object],
    why: str,
    hostile: dict[str, Path],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before: a FIFO hung the compile, ``/dev/zero`` ate the memory, a symlink out of
    the layer was hashed and then served."""
    make(hostile[KEY] / "k.cubin", tmp_path / "outside.cubin")
    caplog.set_level(logging.WARNING, logger="vllm.tq_warmup_plugin")
    assert served(KEY) is None and served(OTHER) is not None
    (warning,) = _warnings(caplog)
    assert f": {hostile[KEY].name}/k.cubin: the manifest says sha256 " in warning
    assert why in warning, warning


def test_a_key_directory_that_is_a_symlink_out_of_the_layer_is_not_served(
    hostile: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: served from wherever it pointed, writable storage included."""
    outside = tmp_path / "writable"
    hostile[KEY].rename(outside)
    hostile[KEY].symlink_to(outside)
    caplog.set_level(logging.WARNING, logger="vllm.tq_warmup_plugin")
    assert served(KEY) is None and served(OTHER) is not None
    (warning,) = _warnings(caplog)
    assert f": {hostile[KEY].name}: the manifest says a key directory inside the layer" in warning
    assert "found a symlink" in warning


def test_a_layer_named_through_a_current_link_is_served(
    lc: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``TQ_WARMUP_CACHE_LAYERS=/layers/current``, a link fleets repoint to roll a layer.
    Before: the layer's root was opened O_NOFOLLOW, every key was 'found a symlink' (one
    WARNING each) and nothing in it was served."""
    layer(tmp_path / "layer-v2", monkeypatch)
    (tmp_path / "current").symlink_to("layer-v2")
    monkeypatch.setenv(lc.LAYERS_ENV, str(tmp_path / "current"))
    caplog.set_level(logging.WARNING, logger="vllm.tq_warmup_plugin")
    assert served(KEY) is not None and served(OTHER) is not None
    assert _warnings(caplog) == []


def test_bytes_swapped_after_the_first_lookup_are_not_served(hostile: dict[str, Path]) -> None:
    """Before: the first lookup hashed the layer's file and every later one handed
    Triton the layer's path: a cubin swapped to EVILEVILEVIL was served."""
    first = served(KEY)
    assert first is not None
    cubin = hostile[KEY] / "k.cubin"
    cubin.write_bytes(b"EVILE")  # same size, other bytes
    later = served(KEY)
    assert later is not None and Path(later["k.cubin"]).read_bytes() == b"cubin"
    assert not Path(later["k.cubin"]).is_relative_to(hostile[KEY].parent)
    assert oct(Path(later["k.cubin"]).parent.parent.parent.stat().st_mode & 0o777) == "0o700"


def test_files_a_manifest_does_not_list_are_never_served(hostile: dict[str, Path]) -> None:
    """Before: any file in a vouched key directory was served."""
    (hostile[KEY] / "extra.cubin").write_bytes(b"unlisted")
    assert _manager(KEY).get_file("k.cubin") is not None
    assert _manager(KEY).get_file("extra.cubin") is None


@pytest.mark.parametrize("where", ["is", "inside", "holds"])
def test_a_layer_that_overlaps_tritons_cache_directory_is_one_warning(
    where: str,
    lc: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before: a layer that was ``TRITON_CACHE_DIR`` was dropped silently, and Triton's
    own lookups served it, a corrupted file included."""
    root = tmp_path / "layer"
    layer(root, monkeypatch)
    own = {"is": root, "inside": root.parent, "holds": root / "own"}[where]
    monkeypatch.setenv("TRITON_CACHE_DIR", str(own))
    monkeypatch.setenv(lc.LAYERS_ENV, str(root))
    caplog.set_level(logging.WARNING, logger="vllm.tq_warmup_plugin")
    _manager(KEY)
    _manager(OTHER)
    (warning,) = _warnings(caplog)
    how = {"is": "is", "inside": "lies inside", "holds": "holds"}[where]
    assert warning.startswith(
        f"tq-warmup: Triton cache layer {root} {how} Triton's cache directory (TRITON_CACHE_DIR="
    )


def test_a_layer_that_fails_a_lookup_never_raises_into_triton(
    hostile: dict[str, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: object) -> Any:
        raise MemoryError

    monkeypatch.setattr(manifest, "digest", broken)  # hashing a key directory's file
    caplog.set_level(logging.WARNING, logger="vllm.tq_warmup_plugin")
    assert served(KEY) is None and served(OTHER) is None
    (warning,) = _warnings(caplog)
    assert "failed a lookup (MemoryError: )" in warning


# --- safe_io itself ----------------------------------------------------------------


def test_safe_io_refuses_what_is_not_a_bounded_regular_file(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "zero").symlink_to("/dev/zero")
    with open(tmp_path / "sparse", "wb") as fh:
        fh.truncate(safe_io.MAX_JSON_BYTES + 1)
    (tmp_path / "deep.json").write_text("[" * (safe_io.MAX_JSON_DEPTH + 1) + "]" * 65)
    cases = {
        "fifo": "a FIFO",
        "zero": "a symlink",
        "sparse": "more than the",
        "deep.json": "nested more than 64 levels deep",
        "missing": "No such file",
        "sparse/x": "Not a directory",
    }
    for name, why in cases.items():
        with pytest.raises(safe_io.UnsafeFile, match=why):
            fakes.within(10, lambda n=name: safe_io.read_json(str(tmp_path / n)))  # type: ignore[misc]
    with pytest.raises(safe_io.UnsafeFile, match="a character device"):
        safe_io.read_json(str(tmp_path / "zero"), follow=True)
    (tmp_path / "ok.json").write_text('{"a": [1]}')
    (tmp_path / "link.json").symlink_to(tmp_path / "ok.json")
    assert safe_io.read_json(str(tmp_path / "link.json"), follow=True) == {"a": [1]}


# --- tq-warmup verify ----------------------------------------------------------------


def verify(root: Path) -> tuple[int, list[str]]:
    out = io.StringIO()

    def run() -> int:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            return cli.main(["verify", "--cache-dir", str(root)])

    rc = fakes.within(20, run)
    return rc, out.getvalue().splitlines()


@pytest.fixture
def verified(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    monkeypatch.setattr(manifest, "installed_stack", lambda arch=None: fakes.STACK)
    root = tmp_path / "cache"
    dirs = {}
    for key in ("A" * 52, "B" * 52):
        fakes.key_dir(root, key)
        dirs[key] = root / key
        fakes.write_manifest(root, {key: manifest.key_dir_hashes(root / key)})
    return dirs


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda d: (d["k"].unlink(), os.mkfifo(d["k"])), "a FIFO"),
        (lambda d: (d["k"].unlink(), d["k"].symlink_to("/dev/zero")), "a symlink"),
        (lambda d: os.mkfifo(d["fifo"]), "a FIFO"),
        (lambda d: d["deep"].write_text("[" * 100_000 + "]" * 100_000), "nested more than"),
    ],
)
def test_verify_names_a_hostile_file_in_one_line(
    make: Callable[[dict[str, Path]], object], why: str, verified: dict[str, Path]
) -> None:
    """Before: a FIFO blocked ``verify`` forever, ``/dev/zero`` raised MemoryError, a
    deep manifest RecursionError."""
    root = verified["A" * 52].parent
    make(
        {
            "k": verified["A" * 52] / "k.cubin",
            "fifo": root / f"{manifest.PREFIX}fifo.json",
            "deep": root / f"{manifest.PREFIX}deep.json",
        }
    )
    rc, lines = verify(verified["A" * 52].parent)
    assert rc == 1, lines
    (problem,) = [line for line in lines if why in line]
    assert not problem.startswith("tq-warmup:") and lines[-1].endswith(": 1 problem")


def test_a_stage_left_by_a_killed_precompile_is_named_by_verify_and_removed_by_the_next(
    verified: dict[str, Path],
) -> None:
    """Before: a SIGKILLed precompile's stage stayed, and nothing mentioned it. The
    real SIGKILL is in ``test_precompile_install``."""
    root = verified["A" * 52].parent
    dead = root / f"{precompile.STAGE_PREFIX}dead"
    (dead / "K").mkdir(parents=True)
    (dead / precompile.ALIVE_FILE).write_text("")
    running = root / f"{precompile.STAGE_PREFIX}running"
    running.mkdir()
    with open(running / precompile.ALIVE_FILE, "w") as alive:
        fcntl.flock(alive, fcntl.LOCK_EX)  # as a live precompile holds it
        rc, lines = verify(root)
        assert rc == 1 and lines[0] == (
            f"{dead.name}: left by a precompile that did not finish (the next one removes it)"
        )
        assert lines[-1].endswith(": 1 problem"), lines
        with precompile.staging(root, fakes.STACK) as stage:
            assert not dead.exists() and running.exists()
            assert precompile.stale_stages(root) == []  # ours is in use too
        assert not stage.exists()
    rc, lines = verify(root)  # its precompile is gone now
    assert rc == 1 and lines[0].startswith(f"{running.name}: left by a precompile that did not")
