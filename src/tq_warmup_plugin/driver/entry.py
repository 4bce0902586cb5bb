"""The shipped CUDA driver JIT cache: its entries, their manifest, the match with a node.

vLLM 0.26.0's FlashAttention-2 library (``vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so``)
holds sm_80 code only (``cuobjdump --list-elf``: 76 sm_80 entries, none for sm_90), and
TurboQuant runs every layer on FA2, so on an H100/H200 the CUDA driver JIT-compiles each
FA2 module's PTX the first time a process loads it (minutes of a fresh machine's first engine
start: vLLM 0.26.0, ``benchmarks/results/driver-cache/README.md``) and keeps the result only
in its own cache (``CUDA_CACHE_PATH``, default ``~/.nv/ComputeCache``), which a container
loses with the pod.

``tq-warmup driver-cache`` (``driver.build``) fills a fresh ``CUDA_CACHE_PATH`` on one GPU
and installs it as one *entry* of ``LAYER/driver-cache``: ``<key>/cache/`` (what the
driver wrote) and ``<key>/manifest.json``: the driver (the kernel module's version, which
the driver's JIT compiler ships with), the GPU, the FA2 library's sha256 and size, and a
sha256 and size per cache file. At startup ``driver.startup`` uses an entry whose driver,
GPU and FA2 library match the node (``driver.host``); ``tq-warmup verify`` checks entries offline.

The driver keys its cache entries itself, so a stale entry can only miss, never give
wrong code; the manifest turns a mismatch into one line instead of a silent JIT, and
catches a file changed after the build (a cache file is GPU code the driver runs).
Everything here reads files it did not write: regular files only, no symlinks, bounded
reads; a bad entry costs only that entry. Module level imports only what
``register()`` may pay for (no hashing until an entry is verified or copied).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from .. import safe_io
from ..shipped.pins import refusal as pin_refusal
from .stages import (  # re-exported: an entry's stages are part of its life
    STAGE_PREFIX,
    discard,
    install,
    stage,
    stale_stages,
)

__all__ = [
    "CACHE_DIR",
    "COMPILED_DIR",
    "COMPILED_FILE",
    "DRIVER_DIR",
    "KIND",
    "MANIFEST",
    "MAX_COMPILED_BYTES",
    "MAX_FILES",
    "MAX_MANIFEST_BYTES",
    "SCHEMA",
    "STAGE_PREFIX",
    "DriverManifest",
    "EntryError",
    "Node",
    "content_digest",
    "copy_entry",
    "discard",
    "entries",
    "entry_key",
    "file_problems",
    "hash_file",
    "install",
    "listing",
    "parse",
    "read",
    "stage",
    "stale_stages",
    "tree_problems",
    "walk",
]

SCHEMA = 1
KIND = "tq-warmup-driver-cache"
DRIVER_DIR = "driver-cache"
"""The entries' directory inside a shipped layer (``--cache-dir``)."""
MANIFEST = "manifest.json"
CACHE_DIR = "cache"
"""An entry's ``CUDA_CACHE_PATH`` content."""
COMPILED_DIR = "compiled"
"""An entry's ``torch.compile`` artifacts (``driver.compiled``), beside the driver's cache:
what an engine of the fleet compiled for this GPU, not the driver's to read."""
COMPILED_FILE = "torch-compile.bin"
"""What the engine child writes; the entry holds it as ``torch-compile-<sha256 16>.bin``,
so a build seeded by an earlier entry keeps that build's artifacts beside its own."""
MAX_COMPILED_BYTES = 256 << 20
"""The most one ``compiled`` file holds: far above the engine child's artifacts (a few MiB
at most)."""
_MAX_COMPILED = 16
MAX_MANIFEST_BYTES = 1 << 20
"""An entry's manifest: ~100 bytes a file, so 10,000 files; every vLLM process reads the
manifests, and 64 at this cap read in about 1 s (issue 30)."""
MAX_FILES = 100_000
MAX_DEPTH = 8
MAX_ENTRIES = 64
_CHUNK = 1 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")


class EntryError(ValueError):
    """An entry or file this release does not use; the message is the reason."""


