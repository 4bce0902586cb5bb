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
off; PR #46461 (open) adds a host-side check. The same test is in every release through
0.34 (``compat.Features.prefix_fast_path_unsafe``).

What: ``_prefill_attention`` keeps vLLM's fast path only for a batch whose every request is a
first chunk (``seq_len == query_len``), decided on the host from the metadata's CPU copies
(``query_start_loc_cpu``, ``seq_lens_cpu``: ``Features.prefill_host_copies``; no sync, no
``.tolist()`` of a device tensor). A batch that meets vLLM's test with a cache hit (or a later
chunk) in it is split where it holds ``MIN_FRESH`` (two) first chunks or more: vLLM's own
method runs twice, unchanged. First on the whole batch as it is: its fast path, one
FlashAttention call, right for every first chunk (its keys are its own tokens). Then the
hits, whose rows replace theirs of the first call (wasted work there: a hit's new tokens
over themselves alone, small beside its continuation): those of up to 128 new tokens in
shared launches of vLLM's own decode launcher, as its loop would serve each alone
(``prefix_hits``); the longer ones packed into a batch of their own (``sub_metadata``: each
field of ``TurboQuantMetadata`` gathered or kept, ``FIELDS``; the lengths from the host
copies; one asynchronous host-to-device copy of the packed offsets) through vLLM's loop,
each hit's continuation over its cached prefix. Runs of
consecutive hits stay whole, so the gather is one ``torch.cat`` per tensor (none for one run)
and the scatter one copy per run. Why split: sent whole to the loop, every first chunk costs
its own FlashAttention call, and each request a pass of the loop's host work. Any other
denied batch reaches vLLM's loop whole, as before the split: the same call with
``max_seq_len`` one above ``max_query_len`` (still an upper bound of every sequence, which is
all the loop reads it for: the size of its cached arange). There a first chunk (at most one)
takes FlashAttention over its own K/V and a hit the continuation kernels over its cached
prefix. Nothing here launches a kernel of its own beyond torch's copies: both calls take
launch shapes of vLLM's own paths, whose kernels are in the warmup plan already
(``continuation``, ``dequant``), so a guarded batch compiles nothing.

The split is not made, and the batch goes to the loop whole, where vLLM has no FlashAttention
(``_HAS_FLASH_ATTN`` false, as on a CPU: its fast path is then the loop as well), where the
metadata has no host copies (0.20), and where its class has a field outside ``FIELDS`` (a
release newer than this module knows: the field is not judged).

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
import dataclasses
import itertools
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from .. import compat, patching
from .gate import install_where_needed

__all__ = [
    "FIELDS",
    "MIN_FRESH",
    "MODULE",
    "RISK",
    "SubBatch",
    "first_chunks_only",
    "install",
    "installed",
    "keeps_fast_path",
    "missing",
    "pack",
    "remove",
    "split_batch",
    "sub_metadata",
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
    lengths = _host_lengths(meta)
    return None if lengths is None else first_chunks_only(*lengths)


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
        "first chunks (%s); a prefix-cache hit takes the cache-reading path (upstream "
        "#46460), and the first chunks beside it keep one FlashAttention call where there "
        "are two or more; TQ_WARMUP_PREFIX_GUARD=0 turns it off",
        how,
    )


def split_batch(query_start_loc: Any, seq_lens: Any) -> tuple[list[int], list[int]]:
    """A prefill batch's requests that have tokens, parted on the host: ``(first chunks,
    the rest)``, the rest being cache hits and later chunks (``seq_len > query_len``).
    Host tensors or lists; padding requests (0 tokens) are in neither."""
    qsl, seqs = _host_list(query_start_loc), _host_list(seq_lens)
    fresh: list[int] = []
    hits: list[int] = []
    for i in range(len(qsl) - 1):
        q = qsl[i + 1] - qsl[i]
        if q > 0:
            (fresh if i < len(seqs) and seqs[i] == q else hits).append(i)
    return fresh, hits


@dataclass(frozen=True)
class SubBatch:
    """The cache hits of a mixed prefill batch packed into a batch of their own, all on
    the host: their runs of consecutive requests ``[a, b)``, each run's token rows in
    the batch, and the packed batch's lengths."""

    runs: list[tuple[int, int]]
    rows: list[tuple[int, int]]
    query_start_loc: list[int]
    seq_lens: list[int]


def pack(query_start_loc: Any, seq_lens: Any, hits: list[int]) -> SubBatch:
    """``hits`` (ascending request indices) of a batch packed in order: runs of
    consecutive requests are kept whole, so each run is one slice of every tensor."""
    qsl, seqs = _host_list(query_start_loc), _host_list(seq_lens)
    runs: list[tuple[int, int]] = []
    for i in hits:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    sub_qsl = [0]
    for i in hits:
        sub_qsl.append(sub_qsl[-1] + qsl[i + 1] - qsl[i])
    return SubBatch(
        runs=runs,
        rows=[(qsl[a], qsl[b]) for a, b in runs],
        query_start_loc=sub_qsl,
        seq_lens=[seqs[i] for i in hits],
    )


MIN_FRESH = 2
"""First chunks a denied batch needs for the split: with one, vLLM's loop serves it with
one FlashAttention call already, and the split would add only the gather and scatter."""

