"""What one run requests: the phases, their prompts and the dummy model's config.json.

Phases, in this order (B = ``--budget``, the chunked-prefill token budget):

``decode``
    one short prompt (32 tokens) and ``--max-tokens`` decode steps.
``batch``
    8 short prompts at once (a batched prefill, then batched decode steps).
``long``
    one prompt of 3*B tokens: chunks B, B, B, i.e. two continuation chunks of
    more than 128 tokens (the "dequantise the cache + FlashAttention" path).
``short_tail``
    one prompt of B+100 tokens: its last chunk (100 tokens) is a continuation
    chunk of 128 tokens or fewer (the "decode kernel as prefill" path).
``prefix_hit``
    the block-aligned first ~2*B tokens of the ``long`` prompt (a prefix-cache
    hit) plus 40 new tokens: a short continuation over a long cached context.

"first" is the first request of a phase; "steady" is a second request of the
same shape with different token ids (prefix caching is on, so an identical
repeat would only hit the cache; ``prefix_hit`` reuses the prefix of the
second ``long`` prompt).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tq_warmup_plugin.compat import CONTINUATION_DECODE_THRESHOLD, features, parse_version
from tq_warmup_plugin.geometry import PRESETS as TQ_PRESETS_BY_NAME

__all__ = [
    "AUTO",
    "MODES",
    "PHASES",
    "PRESETS",
    "RUNNERS",
    "TQ_PRESETS",
    "VARIANTS",
    "Geometry",
    "PhasePlan",
    "PromptSource",
    "auto_max_model_len",
    "build_model_config",
    "check_attention_chunk",
    "chunk_overrun_warning",
    "chunk_schedule",
    "config_id",
    "default_gpu_mem_util",
    "describe_chunks",
    "gpu_slug",
    "make_prompts",
    "parse_geometry",
    "parse_list",
    "plan_phases",
]

TQ_PRESETS: tuple[str, ...] = tuple(TQ_PRESETS_BY_NAME)
# vLLM's own KV cache: the baseline every matrix runs beside the TurboQuant presets.
AUTO = "auto"
PRESETS: tuple[str, ...] = (AUTO, *TQ_PRESETS)
MODES: tuple[str, ...] = ("eager", "cudagraph")
VARIANTS: tuple[str, ...] = ("on-cold", "off-cold", "on-warm")
RUNNERS: tuple[str, ...] = ("default", "v1", "v2")
PHASES: tuple[str, ...] = ("decode", "batch", "long", "short_tail", "prefix_hit")


@dataclass(frozen=True)
class Geometry:
    """Attention geometry: head size, query heads, KV heads."""

    head_size: int
    q_heads: int
    kv_heads: int

    @property
    def label(self) -> str:
        return f"{self.head_size}x{self.q_heads}x{self.kv_heads}"


def parse_geometry(text: str) -> Geometry:
    """Parse ``HEADSIZExQHEADSxKVHEADS`` (e.g. ``128x16x8``)."""
    parts = text.lower().strip().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"geometry must be HEADSIZExQHEADSxKVHEADS, got {text!r}")
    hs, q, kv = (int(p) for p in parts)
    if q % kv:
        raise ValueError(f"query heads ({q}) must be a multiple of KV heads ({kv})")
    return Geometry(hs, q, kv)


def parse_list(text: str, allowed: Sequence[str] | None = None) -> list[str]:
    """Split a comma list; ``all`` expands to ``allowed``."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if allowed is not None:
        if items == ["all"]:
            return list(allowed)
        bad = [t for t in items if t not in allowed]
        if bad:
            raise ValueError(f"unknown value(s) {bad}; choose from {list(allowed)} or 'all'")
    return items


def config_id(
    preset: str,
    mode: str,
    geometry: Geometry,
    layers: int,
    budget: int,
    tp: int,
    attention_chunk: int = 0,
) -> str:
    """The name of one configuration (preset, mode, geometry, model and scheduler sizes).

    A Llama 4 model with chunked local attention adds ``-c<chunk>``; the plain Llama
    adds nothing, so the ids of runs made before the option existed stay the same.
    """
    chunk = f"-c{attention_chunk}" if attention_chunk else ""
    return (
        f"{preset}-{mode}-h{geometry.head_size}q{geometry.q_heads}kv{geometry.kv_heads}"
        f"-L{layers}-b{budget}-tp{tp}{chunk}"
    )


