"""The spec benchmark's configurations: kinds, drafting methods, model sizes, prompts.

A configuration is one engine: a drafting method and its k speculative tokens (or none),
the CUDA-graph mode asked of vLLM, and the plugin's ``TQ_WARMUP_SPEC_GUARD``:

* unset (or ``1``): auto, the batched verify path where the plugin proves it, else the
  PIECEWISE downgrade of verify batches;
* ``piecewise``: the PIECEWISE downgrade always (the guard of issue 10);
* ``0``: no guard: vLLM's own FULL graphs of verify batches.

Kinds, for each k (:data:`SPEC_KINDS`): ``eager`` (enforce_eager), ``piecewise`` (vLLM
asked for PIECEWISE graphs), ``full-batched`` (FULL_AND_PIECEWISE, guard unset),
``full-guard`` (FULL_AND_PIECEWISE, ``piecewise``: the name older summaries use for the
guarded row), ``full-noguard`` (FULL_AND_PIECEWISE, ``0``). Beside them ``ref-eager`` (the
reference: eager, no speculation) and ``nospec-full`` (FULL_AND_PIECEWISE, no speculation).

Methods (:data:`METHOD_PREFIX`): ``ngram``, ``draft_model`` (the dummy model drafts for
itself), ``mtp`` (a dense MTP model: vLLM's ``MiMoForCausalLM``, a Qwen2 with
``num_nextn_predict_layers``, whose MTP layer vLLM 0.26 builds as ``MiMoMTPModel``:
``config/speculative.py`` renames the architecture when ``method`` is ``mtp``) and
``eagle`` (a one-layer Llama head, written beside the model: vLLM 0.26 wraps a plain
``LlamaForCausalLM`` config in its ``EAGLEConfig`` as ``EagleLlamaForCausalLM``). On the
CPU, vLLM 0.26.0's ``SpeculativeConfig`` resolves those draft architectures from the
config.json files written here (tests/test_spec_bench.py); whether an engine starts
with them is for the GPU run to show.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.tqbench import phases

__all__ = [
    "FULL",
    "GUARD_AUTO",
    "GUARD_OFF",
    "GUARD_PIECEWISE",
    "KIND_GUARD",
    "METHOD_PREFIX",
    "MODEL_SIZES",
    "NOSPEC_FULL",
    "PERIOD",
    "PIECEWISE",
    "PROMPT_KINDS",
    "REFERENCE",
    "SPEC_KINDS",
    "ModelSize",
    "SpecConfig",
    "build_configs",
    "eagle_head_config",
    "kind_of",
    "model_config",
    "spec_config",
    "spec_prompts",
]

REFERENCE = "ref-eager"
NOSPEC_FULL = "nospec-full"
FULL, PIECEWISE = "FULL_AND_PIECEWISE", "PIECEWISE"
# TQ_WARMUP_SPEC_GUARD's values; None: the variable is unset (auto).
GUARD_AUTO: str | None = None
GUARD_PIECEWISE, GUARD_OFF = "piecewise", "0"
SPEC_KINDS: tuple[str, ...] = ("eager", "piecewise", "full-batched", "full-guard", "full-noguard")
# kind -> (cudagraph mode asked, None: enforce_eager; TQ_WARMUP_SPEC_GUARD)
KIND_GUARD: dict[str, tuple[str | None, str | None]] = {
    "eager": (None, GUARD_AUTO),
    "piecewise": (PIECEWISE, GUARD_AUTO),
    "full-batched": (FULL, GUARD_AUTO),
    "full-guard": (FULL, GUARD_PIECEWISE),
    "full-noguard": (FULL, GUARD_OFF),
}
METHOD_PREFIX = {"ngram": "ngram", "draft_model": "draft", "mtp": "mtp", "eagle": "eagle"}
PERIOD = 24  # tokens in the pattern every "repeat" prompt repeats
PROMPT_KINDS = ("repeat", "random")


@dataclass(frozen=True)
class ModelSize:
    """The dummy model's shape: attention geometry, layers, MLP width, vocabulary."""

    geometry: str
    layers: int
    intermediate_size: int
    vocab_size: int


MODEL_SIZES = {
    # The benchmark's default since issue 10: small enough for 8 engines on one GPU.
    "small": ModelSize("128x16x8", 8, 1024, 1024),
    # Llama-3-8B's shape (hidden 4096 = 32 x 128, 32/8 heads, MLP 14336, vocab 128256),
    # the model of issue 23's throughput table.
    "llama3-8b": ModelSize("128x32x8", 32, 14336, 128256),
}


@dataclass(frozen=True)
class SpecConfig:
    """One engine: speculation (``method`` None: none), CUDA graphs, the guard's value."""

    name: str
    method: str | None = None
    k: int = 0
    cudagraph_mode: str | None = None  # None: enforce_eager
    spec_guard: str | None = GUARD_AUTO  # TQ_WARMUP_SPEC_GUARD; None: unset

    def speculative_config(self, model_dir: str, head_dir: str = "") -> dict[str, Any] | None:
        """vLLM's ``speculative_config`` (keys as in 0.22 / 0.26 config/speculative.py);
        ``head_dir``: the EAGLE head's directory (:func:`eagle_head_config`)."""
        if self.method == "ngram":
            return {
                "method": "ngram",
                "num_speculative_tokens": self.k,
                "prompt_lookup_max": 4,
                "prompt_lookup_min": 2,
            }
        if self.method == "draft_model":
            return {"method": "draft_model", "model": model_dir, "num_speculative_tokens": self.k}
        if self.method == "mtp":  # the MTP layers of the model itself
            return {"method": "mtp", "num_speculative_tokens": self.k}
        if self.method == "eagle":
            if not head_dir:
                raise ValueError("eagle needs the head's directory")
            return {"method": "eagle", "model": head_dir, "num_speculative_tokens": self.k}
        return None


