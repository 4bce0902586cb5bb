"""The plugin's settings, read once from ``TQ_WARMUP*`` environment variables.

Everything the operator can tune lives here so that the rest of the package
receives one frozen value instead of reading the environment itself.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NamedTuple

# Distinct keys compile on threads: measured on the H200 (vLLM 0.26.0), 4 threads
# cut a cold 6-key warmup from 1.4-1.6 s to 0.8-0.9 s (README, Results).
DEFAULT_THREADS = min(4, os.cpu_count() or 1)

_FALSE = frozenset({"0", "false", "off", "no"})
_TRUE = frozenset({"1", "true", "on", "yes"})


class Settings(NamedTuple):
    """Effective plugin settings.

    enabled: ``TQ_WARMUP`` (default on). ``0/false/off/no`` disables everything.
    strict: ``TQ_WARMUP_STRICT`` turns any warmup failure into a startup failure (for CI).
    report_path: ``TQ_WARMUP_REPORT``: also write the report as JSON to this path;
        ``{rank}`` in the path is replaced by the worker's rank.
    threads: ``TQ_WARMUP_THREADS``: concurrent Triton compiles (1 = serial; default
        4, or fewer CPUs).
    launch: ``TQ_WARMUP_LAUNCH`` (default on): also launch the attention paths'
        non-Triton kernels (cuBLAS, FlashAttention) once on a CUDA device, so CUDA
        loads their modules at startup instead of in the first long request.
    spec_guard: ``TQ_WARMUP_SPEC_GUARD`` (default on): under speculative decoding,
        TurboQuant's metadata builder reports ``UNIFORM_SINGLE_TOKEN_DECODE``, so vLLM
        captures no FULL CUDA graph of a verify batch (``guards/spec_graphs.py`` says why).
    """

    enabled: bool = True
    strict: bool = False
    report_path: str | None = None
    threads: int = DEFAULT_THREADS
    launch: bool = True
    spec_guard: bool = True


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw in _FALSE:
        return False
    if raw in _TRUE:
        return True
    return default


def _positive_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    try:
        value = int(raw) if raw else default
    except ValueError:
        return default
    return max(1, value)


def load(env: Mapping[str, str] | None = None) -> Settings:
    """Parse the settings; unknown or malformed values fall back to the defaults."""
    env = os.environ if env is None else env
    return Settings(
        enabled=_flag(env, "TQ_WARMUP", True),
        strict=_flag(env, "TQ_WARMUP_STRICT", False),
        report_path=env.get("TQ_WARMUP_REPORT") or None,
        threads=_positive_int(env, "TQ_WARMUP_THREADS", DEFAULT_THREADS),
        launch=_flag(env, "TQ_WARMUP_LAUNCH", True),
        spec_guard=_flag(env, "TQ_WARMUP_SPEC_GUARD", True),
    )
