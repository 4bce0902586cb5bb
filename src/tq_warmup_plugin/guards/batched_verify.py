"""The batched verify path: speculative verify batches as one capturable decode launch.

Why: the PIECEWISE cap (``spec_graphs``) keeps verify tokens right, but each
TurboQuant layer's verify attention then runs outside the graph through
``_prefill_attention``'s per-request loop (one decode launch, ``.tolist()`` reads and
scratch per request and layer). That kept half the unguarded FULL-graph throughput or
less, below no speculative decoding at all (vLLM 0.26.0,
``benchmarks/results/spec/SUMMARY-batched.md``). Upstream #40914 (a uniform-batch branch
that allocates during replay and lets mixed batches reach the loop) and #53410
(spec-as-decode rows, unmerged) do not serve both needs in any release the gate names.

What, under speculative decoding on a release with ``Features.spec_verify_batched``:
* the builder treats requests of up to ``1 + k`` tokens as decodes: its own
  ``_init_reorder_batch_threshold(1, supports_spec_as_decode=True)``, so the
  runner orders them first (V1 ``reorder_batch_to_split_decodes_and_prefills``, V2
  ``sort_batch_req_ids``);
* every metadata it builds has that decode part rewritten into one row per query token
  (``verify_rows.VerifyRows``): vLLM's own ``forward`` then runs its pure-decode (or
  mixed) branch, one ``_decode_attention`` launch per layer over those rows, with scratch
  from the workspace the plugin reserves for ``max_num_seqs * (1 + k)`` rows; prefill
  chunks after them keep vLLM's path;
* the builder keeps vLLM's ``UNIFORM_BATCH``, so uniform verify batches are captured
  FULL with the rows inside; configurations the rows do not serve (decode context
  parallelism forces the threshold to 1) keep the PIECEWISE cap.
The KV cache layout never matters here: the rows are metadata, and vLLM's
``_decode_attention`` hands the kernels its own view (head-major where
``Features.kv_head_major``, else token-major). Releases without the gate (0.20: decode scratch
lives on the layer and grows with ``torch.empty``, and the metadata has no host copies)
get the PIECEWISE cap, said in one line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

from .. import compat, patching
from ..worker.verify_rows import ROWS_ATTR, VerifyRows, rows_of
from . import spec_graphs
from .gate import install_where_needed

__all__ = [
    "MODULE",
    "ROWS_ATTR",
    "install",
    "installed",
    "remove",
    "rows_of",
    "serve_rows",
    "serves",
]

logger = logging.getLogger("vllm.tq_warmup_plugin")

MODULE = compat.BACKEND_MODULE
"""The vLLM module this guard adjusts once it has executed."""

_GUARD_ATTR = "__tq_warmup_batched_verify__"
_once = patching.Once()


def _threshold(vllm_config: Any) -> int:
    """The decode threshold a TurboQuant builder of this configuration serves rows for:
    a TurboQuant cache under speculative decoding (``compat.spec_decode_threshold``);
    at most 1 where it serves none (UltraQuant's subclass included, 0.32+)."""
    cache = getattr(vllm_config, "cache_config", None)
    if not str(getattr(cache, "cache_dtype", "")).startswith(compat.TQ_DTYPE_PREFIX):
        return 0
    return compat.spec_decode_threshold(vllm_config)


def serves(vllm_config: Any) -> bool:
    """Whether a TurboQuant builder of this configuration takes the batched path."""
    return _threshold(vllm_config) > 1


def _announce(rows: VerifyRows, k_tokens: int) -> None:
    if not _once.first("batched"):
        return
    logger.info(
        "tq-warmup: speculative decoding with TurboQuant: verify batches take the batched "
        "decode path (requests of up to %d tokens as one decode row per token, %d rows, "
        "one launch per layer; FULL CUDA graphs of verify batches kept); "
        "TQ_WARMUP_SPEC_GUARD=piecewise forces PIECEWISE, 0 turns both off",
        k_tokens,
        rows.capacity,
    )


def serve_rows(builder: Any) -> None:
    """After vLLM's ``__init__``: the spec-as-decode threshold and the builder's rows (the
    patched ``__init__`` calls it; ``benchmarks/tqbench/verify_attention.py`` too, on a
    builder it made without ``__init__``)."""
    config = builder.vllm_config
    expected = _threshold(config)
    if expected <= 1:
        return
    builder._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
    # The support level keys on ``serves``, so the builder must serve what it exempts
    # (the contract tests pin vLLM's threshold to ``spec_decode_threshold``).
    threshold = max(int(builder.reorder_batch_threshold or 1), expected)
    builder.reorder_batch_threshold = threshold
    capacity = int(config.scheduler_config.max_num_seqs) * threshold
    rows = VerifyRows(capacity, threshold, builder.device)
    setattr(builder, ROWS_ATTR, rows)
    _announce(rows, threshold)


def _wrap_init(original: Callable[..., None]) -> Callable[..., None]:
    @patching.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        serve_rows(self)

    return __init__


def _wrap_build(original: Callable[..., Any]) -> Callable[..., Any]:
    @patching.wraps(original)
    def build(self: Any, *args: Any, **kwargs: Any) -> Any:
        meta = original(self, *args, **kwargs)
        rows = rows_of(self)
        if rows is not None:
            rows.rewrite(meta)
        return meta

    return build


def install(backend: ModuleType) -> bool:
    """Serve verify batches with the rows where the release is proven for them, and cap
    the support level of whatever they do not serve; elsewhere the PIECEWISE cap
    alone. Returns whether the rows are in place; never raises into vLLM's import."""
    if install_where_needed(
        "batched verify", lambda feats: feats.spec_verify_batched, lambda: _apply(backend)
    ):
        return True
    release = compat.installed_vllm_version()
    spec_graphs.install(backend, why=f"vLLM {release} has no proven batched verify path")
    return False


def _apply(backend: ModuleType) -> bool:
    builder: type = getattr(backend, compat.BUILDER_CLASS)
    if builder.__dict__.get(_GUARD_ATTR):
        return True
    patching.replace(builder, "__init__", _wrap_init(builder.__dict__["__init__"]))
    patching.replace(builder, "build", _wrap_build(builder.__dict__["build"]))
    setattr(builder, _GUARD_ATTR, True)
    why = "a configuration the batched verify path does not serve"
    if not spec_graphs.install(backend, exempt=serves, why=why):
        remove(backend)
        raise RuntimeError("the support-level cap for unserved configurations is not in place")
    return True


def installed(backend: ModuleType) -> bool:
    """Whether the builder class of ``backend`` builds verify rows."""
    builder = getattr(backend, compat.BUILDER_CLASS, None)
    return builder is not None and bool(builder.__dict__.get(_GUARD_ATTR))


def remove(backend: ModuleType) -> None:
    """Give the builder vLLM's own ``__init__``/``build`` and support level back."""
    builder = getattr(backend, compat.BUILDER_CLASS, None)
    if builder is not None and builder.__dict__.get(_GUARD_ATTR):
        for name in ("__init__", "build"):
            patching.restore(builder, name)
        delattr(builder, _GUARD_ATTR)
    spec_graphs.remove(backend)
    _once.reset()
