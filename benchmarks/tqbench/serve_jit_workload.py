"""What a ``serve-jit`` row serves: the request mix (:func:`mix`: waves sent together,
prompts ngram can draft from) and the models beside the dummy Llama: a Mixtral of the
same attention (:func:`mixtral_config`, ``fused_moe_kernel`` on Hopper) and a small
Qwen3-Next (:func:`qwen3_next_config`, gated delta nets beside full attention, its own
MTP layer)."""

from __future__ import annotations

import random
from typing import Any

__all__ = ["mix", "mixtral_config", "qwen3_next_config"]


def _pattern_prompt(rng: random.Random, vocab: int, length: int) -> list[int]:
    """A prompt that repeats an 8-token pattern with a few changes: ngram finds it."""
    pattern = [rng.randrange(10, vocab) for _ in range(8)]
    out = [pattern[i % 8] for i in range(length)]
    for i in rng.sample(range(length), max(1, length // 20)):
        out[i] = rng.randrange(10, vocab)
    return out


def mix(seed: int, vocab: int) -> list[list[dict[str, Any]]]:
    """The requests, in waves sent together (each a ``/v1/completions`` body less the
    model): the order is the one a server meets them in."""
    rng = random.Random(seed)

    def p(n: int) -> list[int]:
        return _pattern_prompt(rng, vocab, n)

    greedy = {"temperature": 0}
    rand = {"temperature": 0.8, "top_p": 0.9, "seed": 1}
    ids = {"return_tokens_as_token_ids": True}  # logprobs without the tokenizer
    prefix = p(640)
    return [
        [{"prompt": p(16), "max_tokens": 16, **greedy}],
        [{"prompt": p(3000), "max_tokens": 8, **greedy}],
        [{"prompt": prefix + p(24 + 16 * i), "max_tokens": 16, **greedy} for i in range(4)],
        [
            {"prompt": p(40 + 7 * i), "max_tokens": 24, **(greedy if i % 2 else rand)}
            for i in range(16)
        ],
        [{"prompt": p(64), "max_tokens": 16, "logprobs": n, **ids, **greedy} for n in (1, 5, 20)],
        [{"prompt": p(48), "max_tokens": 8, "prompt_logprobs": 2, **ids, **greedy}],
        [{"prompt": p(48), "max_tokens": 16, "n": 2, **rand}],
        [{"prompt": p(48), "max_tokens": 32, "stop_token_ids": [3, 5, 7], **greedy}],
        [{"prompt": p(200), "max_tokens": 48, **rand} for _ in range(4)],
        [{"prompt": prefix + p(100), "max_tokens": 16, "logprobs": 2, **ids, **rand}],
    ]


def mixtral_config(llama: dict[str, Any], experts: int = 4, top_k: int = 2) -> dict[str, Any]:
    """A Llama ``config.json`` as a Mixtral of the same attention and width: ``experts``
    experts of the Llama's ``intermediate_size`` each, ``top_k`` per token, on every layer
    (vLLM's ``MixtralForCausalLM`` reads ``num_local_experts`` and ``num_experts_per_tok``)."""
    config = {k: v for k, v in llama.items() if k not in ("mlp_bias", "head_dim")}
    config.update(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        sliding_window=None,
    )
    return config


def qwen3_next_config(max_model_len: int, layers: int = 24) -> dict[str, Any]:
    """A small Qwen3-Next ``config.json``: Qwen3-Next-80B-A3B's attention, gated-delta-net
    and expert shapes (its Hugging Face config) with ``layers`` layers (a full-attention
    layer every 4th: 24 give 6, and the plugin found 7 TurboQuant layers with the MTP
    layer's, H200, 0.26.0, serve-jit run R) and 8 experts, top 2, so dummy weights are
    small; one MTP layer."""
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "hidden_size": 2048,
        "intermediate_size": 5120,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "num_hidden_layers": layers,
        "full_attention_interval": 4,
        "layer_types": [
            "full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)
        ],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "norm_topk_prob": True,
        "mlp_only_layers": [],
        "partial_rotary_factor": 0.25,
        "max_position_embeddings": max_model_len,
        "rope_theta": 10000000,
        "rms_norm_eps": 1e-06,
        "hidden_act": "silu",
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 1,
        "torch_dtype": "bfloat16",
    }
