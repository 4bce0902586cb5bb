"""The V1 cache-dtype guard: TurboQuant engines on vLLM 0.25-0.26's V1 runner start.

Why (upstream #50709): 0.25-0.26 build ``TQFullAttentionSpec`` without ``kv_quant_mode``
(``model_executor/layers/attention/attention.py``, 0.25:672-679, 0.26:677-684), so it
keeps ``KVQuantMode.NONE``, which has no TurboQuant member there. The V1 runner
(``v1/worker/gpu_model_runner.py``, 0.25:7192-7208, 0.26:7349-7365) then passes
``cache_dtype_str="auto"`` for it to ``TurboQuantAttentionBackend.get_kv_cache_shape``,
whose ``TurboQuantConfig.from_cache_dtype("auto")`` (``turboquant_attn.py`` 0.25:161,
0.26:162) raises "Unknown TurboQuant cache dtype: 'auto'" (``turboquant/config.py``
220-225): every TurboQuant engine on the V1 runner (ngram / draft-model
speculative decoding, MoE and hybrid models, ``VLLM_USE_V2_MODEL_RUNNER=0``) fails at
startup. The V2 runner special-cases the spec (``v1/worker/gpu/attn_utils.py``
0.25:312-317); 0.20-0.24 pass the cache config's dtype; 0.27.1+ have
``KVQuantMode.TURBOQUANT``.

What: the backend's shape function gets the preset this process's TurboQuant layers
use in place of a dtype that is not ``turboquant_*``. Only layers whose dtype starts with
``turboquant_`` select this backend, so this cannot relabel a real "auto" layer. The
preset is recorded when ``TurboQuantAttentionImpl.__init__`` succeeds (its validated
``kv_cache_dtype``): the worker builds the model, hence every impl, before it allocates
the KV cache. With no preset seen, or two different ones, vLLM's own error stands.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

from .. import compat, patching
from .gate import install_where_needed

__all__ = ["MODULE", "install", "installed", "remove", "substitute"]

logger = logging.getLogger("vllm.tq_warmup_plugin")

MODULE = compat.BACKEND_MODULE
"""The vLLM module this guard adjusts once it has executed."""

BACKEND_CLASS = compat.BACKEND_CLASS
IMPL_CLASS = compat.IMPL_CLASS

_presets: set[str] = set()
"""The ``kv_cache_dtype`` of every TurboQuant impl this process built while guarded."""
_once = patching.Once()


def substitute(cache_dtype_str: str, presets: set[str]) -> str | None:
    """The dtype to hand vLLM's shape function in place of ``cache_dtype_str``, or None
    to hand it ``cache_dtype_str`` unchanged (a TurboQuant dtype, or no single preset)."""
    if cache_dtype_str.startswith(compat.TQ_DTYPE_PREFIX) or len(presets) != 1:
        return None
    return next(iter(presets))


def _log_substitution(given: str, preset: str) -> None:
    if not _once.first("substitution"):
        return
    version = compat.parse_version(compat.installed_vllm_version()) or (0, 0)
    logger.info(
        "tq-warmup: vLLM %d.%d V1 runner passed cache dtype %r for TurboQuant layers "
        "(upstream #50709); using %s",
        version[0],
        version[1],
        given,
        preset,
    )


def _log_declined(given: str) -> None:
    if not _once.first("declined"):
        return
    why = (
        (
            f"this process built TurboQuant layers with {len(_presets)} presets "
            f"({', '.join(sorted(_presets))})"
        )
        if _presets
        else "no TurboQuant layer was built"
    )
    logger.warning(
        "tq-warmup: cannot replace cache dtype %r for TurboQuant layers (upstream #50709): "
        "%s; vLLM's own error follows",
        given,
        why,
    )


def _guard_shape(original: Callable[..., Any]) -> Callable[..., Any]:
    """``get_kv_cache_shape``'s function with the preset in place of a non-TurboQuant
    dtype. Its signature (0.25-0.26): ``(num_blocks, block_size, num_kv_heads,
    head_size, cache_dtype_str="turboquant_4bit_nc")``; an omitted dtype stays omitted."""

    @patching.wraps(original)
    def get_kv_cache_shape(*args: Any, **kwargs: Any) -> Any:
        if len(args) > 4:
            given, args, kwargs = args[4], args[:4], {**kwargs, "cache_dtype_str": args[4]}
        else:
            given = kwargs.get("cache_dtype_str")
        if isinstance(given, str):
            preset = substitute(given, _presets)
            if preset is not None:
                _log_substitution(given, preset)
                kwargs["cache_dtype_str"] = preset
            elif not given.startswith(compat.TQ_DTYPE_PREFIX):
                _log_declined(given)
        return original(*args, **kwargs)

    return get_kv_cache_shape


def _recording_init(original: Callable[..., Any]) -> Callable[..., Any]:
    """``TurboQuantAttentionImpl.__init__`` that records the preset once it is valid
    (``__init__`` raises for an unknown one, 0.25-0.26)."""

    @patching.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        dtype = getattr(self, "kv_cache_dtype", None)
        if isinstance(dtype, str) and dtype.startswith(compat.TQ_DTYPE_PREFIX):
            _presets.add(dtype)

    return __init__


def install(backend: ModuleType) -> bool:
    """Guard the backend's shape function where the installed release needs it.
    Returns whether the guard is in place; never raises into vLLM's import."""
    return install_where_needed(
        "V1 cache-dtype", lambda feats: feats.v1_tq_cache_dtype_lost, lambda: _apply(backend)
    )


def _apply(backend: ModuleType) -> bool:
    if installed(backend):
        return True
    backend_cls: type = getattr(backend, BACKEND_CLASS)
    impl_cls: type = getattr(backend, IMPL_CLASS)
    # A staticmethod in 0.25-0.26; reading it through the class gives the function.
    shape = staticmethod(_guard_shape(backend_cls.get_kv_cache_shape))  # type: ignore[attr-defined]
    init = _recording_init(impl_cls.__init__)  # type: ignore[misc]
    patching.replace(backend_cls, "get_kv_cache_shape", shape)
    patching.replace(impl_cls, "__init__", init)
    return True


def installed(backend: ModuleType) -> bool:
    """Whether the backend class of ``backend`` carries the guarded shape function."""
    cls = getattr(backend, BACKEND_CLASS, None)
    current = cls.__dict__.get("get_kv_cache_shape") if cls is not None else None
    return patching.is_ours(current)


def remove(backend: ModuleType) -> None:
    """Give both classes vLLM's own attributes back and forget the recorded presets."""
    for class_name, name in ((BACKEND_CLASS, "get_kv_cache_shape"), (IMPL_CLASS, "__init__")):
        cls = getattr(backend, class_name, None)
        if cls is not None:
            patching.restore(cls, name)
    _presets.clear()
    _once.reset()
