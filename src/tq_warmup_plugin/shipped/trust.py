"""What a shipped Triton cache layer may serve in this process: its trust model.

The layered cache (``layered_cache``) asks here, on each lookup in a layer, whether a
key directory is served and from where. A layer holds machine code the GPU will run,
and is read by every Triton compile of the process, TurboQuant or not; it is treated
as hostile (a hostile image builder, a shared volume, a full disk: issue 20).

* **What a layer must be**: a directory of key directories, each of regular files
  inside it (no symlink, FIFO or device, at the sizes the manifest records), and the
  manifests, each a regular file of at most 64 MiB and 64 levels (``safe_io``).
* **What is served is what was hashed**: on a key's first lookup its listed files are
  read once (bounded, ``O_NOFOLLOW``), hashed, and written to a private directory of
  this process (``mkdtemp`` in ``/dev/shm``, else, where it is mounted ``noexec`` or
  once a write there fails, ``TMPDIR``: mode 0700, removed at exit, and what a killed
  process of this user left there is removed by the next one; never in a directory
  another user owns or may write without the sticky bit, which one of this user's gets);
  Triton is handed paths there, never into the layer. Chosen over refusing layer files
  that others can write: Triton opens the returned path later, by name, so a check of
  the layer's modes or owner at hash time cannot bind the bytes Triton reads then (a
  file, or a whole key directory, swapped after the first lookup was served; issue 20),
  and the owner (root, in an image) can still write; a copy binds them by construction.
  It costs one write of the kernel's files (0.02-0.5 MiB) per key and process
  (``python -m benchmarks.tqbench layer-check-cost``).
* Files a manifest does not list are never served: only the listed ones are copied.
* **Any failure reading a manifest costs only that manifest**: one WARNING naming the
  layer and the manifest, remembered for the process; nothing raises into Triton. The
  first lookup reads at most ``MAX_MANIFESTS`` manifests for at most ``READ_BUDGET_S``
  (the first always): what is left is one WARNING naming the limit.
* A layer without any manifest (a plain Triton cache, or a precompile that died
  before its manifest) is one WARNING and not served, unless
  ``TQ_WARMUP_CACHE_UNVERIFIED=1`` (``settings``) and no ``TQ_WARMUP_CACHE_PIN`` is set
  (a pin closes that door too); then its regular files are copied unchecked. A layer
  that is, lies inside or holds ``TRITON_CACHE_DIR`` is one WARNING: Triton's own
  lookups read that directory unchecked.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..atomic import UnsafeWrite, abandoned, claim_directory, hold
from ..settings import load as load_settings
from . import manifest, pins

__all__ = ["OWNER", "PREFIX", "SHM", "layer_trust", "private_root", "sweep", "warn_once"]

logger = logging.getLogger("vllm.tq_warmup_plugin")

_lock = threading.Lock()
_warned: set[tuple[str, str]] = set()


def warn_once(problem: str, path: str, message: str, *args: object) -> None:
    """One WARNING per (problem, path) and process."""
    with _lock:
        if (problem, path) in _warned:
            return
        _warned.add((problem, path))
    logger.warning(message, *args)


_private_roots: dict[int, str] = {}  # pid -> this process's copies of served files

SHM = "/dev/shm"
"""Where the copies go first: memory, where a key is copied a few times faster than to a
disk ``/tmp`` (commit 300e231); ``tempfile``'s directory when it fails."""
PREFIX = "tq-warmup-layer-"
OWNER = ".owner"
"""A private directory's marker: ``<pid namespace inode> <pid> flock`` of the process it
is for, written once that process holds the directory's ``flock`` (``atomic.hold``)."""
LOCKED = "flock"
_held: dict[str, int] = {}  # this process's private directories -> the descriptor holding each
MAX_SWEPT = 256  # directories looked at per sweep: a startup never walks a huge /dev/shm
MAX_MANIFESTS = 64
"""Manifests of one layer read at its first lookup; the rest are one WARNING (a layer has
one per ``precompile``: a fleet's layer holds a few)."""
READ_BUDGET_S = 2.0
"""How long the first lookup in a layer reads its manifests before it stops, one WARNING
(as ``driver.startup.READ_BUDGET_S``): 64 manifests of 64 MiB each would hold that
lookup, and the compile behind it, for minutes."""


def private_root() -> str | None:
    """This process's directory of served copies, if it made one."""
    with _lock:
        return _private_roots.get(os.getpid())


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "?"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process, or not ours to ask: alive
        return True
    return True


