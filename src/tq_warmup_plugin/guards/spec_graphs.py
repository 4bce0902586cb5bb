"""The speculative-decoding guard: no FULL CUDA graph of a TurboQuant verify batch.

Why: ``TurboQuantMetadataBuilder`` reports ``UNIFORM_BATCH`` (all releases), so with
speculative decoding vLLM captures FULL graphs of uniform 1+k-token verify batches.
Capture runs TurboQuant's per-request prefill loop on dummy metadata whose sequence
length equals the query length, and the graph keeps that branch, "attention over the
new tokens only", for every replay: wrong tokens and no error (0.21 and later; ngram
engines were WRONG on vLLM 0.22.0 and 0.26.0, ``benchmarks/results/spec/SUMMARY.md``), or a
startup crash on 0.20 (``.tolist()`` during capture).
Upstream: #40831, #52475, #53180 (wrong tokens), #40807 (0.20); the fixes (#43747,
#53406) are unmerged in every release ``compat.Features.spec_graphs_unsafe`` names.

What: under speculative decoding the builder, and any subclass, reports at most
``UNIFORM_SINGLE_TOKEN_DECODE``. vLLM's own mode resolution then runs verify batches
without a FULL graph (``resolve_cudagraph_mode_and_sizes``: FULL decode graphs with
``uniform_decode_query_len > 1`` need ``UNIFORM_BATCH``, else PIECEWISE, all releases).
Without speculative decoding vLLM's own value is returned unchanged. The builder's
support level is read while the KV cache is initialised, before ``kernel_warmup``,
so this is installed when the backend module is imported, not in the worker.

This cap is the fallback of the batched verify path (``batched_verify``), which serves
verify batches inside FULL graphs where it is proven: installed by it, the cap exempts
the configurations it serves; installed alone (``TQ_WARMUP_SPEC_GUARD=piecewise``) it
caps every speculative configuration.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

from .. import compat, patching
from .gate import install_where_needed

__all__ = ["MODULE", "RISK", "capped_support", "install", "installed", "remove"]

logger = logging.getLogger("vllm.tq_warmup_plugin")

MODULE = compat.BACKEND_MODULE
"""The vLLM module this guard adjusts once it has executed."""

_GUARD_ATTR = "__tq_warmup_spec_guard__"
_once = patching.Once()
_exempt: Callable[[Any], bool] | None = None
"""Configurations another verify path serves (``batched_verify.serves``): not capped."""
_ON_REQUEST = "TQ_WARMUP_SPEC_GUARD=piecewise"
_why = _ON_REQUEST
"""Why verify batches run PIECEWISE, for the INFO line."""


def capped_support(support: Any, speculative: bool, cap: Any) -> Any:
    """The support level to report: ``support``, lowered to ``cap`` under speculative
    decoding (enum members compare by ``value``, as vLLM compares them)."""
    return cap if speculative and support.value > cap.value else support


def _announce(builder: type, support: Any, cap: Any) -> None:
    if not _once.first("cap"):
        return
    logger.info(
        "tq-warmup: speculative decoding with TurboQuant: verify batches run PIECEWISE "
        "(%s; %s reports %s instead of %s: a FULL graph of a verify batch through the "
        "per-request loop ignores the cached context); TQ_WARMUP_SPEC_GUARD=0 turns this off",
        _why,
        builder.__name__,
        cap.name,
        support.name,
    )


def _guard(original: Callable[..., Any]) -> Callable[..., Any]:
    """``get_cudagraph_support``'s function, capped under speculative decoding."""

    @patching.wraps(original)
    def get_cudagraph_support(cls: type, vllm_config: Any, kv_cache_spec: Any) -> Any:
        support = original(cls, vllm_config, kv_cache_spec)
        cap = compat.single_token_decode_support()
        unsafe = compat.speculative_decoding(vllm_config) and not (
            _exempt is not None and _exempt(vllm_config)
        )
        capped = capped_support(support, unsafe, cap)
        if capped is not support:
            _announce(cls, support, cap)
        return capped

    return get_cudagraph_support


def _guard_class(cls: type) -> None:
    """Cap ``cls.get_cudagraph_support`` (inherited or its own), once."""
    if patching.is_ours(cls.__dict__.get("get_cudagraph_support")):
        return
    # A bound classmethod's ``__func__`` is the plain function, wherever it is defined.
    original = cls.get_cudagraph_support.__func__  # type: ignore[attr-defined]
    patching.replace(cls, "get_cudagraph_support", classmethod(_guard(original)))


def _init_subclass_guarded(cls: Any, /, **kwargs: Any) -> None:
    """A subclass (UltraQuant-style) that defines its own ``get_cudagraph_support``
    is capped as soon as it is created; one that inherits ours already is."""
    builder = next(c for c in cls.__mro__ if c.__dict__.get(_GUARD_ATTR))
    super(builder, cls).__init_subclass__(**kwargs)
    if "get_cudagraph_support" in cls.__dict__:
        _guard_class(cls)


RISK = (
    f"through vLLM {compat.NEWEST[0]}.{compat.NEWEST[1]} a FULL CUDA graph of a TurboQuant "
    "verify batch ignores the context (wrong tokens with speculative decoding): "
    '--compilation-config \'{"cudagraph_mode": "PIECEWISE"}\' avoids it'
)
"""What a release newer than the plugin knows may do unguarded (``install_where_needed``)."""


def install(
    backend: ModuleType,
    exempt: Callable[[Any], bool] | None = None,
    why: str = _ON_REQUEST,
) -> bool:
    """Guard the backend module's builder class when the installed release needs it,
    leaving the configurations ``exempt`` names to another path; ``why`` the cap is in
    force goes into the INFO line. Returns whether the guard is in place; never raises
    into vLLM's import."""
    global _exempt, _why
    _exempt, _why = exempt, why
    return install_where_needed(
        "speculative-decoding",
        lambda feats: feats.spec_graphs_unsafe,
        lambda: _apply(backend),
        RISK,
    )


def _apply(backend: ModuleType) -> bool:
    builder: type = getattr(backend, compat.BUILDER_CLASS)
    if builder.__dict__.get(_GUARD_ATTR):
        return True
    _guard_class(builder)
    if "__init_subclass__" not in builder.__dict__:  # none in all releases
        builder.__init_subclass__ = classmethod(_init_subclass_guarded)  # type: ignore[method-assign, assignment]
    setattr(builder, _GUARD_ATTR, True)
    return True


def installed(backend: ModuleType) -> bool:
    """Whether the builder class of ``backend`` carries the guard."""
    builder = getattr(backend, compat.BUILDER_CLASS, None)
    return builder is not None and bool(builder.__dict__.get(_GUARD_ATTR))


def remove(backend: ModuleType) -> None:
    """Give the builder (and subclasses guarded since) vLLM's own methods back."""
    global _exempt
    _exempt = None
    _once.reset()
    builder = getattr(backend, compat.BUILDER_CLASS, None)
    if builder is None or not builder.__dict__.get(_GUARD_ATTR):
        return
    for cls in (builder, *_subclasses(builder)):
        patching.restore(cls, "get_cudagraph_support")
    init = builder.__dict__.get("__init_subclass__")
    if init is not None and init.__func__ is _init_subclass_guarded:
        del builder.__init_subclass__
    delattr(builder, _GUARD_ATTR)


def _subclasses(cls: type) -> list[type]:
    direct: list[type] = cls.__subclasses__()
    return [c for sub in direct for c in (sub, *_subclasses(sub))]
