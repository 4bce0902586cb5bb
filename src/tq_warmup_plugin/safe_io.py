"""Reading files the plugin did not write, as if they were hostile.

A shipped Triton cache layer, its manifests and the CLI's inputs come from an image
builder, a shared volume or a user; each read here is bounded and never blocks:

* the final path component is opened with ``O_NOFOLLOW`` (unless the caller allows a
  symlink, as the CLI does for a model directory in the Hugging Face cache, whose
  ``config.json`` is a symlink into ``blobs/``) and ``O_NONBLOCK``, so a FIFO opens at
  once instead of waiting for a writer (a FIFO manifest hung every compile of the
  process, issue 20);
* what was opened is ``fstat``-ed: only a regular file is read, so a device
  (``/dev/zero``: a ``MemoryError`` after eating the machine's memory) or a directory
  is refused before one byte is read;
* a read takes at most ``limit`` bytes, and a file that says it is larger is refused;
* a directory inside a layer is opened relative to its parent's descriptor with
  ``O_NOFOLLOW | O_DIRECTORY``: a key directory that is a symlink out of the layer is
  refused, and nothing below it can be swapped for one between the check and the read;
* JSON is parsed only below ``MAX_JSON_BYTES`` and ``MAX_JSON_DEPTH``.

Every failure, whatever raised it (``OSError``, ``RecursionError``, ``MemoryError``,
``UnicodeDecodeError``, ``ValueError``), becomes one ``UnsafeFile`` whose message is
the reason in a few words, for a WARNING or a ``tq-warmup:`` line.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from collections.abc import Iterator
from typing import Any

__all__ = [
    "MAX_FILE_BYTES",
    "MAX_JSON_BYTES",
    "MAX_JSON_DEPTH",
    "UnsafeFile",
    "kind_of",
    "open_dir",
    "open_regular",
    "parse_json",
    "printable",
    "read_bytes",
    "read_json",
    "regular_files",
]

MAX_JSON_BYTES = 64 * 2**20
"""A manifest, a startup report, a model config: a 200 MB manifest is not one."""
MAX_FILE_BYTES = 64 * 2**20
"""A file of a Triton cache key directory (a cubin is 0.02-0.5 MiB on sm90)."""
MAX_JSON_DEPTH = 64
"""Nesting levels: a manifest has 4, a startup report 4, a model config under 10."""

_BASE = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


_SYMLINK = "a symlink (a layer's files must be regular files inside it)"


class UnsafeFile(Exception):
    """A file that was not read: not a regular file, too large, unreadable, not JSON,
    nested too deeply. The message is the reason; ``missing``: there is no such file."""

    def __init__(self, reason: str, missing: bool = False) -> None:
        super().__init__(reason)
        self.missing = missing


def kind_of(mode: int) -> str:
    """What a file that is not a regular one is, in words ("a FIFO")."""
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symlink"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        if exc.errno == errno.ELOOP:
            return _SYMLINK
        return exc.strerror or str(exc)
    if isinstance(exc, RecursionError):
        return f"nested more than {MAX_JSON_DEPTH} levels deep"
    if isinstance(exc, MemoryError):
        return "too large to read"
    return str(exc) or type(exc).__name__


@contextlib.contextmanager
def _guarded() -> Iterator[None]:
    """Any failure becomes one ``UnsafeFile``."""
    try:
        yield
    except UnsafeFile:
        raise
    except Exception as exc:  # RecursionError, MemoryError, OSError, ValueError, ...
        raise UnsafeFile(_reason(exc), isinstance(exc, FileNotFoundError)) from None


def open_dir(name: str, dir_fd: int | None = None, *, follow: bool = False) -> int:
    """A descriptor of directory ``name`` (relative to ``dir_fd``), not followed if the
    final component is a symlink unless ``follow`` (a layer's root, which its operator
    names: a ``current`` link is how fleets roll layers); the caller closes it."""
    with _guarded():
        try:
            fd = os.open(name, _BASE | (0 if follow else _NOFOLLOW) | _DIRECTORY, dir_fd=dir_fd)
        except NotADirectoryError:  # Linux: also what a symlink is, with O_NOFOLLOW
            mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=follow).st_mode
            raise UnsafeFile(_SYMLINK if stat.S_ISLNK(mode) else kind_of(mode)) from None
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISDIR(mode):
                raise UnsafeFile(kind_of(mode))
        except BaseException:
            os.close(fd)
            raise
        return fd


def open_regular(
    path: str, *, dir_fd: int | None = None, follow: bool = False
) -> tuple[int, os.stat_result]:
    """A descriptor of regular file ``path`` and its ``fstat``: never a FIFO (it does not
    block), a device or a directory, and no symlink as the final component unless
    ``follow``; the caller closes it (a hash streams a file too large to read whole)."""
    with _guarded():
        fd = os.open(path, _BASE | (0 if follow else _NOFOLLOW), dir_fd=dir_fd)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise UnsafeFile(kind_of(info.st_mode))
        except BaseException:
            os.close(fd)
            raise
        return fd, info


def read_bytes(
    path: str,
    limit: int = MAX_FILE_BYTES,
    *,
    size: int | None = None,
    dir_fd: int | None = None,
    follow: bool = False,
) -> bytes:
    """The bytes of regular file ``path`` (relative to ``dir_fd`` if given); at most
    ``limit`` of them, exactly ``size`` if given (a manifest records each file's)."""
    fd, info = open_regular(path, dir_fd=dir_fd, follow=follow)
    with _guarded():
        try:
            if info.st_size > limit:
                raise UnsafeFile(f"{info.st_size} bytes, more than the {limit} read")
            if size is not None and info.st_size != size:
                raise UnsafeFile(f"a file of {info.st_size} bytes, not {size}")
            chunks, left = [], limit + 1  # one more: a file that grows while read
            while left > 0:
                chunk = os.read(fd, min(left, 2**20))
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
        finally:
            os.close(fd)
        data = b"".join(chunks)
        if len(data) > limit or (size is not None and len(data) != size):
            raise UnsafeFile(f"changed while read ({len(data)} bytes)")
        return data


def _depth(value: Any) -> int:
    """Nesting depth, without recursion (the value came from a hostile file)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        deepest = max(deepest, level)
        if deepest > MAX_JSON_DEPTH:
            break
        if isinstance(item, dict):
            stack.extend((v, level + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, level + 1) for v in item)
    return deepest


def read_json(
    path: str,
    limit: int = MAX_JSON_BYTES,
    *,
    dir_fd: int | None = None,
    follow: bool = False,
) -> Any:
    """The JSON value in regular file ``path``: UTF-8, at most ``limit`` bytes and
    ``MAX_JSON_DEPTH`` levels (Python's parser raises ``RecursionError`` near 1000
    levels, or sooner on a deep stack such as a compile thread's)."""
    return parse_json(read_bytes(path, limit, dir_fd=dir_fd, follow=follow))


def parse_json(data: bytes) -> Any:
    """``read_json``'s parse of bytes already read (UTF-8, ``MAX_JSON_DEPTH`` levels):
    for a caller that must check the very bytes it parses (a pinned manifest's digest)."""
    with _guarded():
        try:
            value = json.loads(data.decode("utf-8"))
        except json.JSONDecodeError as exc:
            raise UnsafeFile(f"not valid JSON ({exc})") from None
        except UnicodeDecodeError:
            raise UnsafeFile("not UTF-8 text") from None
        if _depth(value) > MAX_JSON_DEPTH:
            raise UnsafeFile(f"nested more than {MAX_JSON_DEPTH} levels deep")
        return value


def regular_files(dir_fd: int) -> dict[str, int]:
    """The regular files of an opened directory and their sizes; anything else (a
    symlink, a FIFO, a subdirectory) is left out, not followed."""
    with _guarded():
        found = {}
        with os.scandir(dir_fd) as entries:
            for entry in entries:
                if entry.is_file(follow_symlinks=False):
                    found[entry.name] = entry.stat(follow_symlinks=False).st_size
        return found


def printable(text: str) -> str:
    """``text`` safe to print as one line: every character that is not printable (a
    newline, a control character, a lone surrogate from JSON or from a file name that is
    not UTF-8) as its Python escape. A layer's author controls its file names and
    manifest fields; printed as they are, a name holding a newline could forge a line
    of ``tq-warmup verify``, and a surrogate raised UnicodeEncodeError."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
