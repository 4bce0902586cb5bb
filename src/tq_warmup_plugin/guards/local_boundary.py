"""The chunked-local boundary guard: a Llama 4 with a TurboQuant KV cache starts.

Why: ``ChunkedLocalAttention.__init__`` picks its attention backend from the cache
config's dtype (``chunked_local_attention.py`` 0.20-0.26:102, 0.27.1-0.33:101) before
``Attention.__init__`` turns the dtype of a layer listed in
``kv_cache_dtype_skip_layers`` into ``"auto"`` (``attention.py`` 0.22:264, 0.26:312,
0.33:312). TurboQuant adds its boundary layers (the first two and last two) to that
list (``arg_utils.py``), so a boundary layer that is chunked local gets TurboQuant's
backend with the dtype ``"auto"``, and ``TurboQuantAttentionImpl.__init__`` raises
"Unknown TurboQuant cache dtype: 'auto'". Llama 4's layer 0 is chunked local: with any
TurboQuant preset it did not start, with or without this plugin (vLLM 0.26.0,
``benchmarks/results/llama4/2026-12-01-h200-vllm0.26.0.md``); the same construction raises
on 0.22 and 0.33 (tests).

What: for a layer whose index is in the skip list while the cache dtype is
``turboquant_*``, ``ChunkedLocalAttention.__init__`` gets a copy of the cache config
whose ``cache_dtype`` is ``"auto"``: the backend it picks and the dtype
``Attention.__init__`` gives the layer are then those of vLLM's own skip path (the
layer was going to be ``"auto"`` anyway). Every other layer, and every non-TurboQuant
engine, gets the call unchanged. The layer index is read with vLLM's own
``extract_layer_index``, as ``Attention.__init__`` reads it.

Not fixed here (``compat.Features.local_tq_spec_plain``): on 0.20-0.27 a TurboQuant
layer's KV-cache spec is ``TQFullAttentionSpec`` (``attention.py`` 0.26:677, 0.27.1:677)
but a compressed chunked local layer's is ``ChunkedLocalAttentionSpec`` of uint8 at the
full head size (``chunked_local_attention.py`` 0.20-0.26:122, 0.27.1:121): 32768 bytes a
page beside 17152 at 128x8 heads, so the engine still fails a step later, in KV-cache
grouping ("page size is not divisible by the maximum page size", the same record). The
guard says so in one WARNING when the first such layer is built, before vLLM's error;
0.28+ give both kinds of TurboQuant layer the same spec with ``kv_quant_mode``.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

from .. import compat, patching
from .gate import install_where_needed

__all__ = ["MODULE", "install", "installed", "remove", "skipped_layer"]

logger = logging.getLogger("vllm.tq_warmup_plugin")

MODULE = compat.CHUNKED_LOCAL_MODULE
"""The vLLM module this guard adjusts once it has executed."""

CLASS = compat.CHUNKED_LOCAL_CLASS
_once = patching.Once()


def skipped_layer(cache_config: Any, layer_index: int | None) -> bool:
    """Whether a layer with this index keeps vLLM's own KV cache although the engine's
    dtype is TurboQuant (the index is in ``kv_cache_dtype_skip_layers``)."""
    dtype = getattr(cache_config, "cache_dtype", None)
    skip = getattr(cache_config, "kv_cache_dtype_skip_layers", None) or ()
    return (
        isinstance(dtype, str)
        and dtype.startswith(compat.TQ_DTYPE_PREFIX)
        and layer_index is not None
        and str(layer_index) in skip
    )


def _layer_index(prefix: str) -> int | None:
    extract_layer_index = importlib.import_module(compat.MODEL_UTILS_MODULE).extract_layer_index
    try:
        return int(extract_layer_index(prefix))
    except (AssertionError, ValueError):  # no index in the name: vLLM's own path decides
        return None


def _guard(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @patching.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        cache_config: Any = bound.arguments.get("cache_config")
        prefix = str(bound.arguments.get("prefix", ""))
        dtype = str(getattr(cache_config, "cache_dtype", ""))
        # A TurboQuant engine: this layer is a boundary layer or a compressed one.
        if dtype.startswith(compat.TQ_DTYPE_PREFIX):
            if skipped_layer(cache_config, _layer_index(prefix)):
                plain = copy.copy(cache_config)
                plain.cache_dtype = "auto"
                bound.arguments["cache_config"] = plain
                _announce(prefix, dtype)
            else:
                _warn_spec(prefix)
        original(*bound.args, **bound.kwargs)

    return __init__


def _announce(prefix: str, dtype: str) -> None:
    if not _once.first("boundary"):
        return
    logger.info(
        "tq-warmup: chunked local layer %s is a TurboQuant boundary layer; giving it "
        "vLLM's own backend, not %s's (else: Unknown TurboQuant cache dtype: 'auto')",
        prefix,
        dtype,
    )


def _warn_spec(prefix: str) -> None:
    """One WARNING on releases whose compressed chunked local layers cannot start."""
    if not _once.first("spec"):
        return
    try:
        feats = compat.release_features(compat.installed_vllm_version())
    except compat.UnsupportedRelease:  # not installed there; never raise into vLLM
        return
    if feats.local_tq_spec_plain:
        major, minor = feats.version
        logger.warning(
            "tq-warmup: vLLM %d.%d cannot serve TurboQuant on chunked local attention "
            "layers (%s, Llama 4): their KV-cache spec is not TurboQuant's, so startup "
            "fails in KV-cache grouping (upstream; fixed in 0.28); use vLLM 0.28+ or "
            "--kv-cache-dtype auto",
            major,
            minor,
            prefix,
        )


def install(module: ModuleType) -> bool:
    """Wrap ``ChunkedLocalAttention.__init__`` where the installed release needs it.
    Returns whether the guard is in place; never raises into vLLM's import."""
    return install_where_needed(
        "chunked-local boundary",
        lambda feats: feats.local_boundary_tq_backend,
        lambda: _apply(module),
    )


def _apply(module: ModuleType) -> bool:
    cls: type = getattr(module, CLASS)
    if installed(module):
        return True
    patching.replace(cls, "__init__", _guard(cls.__dict__["__init__"]))
    return True


def installed(module: ModuleType) -> bool:
    """Whether ``ChunkedLocalAttention.__init__`` is the guard."""
    cls = getattr(module, CLASS, None)
    return cls is not None and patching.is_ours(cls.__dict__.get("__init__"))


def remove(module: ModuleType) -> None:
    """Give the class vLLM's own ``__init__`` back."""
    cls = getattr(module, CLASS, None)
    if cls is not None:
        patching.restore(cls, "__init__")
    _once.reset()
