"""Pure derivation of the Triton specializations each TurboQuant kernel path launches.

Triton compiles one binary per specialization: the value of every constexpr,
the dtype of every pointer and whether it is 16-byte aligned (on HIP also whether
its storage is within 2 GiB), and for every other int whether it equals 1, is
divisible by 16, or needs 64 bits. A
``KernelKey`` records exactly that, nothing more, so two layers whose launches
would hit the same binary produce equal keys and are warmed once.

The functions here mirror what vLLM's launchers compute (all releases); the
``real_vllm`` contract tests run the real launchers and assert equality.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from . import compat
from .compat import CONTINUATION_DECODE_THRESHOLD, LAUNCHER_DEFAULT_KV_SPLITS
from .geometry import Geometry, request_bytes, runtime_requests

__all__ = [
    "PATHS",
    "Arg",
    "Const",
    "Int",
    "KernelKey",
    "Ptr",
    "decode_keys",
    "long_continuation_keys",
    "next_pow2",
    "short_continuation_keys",
    "store_keys",
]

# --------------------------------------------------------------------------
# Argument specializations
# --------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class Ptr:
    """A tensor argument: Triton keys on its dtype and on ``data_ptr() % 16 == 0``, and
    on HIP on whether its storage is within 2 GiB (``compat.pointer_in_range``)."""

    dtype: str
    aligned: bool = True
    in_range: bool | None = None
    """HIP's "S": storage within 2 GiB (True) or not (False); None where Triton does
    not key on it (CUDA)."""


@dataclass(frozen=True, order=True)
class Int:
    """A non-constexpr int, reduced to the representative of its Triton class.

    Triton turns 1 into a constexpr, marks multiples of 16 (0 included) as
    divisible, and widens values that do not fit in 32 bits.
    """

    value: int

    @staticmethod
    def of(value: int) -> Int:
        if value == 1:
            return Int(1)
        wide = not -(2**31) <= value < 2**31
        base = 2**32 if wide else 0
        return Int(base + (16 if value % 16 == 0 else 17))


@dataclass(frozen=True, order=True)
class Const:
    """A ``tl.constexpr`` argument: its exact value is part of the key."""

    value: float | int


Arg = Ptr | Int | Const


@dataclass(frozen=True, order=True)
class KernelKey:
    """One Triton specialization of one kernel: what a launch compiles."""

    kernel: str
    args: tuple[tuple[str, Arg], ...]
    num_warps: int
    num_stages: int | None = None

    def describe(self) -> str:
        """A compact, complete rendering, used by the report and ``inspect``.

        Pointers print as ``*dtype`` (``~`` marks an unaligned one, ``:S`` / ``:>2G`` a
        storage within / over 2 GiB on HIP), ints as their Triton class (``1``, ``%16``,
        ``i32``, ``i64%16``, ``i64``), constexprs as values.
        """
        parts = []
        for name, arg in self.args:
            if isinstance(arg, Ptr):
                span = {None: "", True: ":S", False: ":>2G"}[arg.in_range]
                parts.append(f"{name}=*{arg.dtype}{'' if arg.aligned else '~'}{span}")
            elif isinstance(arg, Int):
                wide = "i64" if arg.value >= 2**32 else ""
                cls = "1" if arg.value == 1 else ("%16" if arg.value % 16 == 0 else "")
                parts.append(f"{name}={wide}{cls or ('' if wide else 'i32')}")
            else:
                parts.append(f"{name}={arg.value}")
        stages = "" if self.num_stages is None else f",stages={self.num_stages}"
        return f"{self.kernel}[warps={self.num_warps}{stages}]({', '.join(parts)})"


Choice = Arg | tuple[Arg, ...]
"""An argument, or the alternatives it takes at runtime (one key each)."""


def _keys(kernel: str, num_warps: int, num_stages: int | None, **args: Choice) -> list[KernelKey]:
    """One key per combination of the alternatives (in argument order)."""
    names = list(args)
    options = [arg if isinstance(arg, tuple) else (arg,) for arg in args.values()]
    return [
        KernelKey(kernel, tuple(zip(names, combo, strict=True)), num_warps, num_stages)
        for combo in itertools.product(*options)
    ]


def next_pow2(n: int) -> int:
    """The least power of two >= ``n`` (1 for ``n`` <= 1): Triton block sizes and the
    ``BLOCK_SIZE`` constexprs vLLM's launchers derive (``next_power_of_2``)."""
    return 1 << max(0, n - 1).bit_length()


