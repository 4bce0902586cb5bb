"""The plugin's settings, read once from ``TQ_WARMUP*`` environment variables.

Everything the operator can tune lives here so that the rest of the package
receives one frozen value instead of reading the environment itself. A value
that is not understood keeps the default, and :func:`parse` says so in one line
per variable, which ``register()`` logs as a WARNING; so is a ``TQ_WARMUP*`` variable
the plugin does not read at all (``KNOWN``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NamedTuple

__all__ = [
    "CACHE_LAYERS_ENV",
    "DEFAULT_THREADS",
    "KNOWN",
    "MANAGERS",
    "Settings",
    "cache_layers",
    "cpu_count",
    "load",
    "parse",
]


def cpu_count() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# Distinct keys compile on threads, at most one per CPU (more only compete for them, issue
# 12); more than 4 did not help, as Triton holds the GIL for most of a compile (vLLM 0.26.0,
# benchmarks/results/serve-jit/SUMMARY.md).
DEFAULT_THREADS = min(4, cpu_count())

_FALSE = frozenset({"0", "false", "off", "no"})
_TRUE = frozenset({"1", "true", "on", "yes"})


class Settings(NamedTuple):
    """Effective plugin settings.

    enabled: ``TQ_WARMUP`` (default on). ``0/false/off/no`` disables everything.
    strict: ``TQ_WARMUP_STRICT`` turns any warmup failure, a skipped layer or an
        unsupported vLLM release into a startup failure (for CI).
    report_path: ``TQ_WARMUP_REPORT``: also write the report as JSON to this path;
        ``{rank}`` in the path is replaced by the worker's rank.
    threads: ``TQ_WARMUP_THREADS``: concurrent Triton compiles (1 = serial; default
        4, or fewer CPUs; never more than the CPUs).
    launch: ``TQ_WARMUP_LAUNCH`` (default on): also launch the attention paths'
        non-Triton kernels (cuBLAS, FlashAttention) once on a CUDA device, so CUDA
        loads their modules at startup instead of in the first long request.
    spec_guard: ``TQ_WARMUP_SPEC_GUARD`` (default on): under speculative decoding,
        verify batches take the batched verify path (``guards/batched_verify.py``) where
        it is proven, else run PIECEWISE (``guards/spec_graphs.py`` says why); ``0`` turns
        both off.
    spec_piecewise: ``TQ_WARMUP_SPEC_GUARD=piecewise``: the PIECEWISE cap everywhere,
        never the batched path.
    prefix_guard: ``TQ_WARMUP_PREFIX_GUARD`` (default on): TurboQuant's first-chunk
        prefill fast path serves only batches of first chunks, so a prefix-cache hit
        keeps its cached prefix (``guards/prefix_fast_path.py``); ``0`` turns it off.
    cache_unverified: ``TQ_WARMUP_CACHE_UNVERIFIED`` (default off): a Triton cache layer
        without a tq-warmup manifest (a plain Triton cache) is served unverified; off,
        it is one WARNING and not served (``layered_cache``): a half-built layer, or one
        whose manifest was removed, must not run on the GPU unchecked.
    driver_cache: ``TQ_WARMUP_DRIVER_CACHE``: a shipped CUDA driver JIT cache
        (``tq-warmup driver-cache``'s ``LAYER/driver-cache``); where an entry matches
        this node, ``register()`` points ``CUDA_CACHE_PATH`` at it (``driver_startup``).
    driver_cache_copy_to: ``TQ_WARMUP_DRIVER_CACHE_COPY_TO``: a writable directory
        the matching entry is copied into first, in a private ``tq-warmup-driver-<uid>``
        directory (default: the temporary directory; never the entry itself).
    driver_cache_override: ``TQ_WARMUP_DRIVER_CACHE_OVERRIDE`` (default off): replace a
        ``CUDA_CACHE_PATH`` that is already set (else it is left alone, one WARNING).
    vllm_kernels: ``TQ_WARMUP_VLLM_KERNELS`` (default on): also warm vLLM's own kernels
        that a TurboQuant server reaches and vLLM's warmup leaves out (slot mapping at
        TurboQuant's block size, the rejection sampler's greedy and random batches,
        logprobs; ``vllm_kernels.run``).
    ahead: ``TQ_WARMUP_AHEAD`` (default on): with ``vllm_kernels``, a CPU-only fork of the
        worker started at ``load_model`` builds those kernels' keys while the worker loads
        its model (``ahead``), so a cold worker does not compile them in ``kernel_warmup``
        (over ten seconds of a V2 worker's startup on vLLM 0.26.0,
        ``benchmarks/results/serve-jit/SUMMARY.md``); ``0`` never starts it.
    trusted: what a shipped cache (Triton layer or driver-cache entry) may serve, from
        ``TQ_WARMUP_CACHE_PIN`` and ``cache_unverified`` (``shipped.pins.describe``): what
        ``doctor`` shows. A pin closes every other door: with it set, a layer without a
        manifest is not served whatever ``TQ_WARMUP_CACHE_UNVERIFIED`` says.
    """

    enabled: bool = True
    strict: bool = False
    report_path: str | None = None
    threads: int = DEFAULT_THREADS
    launch: bool = True
    spec_guard: bool = True
    spec_piecewise: bool = False
    prefix_guard: bool = True
    cache_unverified: bool = False
    driver_cache: str | None = None
    driver_cache_copy_to: str | None = None
    driver_cache_override: bool = False
    vllm_kernels: bool = True
    ahead: bool = True
    trusted: str = "any manifest that matches its files"


_FLAG_VALUES = "1, true, on, yes / 0, false, off, no (any case)"


def _flag(
    env: Mapping[str, str], name: str, default: bool, problems: list[str], also: str = ""
) -> bool:
    raw = env.get(name, "")
    value = raw.strip().lower()
    if value in _FALSE:
        return False
    if value in _TRUE:
        return True
    if raw:
        problems.append(
            f"tq-warmup: {name}={raw!r} is not one of {_FLAG_VALUES}{also}: "
            f"using the default ({'on' if default else 'off'})"
        )
    return default


def _threads(env: Mapping[str, str], name: str, problems: list[str]) -> int:
    raw = env.get(name, "")
    if not raw:
        return DEFAULT_THREADS
    cpus = cpu_count()
    accepted = f"a whole number from 1 to {cpus}, this machine's CPU count"
    try:
        value = int(raw.strip())
    except ValueError:
        problems.append(
            f"tq-warmup: {name}={raw!r} is not {accepted}: using the default ({DEFAULT_THREADS})"
        )
        return DEFAULT_THREADS
    if value < 1:
        problems.append(f"tq-warmup: {name}={raw!r} is not {accepted}: using 1 (serial)")
        return 1
    if value > cpus:
        problems.append(
            f"tq-warmup: {name}={raw!r} is more than this machine's {cpus} CPUs: "
            f"capped at {cpus} (accepted: {accepted})"
        )
        return cpus
    return value


def _path(
    env: Mapping[str, str], name: str, problems: list[str], blank: str, accepted: str
) -> str | None:
    raw = env.get(name, "")
    if raw and not raw.strip():
        problems.append(f"tq-warmup: {name}={raw!r} is blank: {blank} (accepted: {accepted})")
    return raw if raw.strip() else None


def _report_path(env: Mapping[str, str], name: str, problems: list[str]) -> str | None:
    return _path(
        env,
        name,
        problems,
        "no JSON report is written",
        "a file path, '{rank}' replaced by the worker's rank",
    )


def _directory(env: Mapping[str, str], name: str, problems: list[str]) -> str | None:
    return _path(env, name, problems, "unset", "a directory")


def parse(env: Mapping[str, str] | None = None) -> tuple[Settings, list[str]]:
    """The settings, and one line per variable whose value was not understood (the
    default, or the nearest accepted value, is used instead). Logs nothing."""
    env = os.environ if env is None else env
    problems: list[str] = []
    spec_piecewise = env.get("TQ_WARMUP_SPEC_GUARD", "").strip().lower() == "piecewise"
    settings = Settings(
        enabled=_flag(env, "TQ_WARMUP", True, problems),
        strict=_flag(env, "TQ_WARMUP_STRICT", False, problems),
        report_path=_report_path(env, "TQ_WARMUP_REPORT", problems),
        threads=_threads(env, "TQ_WARMUP_THREADS", problems),
        launch=_flag(env, "TQ_WARMUP_LAUNCH", True, problems),
        spec_guard=spec_piecewise
        or _flag(env, "TQ_WARMUP_SPEC_GUARD", True, problems, " / piecewise"),
        spec_piecewise=spec_piecewise,
        prefix_guard=_flag(env, "TQ_WARMUP_PREFIX_GUARD", True, problems),
        cache_unverified=_flag(env, "TQ_WARMUP_CACHE_UNVERIFIED", False, problems),
        driver_cache=_directory(env, "TQ_WARMUP_DRIVER_CACHE", problems),
        driver_cache_copy_to=_directory(env, "TQ_WARMUP_DRIVER_CACHE_COPY_TO", problems),
        driver_cache_override=_flag(env, "TQ_WARMUP_DRIVER_CACHE_OVERRIDE", False, problems),
        vllm_kernels=_flag(env, "TQ_WARMUP_VLLM_KERNELS", True, problems),
        ahead=_flag(env, "TQ_WARMUP_AHEAD", True, problems),
    )
    if env.get("TQ_WARMUP_CACHE_PIN", "").strip():  # read where used; a bad item said here
        from .shipped import pins

        pinned, bad = pins.parse(env["TQ_WARMUP_CACHE_PIN"])
        problems.extend(bad)
        if settings.cache_unverified:
            problems.append(
                "tq-warmup: TQ_WARMUP_CACHE_UNVERIFIED=1 is ignored: TQ_WARMUP_CACHE_PIN is "
                "set, and a layer without a manifest it names is not served"
            )
        settings = settings._replace(trusted=pins.describe(pinned))
    elif settings.cache_unverified:
        trusted = f"{settings.trusted}; a layer without one, unchecked"
        settings = settings._replace(trusted=trusted)
    manager = env.get("TRITON_CACHE_MANAGER")
    if env.get(CACHE_LAYERS_ENV, "").strip() and manager not in MANAGERS:
        problems.append(
            f"tq-warmup: {CACHE_LAYERS_ENV} is set but TRITON_CACHE_MANAGER is "
            f"{'unset' if manager is None else repr(manager)}, not {MANAGERS[0]}: "
            "Triton reads no layer"
        )
    problems.extend(_unknown(env))
    return settings, problems


MANAGERS = (
    "tq_warmup_plugin.layered_cache:LayeredCacheManager",
    "tq_warmup_plugin.shipped.layered_cache:LayeredCacheManager",
)
"""``TRITON_CACHE_MANAGER`` values that read ``TQ_WARMUP_CACHE_LAYERS``: what operators
write, and the module's own name (``shipped.layered_cache.MANAGER_NAMES``, which imports
Triton; ``tests/test_settings.py`` checks that the two agree)."""


KNOWN = frozenset(
    {"TQ_WARMUP", "TQ_WARMUP_STRICT", "TQ_WARMUP_REPORT", "TQ_WARMUP_THREADS",
     "TQ_WARMUP_LAUNCH", "TQ_WARMUP_SPEC_GUARD", "TQ_WARMUP_PREFIX_GUARD",
     "TQ_WARMUP_CACHE_UNVERIFIED", "TQ_WARMUP_DRIVER_CACHE", "TQ_WARMUP_DRIVER_CACHE_COPY_TO",
     "TQ_WARMUP_DRIVER_CACHE_OVERRIDE", "TQ_WARMUP_VLLM_KERNELS", "TQ_WARMUP_AHEAD",
     "TQ_WARMUP_CACHE_LAYERS", "TQ_WARMUP_CACHE_PIN"}
)  # fmt: skip
"""Every variable the plugin reads: ``Settings``', the layers (``cache_layers``) and
their pin (``shipped.pins``)."""


def _unknown(env: Mapping[str, str]) -> list[str]:
    """One line per ``TQ_WARMUP*`` variable the plugin does not read (a typo, or one of
    another release), with the nearest name it does read."""
    odd = sorted(name for name in env if name.startswith("TQ_WARMUP") and name not in KNOWN)
    if not odd:
        return []
    import difflib  # only here: register() imports this module in every vLLM process

    lines = []
    for name in odd:
        near = difflib.get_close_matches(name, sorted(KNOWN), n=1, cutoff=0.85)
        hint = f"did you mean {near[0]}?" if near else f"known: {', '.join(sorted(KNOWN))}"
        lines.append(f"tq-warmup: {name} is not a setting of this plugin: ignored ({hint})")
    return lines


def load(env: Mapping[str, str] | None = None) -> Settings:
    """The settings alone (:func:`parse` without the problems)."""
    return parse(env)[0]


CACHE_LAYERS_ENV = "TQ_WARMUP_CACHE_LAYERS"
"""Read-only Triton cache layers, ``os.pathsep`` separated, in order (layered_cache.py)."""


def cache_layers(env: Mapping[str, str] | None = None) -> str:
    """``TQ_WARMUP_CACHE_LAYERS`` as set now. Not part of ``Settings``: Triton builds its
    cache manager in any process, the compile workers too, which never ran
    ``register()``; ``layered_cache.layer_roots`` checks each directory."""
    env = os.environ if env is None else env
    return env.get(CACHE_LAYERS_ENV, "")