def gpu_slug(name: str) -> str:
    """``NVIDIA H200`` -> ``nvidia-h200``."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug or "unknown-gpu"


def chunk_schedule(new_tokens: int, budget: int, cached: int = 0) -> list[dict[str, int]]:
    """Chunks the scheduler makes of one request's prompt when it runs alone.

    Each chunk: ``tokens`` (query length) and ``context`` (tokens already in the
    cache when it runs). ``context`` > 0 marks a continuation chunk.
    """
    chunks: list[dict[str, int]] = []
    done = 0
    while done < new_tokens:
        n = min(budget, new_tokens - done)
        chunks.append({"tokens": n, "context": cached + done})
        done += n
    return chunks


def describe_chunks(chunks: Iterable[dict[str, int]]) -> str:
    """``512, 512+c, 100+c`` style summary (``+c``: continuation, ``*``: <= 128 path)."""
    out = []
    for c in chunks:
        if c["context"] == 0:
            out.append(str(c["tokens"]))
        elif c["tokens"] <= CONTINUATION_DECODE_THRESHOLD:
            out.append(f"{c['tokens']}+c*")
        else:
            out.append(f"{c['tokens']}+c")
    return ", ".join(out)


@dataclass(frozen=True)
class PhasePlan:
    """Prompt lengths of every phase, derived from the chunk budget."""

    budget: int
    block_size: int
    max_tokens: int
    short_len: int
    batch_size: int
    long_len: int
    short_tail_len: int
    prefix_len: int
    prefix_tail: int

    @property
    def required_max_model_len(self) -> int:
        longest = max(self.long_len, self.short_tail_len, self.prefix_len + self.prefix_tail)
        return longest + self.max_tokens

    def prompt_lens(self, phase: str) -> list[int]:
        if phase == "decode":
            return [self.short_len]
        if phase == "batch":
            return [self.short_len] * self.batch_size
        if phase == "long":
            return [self.long_len]
        if phase == "short_tail":
            return [self.short_tail_len]
        if phase == "prefix_hit":
            return [self.prefix_len + self.prefix_tail]
        raise ValueError(phase)

    def expected_cached(self, phase: str) -> int:
        return self.prefix_len if phase == "prefix_hit" else 0

    def expected_chunks(self, phase: str) -> list[dict[str, int]]:
        """Prefill chunks of one prompt of the phase (``batch``: all prompts together)."""
        if phase == "batch":
            return chunk_schedule(self.short_len * self.batch_size, self.budget)
        if phase == "prefix_hit":
            return chunk_schedule(self.prefix_tail, self.budget, cached=self.prefix_len)
        return chunk_schedule(self.prompt_lens(phase)[0], self.budget)


def plan_phases(
    budget: int,
    block_size: int = 16,
    max_tokens: int = 8,
    short_len: int = 32,
    batch_size: int = 8,
    short_tail: int = 100,
    prefix_tail: int = 40,
) -> PhasePlan:
    """Choose prompt lengths so each phase exercises the path it is named after.

    ``long`` = 3*budget: chunks of exactly ``budget`` tokens, so both continuation
    chunks are longer than 128 tokens (and no short last chunk sneaks in).
    ``short_tail`` = budget + ``short_tail`` (<= 128): one full chunk, then a short
    continuation. ``prefix_hit`` = the block-aligned 2*budget-token prefix of the
    ``long`` prompt plus ``prefix_tail`` new tokens.
    """
    limit = CONTINUATION_DECODE_THRESHOLD
    if budget <= limit:
        raise ValueError(
            f"budget must exceed {limit} tokens, or no continuation "
            "chunk can take the > 128-token (dequantise) path"
        )
    if not 0 < short_tail <= limit:
        raise ValueError(f"short_tail must be in 1..{limit}")
    if not 0 < prefix_tail <= limit:
        raise ValueError(f"prefix_tail must be in 1..{limit}")
    if short_len > budget:
        raise ValueError("short prompts must fit one chunk")
    prefix_len = (2 * budget // block_size) * block_size
    if prefix_len <= 0:
        raise ValueError("block size larger than two chunks")
    return PhasePlan(
        budget=budget,
        block_size=block_size,
        max_tokens=max_tokens,
        short_len=short_len,
        batch_size=batch_size,
        long_len=3 * budget,
        short_tail_len=budget + short_tail,
        prefix_len=prefix_len,
        prefix_tail=prefix_tail,
    )


def auto_max_model_len(required: int, multiple: int = 1024) -> int:
    """Smallest multiple of ``multiple`` that holds ``required`` tokens."""
    return -(-required // multiple) * multiple


def check_attention_chunk(attention_chunk: int, block_size: int = 16) -> None:
    """Refuse a chunk vLLM cannot run: ``make_local_attention_virtual_batches`` asserts
    ``attn_chunk_size % block_size == 0`` on every step (each virtual request owns whole
    blocks), so a bad value would only fail after the engine started."""
    if attention_chunk < 0 or attention_chunk % block_size:
        raise ValueError(
            f"attention chunk {attention_chunk} must be 0 or a positive multiple of the "
            f"block size {block_size}"
        )


def chunk_overrun_warning(
    plan: PhasePlan, attention_chunk: int, vllm_version: str | None
) -> str | None:
    """One line when a phase may run past the first chunk where vLLM mishandles it, else None.

    On 0.21-0.29 (``compat.Features.local_prefill_real_lens``) TurboQuant's prefill over
    a chunked local layer pairs the virtual requests with the real batch's lengths once
    a step continues past the first chunk (IndexError, or attention over wrong lengths):
    an upstream bug, not the plugin's. Prompts and outputs within one chunk stay clear.
    """
    version = parse_version(vllm_version)
    needed = plan.required_max_model_len
    if not attention_chunk or needed <= attention_chunk or version is None:
        return None
    if not features(version).local_prefill_real_lens:
        return None
    return (
        f"the longest prompt + max_tokens ({needed}) exceeds the attention chunk "
        f"({attention_chunk}): vLLM {vllm_version}'s TurboQuant prefill over chunked local "
        "layers mispairs virtual requests past the first chunk (upstream bug, 0.21-0.29)"
    )


def build_model_config(
    geometry: Geometry,
    layers: int,
    max_position_embeddings: int,
    vocab_size: int = 1024,
    intermediate_size: int = 1024,
    attention_chunk: int = 0,
) -> dict[str, Any]:
    """A ``config.json`` for a small dummy-weight Llama with the given attention shape.

    ``attention_chunk`` 0: a plain ``LlamaForCausalLM``. N > 0: a text-only Llama 4
    (``Llama4ForCausalLM``, ``llama4_text``) with ``attention_chunk_size`` N, so that its
    RoPE layers are vLLM's ``ChunkedLocalAttention`` and their TurboQuant kernels get
    a virtual-batch block table of N / block_size columns, not the runner's
    (``max_model_len`` / block_size): the keys the plugin must plan apart.

    Which layers are which (vLLM's ``llama4.py``: a layer is chunked local unless
    ``no_rope_layers[i] == 0``, i.e. NoPE, which transformers' ``Llama4TextConfig``
    derives from ``no_rope_layer_interval`` 4): every fourth layer (3, 7, 11, ...) is
    global NoPE attention, all others chunked local. TurboQuant leaves layers 0, 1,
    L-2 and L-1 uncompressed, so with 8 layers it compresses 2, 4, 5 (chunked local)
    and 3 (global); with any L >= 6 at least layer 2 (local) and 3 (global).

    A tiny MoE keeps it a Llama 4 as vLLM builds one (routed and shared experts): 2
    experts, top-1, on every second layer (1, 3, 5, ...; ``interleave_moe_layer_step``
    2), each expert and the shared one ``intermediate_size`` wide like the dense layers'
    MLP (``intermediate_size_mlp``). On Hopper vLLM runs it with Triton's
    ``fused_moe_kernel``, which may compile for a token count startup did not run: such
    a compile is not TurboQuant's (``other_jit_after_startup``) but still raises under
    ``--jit-monitor-mode error``. QK-norm and attention temperature tuning are off:
    neither changes the attention kernels (vLLM turns tuning on only past 32k tokens).
    """
    if layers < 6:
        raise ValueError("TurboQuant leaves the first two and last two layers alone: use >= 6")
    check_attention_chunk(attention_chunk)
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": geometry.q_heads * geometry.head_size,
        "head_dim": geometry.head_size,
        "num_attention_heads": geometry.q_heads,
        "num_key_value_heads": geometry.kv_heads,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }
    if not attention_chunk:
        return config
    del config["mlp_bias"]  # LlamaConfig's; Llama4TextConfig has none
    config.update(
        architectures=["Llama4ForCausalLM"],
        model_type="llama4_text",
        intermediate_size_mlp=intermediate_size,
        attention_chunk_size=attention_chunk,
        no_rope_layer_interval=4,
        num_local_experts=2,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        use_qk_norm=False,
        attn_temperature_tuning=False,
    )
    return config


def make_prompts(n: int, length: int, seed: int, vocab_size: int) -> list[list[int]]:
    """``n`` prompts of random token ids (not the special ids 0..2)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for _ in range(n)]