def _row_alignments(g: Geometry) -> tuple[bool, ...]:
    """Alignments of ``block_table[r]`` over the rows a request can occupy.

    Row r starts at ``r * width * 4`` bytes: every row is 16-byte aligned only when
    the width is a multiple of 4 (or there is a single row). A microbatch's table can
    also start behind a whole table of ``max_num_seqs`` rows (0.32+ ``kernel_block_table
    [ubatch]``), so with microbatching one row is no exemption.
    """
    single = g.max_num_seqs < 2 and "block_table" not in g.ubatch_sliced
    if g.block_table_width % 4 == 0 or single:
        return (True,)
    return (True, False)


def _local_row_alignments(g: Geometry) -> tuple[bool, ...]:
    """Alignments of a chunked local layer's virtual-batch row that a continuation
    reads (decode reads the table from its base, always aligned).

    The table is built per step (per microbatch too), so microbatching never offsets
    it. Only a request's first virtual row can continue a cached prefix, which with a
    single request is row 0; on 0.21-0.29 any row can (``compat.Features.
    local_prefill_real_lens``).
    """
    single = g.max_num_seqs < 2 and not g.features.local_prefill_real_lens
    if g.local_width % 4 == 0 or single:
        return (True,)
    return (True, False)


def _sliced_alignments(g: Geometry, view: str, spread: int) -> tuple[bool, ...]:
    """Alignments of a runner buffer's base as a microbatch gets it: aligned without
    microbatching; with it, any offset of the ``spread`` requests or tokens a batch
    can hold (only the first microbatch starts at 0), see ``compat.ubatch_sliced``."""
    if view in g.ubatch_sliced and spread >= 2:
        return (True, False)
    return (True,)


# --------------------------------------------------------------------------
# Pointer storages (bytes): only HIP keys on them (``Geometry.pointer_ranges``)
# --------------------------------------------------------------------------

Sizes = tuple[int, ...]
_TINY: Sizes = (0,)
"""Centroids and midpoints: at most 2**8 floats."""


def _ptr(
    g: Geometry, dtype: str, sizes: Sizes, aligned: tuple[bool, ...] = (True,)
) -> tuple[Ptr, ...]:
    """A pointer in every alignment and, on HIP, every 2 GiB answer its storage sizes
    give (the smallest and largest of a tensor allocated per launch cover the rest)."""
    if not g.pointer_ranges:
        return tuple(Ptr(dtype, a) for a in aligned)
    spans = sorted({compat.pointer_in_range(n) for n in sizes}, reverse=True)
    return tuple(Ptr(dtype, a, span) for a in aligned for span in spans)


def _upto(per_row: int, rows: int) -> Sizes:
    """A tensor allocated per launch for 1..rows rows (requests, tokens, blocks)."""
    return (per_row, per_row * max(1, rows))


def _workspace(g: Geometry) -> Sizes:
    """The workspace buffers the views come from (0.21+): the real ones after the
    reservation, else the largest request planned (what the reservation grows to)."""
    if g.workspace_bytes:
        return g.workspace_bytes
    return (max((request_bytes(group) for group in runtime_requests(g)), default=0),)


def _activations(g: Geometry) -> Sizes:
    """What a step's qkv projection output can hold (k8v4 queries, keys and values
    reach the kernels as its views, or copies of one token's head up)."""
    heads = g.num_heads + 2 * g.num_kv_heads
    return _upto(g.head_size * 2, g.max_num_batched_tokens * heads * g.head_size)


def _seq_storage(g: Geometry) -> Sizes:
    """``seq_lens``: the runner's buffer of ``max_num_seqs`` or the prefill loop's
    arange of ``max_model_len + 2`` int32 (or a smaller slice copy)."""
    return (4, 4 * max(g.max_num_seqs, g.max_model_len + 2))


def _local_table(g: Geometry) -> Sizes:
    """A virtual-batch block table: ``local_width`` int32 per virtual request, at most
    one per scheduled token plus one per (padding) request."""
    return _upto(g.local_width * 4, g.max_num_batched_tokens + g.max_num_seqs)


class _Table(NamedTuple):
    """The block table one path's kernels get: row stride, storage sizes, and the
    alignments of the row a continuation reads."""

    stride: int
    sizes: Sizes
    rows: tuple[bool, ...]


def _table(g: Geometry) -> _Table:
    """The runner's block table, or a chunked local layer's virtual-batch one."""
    if g.attention_chunk:
        return _Table(g.local_width, _local_table(g), _local_row_alignments(g))
    return _Table(g.block_table_width, (g.block_table_bytes,), _row_alignments(g))


