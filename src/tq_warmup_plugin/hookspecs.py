"""The warmer hook specifications, and the ``hookimpl`` marker warmers use.

A warmer contributes keys for the TurboQuant layers a worker has and/or knows how
to compile a kind of key. The TurboQuant kernel paths are the first
implementations (``warmers/``); other packages add theirs through the
``tq_warmup.warmers`` entry-point group, each entry point naming a module or
object with ``@hookimpl`` functions.

This module only declares. The host (``warmup``) builds the plugin manager and calls
the hooks, so a warmer imports the specs without importing the host, and the host's
import of the built-in warmers makes no cycle.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping

import pluggy

from .geometry import Geometry
from .vllm_kernels.jobs import Declined, Engine, Job

PROJECT = "tq_warmup"
ENTRY_POINT_GROUP = "tq_warmup.warmers"

__all__ = [
    "ENTRY_POINT_GROUP",
    "PROJECT",
    "hookimpl",
    "tq_warmup_compile",
    "tq_warmup_engine_jobs",
    "tq_warmup_keys",
]

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def tq_warmup_keys(  # type: ignore[empty-body]
    geometries: Mapping[str, Geometry],
) -> Iterable[tuple[str, str, Hashable]]:
    """Return ``(layer name, path name, key)`` triples to warm for these layers.

    Keys must be hashable and equal exactly when they compile to the same binary:
    the plan warms each distinct key once.
    """


@hookspec(firstresult=True)
def tq_warmup_compile(key: Hashable) -> bool | None:
    """Compile ``key`` without touching any live tensor. Return True when handled,
    None to leave the key to another warmer. Raise to report a failure."""


@hookspec
def tq_warmup_engine_jobs(engine: Engine) -> Iterable[Job | Declined]:  # type: ignore[empty-body]
    """Return the jobs that warm vLLM's own kernels this engine reaches (slot mapping,
    samplers, logprobs), or one ``Declined`` where the warmer's kernel is not reached
    here or vLLM warms it itself. A job calls vLLM's own launcher code; the host runs it
    with launches turned into compiles (``compat.compile_only_launches``)."""
