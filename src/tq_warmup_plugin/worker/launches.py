"""First launches of the non-Triton kernels on TurboQuant's attention paths.

CUDA loads a kernel's module on the kernel's first launch in a process
(``CUDA_MODULE_LOADING=LAZY``, PyTorch's default), and TurboQuant's long
continuation runs kernels that nothing before the first such request launches:
a GEMM in a dtype the model does not use (the MSE key un-rotation: fp16 from
0.21, fp32 in 0.20) and FlashAttention-2 over more keys than queries. The first
long request paid for both module loads (vLLM 0.26.0, eager,
``benchmarks/results/README.md``). Launching each shape class once on zero tensors
during warmup moves that cost to startup.

TurboQuant also keeps the first and last layers in the model dtype on vLLM's
FlashAttention backend and forces FlashAttention 2 there, and FA2 splits a
long-context decode over the keys with a kernel that eager mode first launches on
the first decode after a long prompt: a module load per process, and on a fresh
machine the CUDA driver compiling that kernel's PTX for sm90 first (a first long
request of over 100 s on vLLM 0.26.0, ``benchmarks/results/README.md``). One paged decode
launch per head shape moves it to startup.

Nothing here writes the KV cache: the tensors are scratch, the outputs dropped.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from .. import compat
from ..compat import CONTINUATION_DECODE_THRESHOLD
from ..geometry import Geometry
from .report import error_line

__all__ = [
    "ATTENTION_TOKENS",
    "GEMM_SCRATCH_BYTES",
    "PAGE_TOKENS",
    "UNROTATE_LADDER",
    "Launch",
    "boundary_decode",
    "boundary_prefill",
    "describe",
    "driver_plan",
    "launch_all",
    "launches",
    "not_yet_launched",
    "plan",
    "rotation_rows",
    "unrotate_rows",
]

# Query tokens of the FlashAttention launches at most. Its varlen forward (vLLM's fork,
# non-paged K/V) picks the kernel from dtype, head size and causality only: split-KV is
# for one-token queries and "even M/N" is off whenever cu_seqlens are given. So a short
# launch loads the same kernel, and the scratch it allocates -- after the KV cache, outside
# vLLM's memory profile -- stays a few MiB even for an 8k-token chunk budget.
ATTENTION_TOKENS = 2048
# Page size of the scratch paged cache: vLLM's FlashAttention backend needs a multiple
# of 16, and FA2 reads the page size at run time (no kernel is specialized on it).
PAGE_TOKENS = 16


# The key un-rotation GEMM of a long continuation is ``(Hk * cached_len) x D @ D x D``,
# and cuBLAS picks its kernel by shape: cached_len runs from 1 to
# ``max_model_len - 129`` (the chunk itself is over 128 tokens). Launched: cached lengths
# on a x8 ladder from 1 (1, 8, 64, ...: cuBLAS's heuristics switch tiles at size classes
# of M, not at every M) plus the longest, and the exact lengths a fresh chunked prompt
# runs (every multiple of the chunk budget: cuBLAS also pays its heuristic once per exact
# shape, and a warm engine's first long prompt still paid for a length off the ladder on
# vLLM 0.26.0, benchmarks/results/README.md). Rows are capped where the
# scratch operand reaches GEMM_SCRATCH_BYTES (16 MiB: 65536 rows at D=128 in fp16): by
# then the grid is many waves of the largest tile on any GPU, and beyond it the kernel is
# assumed not to change.
UNROTATE_LADDER = 8
GEMM_SCRATCH_BYTES = 16 * 2**20


def _chunk(g: Geometry) -> int:
    """The most tokens one request runs in a step: the chunk budget, within the context."""
    return min(g.max_num_batched_tokens, g.max_model_len)


def unrotate_rows(g: Geometry) -> list[int]:
    """GEMM rows of the key un-rotations a layer's long continuations run: a ladder of
    size classes, and each cached length of a fresh prompt's chunks, under the cap."""
    hk, d = g.num_kv_heads, g.head_size
    longest = g.max_model_len - CONTINUATION_DECODE_THRESHOLD - 1
    if longest < 1:
        return []
    itemsize = 2 if g.features.unrotate_fp16 else 4
    cap = max(hk, GEMM_SCRATCH_BYTES // (d * itemsize) // hk * hk)
    cached = [1]
    while cached[-1] * UNROTATE_LADDER < longest:
        cached.append(cached[-1] * UNROTATE_LADDER)
    cached.append(longest)
    chunk = _chunk(g)
    cached += range(chunk, min(longest, cap // hk) + 1, chunk)
    return sorted({min(hk * c, cap) for c in cached})


# The fp32 rotations run outside CUDA graphs at each step's shape: the store rotates
# ``tokens x KV heads`` key rows, decode and short continuations ``tokens x query heads``
# query rows. cuBLAS pays a few microseconds per new exact shape for its heuristics, but
# milliseconds when a shape needs a kernel whose module is not loaded yet. A powers-of-two
# ladder from 1 row cut what the first requests' shapes pay to about a tenth (torch 2.11,
# benchmarks/results/gemm-shapes/SUMMARY.md). So: the ladder, not every shape.


def rotation_rows(g: Geometry) -> list[int]:
    """GEMM rows of the fp32 rotations: powers of two from 1 up to the most rows a step
    can rotate (the store's ``chunk x Hk``, decode's ``batch x Hq``, a short
    continuation's ``128 x Hq``), that most, and decode's exact batch sizes (one
    request, the largest batch), under the scratch cap."""
    hq, hk = g.num_heads, g.num_kv_heads
    chunk = _chunk(g)
    cap = max(1, GEMM_SCRATCH_BYTES // (g.head_size * 4))
    top = min(cap, max(hk * chunk, hq * max(g.decode_rows, CONTINUATION_DECODE_THRESHOLD)))
    rows = {top, hq, min(cap, hq * g.decode_rows)}
    rows.update(1 << k for k in range(top.bit_length()) if 1 << k < top)
    return sorted(rows)


class Launch(NamedTuple):
    """One kernel launch on scratch tensors. Equal launches load the same kernels."""

    kind: str
    """``gemm`` (``rows x cols @ cols x cols``), ``attention`` (causal varlen),
    ``paged_decode`` (one query token over a paged cache: the boundary layers) or
    ``paged_prefill`` (a boundary layer's prompt over its own paged keys, causal)."""
    dtype: str
    rows: int
    """GEMM rows, or query tokens."""
    cols: int
    """GEMM inner size (the head size), or key tokens."""
    q_heads: int = 0
    kv_heads: int = 0
    head_size: int = 0

    @property
    def label(self) -> str:
        """``kind dtype rows x cols``: how error lines and ``inspect`` name it."""
        return f"{self.kind} {self.dtype} {self.rows}x{self.cols}"


def launches(g: Geometry) -> list[Launch]:
    """The launches whose kernels a layer's first requests would otherwise load.

    GEMM rows follow the runtime: the store, decode and short continuations rotate
    key and query rows in fp32 (``rotation_rows``: a ladder of size classes); a long
    continuation un-rotates
    ``num_kv_heads x cached`` key rows (``unrotate_rows``: cuBLAS picks kernels by size).
    FlashAttention runs a whole prompt chunk (``q == k``) and a continuation over
    one cached chunk (``k = 2q``), capped at ``ATTENTION_TOKENS`` queries.
    """
    d, hq, hk = g.head_size, g.num_heads, g.num_kv_heads
    chunk = _chunk(g)
    out: list[Launch] = []
    if not g.preset.key_fp8:
        out += [Launch("gemm", "float32", rows, d) for rows in rotation_rows(g)]
        unrotate = "float16" if g.features.unrotate_fp16 else "float32"
        if chunk > CONTINUATION_DECODE_THRESHOLD:
            out += [Launch("gemm", unrotate, rows, d) for rows in unrotate_rows(g)]
    tokens = min(chunk, ATTENTION_TOKENS)
    attention = [(tokens, tokens)]
    if chunk > CONTINUATION_DECODE_THRESHOLD and g.max_model_len >= 2 * chunk:
        attention.append((tokens, 2 * tokens))
    out += [Launch("attention", g.model_dtype, q, k, hq, hk, d) for q, k in attention]
    return out


def boundary_decode(g: Geometry, heads: tuple[int, int, int]) -> Launch:
    """The decode of a boundary layer with ``(query heads, KV heads, head size)``.

    The context is as long as the model allows, capped like the other attention
    launches: FlashAttention splits a one-token query over the keys once the
    context spans a few key blocks, and every split count runs the same kernels.
    """
    q_heads, kv_heads, head_size = heads
    tokens = min(g.max_model_len, ATTENTION_TOKENS)
    return Launch("paged_decode", g.model_dtype, 1, tokens, q_heads, kv_heads, head_size)


def boundary_prefill(g: Geometry, heads: tuple[int, int, int]) -> Launch:
    """A boundary layer's fresh prompt: causal over its own keys in a paged cache.

    Not in :func:`plan`: a worker's boundary layers have run it before warmup only if a
    prompt reached them, but the CUDA driver JIT-compiles its FA2 module (the causal
    split-KV one, FA2's path for any paged cache) on a fresh sm90 machine, so
    :func:`driver_plan` launches it into the shipped driver cache."""
    q_heads, kv_heads, head_size = heads
    tokens = min(_chunk(g), ATTENTION_TOKENS)
    return Launch("paged_prefill", g.model_dtype, tokens, tokens, q_heads, kv_heads, head_size)


def driver_plan(
    geometries: Mapping[str, Geometry], boundary: Mapping[str, tuple[int, int, int]]
) -> dict[Launch, str]:
    """The FlashAttention-2 launches of :func:`plan` (no GEMM: cuBLAS ships sm90 code)
    and each boundary head shape's prefill: what ``tq-warmup driver-cache`` runs so the
    driver's JIT cache holds every FA2 module a server's attention loads."""
    todo = {x: name for x, name in plan(geometries, boundary).items() if x.kind != "gemm"}
    if geometries:
        g = next(iter(geometries.values()))
        for name, heads in boundary.items():
            todo.setdefault(boundary_prefill(g, heads), name)
    return todo


def plan(
    geometries: Mapping[str, Geometry],
    boundary: Mapping[str, tuple[int, int, int]] | None = None,
    prefill_only: bool = False,
) -> dict[Launch, str]:
    """Distinct launches, each with the first layer that needs it.

    ``boundary``: heads of the full-precision FlashAttention-2 layers of the same
    model (their dtype and context length are the TurboQuant layers').
    ``prefill_only``: the runtime never reuses a cached prefix (a pooling model
    without chunked prefill or prefix caching): only a fresh prompt's attention.
    """
    todo: dict[Launch, str] = {}
    for name, g in geometries.items():
        for launch in launches(g):
            if not prefill_only or (launch.kind == "attention" and launch.rows == launch.cols):
                todo.setdefault(launch, name)
    if geometries and boundary and not prefill_only:
        g = next(iter(geometries.values()))
        for name, heads in boundary.items():
            todo.setdefault(boundary_decode(g, heads), name)
    return todo


def _launch(launch: Launch, impl: Any, device: Any) -> None:
    import torch

    dtype = getattr(torch, launch.dtype)
    if launch.kind == "gemm":
        a = torch.zeros(launch.rows, launch.cols, dtype=dtype, device=device)
        a @ torch.zeros(launch.cols, launch.cols, dtype=dtype, device=device)
        return
    q = torch.zeros(launch.rows, launch.q_heads, launch.head_size, dtype=dtype, device=device)
    cu_q = torch.tensor([0, launch.rows], dtype=torch.int32, device=device)
    if launch.kind in ("paged_decode", "paged_prefill"):
        pages = -(-launch.cols // PAGE_TOKENS)
        cache = torch.zeros(
            pages, PAGE_TOKENS, launch.kv_heads, launch.head_size, dtype=dtype, device=device
        )
        table = torch.arange(pages, dtype=torch.int32, device=device)[None]
        used = torch.tensor([launch.cols], dtype=torch.int32, device=device)
        paged = (
            compat.flash_attn_paged_decode(impl)
            if launch.kind == "paged_decode"
            else compat.flash_attn_paged(impl, launch.rows)
        )
        paged(q, cache, cu_q, used, table, launch.cols)
        return
    kv = torch.zeros(launch.cols, launch.kv_heads, launch.head_size, dtype=dtype, device=device)
    cu_k = torch.tensor([0, launch.cols], dtype=torch.int32, device=device)
    compat.flash_attn_varlen(impl)(q, kv, kv, cu_q, cu_k, launch.rows, launch.cols)


_LAUNCHED: set[tuple[str, Launch]] = set()
"""``(device, launch)`` pairs this process already ran: CUDA loads a module once per
process and device, so a second warmup in the same process (``compat.rewarm_cause``)
has nothing left to load for them."""


def not_yet_launched(todo: Mapping[Launch, str], device: Any) -> dict[Launch, str]:
    """The launches of ``todo`` this process has not yet made on ``device``."""
    return {x: layer for x, layer in todo.items() if (str(device), x) not in _LAUNCHED}


def launch_all(
    todo: Mapping[Launch, str], impls: Mapping[str, Any], device: Any
) -> tuple[int, float, list[str]]:
    """Run the launches; returns (done, seconds, error lines). Never raises.
    Successful ones are remembered for :func:`not_yet_launched`."""
    start = time.perf_counter()
    errors: list[str] = []
    done = 0
    attention_ok = compat.flash_attn_available()
    for launch, layer in todo.items():
        if launch.kind == "attention" and not attention_ok:
            continue  # the backend falls back to SDPA: no FlashAttention kernels to load
        try:
            _launch(launch, impls[layer], device)
            done += 1
            _LAUNCHED.add((str(device), launch))
        except Exception as exc:  # a launch that fails costs its first request, not startup
            errors.append(f"launch {launch.label}: {error_line(exc)}")
    if done:
        import torch

        if getattr(device, "type", None) == "cuda":
            torch.cuda.synchronize(device)
    return done, time.perf_counter() - start, errors


def describe(todo: Iterable[Launch]) -> list[str]:
    """One line per launch, for ``tq-warmup inspect``."""
    return [
        x.label
        + (f" (heads {x.q_heads}/{x.kv_heads}, d={x.head_size})" if x.kind != "gemm" else "")
        for x in todo
    ]
