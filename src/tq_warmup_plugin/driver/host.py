"""This node as the shipped driver cache sees it, and an entry's match with it: the
driver and GPUs from ``/proc/driver/nvidia`` (no CUDA context, no ``nvidia-smi``:
``register()`` may pay for it), vLLM's FA2 library found without importing vLLM, and
each way an entry's manifest does not hold here (``match``)."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

from .. import safe_io
from .entry import DriverManifest, EntryError, Node, hash_file

__all__ = ["FA2_LIBRARY", "fa2_library", "match", "read_node"]

FA2_LIBRARY = ("vllm_flash_attn", "_vllm_fa2_C.abi3.so")
# "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 ..." and the open
# modules' "NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build ...".
_NVRM = re.compile(r"^NVRM version:.*?Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)\b", re.M)
_MODEL = re.compile(r"^Model:\s*(.+?)\s*$", re.M)


def _small_text(path: Path) -> str | None:
    try:
        return safe_io.read_bytes(str(path), 64 << 10).decode("utf-8", "replace")
    except (safe_io.UnsafeFile, OSError):
        return None


def read_node(
    proc: str | Path = "/proc", fa2: str | Path | None = None, hash_fa2: bool = False
) -> Node:
    """This node's driver and GPUs from ``/proc/driver/nvidia`` (no CUDA context, no
    ``nvidia-smi``: ``register()`` may pay for it), and the FA2 library's size (and
    sha256 with ``hash_fa2``). A container sees only its own GPUs there."""
    base = Path(proc, "driver", "nvidia")
    text = _small_text(base / "version") or ""
    found = _NVRM.search(text)
    gpus: list[str] = []
    for gpu in sorted(base.glob("gpus/*/information")):
        model = _MODEL.search(_small_text(gpu) or "")
        if model:
            gpus.append(model.group(1))
    size = sha = None
    if fa2 is not None:
        try:
            fd, info = safe_io.open_regular(str(fa2))
            os.close(fd)
            size = info.st_size
            if hash_fa2:
                sha = hash_file(fa2, size)
        except (EntryError, safe_io.UnsafeFile, OSError):
            pass
    return Node(found.group(1) if found else None, tuple(gpus), size, sha)


def fa2_library() -> Path | None:
    """vLLM's FA2 library, found without importing vLLM (``find_spec`` of a top-level
    package imports nothing; all releases keep it at ``vllm/vllm_flash_attn/``)."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):  # ValueError: a stub in sys.modules without a spec
        return None
    for base in (spec.submodule_search_locations or []) if spec else []:
        path = Path(base, *FA2_LIBRARY)
        if path.is_file():
            return path
    return None


def _same_gpu(a: str, b: str) -> bool:
    return " ".join(a.split()).casefold() == " ".join(b.split()).casefold()


def match(shipped: DriverManifest, node: Node, strict: bool = True) -> list[str]:
    """Each way ``shipped`` does not hold on ``node``: ``field: the manifest says X,
    found Y``. ``strict`` (startup): what the node does not know is a problem too, since
    the entry cannot be shown to fit; else (``verify`` without a GPU) it is not checked."""
    problems: list[str] = []

    def differs(what: str, want: object, have: object) -> None:
        if have is None or have == ():
            if strict:
                problems.append(f"{what}: the manifest says {want}, not known here")
        elif want != have:
            problems.append(f"{what}: the manifest says {want}, found {have}")

    differs("driver", shipped.driver, node.driver)
    gpus = node.gpus
    if gpus and all(_same_gpu(shipped.gpu, g) for g in gpus):
        gpus = (shipped.gpu,)
    differs("gpu", shipped.gpu, ", ".join(dict.fromkeys(gpus)) or None)
    differs("fa2 library size", shipped.fa2_size, node.fa2_size)
    if node.fa2_sha256 is not None:
        differs("fa2 library sha256", shipped.fa2_sha256[:12], node.fa2_sha256[:12])
    return problems
