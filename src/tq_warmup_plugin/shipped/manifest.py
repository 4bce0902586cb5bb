"""The shipped cache's manifest: what a precompiled Triton cache was built for, file by file.

``tq-warmup precompile`` writes one manifest per plan beside the Triton cache
directories it installs; the layered cache manager checks them against the running
process before Triton reads a shipped file, and ``tq-warmup verify`` checks them
offline. Triton's own cache key already hashes its build, the kernel source and the
target, so an entry built for another stack is never *found*: the manifest turns such
a cache into one WARNING naming what differs instead of a silent full compile, and it
catches what Triton's key cannot, a file that changed after it was built.

A manifest is a JSON object: ``schema``, the stack fields (``STACK_FIELDS``), the plan
(``kv_cache_dtype``, ``geometries``, ``keys``: what ``inspect`` prints) and ``files``,
for each Triton cache key directory its files' ``{"sha256": ..., "size": ...}``. The
checks are pure; only ``installed_stack``, ``read`` and the key directory readers look
at the machine, and those read through ``safe_io``: a manifest or a listed file that
is a symlink, a FIFO, a device, too large, or nested too deeply is a problem, never a
hang or an exception other than ``ManifestError``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import sys
import sysconfig
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from .. import compat, safe_io
from .pins import refusal as pin_refusal

__all__ = [
    "PREFIX",
    "SCHEMA",
    "STACK_FIELDS",
    "Listed",
    "Manifest",
    "ManifestError",
    "Problem",
    "Stack",
    "build",
    "check",
    "digest",
    "file_name",
    "file_problems",
    "for_other_arch",
    "from_json",
    "installed_stack",
    "kernel_sources",
    "key_dir_hashes",
    "key_dir_problems",
    "listed",
    "load_key_dir",
    "manifest_files",
    "parse",
    "python_abi",
    "read",
    "stack_problems",
    "triton_build",
]

SCHEMA = 2
"""2: each listed file has its size (a file is read only up to it); 1 had the sha256 only."""
PREFIX = "tq-warmup-manifest-"
STACK_FIELDS = ("vllm", "kernel_sources", "triton", "triton_build", "python_abi", "arch")

_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Stack:
    """What a Triton cache entry depends on. ``None``: not known here (not checked)."""

    vllm: str | None = None
    """vLLM's version string as installed, exactly."""
    kernel_sources: str | None = None
    """sha256 over the installed files of the TurboQuant kernel modules (``kernel_sources``)."""
    triton: str | None = None
    triton_build: str | None = None
    """sha256 of ``triton_key()``: Triton's hash of its own installed files, ``libtriton``
    included, which differs between the wheels of one release for two Pythons."""
    python_abi: str | None = None
    """The wheel ABI tag, ``cp312``: the Python the Triton build is for."""
    arch: int | str | None = None
    """The compile target, ``90`` for sm90 (a string on ROCm: ``gfx942``)."""


class Problem(NamedTuple):
    """One way a manifest does not hold here: a stack field, a file, or the manifest."""

    what: str
    """A field of ``STACK_FIELDS``, ``<key dir>/<file>``, or ``manifest``."""
    expected: str
    """What the manifest says."""
    found: str
    """What is here."""

    def __str__(self) -> str:
        return self.line()

    def line(self, here: str = "found") -> str:
        """The mismatch as one line; ``here``: how this side was learnt (``verify --arch``
        is asked for, not found)."""
        return f"{self.what}: the manifest says {self.expected}, {here} {self.found}"


class ManifestError(ValueError):
    """A file that is not a manifest this release reads; the message says why."""


class Listed(NamedTuple):
    """One file of a key directory as installed."""

    sha256: str
    size: int


@dataclass(frozen=True)
class Manifest:
    stack: Stack
    files: Mapping[str, Mapping[str, Listed]]
    """Triton cache key directory -> file name -> the installed file's sha256 and size."""


