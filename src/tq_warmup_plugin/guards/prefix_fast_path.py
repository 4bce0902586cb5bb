"""The prefix-cache guard: a cache hit never loses its cached prefix (upstream #46460).

Why: ``TurboQuantAttentionImpl._prefill_attention`` serves a prefill (sub-)batch with one
FlashAttention call over the batch's own raw K/V (``cu_seqlens_k = query_start_loc``)
when ``max_query_len == max_seq_len`` (``turboquant_attn.py`` 0.20:546, 0.22:579,
0.26:624, 0.33:740), a test its comment reads as "no request has prior cached KV". Two
batch maxima cannot say that: a fresh prompt C whose length is at least every other
request's whole sequence makes them equal while a cache hit B (query 50, sequence 690)
rides along, and B then attends its 50 new tokens only, silently; its deeper layers
store K/V computed from that, so every later token of B is off. The mixed branch of
``forward`` builds the prefill part's metadata with the *batch's* ``max_query_len`` and
the *prefill part's* ``max_seq_len`` (0.22:486-505, 0.26:531-550, 0.33:626-645), so a
decode beside them changes nothing. Prefix caching is vLLM's default and a shared system
prompt makes such steps common: upstream #46460 measured 47-75 of 52 C-Eval subjects
hallucinated (Qwen3-8B, turboquant_4bit_nc, 512 sequences), gone with prefix caching
off; PR #46461 (open) adds a host-side check. The same test is in every release
all releases (``compat.Features.prefix_fast_path_unsafe``).

What: ``_prefill_attention`` keeps vLLM's fast path only for a batch whose every request is a
first chunk (``seq_len == query_len``), decided on the host from the metadata's CPU copies
(``query_start_loc_cpu``, ``seq_lens_cpu``: ``Features.prefill_host_copies``; no sync, no
``.tolist()`` of a device tensor). Any other batch reaches vLLM's own per-request loop,
unchanged: the same call with ``max_seq_len`` one above ``max_query_len`` (still an upper bound
of every sequence, which is all the loop reads it for: the size of its cached arange), where a
fresh request still takes FlashAttention over its own K/V and a hit takes the continuation
kernels over its cached prefix. Those kernels are in the warmup plan already (``continuation``,
``dequant``): a routed request compiles nothing.

Where the decision cannot be made exactly it is made conservatively, said in the INFO
line: 0.20's metadata has no host copies, so there only a batch of one request (whose
two maxima are its own lengths) keeps the fast path. On 0.21-0.29 a chunked local
layer's host lengths are the real batch's, not its virtual batch's
(``Features.local_prefill_real_lens``): there the loop is the broken side, so such a
layer keeps vLLM's choice and one WARNING says so. Under CUDA-graph capture nothing is
changed: TurboQuant's graphs hold no prefill branch (``UNIFORM_BATCH``: decode-only
batches; verify batches are decode rows or PIECEWISE, ``batched_verify``), and the one
configuration that captures this branch (``TQ_WARMUP_SPEC_GUARD=0``) is wrong either
way. Batched verify rows are the decode part and never reach this function; DBO
micro-batches each bring their own metadata and host copies; pooling models take the
same path. ``TQ_WARMUP_PREFIX_GUARD=0`` turns the guard off (for the proof).
"""

from __future__ import annotations

import copy
import logging
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from .. import compat, patching
from .gate import install_where_needed

__all__ = [
    "MODULE",
    "RISK",
    "first_chunks_only",
    "install",
    "installed",
    "keeps_fast_path",
    "missing",
    "remove",
]

logger = logging.getLogger("vllm.tq_warmup_plugin")

MODULE = compat.BACKEND_MODULE
"""The vLLM module this guard adjusts once it has executed."""

_METHOD = "_prefill_attention"
_once = patching.Once()
_failed: list[bool] = []
"""Non-empty after an install on a release with the bug that did not place the guard."""


def first_chunks_only(query_start_loc: Any, seq_lens: Any) -> bool:
    """Whether every request of a batch is a first chunk: its sequence is exactly its
    query (``seq_lens[i] == query_start_loc[i + 1] - query_start_loc[i]``). Host
    tensors or lists; a batch of padding requests (0 tokens, length 0) counts as fresh."""
    qsl, seqs = _host_list(query_start_loc), _host_list(seq_lens)
    n = len(qsl) - 1
    if len(seqs) < n:
        return False
    return all(seqs[i] == qsl[i + 1] - qsl[i] for i in range(n))


def _host_list(values: Any) -> list[int]:
    """A host tensor's values (``tolist``: host copies only, never a device tensor), or
    a sequence's."""
    return [int(x) for x in (values.tolist() if hasattr(values, "tolist") else values)]


def _first_chunks(meta: Any) -> bool | None:
    """``first_chunks_only`` of the metadata's host copies; None where it has none.
    Two host tensors of ``num_reqs (+1)`` entries: microseconds, no device sync (vLLM's
    own loop reads the same copies with ``tolist``)."""
    qsl = getattr(meta, "query_start_loc_cpu", None)
    seqs = getattr(meta, "seq_lens_cpu", None)
    if qsl is None or seqs is None:
        return None
    return first_chunks_only(_host_list(qsl), _host_list(seqs))