def _owner(entry: os.DirEntry[str]) -> list[str] | None:
    """The owner marker of ``entry`` if it is a private directory of this user's (never a
    symlink, another user's, or one not finished: no marker yet)."""
    if not entry.name.startswith(PREFIX) or not entry.is_dir(follow_symlinks=False):
        return None
    if entry.stat(follow_symlinks=False).st_uid != os.getuid():
        return None
    try:
        fd = os.open(os.path.join(entry.path, OWNER), os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as fh:
            return fh.read(64).decode("ascii", "replace").split()
    except OSError:
        return None


def _dead_pid(owner: list[str], namespace: str) -> bool:
    """An older release's marker (``<namespace> <pid>``, no lock held): its process of
    this PID namespace is dead. Another namespace's is left alone: its PIDs say nothing."""
    if len(owner) != 2 or owner[0] != namespace or not owner[1].isdigit():
        return False
    pid = int(owner[1])
    return pid != os.getpid() and not _alive(pid)


def sweep(parent: str) -> list[str]:
    """Remove what dead processes of this user left in ``parent`` (at most ``MAX_SWEPT``
    entries looked at); the paths removed. A directory is dead when no process holds its
    ``flock`` (``atomic.hold``): that proof holds across PID namespaces, so what a killed
    container left in a ``/dev/shm`` the next one shares is removed too. A SIGKILL, or
    SIGTERM with Python's default handler, skips the atexit removal."""
    namespace, removed = _pid_namespace(), []
    try:
        with os.scandir(parent) as entries:
            for n, entry in enumerate(entries):
                if n >= MAX_SWEPT:
                    break
                owner = _owner(entry)
                if owner is None:
                    continue
                if owner[2:] == [LOCKED]:
                    held = abandoned(entry.path)
                    if held is None:  # alive (or not a directory any more)
                        continue
                    try:
                        shutil.rmtree(entry.path, ignore_errors=True)  # never follows a link
                    finally:
                        os.close(held)
                elif _dead_pid(owner, namespace):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    continue
                removed.append(entry.path)
    except OSError:
        pass
    return removed


def _new_root(base: str | None) -> str:
    """A fresh private directory (``mkdtemp``: 0700) in ``base`` (None: ``TMPDIR``),
    marked with its owner; OSError when ``base`` cannot hold it (a full ``/dev/shm``) or
    another user could swap it there (``atomic.claim_directory``: another user's, or one
    others may write without the sticky bit that is not this user's, whose owner or
    writers could rename the 0700 directory away and put one of theirs at its name,
    whose files Triton then loads). One of this user's that others may write (the
    emptyDirs ``deploy/kubernetes.yaml`` mounts at ``/dev/shm`` and ``/tmp``) gets the
    sticky bit, one INFO line."""
    parent = tempfile.gettempdir() if base is None else base
    try:
        claimed = claim_directory(parent)
    except UnsafeWrite as exc:
        raise PermissionError(f"{exc}: another user could swap the copies") from None
    if claimed:
        logger.info(claimed)
    made = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=parent)
    try:
        _held[made] = hold(made)  # before the marker: a sweep never sees it unheld
        fd = os.open(os.path.join(made, OWNER), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(f"{_pid_namespace()} {os.getpid()} {LOCKED}\n")
    except OSError:
        shutil.rmtree(made, ignore_errors=True)
        _release(made)
        raise
    return made


def _release(path: str) -> None:
    fd = _held.pop(path, None)
    if fd is not None:
        os.close(fd)


def _make_private_root() -> str:
    """This process's directory of served copies, made on first need, removed at exit
    by the process that made it (a forked child makes its own); first what dead
    processes left beside it is swept away. In ``SHM`` where it can be, else ``TMPDIR``:
    not in a ``SHM`` mounted ``noexec`` (Docker's default), where the host launchers a
    layer ships (``compat.build_host_launcher``, native code Triton ``dlopen``s) would not
    load and Triton would build each again."""
    pid = os.getpid()
    with _lock:
        if pid not in _private_roots:
            try:
                if not _executable_mount(SHM):
                    raise OSError(f"{SHM} is mounted noexec")
                made = _new_root(SHM)
            except OSError:
                made = _new_root(None)
            sweep(os.path.dirname(made))
            _private_roots[pid] = made
            atexit.register(_remove, pid, made)
        return _private_roots[pid]


def _executable_mount(path: str) -> bool:
    """Whether files under ``path`` may be mapped executable (its mount has no ``noexec``)."""
    try:
        return not os.statvfs(path).f_flag & os.ST_NOEXEC
    except (OSError, AttributeError):
        return False


def _to_tmpdir(failed: str, exc: OSError) -> str:
    """After a write into ``SHM`` failed (full): this process's copies go to ``TMPDIR``
    from now on, said in one WARNING."""
    pid = os.getpid()
    with _lock:
        if _private_roots.get(pid) == failed:  # kept to exit: other threads were handed
            _private_roots[pid] = made = _new_root(None)  # paths in it, which Triton opens
            atexit.register(_remove, pid, made)
    warn_once(
        "shm",
        SHM,
        "tq-warmup: cannot write served kernel copies in %s (%s): using %s instead",
        SHM,
        exc.strerror or exc,
        tempfile.gettempdir(),
    )
    return _private_roots[pid]


def _remove(pid: int, path: str) -> None:
    if os.getpid() == pid:
        shutil.rmtree(path, ignore_errors=True)
        _release(path)


def _write(target: str, data: dict[str, bytes]) -> None:
    partial = f"{target}.{threading.get_ident()}"
    os.makedirs(partial, mode=0o700)
    try:
        for name, content in data.items():
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
            fd = os.open(os.path.join(partial, name), flags, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(content)
        os.rename(partial, target)
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _copy(root: str, key: str, data: dict[str, bytes]) -> str:
    """Write the hashed bytes of one key directory into this process's private
    directory; the directory Triton is handed for it. A write that fails in ``SHM``
    (full) moves the private directory to ``TMPDIR`` and is made again there."""
    private, layer = _make_private_root(), manifest.digest(root)[:16]
    target = os.path.join(private, layer, key)
    try:
        _write(target, data)
    except OSError as exc:
        if not private.startswith(os.path.join(SHM, "")):
            raise
        target = os.path.join(_to_tmpdir(private, exc), layer, key)
        _write(target, data)
    return target


@dataclass
class _Trust:
    """What one layer may serve in this process."""

    root: str
    listed: dict[str, list[tuple[str, dict[str, manifest.Listed]]]] | None
    """Key directory -> (manifest, files) of each manifest that holds here and lists it;
    ``None``: the layer has no manifest and is served unverified (opted in)."""
    verdicts: dict[str, tuple[str, frozenset[str]] | None] = field(default_factory=dict)
    """Key directory -> (its private copy, the file names served), or None: not served."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def serves(self, key: str) -> tuple[str, frozenset[str]] | None:
        """Where ``key``'s served files are, if it is served; its files are read, hashed
        and copied on the first call for it: a worker reads a few of a layer's keys
        (``python -m benchmarks.tqbench layer-check-cost``)."""
        with self.lock:  # compile threads ask for the same key at once
            if key not in self.verdicts:
                self.verdicts[key] = self._check(key)
            return self.verdicts[key]

    def _check(self, key: str) -> tuple[str, frozenset[str]] | None:
        if self.listed is None:
            checked = [("", manifest.load_key_dir(self.root, key, None))]
        else:
            checked = [
                (n, manifest.load_key_dir(self.root, key, f)) for n, f in self.listed.get(key, [])
            ]
        if not checked:  # not listed by a manifest that holds: not part of what was shipped
            return None
        if self.listed is None and checked[0][1][1]:  # unverified: a miss, nothing to warn
            return None
        for _, (data, problems) in checked:
            if not problems and data:
                try:
                    return _copy(self.root, key, data), frozenset(data)
                except OSError as exc:
                    warn_once(
                        "private copy",
                        self.root,
                        "tq-warmup: cannot copy Triton cache layer %s's kernels into a private "
                        "directory of this process (%s); they are not used and compile into "
                        "Triton's cache directory",
                        self.root,
                        exc,
                    )
                    return None
        name, (_, problems) = checked[0]
        for problem in problems:
            logger.warning(
                "tq-warmup: Triton cache layer %s, %s: %s; that kernel is not used and "
                "compiles into Triton's cache directory",
                self.root,
                name,
                problem,
            )
        return None


_trusts: dict[tuple[int, str], _Trust] = {}  # (pid, layer): a forked child checks anew
_trust_lock = threading.Lock()


def _running_driver() -> Any | None:
    """Triton's active driver if it exists already, else None; never creates it.

    Triton makes a cache manager while it creates its driver (``CudaDriver`` ->
    ``CudaUtils`` -> ``compile_module_from_src``, 3.6-3.8), so a lookup may come from
    inside ``driver.active``. Asking ``driver.active`` there created a second driver
    inside the first, whose utils build asked this cache again and waited on
    ``_trust_lock`` forever: the first engine with the layer hung at startup (vLLM 0.26.0,
    Triton 3.6.0, ``benchmarks/results/shipped/2026-12-01-h200-vllm0.26.0-hang.md``).
    ``DriverConfig`` keeps ``_active`` and ``_default`` in 3.6.0, 3.7.1 and 3.8.0."""
    from triton.runtime.driver import driver as config

    return getattr(config, "_active", None) or getattr(config, "_default", None)


def _running_arch(active: Any) -> int | str | None:
    """The target this process compiles for; ``None`` if the driver cannot say."""
    try:
        arch: int | str = active.get_current_target().arch
    except Exception:  # no usable driver: arch is not checked (Triton's key has it anyway)
        return None
    return arch


def _running_stack(active: Any) -> manifest.Stack:
    return manifest.installed_stack(arch=_running_arch(active))


def layer_trust(root: str) -> _Trust | None:
    """Read and check ``root``'s manifests, once per process (the first lookup after
    Triton's driver exists). ``None`` before it exists: that lookup is the driver's own
    utils build, which no manifest lists, so the layer serves nothing to it. Whatever
    fails here is remembered as a layer that serves nothing, with one WARNING."""
    with _trust_lock:
        if (os.getpid(), root) in _trusts:
            return _trusts[os.getpid(), root]
        active = _running_driver()
        if active is None:
            return None
        try:
            trust = _read_layer(root, active)
        except Exception as exc:  # never into Triton: this layer serves nothing
            logger.warning(
                "tq-warmup: Triton cache layer %s cannot be checked (%s: %s); nothing in it "
                "is used",
                root,
                type(exc).__name__,
                exc,
            )
            trust = _Trust(root, {})
        _trusts[os.getpid(), root] = trust
        return trust


def _read_layer(root: str, active: Any) -> _Trust:
    files = manifest.manifest_files(root)
    pinned = pins.current()  # TQ_WARMUP_CACHE_PIN: only the manifests it names
    if not files:
        if load_settings().cache_unverified and pinned is not None:
            logger.warning(
                "tq-warmup: Triton cache layer %s has no tq-warmup manifest: nothing in it is "
                "used (%s is set: TQ_WARMUP_CACHE_UNVERIFIED=1 serves nothing unpinned)",
                root,
                pins.PIN_ENV,
            )
            return _Trust(root, {})
        if load_settings().cache_unverified:
            logger.warning(
                "tq-warmup: Triton cache layer %s has no tq-warmup manifest: its kernels are "
                "used unverified (TQ_WARMUP_CACHE_UNVERIFIED=1)",
                root,
            )
            return _Trust(root, None)
        logger.warning(
            "tq-warmup: Triton cache layer %s has no tq-warmup manifest: nothing in it is "
            "used (tq-warmup precompile writes one; TQ_WARMUP_CACHE_UNVERIFIED=1 serves a "
            "plain Triton cache unverified)",
            root,
        )
        return _Trust(root, {})
    found: dict[str, manifest.Manifest] = {}
    deadline = time.monotonic() + READ_BUDGET_S
    for i, path in enumerate(files):
        over = i >= MAX_MANIFESTS or (i > 0 and time.monotonic() > deadline)
        if over:
            limit = (
                f"the first {MAX_MANIFESTS}"
                if i >= MAX_MANIFESTS
                else f"{READ_BUDGET_S:g} s of reading (the first {i})"
            )
            logger.warning(
                "tq-warmup: Triton cache layer %s: %d manifests past %s not read; what "
                "they list compiles (ship one layer per fleet)",
                root,
                len(files) - i,
                limit,
            )
            break
        try:
            found[path.name] = manifest.read(path, pinned)
        except Exception as exc:  # ManifestError; anything else costs this manifest too
            logger.warning(
                "tq-warmup: Triton cache layer %s: %s is not a usable manifest (%s); "
                "nothing it lists is used",
                root,
                path.name,
                exc,
            )
    try:
        running = _running_stack(active)
    except Exception as exc:  # never fail a compile: check the files only
        logger.warning(
            "tq-warmup: cannot read this process's vLLM/Triton stack (%s): Triton cache "
            "layer %s is checked file by file only",
            exc,
            root,
        )
        running = manifest.Stack()
    other = manifest.for_other_arch(found, running)
    listed: dict[str, list[tuple[str, dict[str, manifest.Listed]]]] = {}
    for name, shipped in found.items():
        problems = [] if name in other else manifest.stack_problems(shipped, running)
        for problem in problems:
            logger.warning(
                "tq-warmup: Triton cache layer %s, %s: %s; none of its %d kernels is used",
                root,
                name,
                problem,
                len(shipped.files),
            )
        if problems or name in other:
            continue
        for key, names in shipped.files.items():
            listed.setdefault(key, []).append((name, dict(names)))
    return _Trust(root, listed)