# --------------------------------------------------------------------------
# Kernel paths
# --------------------------------------------------------------------------


def _mid_o(g: Geometry, splits: int, batch: int, from_workspace: bool) -> Sizes:
    """Stage 1's partial results: a workspace view (decode, 0.21+) or per launch."""
    row = g.num_heads * splits * (g.head_size + 1) * 4
    return _workspace(g) if from_workspace else _upto(row, batch)


def _stage1(
    g: Geometry,
    splits: int,
    bt_stride: int,
    bt_sizes: Sizes,
    rows: tuple[bool, ...],
    seqs: tuple[bool, ...],
    batch: int,
    from_workspace: bool,
) -> list[KernelKey]:
    """One key per block-table row and ``seq_lens`` alignment (and HIP storage span);
    ``batch`` bounds the per-launch tensors, ``from_workspace`` says where mid_o is."""
    p = g.preset
    d = g.head_size
    kv = g.kv_strides
    # k8v4 hands the query over as is; the MSE presets rotate it into fp32.
    query = _activations(g) if p.key_fp8 else _upto(g.num_heads * d * 4, batch)
    return _keys(
        "_tq_decode_stage1",
        1,
        1,
        Q_rot_ptr=_ptr(g, g.short_dtype if p.key_fp8 else "fp32", query),
        KV_cache_ptr=_ptr(g, "u8", (g.kv_storage_bytes,), (g.kv_aligned,)),
        Block_table_ptr=_ptr(g, "i32", bt_sizes, rows),
        Seq_lens_ptr=_ptr(g, "i32", _seq_storage(g), seqs),
        Centroids_ptr=_ptr(g, "fp32", _TINY),
        Mid_o_ptr=_ptr(g, "fp32", _mid_o(g, splits, batch, from_workspace)),
        stride_qb=Int.of(g.num_heads * d),
        stride_qh=Int.of(d),
        stride_cache_block=Int.of(kv[0]),
        stride_cache_pos=Int.of(kv[1]),
        stride_cache_head=Int.of(kv[2]),
        stride_bt_b=Int.of(bt_stride),
        stride_mid_b=Int.of(g.num_heads * splits * (d + 1)),
        stride_mid_h=Int.of(splits * (d + 1)),
        stride_mid_s=Int.of(d + 1),
        NUM_KV_HEADS=Const(g.num_kv_heads),
        HEAD_DIM=Const(d),
        BLOCK_SIZE=Const(g.block_size),
        NUM_KV_SPLITS=Const(splits),
        KV_GROUP_SIZE=Const(g.num_heads // g.num_kv_heads),
        MSE_BITS=Const(p.key_mse_bits),
        MSE_BYTES=Const(math.ceil(d * p.key_mse_bits / 8)),
        KPS=Const(p.key_packed_size),
        VQB=Const(p.value_bits),
        VAL_DATA_BYTES=Const(p.value_data_bytes),
        ATTN_SCALE=Const(g.scale),
        BLOCK_D=Const(next_pow2(d)),
        BLOCK_KV=Const(4),
        KEY_FP8=Const(int(p.key_fp8)),
        NORM_CORRECTION=Const(int(p.norm_correction)),
        FP8_E4B15=Const(g.fp8_e4b15),
    )


def _stage2(
    g: Geometry, splits: int, seqs: tuple[bool, ...], batch: int, from_workspace: bool
) -> list[KernelKey]:
    d = g.head_size
    fp16_out = g.features.stage2_output_fp16
    extra: dict[str, Arg] = {}
    if fp16_out:
        extra["OUTPUT_FP16"] = Const(int(g.model_dtype == "float16"))
    out_bytes = 2 if fp16_out else 4
    out = _workspace(g) if from_workspace else _upto(g.num_heads * d * out_bytes, batch)
    lse = _workspace(g) if from_workspace else _upto(g.num_heads * 4, batch)
    return _keys(
        "_fwd_kernel_stage2",
        4,
        2,
        Mid_O=_ptr(g, "fp32", _mid_o(g, splits, batch, from_workspace)),
        # 0.20 reduces into an fp32 buffer and casts afterwards.
        o=_ptr(g, g.short_dtype if fp16_out else "fp32", out),
        lse=_ptr(g, "fp32", lse),
        B_Seqlen=_ptr(g, "i32", _seq_storage(g), seqs),
        stride_mid_ob=Int.of(g.num_heads * splits * (d + 1)),
        stride_mid_oh=Int.of(splits * (d + 1)),
        stride_mid_os=Int.of(d + 1),
        stride_obs=Int.of(g.num_heads * d),
        stride_oh=Int.of(d),
        stride_lse_bs=Int.of(g.num_heads),
        NUM_KV_SPLITS=Const(splits),
        BLOCK_DV=Const(next_pow2(d)),
        Lv=Const(d),
        **extra,
    )


def decode_keys(g: Geometry) -> tuple[KernelKey, ...]:
    """Plain decode (pure decode batches, the decode part of mixed batches, graph
    replays): the runner's block table and ``seq_lens`` buffers from their base (with
    microbatching, from the later microbatches' first request), and workspace views
    (256-byte aligned) sized with the configured split count.

    A chunked local layer decodes over its virtual batch instead: a fresh table of
    ``local_width`` columns and fresh ``seq_lens``, both read from their base."""
    s, b, ws = g.num_kv_splits, g.decode_rows, g.features.uses_workspace
    table = _table(g)
    if g.attention_chunk:
        rows: tuple[bool, ...] = (True,)
        seqs: tuple[bool, ...] = (True,)
    else:
        rows = _row_alignments(g) if "block_table" in g.ubatch_sliced else (True,)
        seqs = _sliced_alignments(g, "seq_lens", g.max_num_seqs)
    stage1 = _stage1(g, s, table.stride, table.sizes, rows, seqs, b, ws)
    return (*stage1, *_stage2(g, s, seqs, b, ws))


def short_continuation_keys(g: Geometry) -> tuple[KernelKey, ...]:
    """Continuation chunks of 2..128 tokens (chunked prefill tails, prefix-cache hits,
    speculative verify batches, which TurboQuant treats as prefill): the decode
    kernels with the launcher's 32 splits, one block-table row expanded with stride 0
    and ``seq_lens`` sliced from a cached arange at any offset (a chunked local layer:
    a row of its virtual-batch table)."""
    s, b = LAUNCHER_DEFAULT_KV_SPLITS, CONTINUATION_DECODE_THRESHOLD
    seqs = (True, False) if g.features.continuation_seq_lens_sliced else (True,)
    table = _table(g)
    # No workspace: the fast path passes the launcher no buffers (0.21-0.33).
    stage1 = _stage1(g, s, 0, table.sizes, table.rows, seqs, b, from_workspace=False)
    return (*stage1, *_stage2(g, s, seqs, b, from_workspace=False))


def long_continuation_keys(g: Geometry) -> tuple[KernelKey, ...]:
    """Continuation chunks over 128 tokens dequantize the cached prefix into fp16
    scratch of ``A = ceil(cached/block) * block`` rows, then run flash attention.
    Only reachable when a chunk can exceed the threshold. On a chunked local layer a
    continuing virtual request holds at most ``attention_chunk_size - 1`` new tokens
    (0.21-0.29: ``attention_chunk_size``, ``compat.Features.local_prefill_real_lens``;
    the chunk is a multiple of a block size of 16 or more, so both exceed 128 together),
    and the kernel reads a row of the virtual-batch table; its scratch lengths stay
    within the runner's, in the same stride classes."""
    limit = CONTINUATION_DECODE_THRESHOLD
    if g.max_num_batched_tokens <= limit or 0 < g.attention_chunk <= limit:
        return ()
    table = _table(g)
    p = g.preset
    d = g.head_size
    kv = g.kv_strides
    # 0.21+: workspace views; 0.20: a per-layer buffer of up to the longest prefix.
    scratch = (
        _workspace(g)
        if g.features.uses_workspace
        else _upto(g.num_kv_heads * g.block_size * d * 2, g.dequant_rows // g.block_size)
    )
    keys = []
    # The smallest and the largest scratch lengths bound the stride classes in between.
    for rows in sorted({g.block_size, max(g.block_size, g.dequant_rows)}):
        keys += _keys(
            "_tq_full_dequant_kv",
            4,
            None,
            KV_cache_ptr=_ptr(g, "u8", (g.kv_storage_bytes,), (g.kv_aligned,)),
            Block_table_ptr=_ptr(g, "i32", table.sizes, table.rows),
            Centroids_ptr=_ptr(g, "fp32", _TINY),
            K_out_ptr=_ptr(g, "fp16", scratch),
            V_out_ptr=_ptr(g, "fp16", scratch),
            stride_ko_b=Int.of(g.num_kv_heads * rows * d),
            stride_ko_h=Int.of(rows * d),
            stride_ko_s=Int.of(d),
            stride_vo_b=Int.of(g.num_kv_heads * rows * d),
            stride_vo_h=Int.of(rows * d),
            stride_vo_s=Int.of(d),
            stride_cache_block=Int.of(kv[0]),
            stride_cache_pos=Int.of(kv[1]),
            stride_cache_head=Int.of(kv[2]),
            stride_bt_b=Int.of(table.stride),
            HEAD_DIM=Const(d),
            BLOCK_SIZE=Const(g.block_size),
            NUM_KV_HEADS=Const(g.num_kv_heads),
            # impl._mse_bytes: the full head size for FP8 keys.
            MSE_BYTES=Const(d if p.key_fp8 else math.ceil(d * p.key_mse_bits / 8)),
            KPS=Const(p.key_packed_size),
            VQB=Const(p.value_bits),
            VAL_DATA_BYTES=Const(p.value_data_bytes),
            MSE_BITS=Const(p.key_mse_bits),
            KEY_FP8=Const(int(p.key_fp8)),
            BLOCK_D=Const(next_pow2(d)),
            NORM_CORRECTION=Const(int(p.norm_correction)),
            FP8_E4B15=Const(g.fp8_e4b15),
        )
    return tuple(keys)


def store_keys(g: Geometry) -> tuple[KernelKey, ...]:
    """The write path. Its cache strides are constexpr, so they enter as exact values.
    The slot mapping is the runner's buffer from its base, or with microbatching from
    a later microbatch's first token (one key per alignment). The MSE presets hand the
    kernel fp32 tensors computed per launch of up to ``max_num_batched_tokens`` tokens;
    k8v4 the keys and values as they come."""
    p = g.preset
    d = g.head_size
    kv = g.kv_strides
    tokens, hk = g.max_num_batched_tokens, g.num_kv_heads
    common: dict[str, Choice] = {
        "KV_cache_ptr": _ptr(g, "u8", (g.kv_storage_bytes,), (g.kv_aligned,)),
        "Slot_mapping_ptr": _ptr(
            g, "i64", (8 * tokens,), _sliced_alignments(g, "slot_mapping", tokens)
        ),
        "stride_cache_block": Const(kv[0]),
        "stride_cache_pos": Const(kv[1]),
        "stride_cache_head": Const(kv[2]),
        "D": Const(d),
        "H": Const(g.num_kv_heads),
        "BLOCK_SIZE": Const(g.block_size),
        "BLOCK_D": Const(next_pow2(d)),
    }
    tail: dict[str, Choice] = {
        "KPS": Const(p.key_packed_size),
        "VQB": Const(p.value_bits),
        "VAL_DATA_BYTES": Const(p.value_data_bytes),
        "BLOCK_VAL": Const(next_pow2(p.value_data_bytes)),
    }
    grp = Const(next_pow2(d // 8) if d >= 8 else 1)
    if p.key_fp8:
        fp8: dict[str, Choice] = {
            "Key_ptr": _ptr(g, g.short_dtype, _activations(g)),
            "Value_ptr": _ptr(g, g.short_dtype, _activations(g)),
            **common,
            **tail,
            "BLOCK_GRP": grp,
            "FP8_E4B15": Const(g.fp8_e4b15),
        }
        return tuple(_keys("_tq_fused_store_fp8", 4, 1, **fp8))
    mse: dict[str, Choice] = {
        "Y_ptr": _ptr(g, "fp32", _upto(hk * d * 4, tokens)),
        "Norms_ptr": _ptr(g, "fp32", _upto(hk * 4, tokens)),
        "Value_ptr": _ptr(g, "fp32", _upto(hk * d * 4, tokens)),
        "Midpoints_ptr": _ptr(g, "fp32", _TINY),
        **common,
        "MSE_BYTES": Const(math.ceil(d * p.key_mse_bits / 8)),
        **tail,
        "MSE_BITS": Const(p.key_mse_bits),
        "N_CENTROIDS": Const(2**p.key_mse_bits),
        "BLOCK_GRP": grp,
    }
    return tuple(_keys("_tq_fused_store_mse", 4, 1, **mse))


PATHS: dict[str, Callable[[Geometry], tuple[KernelKey, ...]]] = {
    "decode": decode_keys,
    "continuation": short_continuation_keys,
    "dequant": long_continuation_keys,
    "store": store_keys,
}