def keeps_fast_path(meta: Any, layer: Any = None) -> bool:
    """Whether a batch that meets vLLM's fast-path test (``max_query_len ==
    max_seq_len``) may take it: every request a first chunk, per the host copies; a
    single request without them (its maxima are its own lengths); and a chunked local
    layer on a release whose host lengths are not its virtual batch's (vLLM's choice)."""
    fresh = _first_chunks(meta)
    if fresh is None:
        return int(meta.query_start_loc.shape[0]) <= 2
    if fresh:
        return True
    # Not all first chunks by these lengths; a chunked local layer whose host lengths
    # are not its own keeps vLLM's choice (the loop would read the wrong lengths).
    return compat.local_attention_chunk(layer) is not None and _local_lengths_unknown()


def _local_lengths_unknown() -> bool:
    feats = _features()
    if feats is None or not feats.local_prefill_real_lens:
        return False
    if _once.first("local"):
        logger.warning(
            "tq-warmup: vLLM %d.%d gives a chunked local layer (Llama 4) the real batch's "
            "host lengths, not its virtual batch's (upstream): the prefix-cache guard "
            "leaves such layers vLLM's fast path, so a prefix-cache hit there can lose its "
            "prefix; use vLLM 0.30+ or --no-enable-prefix-caching",
            *feats.version,
        )
    return True


def _features() -> compat.Features | None:
    try:
        return compat.release_features(compat.installed_vllm_version())
    except compat.UnsupportedRelease:
        return None


def _capturing() -> bool:
    """Whether this thread's CUDA stream is capturing a graph (no torch imported: no)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _announce() -> None:
    if not _once.first("on"):
        return
    feats = _features()
    how = "decided on the host from the metadata's CPU copies"
    if feats is not None and not feats.prefill_host_copies:
        how = (
            f"vLLM {feats.version[0]}.{feats.version[1]}'s metadata has no host copies of "
            "the lengths, so only a one-request batch keeps it"
        )
    logger.info(
        "tq-warmup: prefix-cache guard on: TurboQuant's first-chunk fast path serves only "
        "batches whose every request is a first chunk (%s); a batch with a prefix-cache "
        "hit takes the cache-reading path (upstream #46460); TQ_WARMUP_PREFIX_GUARD=0 "
        "turns it off",
        how,
    )


def _guard(original: Callable[..., Any]) -> Callable[..., Any]:
    @patching.wraps(original)
    def _prefill_attention(
        self: Any,
        query: Any,
        key: Any,
        value: Any,
        kv_cache: Any,
        attn_metadata: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        _announce()
        meta = attn_metadata
        if meta.max_query_len == meta.max_seq_len and not _capturing():
            layer = kwargs.get("layer", args[3] if len(args) > 3 else None)
            if not keeps_fast_path(meta, layer):
                meta = copy.copy(meta)
                meta.max_seq_len = meta.max_query_len + 1
        return original(self, query, key, value, kv_cache, meta, *args, **kwargs)

    return _prefill_attention


RISK = (
    f"through vLLM {compat.NEWEST[0]}.{compat.NEWEST[1]} TurboQuant's first-chunk fast "
    "path drops a prefix-cache hit's prefix (wrong tokens, upstream #46460): "
    "--no-enable-prefix-caching avoids it"
)
"""What a release newer than the plugin knows may do unguarded (``install_where_needed``)."""


def install(backend: ModuleType) -> bool:
    """Wrap ``TurboQuantAttentionImpl._prefill_attention`` where the installed release
    has the bug. Returns whether the guard is in place; never raises into vLLM's import
    (a failure is install_where_needed's WARNING, and ``missing`` tells strict mode)."""
    placed = install_where_needed(
        "prefix-cache",
        lambda feats: feats.prefix_fast_path_unsafe,
        lambda: _apply(backend),
        RISK,
    )
    feats = _features()
    _failed[:] = [] if placed or feats is None or not feats.prefix_fast_path_unsafe else [True]
    return placed


def _apply(backend: ModuleType) -> bool:
    impl: type = getattr(backend, compat.IMPL_CLASS)
    if not installed(backend):
        patching.replace(impl, _METHOD, _guard(impl.__dict__[_METHOD]))
    return True


def installed(backend: ModuleType) -> bool:
    """Whether the impl's ``_prefill_attention`` is the guard."""
    impl = getattr(backend, compat.IMPL_CLASS, None)
    return impl is not None and patching.is_ours(impl.__dict__.get(_METHOD))


def remove(backend: ModuleType) -> None:
    """Give the impl vLLM's own ``_prefill_attention`` back."""
    impl = getattr(backend, compat.IMPL_CLASS, None)
    if impl is not None:
        patching.restore(impl, _METHOD)
    _once.reset()
    _failed.clear()


def missing(feats: compat.Features, wanted: bool) -> str | None:
    """The warmup's check, for strict mode: an error line where the guard is wanted on
    a release with the bug and its install failed (one WARNING said why), else None."""
    if not (wanted and feats.prefix_fast_path_unsafe and _failed):
        return None
    return (
        "prefix-cache guard not installed: a prefix-cache hit can lose its prefix (upstream #46460)"
    )
