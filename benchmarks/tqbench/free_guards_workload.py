"""The ``free-guards`` benchmark's workloads and figures: pure, from a seed.

A workload is a list of turns in arrival order and how many stay in flight: the child adds
turns as others finish, so the scheduler's steps depend on the step count, not on the wall
clock, and a guard-on and a guard-off pass of one workload see the same batches. Every
pass starts from the same cache: a prefix-cache reset, then each ``warm`` prompt served.

* ``hits``: the token benchmark's cost case (80% of the requests hit one cached prefix of
  640 tokens, 8 fresh prompts longer than every hit), all 40 at once.
* ``chat``: three shared system prompts of 1,000-2,000 tokens, user turns of 50-500 tokens,
  128-512 output tokens, 64 in flight; one turn in eight opens a new conversation (a fresh
  2,100-token prompt that shares nothing), the prefill batches where a fresh prompt meets
  cache hits (upstream #46460's trigger).
* ``long``: four shared 8,000-token documents with questions of 20-60 tokens and 64 output
  tokens, 16 in flight; one turn in eight brings a new 8,200-token document.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "WORKLOADS",
    "Turn",
    "Workload",
    "pass_figures",
    "percentile",
    "prefix_ratios",
    "verify_ratios",
    "workload",
]

WORKLOADS = ("hits", "chat", "long")


@dataclass(frozen=True)
class Turn:
    """One request: its prompt's token ids and how many tokens it generates."""

    name: str
    prompt: list[int]
    max_tokens: int
    fresh: bool = False  # shares no cached prefix


@dataclass(frozen=True)
class Workload:
    """Turns in arrival order, ``in_flight`` at most at once, after ``warm`` is cached."""

    name: str
    turns: list[Turn]
    in_flight: int
    warm: list[list[int]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Workload:
        turns = [Turn(**t) for t in d["turns"]]
        return Workload(str(d["name"]), turns, int(d["in_flight"]), list(d.get("warm", [])))

    def longest(self) -> int:
        """The longest sequence a turn reaches: ``max_model_len`` must hold it."""
        return max(len(t.prompt) + t.max_tokens for t in self.turns)


def _tokens(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]  # no special tokens


def _hits(rng: random.Random, vocab: int) -> Workload:
    prefix = _tokens(rng, vocab, 640)
    turns = [Turn(f"hit{i}", prefix + _tokens(rng, vocab, 64), 64) for i in range(32)]
    turns += [Turn(f"fresh{i}", _tokens(rng, vocab, 720), 64, True) for i in range(8)]
    return Workload("hits", turns, len(turns), [prefix])


def _shared(
    rng: random.Random, vocab: int, name: str, spec: tuple[Any, ...], turns: int
) -> Workload:
    prefixes, question, output, fresh_len, in_flight = spec
    shared = [_tokens(rng, vocab, n) for n in prefixes]
    out = []
    for i in range(turns):
        if i % 8 == 7:
            out.append(
                Turn(f"{name}-new{i}", _tokens(rng, vocab, fresh_len), rng.choice(output), True)
            )
            continue
        body = _tokens(rng, vocab, rng.randint(*question))
        out.append(Turn(f"{name}{i}", rng.choice(shared) + body, rng.choice(output)))
    return Workload(name, out, in_flight, shared)


# name -> (shared prefix lengths, question range, output choices, fresh prompt, in flight)
_SHARED = {
    "chat": ((1000, 1500, 2000), (50, 500), (128, 256, 512), 2100, 64),
    "long": ((8000,) * 4, (20, 60), (64,), 8200, 16),
}


def workload(name: str, seed: int, vocab: int, turns: int = 0) -> Workload:
    """The workload ``name`` (:data:`WORKLOADS`); ``turns``: how many (0: three times
    the in-flight count; ``hits`` has its fixed 40)."""
    rng = random.Random(f"{name}-{seed}")
    if name == "hits":
        return _hits(rng, vocab)
    if name not in _SHARED:
        raise ValueError(f"unknown workload {name!r}: one of {', '.join(WORKLOADS)}")
    spec = _SHARED[name]
    return _shared(rng, vocab, name, spec, turns or 3 * int(spec[-1]))


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100), nearest rank; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def pass_figures(wall_s: float, out_tokens: int, ttft_s: Sequence[float]) -> dict[str, Any]:
    """One pass's output tokens/s and TTFT p50/p99 (ms)."""
    p50, p99 = percentile(ttft_s, 50), percentile(ttft_s, 99)
    return {
        "tok_s": round(out_tokens / wall_s, 1) if wall_s > 0 else None,
        "ttft_p50_ms": None if p50 is None else round(p50 * 1e3, 1),
        "ttft_p99_ms": None if p99 is None else round(p99 * 1e3, 1),
    }


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def prefix_ratios(passes: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Guard on over guard off, pair by pair (a pass: ``guard``, ``tok_s``, TTFT, the
    ``mixed`` prefill calls it saw): the median ratio, each pair's, and TTFT p99 on/off."""
    on = [p for p in passes if p.get("guard") == "on" and p.get("tok_s")]
    off = [p for p in passes if p.get("guard") == "off" and p.get("tok_s")]
    pairs = [a["tok_s"] / b["tok_s"] for a, b in zip(on, off, strict=False)]
    p99 = [
        a["ttft_p99_ms"] / b["ttft_p99_ms"]
        for a, b in zip(on, off, strict=False)
        if a.get("ttft_p99_ms") and b.get("ttft_p99_ms")
    ]
    ratio, ttft = _median(pairs), _median(p99)
    return {
        "ratio": None if ratio is None else round(ratio, 3),
        "pairs": [round(r, 3) for r in pairs],
        "ttft_p99_ratio": None if ttft is None else round(ttft, 3),
        "mixed_steps": max((int(p.get("mixed", 0)) for p in off), default=0),
    }


def verify_ratios(over_noguard_by_batch: Mapping[int, Mapping[str, float]]) -> dict[str, Any]:
    """``{"k=1": {"bs1": r, "bs8": r}, ...}`` from the batched rows' ratios over the
    unguarded FULL graphs, by k and then by batch size."""
    return {
        f"k={k}": {
            f"bs{b}": round(float(r), 3) for b, r in sorted(by.items(), key=lambda x: int(x[0]))
        }
        for k, by in sorted(over_noguard_by_batch.items())
    }