def _short(value: object) -> str:
    """Hashes shortened for a log line; anything else as it is."""
    text = str(value)
    return text[:12] if _SHA256.fullmatch(text) else text


def digest(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


# --------------------------------------------------------------------------
# Building and reading
# --------------------------------------------------------------------------


def build(
    stack: Stack, plan: Mapping[str, Any], files: Mapping[str, Mapping[str, Listed]]
) -> dict[str, Any]:
    """The JSON object of one plan's manifest."""
    return {
        "schema": SCHEMA,
        **dataclasses.asdict(stack),
        **plan,
        "files": {
            k: {n: f._asdict() for n, f in sorted(v.items())} for k, v in sorted(files.items())
        },
    }


def file_name(data: Mapping[str, Any]) -> str:
    """One manifest per plan: named by a hash of what was planned and for what (not of
    the files, so building the same plan again replaces its manifest)."""
    plan = {k: v for k, v in data.items() if k != "files"}
    return f"{PREFIX}{digest(json.dumps(plan, sort_keys=True))[:16]}.json"


def _simple_name(name: object) -> bool:
    """A file or directory name, nothing that walks out of the key directory."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\0" not in name
    )


def _listed(value: object) -> Listed | None:
    if not isinstance(value, dict) or set(value) != {"sha256", "size"}:
        return None
    sha, size = value["sha256"], value["size"]
    if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
        return None
    if not isinstance(size, int) or isinstance(size, bool):
        return None
    return Listed(sha, size) if 0 <= size <= safe_io.MAX_FILE_BYTES else None


def from_json(data: object) -> Manifest:
    """The manifest in a parsed JSON value; ``ManifestError`` says what is wrong."""
    if not isinstance(data, dict):
        raise ManifestError(f"a JSON {type(data).__name__}, not an object")
    if data.get("schema") != SCHEMA:
        raise ManifestError(
            f"schema {data.get('schema')!r}, this tq-warmup reads {SCHEMA} "
            "(rebuild it with tq-warmup precompile)"
        )
    for name in STACK_FIELDS:
        value = data.get(name)
        ok = isinstance(value, str) or (
            name == "arch" and isinstance(value, int) and not isinstance(value, bool)
        )
        if not ok:
            raise ManifestError(
                f"{name} {value!r:.40} is not a "
                f"{'string or number' if name == 'arch' else 'string'}"
            )
    files = data.get("files")
    if not isinstance(files, dict):
        raise ManifestError("no 'files' object")
    parsed: dict[str, dict[str, Listed]] = {}
    for key, listed in files.items():
        if not _simple_name(key) or not isinstance(listed, dict) or not listed:
            raise ManifestError(f"files[{key!r:.60}] is not a key directory with files")
        parsed[key] = {}
        for name, entry in listed.items():
            found = _listed(entry)
            if not _simple_name(name) or found is None:
                raise ManifestError(
                    f"files[{key!r:.60}][{name!r:.60}] is not a file name with a sha256 "
                    f"and a size up to {safe_io.MAX_FILE_BYTES} bytes"
                )
            parsed[key][name] = found
    return Manifest(Stack(**{name: data[name] for name in STACK_FIELDS}), parsed)


def parse(text: str) -> Manifest:
    """The manifest in ``text``; ``ManifestError`` says what is wrong with it."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ManifestError(f"not JSON ({exc})") from None
    except RecursionError:
        raise ManifestError(f"nested more than {safe_io.MAX_JSON_DEPTH} levels deep") from None
    return from_json(data)


def manifest_files(root: str | Path) -> list[Path]:
    """The manifests in a cache directory, in name order (each one, whatever it is:
    ``read`` refuses what is not a regular file)."""
    try:
        with os.scandir(root) as entries:
            names = [e.name for e in entries if e.name.startswith(PREFIX)]
    except OSError:
        return []
    return [Path(root, n) for n in sorted(names) if n.endswith(".json")]


def read(path: Path, pins: frozenset[str] | None = None) -> Manifest:
    """The manifest at ``path``: any failure, whatever raised it (a FIFO, a symlink to
    ``/dev/zero``, a ``RecursionError`` of deep JSON, a wrong type anywhere), is one
    ``ManifestError``: it costs that manifest only. With ``pins`` (``TQ_WARMUP_CACHE_PIN``)
    the bytes read must be pinned, else ``ManifestError`` says so."""
    try:
        data = safe_io.read_bytes(str(path), safe_io.MAX_JSON_BYTES)
        refused = pin_refusal(pins, data)
        if refused:
            raise ManifestError(refused)
        return from_json(safe_io.parse_json(data))
    except ManifestError:
        raise
    except safe_io.UnsafeFile as exc:
        raise ManifestError(f"unreadable: {exc}") from None
    except Exception as exc:  # RecursionError, MemoryError, ...: never past this manifest
        raise ManifestError(f"unreadable: {type(exc).__name__}") from None


# --------------------------------------------------------------------------
# Checking
# --------------------------------------------------------------------------


def stack_problems(manifest: Manifest, running: Stack) -> list[Problem]:
    """Each stack field that differs; a field ``running`` does not know is not checked."""
    problems = []
    for name in STACK_FIELDS:
        want, have = getattr(manifest.stack, name), getattr(running, name)
        if have is not None and str(want) != str(have):
            problems.append(Problem(name, _short(want), _short(have)))
    return problems


def for_other_arch(manifests: Mapping[str, Manifest], running: Stack) -> set[str]:
    """The manifests built for another GPU than ``running``'s, where another manifest of
    the same directory is for this one: a cache shipped for sm80 and sm90 is whole on
    either, and neither half deserves a WARNING on the other GPU."""
    if running.arch is None:
        return set()
    other = {n for n, m in manifests.items() if str(m.stack.arch) != str(running.arch)}
    return other if len(other) < len(manifests) else set()


def listed(data: bytes) -> Listed:
    return Listed(digest(data), len(data))


def key_dir_hashes(path: str | Path) -> dict[str, Listed]:
    """sha256 and size of each regular file in a Triton cache key directory (none if it
    is missing, or is not a directory of its own: a symlink is not followed)."""
    try:
        fd = safe_io.open_dir(str(path))
    except safe_io.UnsafeFile:
        return {}
    try:
        found = {}
        for name in safe_io.regular_files(fd):
            with contextlib.suppress(safe_io.UnsafeFile):  # replaced meanwhile: left out
                found[name] = listed(safe_io.read_bytes(name, dir_fd=fd))
        return found
    except safe_io.UnsafeFile:
        return {}
    finally:
        os.close(fd)


def load_key_dir(
    root: str | Path, key: str, expected: Mapping[str, Listed] | None
) -> tuple[dict[str, bytes], list[Problem]]:
    """The bytes of each listed file of one key directory, and each problem: a file
    missing, not a regular file in the directory, of another size or sha256; or the
    directory itself not one inside ``root`` (a symlink out of the layer; ``root``
    itself may be a link, to a whole layer). ``expected``
    None: every regular file, unchecked (a layer served unverified)."""
    try:  # the root as its operator named it (a "current" link); nothing below it
        root_fd = safe_io.open_dir(str(root), follow=True)
    except safe_io.UnsafeFile as exc:
        return {}, [Problem(str(root), "a directory", str(exc))]
    try:
        try:
            fd = safe_io.open_dir(key, root_fd)
        except safe_io.UnsafeFile as exc:
            return {}, [Problem(key, "a key directory inside the layer", str(exc))]
        try:
            return _load_files(fd, key, expected)
        finally:
            os.close(fd)
    finally:
        os.close(root_fd)


def _load_files(
    fd: int, key: str, expected: Mapping[str, Listed] | None
) -> tuple[dict[str, bytes], list[Problem]]:
    if expected is None:
        try:
            sizes = safe_io.regular_files(fd)
        except safe_io.UnsafeFile as exc:
            return {}, [Problem(key, "a readable directory", str(exc))]
        found = {}
        for name, size in sizes.items():
            with contextlib.suppress(safe_io.UnsafeFile):
                found[name] = safe_io.read_bytes(name, dir_fd=fd, size=size)
        return found, []
    data, problems = {}, []
    for name, want in sorted(expected.items()):
        what, said = f"{key}/{name}", f"sha256 {_short(want.sha256)}"
        try:
            data[name] = safe_io.read_bytes(name, dir_fd=fd, size=want.size)
        except safe_io.UnsafeFile as exc:
            problems.append(Problem(what, said, "no such file" if exc.missing else str(exc)))
            continue
        sha = digest(data[name])
        if sha != want.sha256:
            problems.append(Problem(what, said, f"sha256 {_short(sha)}"))
    return ({}, problems) if problems else (data, [])


def key_dir_problems(root: str | Path, key: str, expected: Mapping[str, Listed]) -> list[Problem]:
    """Each listed file of one key directory that is missing or differs."""
    return load_key_dir(root, key, expected)[1]


def file_problems(manifest: Manifest, root: str | Path) -> list[Problem]:
    return [
        p
        for key in sorted(manifest.files)
        for p in key_dir_problems(root, key, manifest.files[key])
    ]


def check(manifest: Manifest, running: Stack, root: str | Path) -> list[Problem]:
    """Everything that does not hold: the stack against ``running``, then every file."""
    return stack_problems(manifest, running) + file_problems(manifest, root)


# --------------------------------------------------------------------------
# The installed stack (read from files: vLLM is not imported)
# --------------------------------------------------------------------------


def kernel_sources(modules: Collection[str] = tuple(compat.KERNEL_MODULES.values())) -> str | None:
    """sha256 over the installed source files of the TurboQuant kernel modules, found
    by path under vLLM's package directory: ``importlib.util.find_spec("vllm")``
    locates a top-level package without importing it, while ``find_spec`` of a
    submodule would import its parents (vLLM's import takes seconds, and
    ``tq-warmup verify`` must not pay it). ``None`` without vLLM."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):  # ValueError: a stub in sys.modules without a spec
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    sha = hashlib.sha256()
    for module in sorted(set(modules)):
        relative = Path(*module.split(".")[1:]).with_suffix(".py")
        found = [Path(base, relative) for base in spec.submodule_search_locations]
        existing = [p for p in found if p.is_file()]
        sha.update(module.encode() + b"\0")
        sha.update(existing[0].read_bytes() if existing else b"<absent>")
        sha.update(b"\0")
    return sha.hexdigest()


def triton_build(key: str | None = None) -> str | None:
    """sha256 of ``key``, else of the running ``triton_key()`` (Triton 3.6-3.8,
    ``triton.runtime.cache``; looked up at call time, so precompile's
    ``cache_keys_for`` applies); ``None`` without Triton."""
    if key is None:
        try:
            from triton.runtime import cache
        except ImportError:
            return None
        key = str(cache.triton_key())
    return digest(key)


def python_abi() -> str:
    """This interpreter's wheel ABI tag: ``cp312``, ``cp313t`` when free-threaded."""
    threaded = "t" if sysconfig.get_config_var("Py_GIL_DISABLED") else ""
    return f"cp{sys.version_info.major}{sys.version_info.minor}{threaded}"


def installed_stack(arch: int | str | None = None) -> Stack:
    """The stack installed here (``arch`` only if given: a CPU has none)."""
    from importlib import metadata

    try:
        triton: str | None = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton = None
    return Stack(
        vllm=compat.installed_vllm_version(),
        kernel_sources=kernel_sources(),
        triton=triton,
        triton_build=triton_build() if triton is not None else None,
        python_abi=python_abi(),
        arch=arch,
    )