def spec_config(method: str, k: int, kind: str) -> SpecConfig:
    """The configuration of one kind (:data:`SPEC_KINDS`) at ``k`` speculative tokens."""
    mode, guard = KIND_GUARD[kind]
    return SpecConfig(f"{METHOD_PREFIX[method]}{k}-{kind}", method, k, mode, guard)


def kind_of(name: str) -> tuple[str, int | None]:
    """``(kind, k)`` of a configuration's name: ``("full-guard", 2)`` for ``ngram2-full-guard``,
    ``("nospec-full", None)`` for the configurations without speculation."""
    m = re.fullmatch(rf"[a-z]+?(\d+)-({'|'.join(SPEC_KINDS)})", name)
    return (m.group(2), int(m.group(1))) if m else (name, None)


def build_configs(selection: str, ks: Sequence[int], method: str) -> list[SpecConfig]:
    """The configurations ``--configs`` names, the reference first, without repeats.

    Items: ``all``, ``ref-eager``, ``nospec-full``, a kind (expanded over ``ks``) or a
    full name such as ``ngram3-full-noguard`` (any k).
    """
    if method not in METHOD_PREFIX:
        raise ValueError(f"method must be one of {sorted(METHOD_PREFIX)}, got {method!r}")
    if not ks or any(k < 1 for k in ks):
        raise ValueError(f"ks must be positive, got {list(ks)}")
    name_re = re.compile(rf"{METHOD_PREFIX[method]}(\d+)-({'|'.join(SPEC_KINDS)})")
    out = {REFERENCE: SpecConfig(REFERENCE)}
    for item in [t.strip() for t in selection.split(",") if t.strip()]:
        m = name_re.fullmatch(item)
        if item in ("all", NOSPEC_FULL):
            out[NOSPEC_FULL] = SpecConfig(NOSPEC_FULL, cudagraph_mode=FULL)
        if item == "all" or item in SPEC_KINDS:
            kinds = SPEC_KINDS if item == "all" else (item,)
            out.update({c.name: c for k in ks for c in (spec_config(method, k, x) for x in kinds)})
        elif m:
            out.setdefault(item, spec_config(method, int(m.group(1)), m.group(2)))
        elif item not in (REFERENCE, NOSPEC_FULL):
            raise ValueError(
                f"unknown configuration {item!r}: all, {REFERENCE}, {NOSPEC_FULL}, "
                f"{'/'.join(SPEC_KINDS)} or a name like {METHOD_PREFIX[method]}3-full-guard"
            )
    return list(out.values())


def spec_prompts(
    n: int = 8,
    seed: int = 0,
    lens: tuple[int, int] = (150, 430),
    vocab_size: int = 1024,
    kind: str = "repeat",
) -> list[list[int]]:
    """``n`` prompts, lengths evenly from ``lens[0]`` to ``lens[1]``.

    ``repeat``: a random ``PERIOD``-token pattern repeated, so ngram finds its drafts and
    verify batches are uniform. ``random``: no pattern, so ngram mostly finds none and
    verify batches mix requests with fewer drafts than k.
    """
    min_len, max_len = lens
    if not 0 < min_len <= max_len or n < 1:
        raise ValueError("need n >= 1 and 0 < shortest <= longest")
    if kind not in PROMPT_KINDS:
        raise ValueError(f"prompt kind must be one of {PROMPT_KINDS}, got {kind!r}")
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        length = min_len + round(i * (max_len - min_len) / max(1, n - 1))
        if kind == "random":
            prompts.append([rng.randrange(3, vocab_size) for _ in range(length)])
            continue
        pattern = [rng.randrange(3, vocab_size) for _ in range(PERIOD)]
        prompts.append((pattern * (length // PERIOD + 1))[:length])
    return prompts


def model_config(method: str | None, size: ModelSize, max_model_len: int) -> dict[str, Any]:
    """The dummy target model's ``config.json``: a Llama (phases.build_model_config), or
    for ``mtp`` the same shape as vLLM's ``MiMoForCausalLM`` with one MTP layer.

    MiMo's config: ``model_type`` ``qwen2`` (transformers knows no ``mimo`` without remote
    code; vLLM 0.26 picks the class from ``architectures``), ``num_nextn_predict_layers``
    1, which ``SpeculativeConfig`` turns into the draft's ``n_predict``.
    """
    geometry = phases.parse_geometry(size.geometry)
    config = phases.build_model_config(
        geometry, size.layers, max_model_len, size.vocab_size, size.intermediate_size
    )
    if method != "mtp":
        return config
    for key in ("mlp_bias", "attention_bias", "head_dim"):  # Qwen2Config has none of these
        config.pop(key, None)
    config.update(
        architectures=["MiMoForCausalLM"],
        model_type="qwen2",
        num_nextn_predict_layers=1,
        use_sliding_window=False,
    )
    return config


def eagle_head_config(size: ModelSize, max_model_len: int) -> dict[str, Any]:
    """An EAGLE head's ``config.json``: one Llama layer of the target's shape (vLLM 0.26
    ``EagleLlamaForCausalLM`` reads the target's hidden states, so the widths must agree)."""
    geometry = phases.parse_geometry(size.geometry)
    # build_model_config refuses fewer than 6 layers (TurboQuant's boundary); a head has 1.
    config = phases.build_model_config(
        geometry, 6, max_model_len, size.vocab_size, size.intermediate_size
    )
    config["num_hidden_layers"] = 1
    return config
