"""``tq-warmup inspect --model`` against vLLM's own reading of real model configs
(``tests/data/models``: the fields that matter of each family's public config.json).

Families planned: Llama-3, Qwen2.5, Qwen3-MoE and Mixtral (MoE), Mistral, Gemma-2 (its
own scale), Falcon (MQA), ChatGLM3 (vLLM's own config class), Phi-3, Jamba (hybrid),
Qwen3-Next (hybrid, where vLLM can import its code), Llama 4 (text-only, with chunked
local attention).
Refused: DeepSeek-V2-Lite (MLA), BERT (encoder-only).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tq_warmup_plugin import compat
from tq_warmup_plugin.cli import commands as cli
from tq_warmup_plugin.plan import rules as plan_rules

MODELS = Path(__file__).parent / "data" / "models"

# family: (tp, head size, query heads/rank, KV heads/rank, TurboQuant layers, scale, dtype),
# from each model's public config: Gemma-2 scales by query_pre_attn_scalar 144, not 128;
# Qwen3-Next has 12 full-attention layers of 48 and Jamba 4 of 32, hybrids skip none.
PLANNED: dict[str, tuple[int, int, int, int, int, float, str]] = {
    "llama-3-8b": (2, 128, 16, 4, 28, 128**-0.5, "bfloat16"),
    "qwen2.5-7b": (2, 128, 14, 2, 24, 128**-0.5, "bfloat16"),
    "qwen3-30b-a3b": (2, 128, 16, 2, 44, 128**-0.5, "bfloat16"),
    "mistral-7b-v0.3": (2, 128, 16, 4, 28, 128**-0.5, "bfloat16"),
    "mixtral-8x7b": (2, 128, 16, 4, 28, 128**-0.5, "bfloat16"),
    "gemma-2-27b": (2, 128, 16, 8, 42, 144**-0.5, "bfloat16"),
    "falcon-7b": (1, 64, 71, 1, 28, 64**-0.5, "bfloat16"),
    "chatglm3-6b": (2, 128, 16, 1, 24, 128**-0.5, "float16"),
    "phi-3-mini": (2, 96, 16, 16, 28, 96**-0.5, "bfloat16"),
    "jamba-v0.1": (2, 128, 16, 4, 4, 128**-0.5, "bfloat16"),
    "qwen3-next-80b-a3b": (2, 256, 8, 1, 12, 256**-0.5, "bfloat16"),
    "llama-4-scout": (8, 128, 5, 1, 44, 128**-0.5, "bfloat16"),
}
REFUSED = {
    "deepseek-v2-lite": "uses multi-head latent attention (MLA)",
    "bert-base": "is encoder-only",
}


def vllm_reading(directory: Path, tp: int) -> dict[str, Any]:
    """What vLLM itself computes: ModelConfig's heads per rank and head size, and the
    boundary layers ``create_engine_config`` adds (0.21+: from the ModelConfig)."""
    from vllm.config import ModelConfig, ParallelConfig
    from vllm.model_executor.layers.quantization.turboquant import config as tq

    model = ModelConfig(model=str(directory), skip_tokenizer_init=True)
    parallel = ParallelConfig(tensor_parallel_size=tp)
    skip = {int(i) for i in tq.TurboQuantConfig.get_boundary_skip_layers(model)}
    if model.is_hybrid:
        attention = set(tq._get_full_attention_layer_indices(model))
    else:
        attention = set(range(model.hf_text_config.num_hidden_layers))
    return {
        "head_size": model.get_head_size(),
        "num_heads": model.get_num_attention_heads(parallel),
        "num_kv_heads": model.get_num_kv_heads(parallel),
        "layers": len(attention - skip),
        "model_dtype": str(model.dtype).removeprefix("torch."),
    }


def inspect(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(["inspect", "--kv-cache-dtype", "turboquant_4bit_nc", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.real_vllm
@pytest.mark.parametrize("family", sorted(PLANNED))
def test_planned_geometry_is_vllms(family: str, capsys: pytest.CaptureFixture[str]) -> None:
    tp, d, hq, hk, layers, scale, dtype = PLANNED[family]
    rc, out, err = inspect(capsys, "--model", str(MODELS / family), "-tp", str(tp), "--json")
    if rc == 2 and "vLLM cannot import its" in err:  # a dependency the CI venv lacks
        assert err.count("\n") == 1
        pytest.skip(err.strip())
    assert rc == 0, err
    planned = json.loads(out)
    g = planned["geometry"]
    ours = {
        "head_size": g["head_size"],
        "num_heads": g["num_heads"],
        "num_kv_heads": g["num_kv_heads"],
        "layers": planned["turboquant_layers"],
        "model_dtype": g["model_dtype"],
    }
    assert ours == vllm_reading(MODELS / family, tp)
    assert (g["head_size"], g["num_heads"], g["num_kv_heads"]) == (d, hq, hk)
    assert (planned["turboquant_layers"], g["scale"], g["model_dtype"]) == (layers, scale, dtype)
    hybrid = family in ("jamba-v0.1", "qwen3-next-80b-a3b")
    boundary_decodes = [x for x in planned["launches"] if x.startswith("paged_decode")]
    assert bool(boundary_decodes) is not hybrid  # hybrids keep no boundary layers


def planned_keys(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[dict[str, Any], set[str]]:
    rc, out, err = inspect(capsys, *argv, "--json")
    assert rc == 0, err
    planned = json.loads(out)
    return planned, {key for keys in planned["paths"].values() for key in keys}


@pytest.mark.real_vllm
def test_llama4_plans_its_chunked_local_layers(capsys: pytest.CaptureFixture[str]) -> None:
    """The text config's ``attention_chunk_size`` (vLLM's ``ModelConfig`` reads it) adds
    the keys of a virtual-batch table of 8192 / block_size columns: stride class %16."""
    from vllm.config import ModelConfig

    model = MODELS / "llama-4-scout"
    assert ModelConfig(model=str(model), skip_tokenizer_init=True).attention_chunk_size == 8192
    argv = ("--model", str(model), "-tp", "8", "--max-model-len", "10000", "--kv-splits", "16")
    planned, ours = planned_keys(capsys, *argv)
    assert planned["source"].endswith("; chunked local attention of 8192 tokens")
    _, runner_only = planned_keys(capsys, *argv, "--attention-chunk-size", "0")
    assert runner_only < ours
    assert all("stride_bt_b=%16" in key for key in ours - runner_only)
    rc, _, err = inspect(capsys, *argv, "--attention-chunk-size", "100")
    assert rc == 2 and "not a multiple of the block size" in err and err.count("\n") == 1


@pytest.mark.real_vllm
def test_inspect_takes_vllms_prefix_caching_flags_for_a_hybrid(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--enable-prefix-caching`` reaches the hybrid's block as vLLM's own flag does
    (``test_contract_worker_plan`` holds the block to vLLM's); ``--mamba-cache-mode align``
    keeps the block it has without prefix caching, on every release."""
    argv = ("--model", str(MODELS / "jamba-v0.1"), "--max-model-len", "4096")
    blocks = []
    for extra in ((), ("--enable-prefix-caching",), ("--enable-prefix-caching",
                                                      "--mamba-cache-mode", "align")):  # fmt: skip
        planned, _ = planned_keys(capsys, *argv, *extra)
        blocks.append(int(planned["source"].split("attention block ")[1].split()[0]))
    off, on, align = blocks
    assert align == off and on >= off


