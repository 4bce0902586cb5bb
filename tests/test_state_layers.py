"""A hybrid's state layers (``plan.rules.state_layer_count``): the layers that keep a Mamba
state and so share vLLM's KV cache groups with the attention layers, which the KV-block
zeroing key counts (``plan.rules.attention_kv_tensors``). An MLP-only layer keeps none."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tq_warmup_plugin.plan import model as plan_model
from tq_warmup_plugin.plan import rules as plan_rules

MODELS = Path(__file__).parent / "data" / "models"
PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
"""A Nemotron-H layer pattern (``hybrid_override_pattern``): 24 Mamba layers, 4 attention
layers and 24 MLP-only layers."""


def nemotron_h(directory: Path) -> Path:
    """A small Nemotron-H-shaped config (vLLM's own ``NemotronHConfig`` reads it)."""
    directory.mkdir()
    config = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
              "hidden_size": 1024, "num_hidden_layers": len(PATTERN),
              "hybrid_override_pattern": PATTERN, "num_attention_heads": 8,
              "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 2048,
              "mamba_num_heads": 32, "mamba_head_dim": 64, "ssm_state_size": 128,
              "n_groups": 8, "conv_kernel": 4, "expand": 2, "mamba_hidden_act": "silu",
              "mlp_hidden_act": "relu2", "vocab_size": 32000, "max_position_embeddings": 8192,
              "torch_dtype": "bfloat16", "layer_norm_epsilon": 1e-5, "use_bias": False,
              "use_conv_bias": True, "chunk_size": 128, "tie_word_embeddings": False}  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_state_layers_leave_out_attention_and_mlp_only_layers() -> None:
    count = plan_rules.state_layer_count
    nemotron = ["mamba", "mlp", "mamba", "attention", "moe", "mamba"]
    assert count(nemotron, 6, 1) == 3  # the old rule, every non-attention layer: 5
    assert count(["linear_attention"] * 3 + ["full_attention"], 4, 1) == 3  # Qwen3-Next
    assert count(["mamba", "hybrid", "mamba"], 3, 1) == 3  # Zamba2: a hybrid layer has both
    assert count(None, 8, 2) == 6  # no list: every layer but the attention ones
    minimax = SimpleNamespace(hf_text_config=SimpleNamespace(), hf_config=SimpleNamespace(
        attn_type_list=[0, 0, 1, 0]))  # fmt: skip
    assert count(plan_model._layer_types(minimax), 4, 1) == 3


@pytest.mark.real_vllm
def test_state_layers_are_the_layers_vllm_counts_as_state(tmp_path: Path) -> None:
    """``model_shape`` against vLLM's own ``get_num_layers_by_block_type`` of the state
    types (``mamba``: Jamba, vLLM's Nemotron-H config; ``linear_attention``: Qwen3-Next,
    transformers' Nemotron-H config). A Nemotron-H counted its 24 MLP-only layers as state
    before: 48, a zeroing key no worker asks for."""
    from vllm.config import ModelConfig, ParallelConfig

    cases = [nemotron_h(tmp_path / "nemotron-h"), MODELS / "jamba-v0.1",
             MODELS / "qwen3-next-80b-a3b"]  # fmt: skip
    for directory in cases:
        shape = plan_model.model_shape(str(directory), 1, None, 4096, False)
        config = ModelConfig(model=str(directory), skip_tokenizer_init=True, max_model_len=4096)
        vllms = sum(config.get_num_layers_by_block_type(ParallelConfig(), kind)
                    for kind in ("mamba", "linear_attention"))  # fmt: skip
        assert shape.hybrid and shape.state_layers == vllms, (directory.name, vllms)
    assert shape.state_layers == 36  # Qwen3-Next: 48 layers, 12 of them full attention
    nemotron = plan_model.model_shape(str(tmp_path / "nemotron-h"), 1, None, 4096, False)
    assert (nemotron.num_layers, len(nemotron.attention_layers), nemotron.state_layers) == (
        52,
        4,
        24,
    )
