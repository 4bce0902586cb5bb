"""Compiling for a GPU this machine does not have, into a cache another Triton reads.

A compile-only Triton target, the disk-cache keys another Triton build of the same
release computes, and the installation of a plan's kernels into a shared cache
directory. Used by ``tq-warmup precompile``, the ``real_vllm`` tests and
``.ci/check-vllm.py``; never by a worker, which compiles for the GPU it runs on
(``warmers/triton_jit``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import shutil
import stat
import tempfile
import types
import uuid
import zipfile
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

from .. import compat, safe_io
from ..atomic import UnsafeWrite, replace_dir, write_file
from . import manifest

__all__ = [
    "ALIVE_FILE",
    "LOCK_FILE",
    "STAGE_PREFIX",
    "InstallError",
    "WheelError",
    "cache_keys_for",
    "install",
    "refusal",
    "staging",
    "stale_stages",
    "target_stack",
    "triton_key_of",
    "triton_key_of_wheel",
    "use_compile_only_target",
    "wheel_tags",
]


def refusal(
    installed: Mapping[str, str | None],
    image_vllm: str | None,
    image_triton: str | None,
    wheel_release: str | None,
    vllm_version: str | None,
    report: tuple[str, str | None, bool] | None = None,
) -> str | None:
    """Why ``precompile`` must not build here, in one line, or None (pure).

    It compiles the *installed* kernel sources with the *installed* Triton, so it refuses
    what would build a cache the image cannot use: vLLM or Triton missing; an image
    release (``--image-vllm``, ``--image-triton``, the image's Triton wheel) other than
    the installed one; a ``--vllm-version`` other than the installed one; a startup
    report (``report``: its path, its vLLM version, whether it came from HIP) of another
    release or from ROCm, whose keys carry the storage-size flag (``keys``)."""
    missing = " and ".join(k for k in ("vllm", "triton") if installed.get(k) is None)
    if missing:
        return f"precompile compiles the installed kernels: {missing} not installed"
    triton_given = image_triton is not None and wheel_release is not None
    if triton_given and str(image_triton).removeprefix("v") != wheel_release:
        return f"--image-triton {image_triton} but the wheel is Triton {wheel_release}"
    wanted = {"vllm": image_vllm, "triton": image_triton or wheel_release}
    for name, want in wanted.items():
        if want is not None and not compat.same_release(want, installed[name]):
            return (
                f"refusing: the image runs {name} {want} but {installed[name]} is installed "
                "here; Triton's cache is only valid for the same Triton and kernel sources"
            )
    if vllm_version is not None and not compat.same_release(vllm_version, installed["vllm"]):
        return (
            f"refusing: --vllm-version {vllm_version} but vLLM {installed['vllm']} is "
            "installed here, and precompile builds the installed kernel sources (run it "
            f"where vLLM {vllm_version} is installed; inspect plans for any release)"
        )
    if report is not None:
        path, version, hip = report
        if hip:
            return (
                f"refusing: --geometry-json {path} comes from a ROCm (HIP) startup, whose "
                "keys carry the storage-size flag; precompile builds for a CUDA --arch"
            )
        if version is None or not compat.same_release(version, str(installed["vllm"])):
            return (
                f"refusing: --geometry-json {path} comes from vLLM {version} but vLLM "
                f"{installed['vllm']} is installed here; the geometry and kernel sources "
                "differ between releases"
            )
    return None


STAGE_PREFIX = ".tq-warmup-stage-"
LOCK_FILE = ".tq-warmup.lock"
ALIVE_FILE = ".alive"  # in a stage, locked by the precompile that uses it
_GROUP_GLOB = f"{compat.GROUP_PREFIX}*.json"  # the files naming a kernel's files (compat.triton)


def use_compile_only_target(arch: int) -> None:
    """Point Triton at ``cuda:sm<arch>`` on a host without that GPU.

    Triton needs an active driver to pick the compile target and a device for its
    in-memory cache; this one provides both and can launch nothing, which
    ``warmup`` never asks it to (process-wide, so only for ``precompile``, the tests
    and CI's smoke check).
    """
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class CompileOnlyDriver(DriverBase):  # type: ignore[misc]
        def __init__(self) -> None:
            self.target = GPUTarget("cuda", arch, 32)

        @classmethod
        def is_active(cls) -> bool:
            return False

        def get_current_target(self) -> Any:
            return self.target

        def get_current_device(self) -> int:
            return 0

        def set_current_device(self, device: int) -> None:
            pass

        def get_current_stream(self, device: Any = None) -> int:
            return 0

        def get_active_torch_device(self) -> Any:
            return torch.device("cpu")

        def get_device_interface(self) -> Any:
            return torch.cuda

        def get_benchmarker(self) -> Any:
            raise NotImplementedError("compile-only driver")

        def map_python_to_cpp_type(self, ty: str) -> str:
            raise NotImplementedError("compile-only driver")

    triton.runtime.driver.set_active(CompileOnlyDriver())


def triton_key_of(site_packages: str | Path) -> str:
    """``triton_key()`` of another installation of the same Triton release.

    Triton's on-disk cache key starts with ``triton_key()``, a hash of the files of
    the installation it runs from, ``libtriton`` included, which differs between
    the wheels for two Python versions. Triton's own function (3.6-3.8, in
    ``triton.runtime.cache``) is re-run with ``__file__`` pointing into the other tree.
    """
    from triton.runtime import cache as triton_cache

    fn = triton_cache.triton_key.__wrapped__
    scope = dict(fn.__globals__)
    scope["__file__"] = str(Path(site_packages) / "triton" / "runtime" / "cache.py")
    return str(types.FunctionType(fn.__code__, scope)())


class WheelError(ValueError):
    """A file that is not a Triton wheel; the message is the one-line reason."""


def wheel_tags(path: str | Path) -> tuple[str, str]:
    """The Triton release and ABI tag (``cp312``) of a Triton wheel, after checking the
    file is one: a wheel name (``triton-3.6.0-cp312-cp312-manylinux_2_27_x86_64.whl``:
    name, version, python, abi, platform) and a zip holding ``triton/runtime/cache.py``,
    the module ``triton_key_of`` reads. Raises WheelError."""
    wheel = Path(path)
    if not wheel.is_file():
        raise WheelError("no such file")
    fields = wheel.name.removesuffix(".whl").split("-")
    if not wheel.name.endswith(".whl") or len(fields) < 5 or fields[0] != "triton":
        raise WheelError("not a Triton wheel name (triton-<version>-<python>-<abi>-<platform>.whl)")
    try:
        with zipfile.ZipFile(wheel) as archive:
            if "triton/runtime/cache.py" not in archive.namelist():
                raise WheelError("has no triton/runtime/cache.py")
    except (zipfile.BadZipFile, OSError) as exc:
        raise WheelError(f"not a readable wheel ({exc})") from None
    return fields[1], fields[-2]


def target_stack(arch: int | None, wheel: str | None, wheel_key: str | None) -> manifest.Stack:
    """The stack the image runs: the installed one, with the image's Triton build
    (``wheel_key``, its ``triton_key()``) and Python when a wheel names them."""
    here = manifest.installed_stack(arch=arch)
    if wheel is None or wheel_key is None:
        return here
    return dataclasses.replace(
        here, triton_build=manifest.triton_build(wheel_key), python_abi=wheel_tags(wheel)[1]
    )


def triton_key_of_wheel(wheel: str | Path, into: str | Path) -> str:
    """``triton_key()`` of a Triton wheel, unpacked under ``into``."""
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(into)
    return triton_key_of(into)


@contextlib.contextmanager
def cache_keys_for(key: str) -> Iterator[None]:
    """Store compiled kernels under the disk-cache keys another Triton build of the
    same release computes (the binaries are identical; only the key differs)."""
    from triton.runtime import cache as triton_cache

    original = triton_cache.triton_key
    triton_cache.triton_key = lambda: key
    try:
        yield
    finally:
        triton_cache.triton_key = original


# --------------------------------------------------------------------------
# Installing a plan into a cache directory that others read and write at once
# --------------------------------------------------------------------------


@contextlib.contextmanager
def _locked(cache_dir: Path) -> Iterator[None]:
    """Serialize the installs of concurrent precompiles into one directory (compiles
    run in parallel): each decides what to keep and hashes what it lists while no
    other replaces a key directory under it."""
    fd = _open_lock(cache_dir / LOCK_FILE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _open_lock(path: Path) -> int:
    """The lock file, created if missing, never through a symlink and never anything but
    a regular file: a planted link to another file (or to a FIFO) would otherwise have
    ``precompile`` create or block on whatever it names (issue 30)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):
            raise OSError(
                exc.errno, f"{path.name} is a symlink: refused, no lock is taken through one"
            ) from None
        if exc.errno == errno.ENXIO:
            raise OSError(exc.errno, f"{path.name} is not a regular file: refused") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{path.name} is not a regular file: refused")
    return fd


