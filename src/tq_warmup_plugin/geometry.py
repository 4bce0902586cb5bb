"""A TurboQuant layer's shape as its kernels see it: presets, dtypes, ``Geometry``.

Discovery builds a ``Geometry`` from a live worker and the CLI from a model config;
the key functions (``keys``), the workspace plan and the first launches all read
it, so it lives apart from any one of them. Third-party warmers receive it too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, NamedTuple

from . import compat
from .compat import Features

__all__ = [
    "DTYPE_BYTES",
    "PRESETS",
    "Geometry",
    "Preset",
    "Reported",
    "Request",
    "preset",
    "read_report",
    "request_bytes",
    "runtime_requests",
]

# (key_quant_bits, value_quant_bits, norm_correction), TQ_PRESETS in all releases.
PRESETS: dict[str, tuple[int, int, bool]] = {
    "turboquant_k8v4": (8, 4, False),
    "turboquant_4bit_nc": (4, 4, True),
    "turboquant_k3v4_nc": (3, 4, True),
    "turboquant_3bit_nc": (3, 3, True),
}

_MODEL_DTYPES = {"bfloat16": "bf16", "float16": "fp16"}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class Preset:
    """The TurboQuant layout of one cache dtype at one head size (``TurboQuantConfig``)."""

    name: str
    head_size: int
    key_bits: int
    value_bits: int
    norm_correction: bool

    @property
    def key_fp8(self) -> bool:
        return self.key_bits == 8

    @property
    def key_mse_bits(self) -> int:
        return 0 if self.key_fp8 else self.key_bits

    @property
    def key_packed_size(self) -> int:
        if self.key_fp8:
            return self.head_size
        return math.ceil(self.head_size * self.key_mse_bits / 8) + 2

    @property
    def value_data_bytes(self) -> int:
        return math.ceil(self.head_size * self.value_bits / 8)

    @property
    def slot_size_aligned(self) -> int:
        slot = self.key_packed_size + self.value_data_bytes + 4
        return slot + slot % 2

    @property
    def centroid_bits(self) -> int:
        return self.value_bits if self.key_fp8 else self.key_bits


def preset(name: str, head_size: int) -> Preset:
    """Look up a TurboQuant cache dtype; raises ValueError for anything else."""
    if name not in PRESETS:
        raise ValueError(f"not a TurboQuant cache dtype: {name!r}")
    key_bits, value_bits, norm = PRESETS[name]
    return Preset(name, head_size, key_bits, value_bits, norm)


LATER_FIELDS = (
    "ubatch_sliced",
    "pointer_ranges",
    "kv_storage_bytes",
    "block_table_bytes",
    "workspace_bytes",
    "attention_chunk",
    "verify_len",
)
"""``Geometry`` fields with a default that reports written before them lack."""


@dataclass(frozen=True)
class Geometry:
    """The runtime shape of one TurboQuant layer, as its kernels will see it.

    Built by discovery from a live worker, or by the CLI from a model config;
    both must agree, because both feed the same key functions.
    """

    cache_dtype: str
    head_size: int
    num_heads: int
    """Query heads on this tensor-parallel rank."""
    num_kv_heads: int
    """KV heads on this rank."""
    block_size: int
    """Kernel block size: ``shape[1]`` of the KV view the kernels get."""
    scale: float
    """``impl.scale``: a constexpr, so the exact float matters."""
    kv_strides: tuple[int, int, int]
    """Block, position and head strides of that KV view (store kernels: constexpr)."""
    model_dtype: str
    """``bfloat16`` or ``float16``."""
    block_table_width: int
    """Row stride of the runner's block table, in entries."""
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    num_kv_splits: int
    """``attention_config.tq_max_kv_splits_for_cuda_graph``."""
    fp8_e4b15: int
    features: Features = field(compare=True)
    kv_aligned: bool = True
    """Whether the KV cache tensor's base pointer is 16-byte aligned."""
    ubatch_sliced: tuple[str, ...] = ()
    """Metadata tensors that microbatches after the first get as views at an offset
    (``compat.ubatch_sliced``): some of ``block_table``, ``seq_lens``, ``slot_mapping``
    with ``--enable-dbo``; none without microbatching."""
    pointer_ranges: bool = False
    """Triton keys each pointer on whether its storage is within 2 GiB (HIP with buffer
    ops, ``compat.triton_pointer_ranges``): then the storage sizes below count."""
    kv_storage_bytes: int = 0
    """Bytes of the KV tensor's whole storage (``pointer_ranges`` only)."""
    block_table_bytes: int = 0
    """Bytes of the block table's whole storage (``pointer_ranges`` only)."""
    workspace_bytes: tuple[int, ...] = ()
    """Sizes of the workspace buffers after the reservation (``pointer_ranges`` only;
    empty: the largest planned request, ``runtime_requests``)."""
    attention_chunk: int = 0
    """``attention_chunk_size`` of a chunked local attention layer (Llama 4,
    ``compat.local_attention_chunk``); 0 for any other layer. Such a layer's kernels
    never see the runner's block table but a virtual-batch one (``local_width``)."""
    verify_len: int = 0
    """``1 + k`` where the batched verify path serves the layer's builder (its decode
    threshold, ``guards/batched_verify.py``), else 0."""

    @property
    def preset(self) -> Preset:
        return preset(self.cache_dtype, self.head_size)

    @property
    def short_dtype(self) -> str:
        if self.model_dtype not in _MODEL_DTYPES:
            raise ValueError(f"unsupported model dtype {self.model_dtype!r}")
        return _MODEL_DTYPES[self.model_dtype]

    @property
    def dequant_rows(self) -> int:
        """Rows of the fp16 scratch the longest continuation dequantizes into: the
        cached prefix (at most ``max_model_len - 1`` tokens) in whole blocks."""
        return math.ceil(max(0, self.max_model_len - 1) / self.block_size) * self.block_size

    @property
    def local_width(self) -> int:
        """Columns (and row stride) of the virtual-batch block table a chunked local
        attention layer's kernels get, 0 for other layers: ``attention_chunk_size //
        block_size`` (``make_local_attention_virtual_batches``, all releases; its block size
        is the builder's, the kernel block size: ``create_metadata_builders`` copies the
        spec with it). The table is a fresh contiguous int32 tensor of one row per
        virtual request, allocated for every step."""
        return self.attention_chunk // self.block_size

    @property
    def decode_rows(self) -> int:
        """The most requests one decode launch can take. The runner's: ``max_num_seqs``.
        A chunked local layer's virtual batch splits a 2-token query whose cached
        length ends one token before a chunk boundary into two 1-token virtual
        requests, both decodes (TurboQuant's threshold is 1): at most two rows per
        request, and no more than ``max_num_seqs`` plus half the token budget.
        Served by the batched verify path, a decode launch takes one row per token of
        requests of up to ``verify_len`` tokens: ``max_num_seqs * verify_len``."""
        s, t = self.max_num_seqs, self.max_num_batched_tokens
        if self.verify_len:
            return s * self.verify_len
        return min(2 * s, s + t // 2) if self.attention_chunk else s

    def to_dict(self) -> dict[str, object]:
        """Plain fields, without the release features (the release is recorded apart).
        Fields added since the first reports are left out at their default, so a plain
        setup writes the report it always did and older readers take it."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name != "features"
            and not (f.name in LATER_FIELDS and getattr(self, f.name) == f.default)
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], feats: Features) -> Geometry:
        values = dict(data)
        values["kv_strides"] = tuple(values["kv_strides"])
        for name in ("ubatch_sliced", "workspace_bytes"):  # JSON lists
            values[name] = tuple(values.get(name, ()))
        return cls(**values, features=feats)

    @classmethod
    def from_report(cls, raw: object, feats: Features) -> Geometry:
        """One geometry of a JSON report (``to_dict``'s output, from any release of the
        plugin), checked field by field: raises ValueError with one line that names the
        field, never TypeError or KeyError from a hand-edited or foreign file."""
        if not isinstance(raw, dict):
            raise ValueError("is not an object")
        missing = sorted(set(_REQUIRED) - set(raw))
        if missing:
            raise ValueError(f"lacks {', '.join(missing)}")
        unknown = sorted(set(raw) - set(_REQUIRED) - set(_OPTIONAL))
        if unknown:
            raise ValueError(f"has unknown fields {', '.join(unknown)}")
        for name, kind in _REQUIRED.items():
            if not _valid(name, kind, raw[name]):
                raise ValueError(f"{name} {raw[name]!r} is not a valid {kind}")
        for name, valid in _OPTIONAL.items():
            if name in raw and not valid(raw[name]):
                raise ValueError(f"{name} {raw[name]!r} is not valid")
        try:
            geometry = cls.from_dict(raw, feats)
            geometry.check()
        except (ValueError, TypeError) as exc:
            raise ValueError(str(exc)) from None
        return geometry

    def check(self) -> None:
        """Raise ValueError for a geometry the kernels cannot have been built for."""
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} query heads vs {self.num_kv_heads} KV heads")
        if self.head_size <= 0 or self.block_size <= 0:
            raise ValueError(f"head size {self.head_size}, block size {self.block_size}")
        if self.attention_chunk < 0 or self.attention_chunk % self.block_size:
            # make_local_attention_virtual_batches asserts the same (all releases).
            raise ValueError(
                f"attention chunk {self.attention_chunk} is not a multiple of the "
                f"block size {self.block_size}"
            )
        self.preset  # noqa: B018 (validates the cache dtype)
        self.short_dtype  # noqa: B018 (validates the model dtype)


def _is_bool(value: object) -> bool:
    return isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_views(value: object) -> bool:
    views = compat.UBATCH_VIEWS_V1
    return isinstance(value, list) and all(isinstance(v, str) and v in views for v in value)


def _is_sizes(value: object) -> bool:
    return isinstance(value, list) and all(_is_size(v) for v in value)


def _valid(name: str, kind: str, value: object) -> bool:
    """Whether a required field's JSON value can be that field."""
    if name == "kv_strides":
        return isinstance(value, list) and len(value) == 3 and all(map(_is_int, value))
    if kind == "int":
        return _is_size(value)
    if kind == "float":
        return (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
            and value > 0
        )
    return isinstance(value, str) if kind == "str" else True


# Fields a report may lack (written before they existed, or left out at their default:
# ``Geometry.to_dict``): each one's check; the dataclass default stands in for it.
_OPTIONAL: dict[str, Callable[[object], bool]] = {
    "kv_aligned": _is_bool,
    "ubatch_sliced": _is_views,
    "pointer_ranges": _is_bool,
    "kv_storage_bytes": _is_size,
    "block_table_bytes": _is_size,
    "workspace_bytes": _is_sizes,
    "attention_chunk": _is_size,
    "verify_len": _is_size,
}
_REQUIRED = {f.name: str(f.type) for f in fields(Geometry) if f.default is MISSING}
_REQUIRED.pop("features")  # the release is the report's, not a geometry's


Request = tuple[tuple[int, ...], str]
"""(shape, dtype name) as ``get_simultaneous`` takes it."""

_ALIGN = 256  # the workspace's get_simultaneous rounds every view up to 256 bytes


def runtime_requests(g: Geometry) -> list[tuple[Request, ...]]:
    """The workspace a geometry's paths take (pure: ``keys`` sizes the buffers their
    views come from with it, ``workspace`` reserves it): the largest
    ``get_simultaneous`` call of each TurboQuant path for one layer: a
    decode of ``decode_rows`` requests (a chunked local layer's virtual batch can hold
    more than the ``max_num_seqs`` rows that vLLM's own reservation, 0.24+
    ``_reserve_workspace``, sizes for), and the longest continuation's dequantized
    prefix."""
    if not g.features.uses_workspace:
        return []
    b, hq, hk, d, s = g.decode_rows, g.num_heads, g.num_kv_heads, g.head_size, g.num_kv_splits
    groups: list[tuple[Request, ...]] = [
        (((b, hq, s, d + 1), "float32"), ((b, hq, d), g.model_dtype), ((b, hq), "float32")),
    ]
    if g.max_num_batched_tokens > compat.CONTINUATION_DECODE_THRESHOLD:
        # _continuation_prefill: cached prefix <= max_model_len - 1 tokens, in blocks.
        pair = ((1, hk, g.dequant_rows, d), "float16")
        groups.append((pair, pair))
    return groups


def request_bytes(group: Iterable[Request]) -> int:
    """Bytes one ``get_simultaneous`` call needs, as vLLM computes it."""
    total = 0
    for shape, dtype in group:
        raw = math.prod(shape) * DTYPE_BYTES[dtype]
        total += -(-raw // _ALIGN) * _ALIGN
    return total


class Reported(NamedTuple):
    """What a ``TQ_WARMUP_REPORT`` JSON says a real startup discovered."""

    geometries: list[Geometry]
    layers: int
    """The TurboQuant layers they stand for (at least one per geometry)."""
    vllm_version: str


def read_report(data: object) -> Reported:
    """The geometries of a parsed report, checked; raises ValueError with one line."""
    if not isinstance(data, dict) or not isinstance(data.get("geometries"), list):
        raise ValueError(
            "not a tq-warmup report (no 'geometries' list; write one with TQ_WARMUP_REPORT)"
        )
    if not data["geometries"]:
        raise ValueError("the startup found no TurboQuant layers")
    version = data.get("vllm_version")
    try:
        feats = compat.release_features(version if isinstance(version, str) else None)
    except compat.UnsupportedRelease as exc:
        raise ValueError(str(exc)) from None
    found = []
    for index, raw in enumerate(data["geometries"]):
        try:
            found.append(Geometry.from_report(raw, feats))
        except ValueError as exc:
            raise ValueError(f"geometries[{index}]: {exc}") from None
    layers = data.get("layers")
    count = layers if isinstance(layers, int) and layers >= len(found) else len(found)
    return Reported(found, count, str(version))
