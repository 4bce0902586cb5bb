"""The token benchmark's requests, engines and steps: what each child is asked to run.

Pure: prompts are random token ids from a seed, so every engine of a run (and the
reference) gets the same ones. The shapes follow upstream #46460's trigger: a prefix P
cached first, then in one step a fresh prompt C at least as long as every other
request's whole sequence beside cache hits B_j = P + q_j; TurboQuant's fast-path test
(``max_query_len == max_seq_len``) then holds although the B_j have cached context.

* ``prefix_mixed``: the reproduction. Each hit served alone in its step (after a prefix
  cache reset and P cached again) is the reference; ``mixed`` is C with every B_j in one
  step; ``control`` the same hits beside a fresh prompt shorter than them (the maxima
  differ, so vLLM's own loop serves every request: the batching noise of the run).
* ``oracle_requests``: one workload for every row of the oracle: the hits and C, a
  short fresh prompt, a prompt near ``max_model_len`` and a request with ``n = 2``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "ORACLE_ROWS",
    "PREFIX_LEN",
    "QUERIES",
    "EngineRow",
    "Request",
    "Step",
    "oracle_requests",
    "oracle_steps",
    "prefix_mixed_steps",
    "prompts",
]

PREFIX_LEN = 640  # 20 blocks of 32 (TurboQuant's bf16 block size on 0.26): all cached
QUERIES = (24, 40, 56, 72)  # each hit's new tokens; under 128: the continuation kernels


@dataclass(frozen=True)
class Request:
    """One prompt, by name; ``n`` samples (greedy: every sample is the same)."""

    name: str
    prompt: list[int]
    n: int = 1


@dataclass(frozen=True)
class Step:
    """One ``generate`` (or, ``alone``, one per request): after a prefix-cache reset and
    ``warm`` generated first (so its blocks are cached), with the prefix guard ``guard``
    (``on``/``off``; ``""``: as the engine started)."""

    name: str
    requests: list[Request]
    guard: str = ""
    warm: list[int] = field(default_factory=list)
    alone: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def prompts(seed: int, vocab: int, lengths: Sequence[int]) -> list[list[int]]:
    """Random prompts of these lengths (token ids 3..vocab-1, no special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _hits(seed: int, vocab: int) -> tuple[list[int], list[Request]]:
    prefix = prompts(seed, vocab, [PREFIX_LEN])[0]
    tails = prompts(seed + 1, vocab, QUERIES)
    return prefix, [Request(f"B{j}", prefix + tail) for j, tail in enumerate(tails)]


def prefix_mixed_steps(seed: int, vocab: int, guards: Sequence[str] = ("off", "on")) -> list[Step]:
    """The reproduction's steps, for each guard state: alone, mixed, control."""
    prefix, hits = _hits(seed, vocab)
    longest = PREFIX_LEN + max(QUERIES)
    fresh, short = prompts(seed + 2, vocab, [longest + 16, PREFIX_LEN - 40])
    steps = []
    for g in guards:
        steps += [
            Step(f"alone-{g}", hits, g, prefix, alone=True),
            Step(f"mixed-{g}", [Request("C", fresh), *hits], g, prefix),
            Step(f"control-{g}", [Request("C-short", short), *hits], g, prefix),
        ]
    return steps


def oracle_requests(seed: int, vocab: int, max_model_len: int, max_tokens: int) -> list[Request]:
    """The oracle's workload: hits on a cached prefix beside fresh prompts that are
    longer (the #46460 step), a short fresh prompt, one near ``max_model_len`` and a
    parallel-sampling request (``n = 2``, sharing its prompt's blocks)."""
    hits = _hits(seed, vocab)[1]
    near = max_model_len - max_tokens - 1
    fresh, short, long_, shared = prompts(seed + 3, vocab, [PREFIX_LEN + 96, 100, near, 300])
    return [
        Request("C", fresh),
        *hits,
        Request("D", short),
        Request("near-max", long_),
        Request("n2", shared, n=2),
    ]


def oracle_steps(requests: list[Request], prefix: list[int], reference: bool) -> list[Step]:
    """The reference serves every request alone; every other row serves them in one
    step after the prefix is cached, with the guard on and then off."""
    if reference:
        return [Step("alone", requests, "", prefix, alone=True)]
    return [Step(f"batch-{g}", requests, g, prefix) for g in ("on", "off")]


@dataclass(frozen=True)
class EngineRow:
    """One engine of the oracle: the feature X it turns on over the reference's
    TurboQuant-eager-X-off, as ``LLM(...)`` keywords (and a speculative method)."""

    name: str
    feature: str
    eager: bool = False
    prefix_caching: bool = True
    budget: int = 0  # max_num_batched_tokens; 0: vLLM's default
    async_scheduling: str = ""  # "on"/"off"; "": vLLM's default
    method: str = ""  # speculative method; "": none
    k: int = 0
    gpu_blocks: int = 0  # num_gpu_blocks_override; 0: from the KV-cache bytes

    @property
    def reference(self) -> bool:
        return self.name.startswith("ref")


ORACLE_ROWS = (
    # The references serve each request alone after the prefix is cached again: a hit
    # then reads its prefix from the TurboQuant cache, as it does in any correct serving.
    # Against a cache-less engine a hit differs by the cache's quantization (its suffix
    # attends a stored prefix, not the raw K/V of its own prefill): 0.0038 against a
    # floor of 0.0020 (H200, 0.26.0), which ``ref`` against ``ref-nocache`` shows each run.
    EngineRow("ref", "TurboQuant eager, each request alone (the reference)", True),
    EngineRow(
        "ref-nocache", "TurboQuant eager, prefix caching off, each request alone", True, False
    ),
    EngineRow(
        "noise", "FULL graphs, prefix caching off, one batch (the noise floor)", False, False
    ),
    EngineRow("prefix", "prefix caching (vLLM's defaults)"),
    EngineRow("chunked-256", "chunked prefill, 256-token budget", budget=256),
    EngineRow("async-on", "async scheduling on", async_scheduling="on"),
    EngineRow("async-off", "async scheduling off", async_scheduling="off"),
    EngineRow("ngram3", "speculative decoding: ngram k=3", method="ngram", k=3),
    EngineRow("draft2", "speculative decoding: draft_model k=2", method="draft_model", k=2),
    EngineRow("eagle2", "speculative decoding: EAGLE k=2", method="eagle", k=2),
    EngineRow("preempt", "preemption: 96 KV blocks, requests recomputed", gpu_blocks=96),
    EngineRow("ref-mtp", "the MTP target (MiMo): eager, each request alone", True),
    EngineRow("mtp2", "speculative decoding: MTP k=2 (MiMo target)", method="mtp", k=2),
)