def _stage_in_use(stage: Path) -> bool:
    """Whether a precompile still runs in ``stage``: it holds an ``flock`` on the
    stage's ``ALIVE_FILE`` for as long as it lives, and the kernel drops it when the
    process dies, SIGKILL included. A stage without that file predates it or died
    before making it (stages are made under the directory's lock, with the file)."""
    try:
        fd = safe_io.open_dir(str(stage))
    except safe_io.UnsafeFile:
        return False
    try:
        alive = os.open(ALIVE_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    except OSError:
        return False
    finally:
        os.close(fd)
    try:
        fcntl.flock(alive, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(alive)
    return False


def stale_stages(cache_dir: Path) -> list[Path]:
    """The stage directories in ``cache_dir`` left by a precompile that did not finish
    (killed, or its machine lost): ``tq-warmup verify`` names them."""
    try:
        with os.scandir(cache_dir) as entries:
            stages = [Path(e.path) for e in entries if e.name.startswith(STAGE_PREFIX)]
    except OSError:
        return []
    return sorted(p for p in stages if not _stage_in_use(p))


@contextlib.contextmanager
def staging(cache_dir: Path, target: manifest.Stack) -> Iterator[Path]:
    """A private directory inside ``cache_dir`` (same file system: ``os.rename``
    works) for Triton to compile into, removed afterwards whatever happens; made
    under the directory's lock, which also removes the stages of precompiles that
    died (``stale_stages``).

    It starts with hard links to every key directory of ``cache_dir`` that a manifest
    for ``target`` vouches for, file by file, so Triton finds what an earlier
    precompile built ("already there") instead of compiling it again; a corrupt one
    is left out and compiled anew."""
    with contextlib.ExitStack() as stack:
        with _locked(cache_dir):
            for stale in stale_stages(cache_dir):
                shutil.rmtree(stale, ignore_errors=True)
            stage = Path(tempfile.mkdtemp(prefix=STAGE_PREFIX, dir=cache_dir))
            try:
                alive = open(stage / ALIVE_FILE, "w")  # noqa: SIM115 (closed by the stack)
            except OSError:
                shutil.rmtree(stage, ignore_errors=True)
                raise
            stack.enter_context(alive)  # closed (unlocked) after the stage is removed
            stack.callback(shutil.rmtree, stage, ignore_errors=True)
            fcntl.flock(alive, fcntl.LOCK_EX)
            _link_vouched(cache_dir, stage, target)
        yield stage


def _link_vouched(cache_dir: Path, stage: Path, target: manifest.Stack) -> None:
    for path in manifest.manifest_files(cache_dir):
        try:
            found = manifest.read(path)
        except manifest.ManifestError:
            continue
        if manifest.stack_problems(found, target):
            continue
        for key, files in found.files.items():
            if (stage / key).exists() or manifest.key_dir_problems(cache_dir, key, files):
                continue
            (stage / key).mkdir()
            for name in files:
                try:
                    os.link(cache_dir / key / name, stage / key / name, follow_symlinks=False)
                except OSError:  # a file system without hard links
                    shutil.copy2(cache_dir / key / name, stage / key / name, follow_symlinks=False)


def _point_groups_at(key_dir: Path, final: Path) -> None:
    """Make the group files name the files where they will be installed: Triton's own
    manager opens the recorded paths (3.8.0 misses when one is gone, 3.6.0/3.7.1 drop
    it), and ``TRITON_CACHE_DIR`` at the cache directory must find them. Written as a
    new file, so a hard link into the cache directory is never changed in place."""
    for group in key_dir.glob(_GROUP_GLOB):
        data = json.loads(group.read_text())
        children = data.get("child_paths")
        if not isinstance(children, dict):
            continue
        moved = {name: str(final / name) for name in children}
        if moved != children:
            tmp = group.with_name(f".{group.name}.{uuid.uuid4().hex}")
            tmp.write_text(json.dumps({**data, "child_paths": moved}))
            os.replace(tmp, group)


def _move_into_place(ours: Path, final: Path, trash: Path) -> Path | None:
    """One ``os.rename`` of a whole key directory (``atomic.replace_dir``): a reader sees
    the old directory, none, or ours, never a half-written one. A non-empty old one
    (corrupt or incomplete: see ``install``) is first renamed away into ``trash``: where
    it went is returned. Installs hold the directory's lock, so at most one is."""
    aside = replace_dir(ours, final, lambda: trash / f"replaced-{uuid.uuid4().hex}")
    return aside[0] if aside else None


class InstallError(Exception):
    """An install that could not finish and was rolled back; the message is one line."""


def install(
    cache_dir: Path,
    stage: Path,
    key_dirs: Collection[str],
    plan: Mapping[str, Any],
    target: manifest.Stack,
) -> Path:
    """Move this plan's key directories from ``stage`` into ``cache_dir`` and write its
    manifest (``atomic.write_file``: a temporary file, then a rename), listing the
    installed files.

    A key directory already there is kept when its files equal ours, or equal what
    a manifest of the directory lists for it (Triton's compile is deterministic: two
    builds of one key differ only in the paths their group files record, which
    ``_point_groups_at`` makes equal); otherwise it is incomplete or corrupt and
    ours replaces it.

    The manifest comes last, and a failure before it is there (a full disk: the
    manifest or a group file cannot be written) moves every key directory this call
    moved in back out and puts back what it replaced, so no key directory of this
    build is left without its manifest; ``InstallError`` says so in one line. An
    interrupt rolls back the same way and goes on up. A
    reader meanwhile sees key directories that no manifest lists yet, which are not
    served (``shipped.trust``)."""
    with _locked(cache_dir):
        moved: list[tuple[str, Path | None]] = []  # (key, what it replaced, in the stage)
        try:
            vouched: dict[str, list[dict[str, manifest.Listed]]] = {}
            for path in manifest.manifest_files(cache_dir):
                with contextlib.suppress(manifest.ManifestError):
                    for key, listed in manifest.read(path).files.items():
                        vouched.setdefault(key, []).append(dict(listed))
            for key in sorted(key_dirs):
                ours, final = stage / key, cache_dir / key
                if not ours.is_dir():
                    continue
                _point_groups_at(ours, final)
                there = manifest.key_dir_hashes(final)
                if there and (
                    there == manifest.key_dir_hashes(ours) or there in vouched.get(key, [])
                ):
                    continue
                moved.append((key, _move_into_place(ours, final, stage)))
            installed = {key: manifest.key_dir_hashes(cache_dir / key) for key in key_dirs}
            data = manifest.build(target, plan, {k: v for k, v in installed.items() if v})
            file = cache_dir / manifest.file_name(data)
            write_file(file, json.dumps(data, indent=2).encode())
            return file
        except BaseException as exc:  # an interrupt (SIGINT, SIGTERM: cli) rolls back too
            _roll_back(cache_dir, stage, moved)
            if not isinstance(exc, (OSError, UnsafeWrite)):
                raise
            why = (exc.strerror if isinstance(exc, OSError) else None) or exc
            raise InstallError(
                f"cannot install into {cache_dir}: {why}; rolled back, "
                "nothing of this build was installed"
            ) from None


def _roll_back(cache_dir: Path, stage: Path, moved: list[tuple[str, Path | None]]) -> None:
    """Undo ``install``'s renames, newest first (a rename needs no free space)."""
    for key, replaced in reversed(moved):
        with contextlib.suppress(OSError):
            os.rename(cache_dir / key, stage / f"rolled-back-{uuid.uuid4().hex}")
            if replaced is not None:
                os.rename(replaced, cache_dir / key)