FIELDS = frozenset(
    {
        "seq_lens",  # per request: gathered
        "block_table",  # per request: gathered
        "seq_lens_cpu",  # per request: the packed host lengths
        "slot_mapping",  # per token: gathered
        "query_start_loc",  # the packed offsets, one asynchronous host-to-device copy
        "query_start_loc_cpu",  # the packed offsets
        "num_actual_tokens",  # the hits' tokens
        "max_query_len",  # the hits' longest query
        "max_seq_len",  # the hits' longest sequence
        "is_prefill",  # kept (a prefill batch)
        "num_decodes",  # kept (0: decodes never reach this function)
        "num_decode_tokens",  # kept (0)
    }
)
"""Every field of ``TurboQuantMetadata`` (0.21-0.34) and what the hits' packed batch gets
for it. A metadata class with any other field is not split (``_splittable``)."""

_field_sets: dict[type, bool] = {}


def _splittable(meta: Any) -> bool:
    """Whether the metadata's class has exactly ``FIELDS`` (cached per class)."""
    cls = type(meta)
    known = _field_sets.get(cls)
    if known is None:
        names = [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else []
        known = _field_sets[cls] = frozenset(names) == FIELDS
    return known


def _host_lengths(meta: Any) -> tuple[list[int], list[int]] | None:
    """The metadata's host copies as lists; None where it has none."""
    qsl = getattr(meta, "query_start_loc_cpu", None)
    seqs = getattr(meta, "seq_lens_cpu", None)
    if qsl is None or seqs is None:
        return None
    return _host_list(qsl), _host_list(seqs)


def _split(meta: Any, backend: ModuleType) -> tuple[list[int], list[int], list[int]] | None:
    """The host lengths and the hits of a denied batch where it is split: the release
    has FlashAttention (else vLLM's fast path is its loop too), the host lengths, a known
    metadata class, ``MIN_FRESH`` first chunks and at least one hit."""
    lengths = _host_lengths(meta)
    if lengths is None or not getattr(backend, "_HAS_FLASH_ATTN", False) or not _splittable(meta):
        return None
    fresh, hits = split_batch(*lengths)
    if len(fresh) < MIN_FRESH or not hits:
        return None
    return lengths[0], lengths[1], hits


def _cat(parts: list[Any]) -> Any:
    """``parts`` as one tensor: the part itself where there is one (a view, no launch)."""
    if len(parts) == 1:
        return parts[0]
    import torch

    return torch.cat(parts)


def _tensor_like(values: list[int], like: Any) -> Any:
    """``values`` as a tensor of ``like``'s dtype on its device: built on the host, then
    one asynchronous copy where ``like`` is on the GPU (no sync)."""
    import torch

    return torch.tensor(values, dtype=like.dtype).to(like.device, non_blocking=True)


def sub_metadata(meta: Any, sub: SubBatch) -> Any:
    """The metadata of the hits' packed batch (``FIELDS``); ``meta`` is left as it is."""
    out = copy.copy(meta)
    out.seq_lens = _cat([meta.seq_lens[a:b] for a, b in sub.runs])
    out.block_table = _cat([meta.block_table[a:b] for a, b in sub.runs])
    out.slot_mapping = _cat([meta.slot_mapping[a:b] for a, b in sub.rows])
    out.seq_lens_cpu = _tensor_like(sub.seq_lens, meta.seq_lens_cpu)
    out.query_start_loc_cpu = _tensor_like(sub.query_start_loc, meta.query_start_loc_cpu)
    out.query_start_loc = _tensor_like(sub.query_start_loc, meta.query_start_loc)
    out.num_actual_tokens = sub.query_start_loc[-1]
    out.max_query_len = max(b - a for a, b in itertools.pairwise(sub.query_start_loc))
    # A hit's sequence is longer than its query, so this is the hits' longest sequence;
    # the bound keeps the second call vLLM's loop by construction.
    out.max_seq_len = max(*sub.seq_lens, out.max_query_len + 1)
    return out


def _serve_split(
    original: Callable[..., Any],
    split: tuple[list[int], list[int], list[int]],
    self: Any,
    tensors: tuple[Any, Any, Any, Any],
    meta: Any,
    call: tuple[tuple[Any, ...], dict[str, Any], ModuleType],
) -> Any:
    """vLLM's fast path over the whole batch (one FlashAttention call: right for every
    first chunk, whose keys are its own tokens), then the hits' rows written over it:
    the short ones together (``prefix_hits``), the rest by vLLM's loop over them packed
    (their continuation over the cached prefix)."""
    from . import prefix_hits  # on a split step only: register() stays small

    query, key, value, kv_cache = tensors
    args, kwargs, backend = call
    out = original(self, query, key, value, kv_cache, meta, *args, **kwargs)
    qsl, seqs, hits = split
    launch = prefix_hits.launcher(backend, self)
    if launch is not None:
        short, hits = prefix_hits.short_hits(qsl, seqs, hits)
        named = prefix_hits.prefill_args(args, kwargs)
        for group in prefix_hits.groups(short):
            prefix_hits.serve(launch, self, (query, kv_cache, meta.block_table), group, named, out)
    if not hits:
        return out
    sub = pack(qsl, seqs, hits)
    hit_out = original(
        self,
        _cat([query[a:b] for a, b in sub.rows]),
        _cat([key[a:b] for a, b in sub.rows]),
        _cat([value[a:b] for a, b in sub.rows]),
        kv_cache,
        sub_metadata(meta, sub),
        *args,
        **kwargs,
    )
    prefix_hits.write_back(out, hit_out, sub.rows)
    return out


def _guard(original: Callable[..., Any], backend: ModuleType) -> Callable[..., Any]:
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
                split = _split(meta, backend)
                if split is not None:
                    tensors = (query, key, value, kv_cache)
                    call = (args, kwargs, backend)
                    return _serve_split(original, split, self, tensors, meta, call)
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
        patching.replace(impl, _METHOD, _guard(impl.__dict__[_METHOD], backend))
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