class PromptSource:
    """The prompts of each phase's first and steady request, in the order they are asked for.

    ``prefix_hit`` reuses the block-aligned prefix of the same part's ``long`` prompt.
    """

    def __init__(self, plan: PhasePlan, vocab_size: int) -> None:
        self.plan = plan
        self.vocab = vocab_size
        self.long_prompts: dict[str, list[int]] = {}

    def prompts(self, phase: str, part: str) -> list[list[int]]:
        plan, vocab = self.plan, self.vocab
        seed = 1000 * PHASES.index(phase) + (0 if part == "first" else 1)
        if phase in ("decode", "batch", "short_tail"):
            lens = plan.prompt_lens(phase)
            return make_prompts(len(lens), lens[0], seed, vocab)
        if phase == "long":
            p = make_prompts(1, plan.long_len, seed, vocab)[0]
            self.long_prompts[part] = p
            return [p]
        prefix = self.long_prompts.get(part) or make_prompts(1, plan.long_len, seed, vocab)[0]
        tail = make_prompts(1, plan.prefix_tail, seed + 7, vocab)[0]
        return [prefix[: plan.prefix_len] + tail]


def default_gpu_mem_util(jobs: int, total: float = 0.9, margin: float = 0.03) -> float:
    """Per-process ``gpu_memory_utilization`` so that ``jobs`` processes fit together."""
    return round(max(0.05, min(0.85, total / max(1, jobs) - margin)), 3)
