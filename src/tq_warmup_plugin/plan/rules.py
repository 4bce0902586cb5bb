"""The pure rules of an offline plan: what vLLM's code decides from a configuration's
numbers (heads per rank, boundary layers, the KV view, the block and its table row, a
hybrid's state layers and KV tensors, the verify rows), each naming the releases it
covers. No vLLM import: the CLI's plan, the compile-ahead child and the tests read them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from .. import compat
from ..compat import Features

__all__ = [
    "STATELESS_LAYER_TYPES",
    "UnsupportedModel",
    "attention_kv_tensors",
    "block_table_width",
    "boundary_layers",
    "effective_block_size",
    "heads_per_rank",
    "kv_view_strides",
    "parallel_drafting",
    "state_layer_count",
    "verify_len",
]


class UnsupportedModel(ValueError):
    """vLLM would not run TurboQuant on this model (or cannot read it); the message is
    the one-line reason."""


def heads_per_rank(heads: int, kv_heads: int, tp: int) -> tuple[int, int]:
    """Query and KV heads on one tensor-parallel rank, as vLLM splits them (all releases):
    ``ModelConfig.get_num_attention_heads`` is ``heads // tp`` after
    ``verify_with_parallel_config`` refused ``heads % tp``; ``get_num_kv_heads`` is
    ``max(1, kv_heads // tp)``, KV heads replicated when tp > kv_heads, which
    ``QKVParallelLinear`` only allows when tp is a multiple of them (``divide``)."""
    if tp < 1:
        raise UnsupportedModel(f"tensor parallel size {tp} is not a positive number")
    if heads < 1 or kv_heads < 1:
        raise UnsupportedModel(f"{heads} query heads and {kv_heads} KV heads: both must be >= 1")
    if heads % kv_heads:
        raise UnsupportedModel(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    if heads % tp:
        raise UnsupportedModel(f"{heads} query heads do not divide over tensor parallel size {tp}")
    if kv_heads % tp and tp % kv_heads:
        raise UnsupportedModel(
            f"{kv_heads} KV heads neither divide over nor replicate evenly to "
            f"tensor parallel size {tp}"
        )
    return heads // tp, max(1, kv_heads // tp)


def boundary_layers(feats: Features, num_layers: int, hybrid: bool) -> tuple[int, ...]:
    """Layers TurboQuant leaves in the model dtype (``kv_cache_dtype_skip_layers``, set by
    ``EngineArgs.create_engine_config`` from ``TurboQuantConfig.get_boundary_skip_layers``).

    Dense models: the first and last 2 layers, at most half of them (all releases).
    Hybrid models: none (every full-attention layer is TurboQuant) where
    ``Features.hybrid_turboquant``; 0.20 refuses TurboQuant for them.
    """
    if hybrid:
        if not feats.hybrid_turboquant:
            raise UnsupportedModel(
                "vLLM 0.20 refuses TurboQuant for hybrid (attention + Mamba) models"
            )
        return ()
    n = min(2, num_layers // 2)
    return tuple(sorted(set(range(n)) | set(range(num_layers - n, num_layers))))


def kv_view_strides(
    feats: Features, block_size: int, num_kv_heads: int, slot_size: int
) -> tuple[int, int, int]:
    """Block, position and head strides of the KV view the kernels get, for an
    unpadded cache (hybrid models may pad pages: discovery reads the real tensor).

    0.20-0.25 and 0.29-0.33 (LBNHC) are token-major: (blocks, tokens, heads, slot).
    0.26-0.28 allocate (blocks, heads, tokens, slot) and transpose it for the kernels.
    """
    page = block_size * num_kv_heads * slot_size
    if feats.kv_head_major:
        return (page, slot_size, block_size * slot_size)
    return (page, num_kv_heads * slot_size, slot_size)


def effective_block_size(
    feats: Features, requested: int, model_dtype_bytes: int, head_size: int, slot_bytes: int
) -> int:
    """The block size vLLM settles on for TurboQuant layers, for planning without a
    worker (a worker's real KV tensor says it directly).

    ``Features.tq_block_aligned`` (0.25+): TurboQuant leaves boundary layers in the model
    dtype, and ``Platform._align_heterogeneous_kv_block_size`` grows the block, in steps of
    ``align = max(16, requested)``, until a TurboQuant page covers a 16-token page of those
    layers (``2 * head_size * model_dtype_bytes`` bytes a KV head a token). A TurboQuant
    token is ``slot_bytes`` a KV head (``slot_size_aligned``, ``Features.tq_page_packed``,
    0.28+), before that ``2 * head_size`` (uint8 K+V): 32 for a bf16 model at the default
    16 on 0.25-0.27, 64 for ``turboquant_4bit_nc`` on 0.28+ (servers of vLLM 0.26.0 and
    0.34.0, ``benchmarks/results/serve-jit``). Equal pages keep the requested size; 0.20-0.24
    keep it always.
    """
    if not feats.tq_block_aligned:
        return requested
    padded = 2 * head_size * model_dtype_bytes
    primary = slot_bytes if feats.tq_page_packed else 2 * head_size
    if padded == primary:
        return requested
    align = max(16, requested)
    return max(requested, align * -(-16 * padded // (align * primary)))


def block_table_width(
    feats: Features, max_model_len: int, block_size: int, v2: bool, kernel_block: int = 0
) -> int:
    """Row stride of the runner's block table, for planning without a worker.

    ``cdiv(max_model_len, bs)`` blocks, rounded up: 0.27+, both runners, to a multiple of
    ``128 / gcd(128, bs)`` (``Features.block_table_rounded``); 0.21-0.26 V1 and 0.26 V2 to
    a multiple of ``128 // bs`` where bs <= 128; 0.20 V1 not at all. Where the kernels run
    blocks of ``kernel_block`` tokens, smaller than the manager's (a hybrid model's,
    ``compat.kernel_block_size``), the row holds each manager block as ``bs //
    kernel_block`` kernel blocks, in every runner: V1's ``BlockTable`` and V2's
    ``BlockTables`` split their own rows (``blocks_per_kv_block``, 0.21-0.31 and 0.26-0.31),
    0.32+ the attention group's kernel table (``AttentionGroup.create_metadata_builders``).
    Both matter: unrounded, 900 tokens of 16 are 57 blocks where vLLM's own V1 table on
    0.21-0.26 has 64 (``test_contract_worker_plan``); unsplit, a V2 hybrid's row is 2 blocks of
    2160 where vLLM's has 1080 blocks of 16 (``test_contract_table_width``). The keys read the
    row as its stride's divisibility by 16 and its rows' 16-byte alignment: on 0.27+ 5 of that
    test's 10 hybrid and odd-block cases planned another key, on 0.26 none."""
    blocks = -(-max_model_len // block_size)
    if feats.block_table_rounded:
        align = 128 // math.gcd(128, block_size)
    elif (v2 or feats.v1_block_table_aligned) and block_size <= 128:
        align = 128 // block_size
    else:
        align = 1
    width = -(-blocks // align) * align
    if not kernel_block or block_size % kernel_block:
        return width
    return width * (block_size // kernel_block)


STATELESS_LAYER_TYPES = frozenset({"full_attention", "attention", "mlp", "moe"})
"""Layer types of vLLM's hybrid configs that keep no Mamba state: full attention, and
Nemotron-H's MLP-only and MoE-only layers (``hybrid_override_pattern`` ``-`` and ``E``, read
as ``layers_block_type``), which have no KV cache spec and so no place in vLLM's KV cache
groups. Zamba2's ``hybrid`` layers hold a Mamba state beside their shared attention."""


def state_layer_count(types: Sequence[str] | None, num_layers: int, attention: int) -> int:
    """A hybrid's layers that keep a Mamba state (``ModelShape.state_layers``): of its
    listed layer types, those not in ``STATELESS_LAYER_TYPES``; without a list, every
    layer but the attention ones. A Nemotron-H counts its Mamba layers, not its MLPs."""
    if types is None:
        return num_layers - attention
    return sum(1 for kind in types if kind not in STATELESS_LAYER_TYPES)


def attention_kv_tensors(attention: int, state: int) -> int:
    """The KV tensors a hybrid's ``attention`` layers write, beside ``state`` layers of one
    other type: vLLM's uniform-page grouping (``_get_kv_cache_groups_uniform_page_size``,
    read in 0.22, 0.26 and 0.30) sizes groups by the smaller count, or the larger where it
    is under 1.5 times the smaller (a drafter's extra layer), deals each type's layers
    round-robin over as many groups as that size needs, and layer i of every group shares
    tensor i (``get_kv_cache_config_from_groups``): the longest attention group's length.
    6 attention layers beside 4 are 2 groups of 3, so 3 tensors, not 4."""
    if state == 0:
        return attention
    small, large = sorted((attention, state))
    size = large if large < small * 1.5 else small
    groups = -(-attention // size)
    return -(-attention // groups)


def verify_len(
    feats: Features, spec_tokens: int, parallel_drafting: bool = False, method: str | None = None
) -> int:
    """The query length the batched verify path serves as decode rows (``1 + k``, doubled
    drafts under ``parallel_drafting``: ``compat.spec_decode_threshold``, 0.21-0.32; one
    more for draft_model's correction token where ``Features.draft_slot_in_threshold``)
    where the release has it (``Features.spec_verify_batched``), else 0: the geometry's
    ``verify_len`` that discovery reads off a served builder (``verify_rows.rows_of``)."""
    if not spec_tokens or not feats.spec_verify_batched:
        return 0
    extra = int(feats.draft_slot_in_threshold and method == "draft_model")
    return compat.spec_query_len(spec_tokens, parallel_drafting) + extra


def parallel_drafting(spec: Mapping[str, object] | None) -> bool:
    return bool(spec and spec.get("parallel_drafting", False))