@pytest.mark.real_vllm
@pytest.mark.parametrize("family", sorted(REFUSED))
def test_models_vllm_runs_without_turboquant_are_refused(
    family: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = inspect(capsys, "--model", str(MODELS / family))
    assert rc == 2 and not out and err.count("\n") == 1 and REFUSED[family] in err, err


@pytest.mark.real_vllm
def test_a_float32_model_needs_a_dtype(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = json.loads((MODELS / "llama-3-8b" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}))
    rc, _, err = inspect(capsys, "--model", str(tmp_path))
    assert rc == 2 and "config.json says float32" in err and err.count("\n") == 1
    rc, out, _ = inspect(capsys, "--model", str(tmp_path), "--dtype", "float16", "--json")
    assert rc == 0 and json.loads(out)["geometry"]["model_dtype"] == "float16"


@pytest.mark.real_vllm
def test_a_config_file_of_another_name_and_bad_tp(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tmp_path / "llama.json"
    file.write_text((MODELS / "llama-3-8b" / "config.json").read_text())
    assert inspect(capsys, "--model", str(file))[0] == 0
    rc, _, err = inspect(capsys, "--model", str(file), "-tp", "3")
    assert rc == 2 and "must be divisible by tensor parallel size (3)" in err


def test_boundary_rule_per_release() -> None:
    old, new = compat.features((0, 20)), compat.features((0, 26))
    assert plan_rules.boundary_layers(new, 32, hybrid=False) == (0, 1, 30, 31)
    assert plan_rules.boundary_layers(new, 3, hybrid=False) == (0, 2)
    assert plan_rules.boundary_layers(new, 48, hybrid=True) == ()
    with pytest.raises(plan_rules.UnsupportedModel, match=r"0\.20 refuses"):
        plan_rules.boundary_layers(old, 48, hybrid=True)


_SIZE_QWEN3_NEXT = """
import json, sys
from vllm.config import ModelConfig
from benchmarks.tqbench.serve_jit_workload import qwen3_next_config
from tq_warmup_plugin import compat
open(sys.argv[1] + "/config.json", "w").write(json.dumps(qwen3_next_config(4096)))
try:  # vLLM inspects the model class when it reads the config, or when it sizes it
    model = ModelConfig(model=sys.argv[1], skip_tokenizer_init=True, dtype="bfloat16")
    sizes = [compat.hybrid_block_size(model, 1, "turboquant_4bit_nc", 16, k) for k in (0, 2, 4)]
except Exception as exc:
    sizes = str(exc)[:160]
print(json.dumps(sizes))
"""


@pytest.mark.real_vllm
def test_a_hybrids_block_is_the_one_the_h200_logged(tmp_path: Path) -> None:
    """The serve-jit Qwen3-Next with MTP k=2: "Setting attention block size to 2160 tokens"
    (H200, 0.26.0, run Z); its Mamba state grows with the draft tokens, and so does the
    block (k = 0, 2, 4). In a fresh interpreter, as ``precompile`` runs: the model's GDN
    kernels ask the CUDA device for its name when imported beside the compile-only driver
    other tests start. Qwen3-Next's model class imports vLLM's quantization code, which
    needs ``compressed-tensors`` (the CI's venvs have vLLM's pin of it); where it is missing
    this is skipped."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).parents[1]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    out = subprocess.run([sys.executable, "-c", _SIZE_QWEN3_NEXT, str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=600, check=True)  # fmt: skip
    sizes = json.loads(out.stdout.strip().splitlines()[-1])
    if isinstance(sizes, str):
        pytest.skip(f"vLLM cannot inspect Qwen3-Next here: {sizes}")
    assert sizes == [2096, 2160, 2224]


@pytest.mark.real_vllm
def test_a_draft_models_own_layers_are_planned(capsys: pytest.CaptureFixture[str]) -> None:
    """A draft model of head size 64 beside a 128-wide target: its keys too, and said."""
    target = ["--model", str(MODELS / "llama-3-8b"), "--json"]
    rc, out, _ = inspect(capsys, *target)
    alone = json.loads(out)
    spec = {
        "method": "draft_model",
        "model": str(MODELS / "falcon-7b"),
        "num_speculative_tokens": 3,
    }
    rc, out, err = inspect(capsys, *target, "--speculative-config", json.dumps(spec))
    assert rc == 0, err
    both = json.loads(out)
    assert "draft model: 28 TurboQuant layers, head size 64, heads 71/1" in both["source"]
    keys = [k for described in both["paths"].values() for k in described]
    assert any("HEAD_DIM=64," in k for k in keys) and any("HEAD_DIM=128," in k for k in keys)
    assert both["distinct"] > alone["distinct"]
