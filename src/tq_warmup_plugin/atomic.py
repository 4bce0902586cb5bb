"""The plugin's writes: one atomic file write (``write_file``) and one atomic
directory replace (``replace_dir``).

``write_file`` is how every file the plugin writes at a path someone else chose (the
JSON report of ``TQ_WARMUP_REPORT``, a precompiled layer's manifests) is written, the way
a careful daemon writes:

* the directory it goes into is opened once and everything after is relative to that
  descriptor; it must be this user's or root's, and not writable by group or others
  unless it has the sticky bit (``/tmp``): in a 0777 directory (a Kubernetes emptyDir)
  another user could swap the name for a link between any check and the write. One of
  this user's gets the sticky bit (``claim_directory``), as ``driver.startup`` gives its
  copy's base: an emptyDir is the pod user's;
* a target that exists and is not a regular file (a symlink, a FIFO, a device, a
  directory) is refused, never opened: a FIFO without a reader blocks an ``open`` for
  writing for ever, a symlink would have this (often root) process overwrite whatever it
  names;
* the bytes go to a new file beside it (``O_CREAT | O_EXCL | O_NOFOLLOW | O_NONBLOCK``,
  never an existing inode), are ``fsync``-ed and renamed into place: a reader sees the
  old file or the new one, never half of one.

Every refusal and every failure is one ``UnsafeWrite`` whose message is the reason in a
few words, for a WARNING or a ``tq-warmup:`` line.

``replace_dir`` serves the two writers of shipped directories (``shipped.precompile``'s
key directories and ``driver.entry``'s entries). A reader of a shared directory must see
the old directory, none, or the new one, never a half-written one: the new one is built
beside the old one on the same file system and moved in with one ``os.rename``.
``rename`` does not replace a non-empty directory, so an old one is first renamed aside;
another writer may put its own back in between, hence the bounded retry.

``hold`` and ``abandoned`` are how a directory's owner says it is alive: it holds an
``flock`` on the directory for as long as it uses it, and the kernel drops the lock when
the last descriptor closes, SIGKILL included. A PID is no such proof: a new container (a
new PID namespace over the same ``/dev/shm``) reuses the PIDs of the one before, and
another process may have any dead one's.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import uuid
from collections.abc import Callable
from pathlib import Path

from .safe_io import kind_of

__all__ = [
    "UnsafeWrite",
    "abandoned",
    "claim_directory",
    "directory_problem",
    "hold",
    "replace_dir",
    "write_file",
]

ATTEMPTS = 3


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def hold(path: str | os.PathLike[str], shared: bool = False) -> int:
    """A descriptor of the directory ``path`` holding an ``flock`` on it (exclusive, or
    ``shared`` among users of it) until it is closed, by the process or by its death; a
    child forked without ``exec`` shares it. OSError when it cannot be had at once."""
    import fcntl  # only where a directory is held: register() imports this module

    fd = os.open(path, _DIR_FLAGS)
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd


def abandoned(path: str | os.PathLike[str]) -> int | None:
    """A descriptor holding the exclusive ``flock`` of the directory ``path`` when no one
    holds any (its owners are dead: it may be removed, under this descriptor, which the
    caller closes), else None: in use, a link, or not there."""
    try:
        return hold(path)
    except OSError:
        return None


def replace_dir(staged: Path, final: Path, aside: Callable[[], Path]) -> list[Path]:
    """Move the complete directory ``staged`` to ``final``; where ``final`` held a
    directory, it is first renamed to a fresh ``aside()`` path (on the same file system).
    Returns the paths it moved aside, oldest first (empty when ``final`` was free), for
    the caller to remove or to put back on a rollback. Raises OSError when another
    writer keeps putting a directory at ``final``, or on any other rename failure."""
    moved: list[Path] = []
    for _ in range(ATTEMPTS):
        try:
            os.rename(staged, final)
            return moved
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        target = aside()
        try:
            os.rename(final, target)
        except FileNotFoundError:  # another writer moved it first: try again
            continue
        moved.append(target)
    raise OSError(errno.EEXIST, f"{final} keeps being replaced by another writer")


class UnsafeWrite(Exception):
    """A file that was not written; the message is the reason, in a few words."""


_CREATE = (
    os.O_WRONLY
    | os.O_CREAT
    | os.O_EXCL
    | os.O_NONBLOCK
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
)
_DIRECTORY = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)


def directory_problem(info: os.stat_result, where: str, uid: int | None = None) -> str | None:
    """Why the directory ``where`` (its ``stat``) is no place for this user's files, or
    None: it must be this user's or root's, and closed to writes by others unless it has
    the sticky bit."""
    uid = os.geteuid() if uid is None else uid
    if info.st_uid not in (0, uid):
        return f"directory {where} belongs to another user (uid {info.st_uid})"
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        return (
            f"directory {where} is writable by others (mode {stat.S_IMODE(info.st_mode):o}) "
            "without the sticky bit"
        )
    return None


def claim_directory(where: str, dir_fd: int | None = None) -> str | None:
    """Make sure directory ``where`` (open as ``dir_fd``, if given) may hold this user's
    files: None where it may as it is; where it is this user's and others may write it
    without the sticky bit (a Kubernetes emptyDir is root's and 0777), the sticky bit is
    set, as ``/tmp`` has it, so that nobody else can rename or remove what this user makes
    in it, and the line saying so is returned (for an INFO line); ``UnsafeWrite`` where
    another user owns it, or may write it and this user cannot set the bit."""
    info = os.stat(where) if dir_fd is None else os.fstat(dir_fd)
    problem = directory_problem(info, where)
    if problem is None:
        return None
    if info.st_uid != os.geteuid() or not stat.S_ISDIR(info.st_mode):
        raise UnsafeWrite(problem)
    mode = stat.S_IMODE(info.st_mode) | stat.S_ISVTX
    try:
        os.chmod(where, mode) if dir_fd is None else os.fchmod(dir_fd, mode)
    except OSError as exc:
        raise UnsafeWrite(f"{problem} ({_why(exc)} setting the sticky bit)") from None
    return f"tq-warmup: set the sticky bit on {where} (others could write it)"


def write_file(path: str | os.PathLike[str], data: bytes, mode: int = 0o644) -> str | None:
    """Write ``data`` as the regular file ``path``, atomically (module docstring);
    ``UnsafeWrite`` with the reason where it is refused or fails. Returns
    ``claim_directory``'s line where it set the sticky bit on the directory, else None."""
    where, name = os.path.split(os.path.abspath(os.fspath(path)))
    if not name or name in (".", ".."):
        raise UnsafeWrite(f"{path} names no file")
    try:
        dir_fd = os.open(where, _DIRECTORY)
    except (OSError, ValueError) as exc:  # ValueError: a NUL or a lone surrogate in it
        raise UnsafeWrite(f"directory {where}: {_why(exc)}") from None
    try:
        return _write_in(dir_fd, where, name, data, mode)
    except (OSError, ValueError) as exc:
        raise UnsafeWrite(_why(exc)) from None
    finally:
        os.close(dir_fd)


def _why(exc: Exception) -> str:
    return (exc.strerror if isinstance(exc, OSError) else None) or str(exc)


def _write_in(dir_fd: int, where: str, name: str, data: bytes, mode: int) -> str | None:
    claimed = claim_directory(where, dir_fd)
    try:
        there = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISREG(there.st_mode):
            raise UnsafeWrite(f"{name} is {kind_of(there.st_mode)}, not a regular file")
    temp = f".{name}.{uuid.uuid4().hex[:12]}.tmp"
    try:
        fd = os.open(temp, _CREATE, mode, dir_fd=dir_fd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:  # an interrupt too: no temporary file is left
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=dir_fd)
        raise
    with contextlib.suppress(OSError):
        os.fsync(dir_fd)  # the rename itself survives a crash
    return claimed
