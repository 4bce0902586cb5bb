"""What every benchmark engine shares: LLM(...) keywords, the GPU name, the repository root.

``run`` (the first-request phases) and the spec children (``spec``, ``shipped``) start
vLLM with the same dummy-weight keywords; each adds its own on top. Nothing here imports
vLLM or torch at import time: the parents (``matrix``, ``spec``, ``shipped``) import it.
"""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path
from typing import Any

__all__ = [
    "REPO_ROOT",
    "engine_kwargs",
    "gpu_name",
    "installed_vllm_version",
    "jit_monitor_support",
    "nvidia_smi_name",
]

# The checkout: children run ``python -m benchmarks.tqbench`` from here.
REPO_ROOT = Path(__file__).resolve().parents[2]


def engine_kwargs(
    *,
    model: str,
    preset: str,
    max_model_len: int,
    max_num_seqs: int,
    gpu_mem_util: float,
    kv_cache_gib: float,
    cudagraph_mode: str | None,
    enforce_eager: bool,
    monitor_mode: str | None = None,
) -> dict[str, Any]:
    """The ``LLM(...)`` keywords of a dummy-weight engine (names as in all vLLM releases
    ``EngineArgs``): no tokenizer, bf16, a fixed KV cache of ``kv_cache_gib`` (0: vLLM
    sizes it from ``gpu_mem_util``), ``cudagraph_mode`` when asked (None: vLLM's default),
    and ``jit_monitor_mode`` only where vLLM has it (>= 0.25, see :func:`jit_monitor_support`)."""
    kwargs: dict[str, Any] = {
        "model": model,
        "skip_tokenizer_init": True,
        "load_format": "dummy",
        "dtype": "bfloat16",
        "kv_cache_dtype": preset,
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        "enforce_eager": enforce_eager,
        "gpu_memory_utilization": gpu_mem_util,
        "seed": 0,
    }
    if kv_cache_gib > 0:
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * (1 << 30))
    if cudagraph_mode and not enforce_eager:
        kwargs["compilation_config"] = {"cudagraph_mode": cudagraph_mode}
    if monitor_mode:
        kwargs["jit_monitor_mode"] = monitor_mode
    return kwargs


def jit_monitor_support(vllm_version: str) -> tuple[str, bool]:
    """Where vLLM's JIT monitor lives and whether ``jit_monitor_mode`` exists.

    0.25+: ``vllm.utils.jit_monitor`` and ``observability_config.jit_monitor_mode``
    (``warn``/``error``). 0.22 (and the releases around it) has a warn-only monitor in
    ``vllm.triton_utils.jit_monitor``; 0.20 has none, which ``run`` tolerates.
    """
    from tq_warmup_plugin.compat import parse_version

    if (parse_version(vllm_version) or (0, 0)) >= (0, 25):
        return "vllm.utils.jit_monitor", True
    return "vllm.triton_utils.jit_monitor", False


def gpu_name() -> str | None:
    """Device 0's name as vLLM's platform (else torch) reports it, in an engine's process."""
    with contextlib.suppress(Exception):
        from vllm.platforms import current_platform

        return str(current_platform.get_device_name(0))
    with contextlib.suppress(Exception):
        import torch

        return str(torch.cuda.get_device_name(0))
    return None


def nvidia_smi_name() -> str | None:
    """Device 0's name from ``nvidia-smi``: for a parent, which imports neither vLLM nor torch."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    names = [n.strip() for n in out.splitlines() if n.strip()]
    return names[0] if names else None


def installed_vllm_version() -> str | None:
    """The installed vLLM's version from its metadata (no import of vLLM)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm")
    except PackageNotFoundError:
        return None