@dataclass(frozen=True)
class DriverManifest:
    """What one entry was built on, and its files (relative path -> (sha256, size))."""

    driver: str
    """The NVIDIA kernel module's version (``/proc/driver/nvidia/version``), e.g. ``580.95.05``."""
    gpu: str
    """The GPU's name as the driver gives it (``/proc/driver/nvidia/gpus/*/information``)."""
    fa2_sha256: str
    fa2_size: int
    files: Mapping[str, tuple[str, int]]
    compute_capability: str | None = None
    cuda_runtime: str | None = None
    """``torch.version.cuda`` of the build."""
    cuda_driver_api: int | None = None
    """``cuDriverGetVersion``: the CUDA API the driver implements (13000 for 13.0)."""
    launches: tuple[str, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Informational only (versions, build seconds): never checked."""
    compiled: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    """``COMPILED_DIR``'s files (name -> (sha256, size)): the engine's ``torch.compile``
    artifacts; absent from the JSON when empty, so an entry built before them keeps its
    digest (its pin, its copy's name)."""

    def to_json(self) -> str:
        data = asdict(self)
        data["files"] = {k: {"sha256": s, "size": n} for k, (s, n) in sorted(self.files.items())}
        data["launches"] = list(self.launches)
        data.pop("compiled")
        if self.compiled:
            data["compiled"] = {
                k: {"sha256": s, "size": n} for k, (s, n) in sorted(self.compiled.items())
            }
        return json.dumps({"schema": SCHEMA, "kind": KIND, **data}, indent=1)

    @property
    def size(self) -> int:  # bytes of all files
        return sum(n for _, n in self.files.values())


class Node(NamedTuple):
    """What a match needs to know about this machine; ``None``: not known here."""

    driver: str | None = None
    gpus: tuple[str, ...] = ()
    fa2_size: int | None = None
    fa2_sha256: str | None = None
    """Hashing 300 MB costs ~1 s: only ``verify`` and the build compute it."""


def _open_regular(path: str | Path) -> tuple[int, os.stat_result]:
    """``safe_io.open_regular``, its refusal an ``EntryError`` naming the file."""
    try:
        return safe_io.open_regular(str(path))
    except safe_io.UnsafeFile as exc:
        raise EntryError(f"{path}: {exc}") from None


def _read_bounded(path: str | Path, limit: int) -> bytes:
    try:
        return safe_io.read_bytes(str(path), limit)
    except safe_io.UnsafeFile as exc:
        raise EntryError(f"{path}: {exc}") from None


def _relative(name: object) -> bool:
    """A relative path of simple names, nothing that walks out of the cache directory."""
    if not isinstance(name, str) or not name or "\0" in name or name.startswith("/"):
        return False
    parts = name.split("/")
    return len(parts) <= MAX_DEPTH and all(p not in ("", ".", "..") for p in parts)


def _text(data: Mapping[str, Any], name: str, optional: bool = False) -> Any:
    if (value := data.get(name)) is None and optional:
        return None
    if not isinstance(value, str) or not value or len(value) > 256:
        raise EntryError(f"{name} {value!r:.80} is not a string")
    return value


def _count(value: object, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise EntryError(f"{name} {value!r:.80} is not a size")
    return value


def parse(text: bytes | str) -> DriverManifest:
    """The manifest in ``text``; ``EntryError`` says in one line what is wrong with it."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise EntryError("not a manifest: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise EntryError(f"not JSON ({str(exc)[:120]})") from None
    if not isinstance(data, dict) or data.get("kind") != KIND:
        raise EntryError(f"not a {KIND} manifest")
    if data.get("schema") != SCHEMA:
        raise EntryError(f"schema {data.get('schema')!r:.20}, this tq-warmup reads {SCHEMA}")
    sha = _text(data, "fa2_sha256")
    if not _SHA256.fullmatch(sha):
        raise EntryError("fa2_sha256 is not a sha256")
    files = data.get("files")
    if not isinstance(files, dict) or len(files) > MAX_FILES:
        raise EntryError(f"files is not an object of at most {MAX_FILES} files")
    listed = _listing(files, "files", _relative)
    compiled = data.get("compiled", {})
    if not isinstance(compiled, dict) or len(compiled) > _MAX_COMPILED:
        raise EntryError(f"compiled is not an object of at most {_MAX_COMPILED} files")
    artifacts = _listing(compiled, "compiled", _simple)
    if any(size > MAX_COMPILED_BYTES for _, size in artifacts.values()):
        raise EntryError(f"compiled: a file over {MAX_COMPILED_BYTES >> 20} MiB")
    launches = data.get("launches", [])
    if not isinstance(launches, list) or not all(isinstance(x, str) for x in launches):
        raise EntryError("launches is not a list of strings")
    api = data.get("cuda_driver_api")
    extra = data.get("extra", {})
    return DriverManifest(
        driver=_text(data, "driver"),
        gpu=_text(data, "gpu"),
        fa2_sha256=sha,
        fa2_size=_count(data.get("fa2_size"), "fa2_size"),
        files=listed,
        compute_capability=_text(data, "compute_capability", optional=True),
        cuda_runtime=_text(data, "cuda_runtime", optional=True),
        cuda_driver_api=None if api is None else _count(api, "cuda_driver_api"),
        launches=tuple(launches),
        extra=extra if isinstance(extra, dict) else {},
        compiled=artifacts,
    )


def _simple(name: object) -> bool:
    """One plain file name: ``compiled`` holds no directories."""
    return _relative(name) and "/" not in str(name)


def _listing(
    files: Mapping[str, Any], label: str, valid: Callable[[object], bool]
) -> dict[str, tuple[str, int]]:
    listed: dict[str, tuple[str, int]] = {}
    for name, item in files.items():
        ok = valid(name) and isinstance(item, dict)
        if not ok or not _SHA256.fullmatch(str(item.get("sha256"))):
            raise EntryError(f"{label}[{name!r:.80}] is not a relative path with a sha256")
        listed[name] = (item["sha256"], _count(item.get("size"), f"{label}[{name!r:.80}].size"))
    return listed


def read(entry: str | Path, pins: frozenset[str] | None = None) -> DriverManifest:
    """The manifest of one entry directory (bounded, a regular file only); with ``pins``
    (``TQ_WARMUP_CACHE_PIN``) the bytes read must be pinned, else ``EntryError``."""
    data = _read_bounded(Path(entry) / MANIFEST, MAX_MANIFEST_BYTES)
    refused = pin_refusal(pins, data)
    if refused:
        raise EntryError(refused)
    return parse(data)


def entries(root: str | Path) -> list[Path]:
    """The entry directories of a driver-cache directory, in name order (no symlinks,
    no stage directories, at most ``MAX_ENTRIES``); none if it is not a directory."""
    return listing(root)[0]


def listing(root: str | Path, node: Node | None = None) -> tuple[list[Path], int]:
    """``entries``, and how many past ``MAX_ENTRIES`` were left out. With ``node``, the
    entries whose name holds its driver version come first (``entry_key``), so the
    limit never leaves out this node's own entry before another fleet's."""
    try:
        with os.scandir(root) as it:
            found = [
                Path(e.path)
                for e in it
                if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)
            ]
    except OSError:
        return [], 0
    mine = _driver_slug(node.driver) if node is not None and node.driver else None
    found.sort(key=lambda p: (mine is None or f"-{mine}-" not in p.name, p.name))
    return found[:MAX_ENTRIES], max(0, len(found) - MAX_ENTRIES)


def _driver_slug(driver: str) -> str:
    return re.sub(r"[^0-9.]", "_", driver)


def walk(top: str | Path) -> Iterator[tuple[str, os.DirEntry[str] | None]]:
    """Every file under ``top`` as (relative path, entry); an entry of ``None`` marks a
    path that is not a plain file or directory (a symlink, a FIFO, too deep, too many)."""
    count = 0

    def visit(path: str, prefix: str, depth: int) -> Iterator[tuple[str, os.DirEntry[str] | None]]:
        nonlocal count
        with os.scandir(path) as it:
            for e in sorted(it, key=lambda e: e.name):
                name = f"{prefix}{e.name}"
                count += 1
                if count > MAX_FILES:
                    yield name, None
                    return
                if e.is_dir(follow_symlinks=False) and depth < MAX_DEPTH:
                    yield from visit(e.path, f"{name}/", depth + 1)
                elif e.is_file(follow_symlinks=False):
                    yield name, e
                else:
                    yield name, None

    yield from visit(str(top), "", 1)


def entry_key(driver: str, gpu: str, fa2_sha256: str) -> str:
    """An entry's directory name: ``NVIDIA_H200-580.95.05-fa2-869c73f37150``."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", gpu).strip("_") or "gpu"
    return f"{slug}-{_driver_slug(driver)}-fa2-{fa2_sha256[:12]}"


def _hash_fd(fd: int, size: int, out: Any = None) -> str:
    """sha256 of at most ``size + 1`` bytes of ``fd`` (closed after), copied to ``out``."""
    import hashlib

    sha = hashlib.sha256()
    left = size + 1
    with os.fdopen(fd, "rb") as fh:
        while left > 0 and (chunk := fh.read(min(_CHUNK, left))):
            left -= len(chunk)
            sha.update(chunk)
            if out is not None:
                out.write(chunk)
    if left <= 0:
        raise EntryError("it grew while it was read")
    return sha.hexdigest()


def hash_file(path: str | Path, size: int, out: Any = None) -> str:
    """sha256 of a regular file of ``size`` bytes (no symlink), copied to ``out``."""
    fd, info = _open_regular(path)
    if info.st_size != size:
        os.close(fd)
        raise EntryError(f"{info.st_size} bytes, the manifest says {size}")
    return _hash_fd(fd, size, out)


def file_problems(entry: str | Path, shipped: DriverManifest) -> list[str]:
    """Each cache file of ``entry`` that is missing, differs, is not listed or is not a
    plain file: what the driver would load that the build did not write; and each of its
    ``compiled`` files that is missing or differs (``driver.compiled`` reads them)."""
    problems = tree_problems(Path(entry) / CACHE_DIR, shipped, CACHE_DIR)
    return problems + _hash_problems(Path(entry, COMPILED_DIR), COMPILED_DIR, shipped.compiled)


def _hash_problems(top: Path, label: str, listed: Mapping[str, tuple[str, int]]) -> list[str]:
    """Each of ``listed``'s files under ``top`` that cannot be read or differs."""
    problems = []
    for name, (sha, size) in sorted(listed.items()):
        try:
            found = hash_file(top / name, size)
        except (EntryError, OSError) as exc:
            problems.append(f"{label}/{name}: {exc}")
            continue
        if found != sha:
            problems.append(
                f"{label}/{name}: the manifest says sha256 {sha[:12]}, found {found[:12]}"
            )
    return problems


def tree_problems(
    top: str | Path, shipped: DriverManifest, label: str, hashed: bool = True
) -> list[str]:
    """``file_problems`` of any tree that should hold exactly ``shipped``'s files (an
    entry's cache, or a copy made from it); ``hashed=False``: the shape only (every file
    listed and plain, no link anywhere, none missing), for a copy that hashes as it goes."""
    top = Path(top)
    problems: list[str] = []
    seen: set[str] = set()
    try:
        for name, item in walk(top):
            if item is None:
                problems.append(f"{label}/{name}: not a plain file (a symlink, or too deep)")
            elif name not in shipped.files:
                problems.append(f"{label}/{name}: not in the manifest")
            else:
                seen.add(name)
    except OSError as exc:
        return [f"{label}: cannot be read ({exc.strerror or exc})"]
    for name in sorted(set(shipped.files) - seen):
        problems.append(f"{label}/{name}: listed by the manifest, no such file")
    if hashed:
        problems += _hash_problems(top, label, {n: shipped.files[n] for n in seen})
    return problems


def content_digest(shipped: DriverManifest) -> str:
    """sha256 of the manifest's canonical form: every file's sha256 and size, the node
    it was built for; a copy is named by it, so two entries' copies never share a name."""
    import hashlib  # not at module level: register() with no matching entry hashes nothing

    return hashlib.sha256(shipped.to_json().encode()).hexdigest()


def copy_entry(entry: str | Path, shipped: DriverManifest, dest: str | Path) -> None:
    """Copy the files ``shipped`` lists (nothing else) from ``entry`` into ``dest`` (a new
    directory), hashing each as it is read; ``EntryError`` on the first that differs, and
    first on a cache that is not exactly the listed plain files (a symlinked
    sub-directory: ``open`` would follow it, and ``verify`` calls it a problem)."""
    src, out = Path(entry) / CACHE_DIR, Path(dest)
    # Unlisted plain files are left behind (never copied); anything else stops the copy.
    shape = [p for p in tree_problems(src, shipped, CACHE_DIR, hashed=False)
             if not p.endswith(": not in the manifest")]  # fmt: skip
    if shape:
        raise EntryError(shape[0] + (f" (and {len(shape) - 1} more)" if len(shape) > 1 else ""))
    out.mkdir(parents=True, exist_ok=True)
    for name, (sha, size) in sorted(shipped.files.items()):
        target = out / name
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(target, "xb") as fh:
                found = hash_file(src / name, size, fh)
        except OSError as exc:
            raise EntryError(f"{CACHE_DIR}/{name}: {exc.strerror or exc}") from None
        except EntryError as exc:
            raise EntryError(f"{CACHE_DIR}/{name}: {exc}") from None
        if found != sha:
            raise EntryError(
                f"{CACHE_DIR}/{name}: sha256 {found[:12]}, the manifest says {sha[:12]}"
            )
