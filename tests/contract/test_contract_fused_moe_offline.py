"""Contract: a MoE model's ``fused_moe_kernel`` keys built without a worker (``precompile``,
the compile-ahead child) are the keys its worker's warmup forwards launch.

The offline side is the whole path a child takes: vLLM's ``ModelConfig`` of a public
config, the experts it gives a rank (``compat.moe_experts_of_config``), the engine request
through JSON, ``engine_plan``'s CPU engine and the fused MoE warmer's offline jobs, each
step through vLLM's own ``TritonExperts.apply`` on meta tensors. The worker side is the
warmer's real-forward choice over a built model's experts (the runner is a stand-in that
holds their weights), each step the keys vLLM's experts ask for on the H200
(``test_contract_fused_moe.serving_keys``). Triton's ``jit_cache_hook`` records the keys
and compiles nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import fakes
import pytest
from realvllm import has_v1_runner, recorded_keys
from test_contract_fused_moe import (  # noqa: F401
    _cpu_stand_ins,
    moe_engine,
    serving_keys,
    triton_method,
)

from tq_warmup_plugin import compat
from tq_warmup_plugin.vllm_kernels import offline as engine_plan
from tq_warmup_plugin.vllm_kernels import run as engine_warmup
from tq_warmup_plugin.warmers import vllm_fused_moe

pytestmark = pytest.mark.real_vllm

MODELS = Path(__file__).parents[1] / "data" / "models"

# family: (experts, top_k, hidden, expert width), from each model card's config.json.
EXPERTS = {
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
}


def model_config(family: str) -> Any:
    from vllm.config import ModelConfig

    return ModelConfig(model=str(MODELS / family), skip_tokenizer_init=True)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("family", sorted(EXPERTS))
def test_the_config_gives_each_rank_its_experts(family: str, tp: int) -> None:
    """``FusedMoE`` splits the experts' width over the tensor-parallel ranks; every rank
    holds every expert, gate and up projection stacked."""
    e, top_k, hidden, width = EXPERTS[family]
    (layer,) = compat.moe_experts_of_config(model_config(family), tp)
    assert layer == compat.MoeExperts(
        (e, 2 * width // tp, hidden), (e, hidden, width // tp), e, top_k, "bfloat16"
    )


def test_a_dense_model_has_none_and_an_undrivable_one_says_why() -> None:
    assert compat.moe_experts_of_config(model_config("mistral-7b-v0.3")) == ()
    with pytest.raises(compat.CompatError, match="expert parallel"):
        compat.moe_experts_of_config(model_config("mixtral-8x7b"), 1, expert_parallel=True)


class _Runner:
    """A built model's experts (``w13_weight``, ``w2_weight``, ``moe_config``) on two
    modules, and ``_dummy_run`` recorded."""

    def __init__(self, layer: compat.MoeExperts, method: Any = None) -> None:
        from types import SimpleNamespace

        import torch

        experts = SimpleNamespace(
            w13_weight=torch.empty(*layer.w13, dtype=torch.bfloat16, device="meta"),
            w2_weight=torch.empty(*layer.w2, dtype=torch.bfloat16, device="meta"),
            moe_config=SimpleNamespace(num_experts=layer.experts,
                                       experts_per_token=layer.top_k),
            quant_method=method,
        )  # fmt: skip
        self.model = SimpleNamespace(modules=lambda: [experts, experts])
        self.ran: list[int] = []

    def _dummy_run(self, tokens: int, **_: Any) -> None:
        self.ran.append(tokens)


def offline_keys(family: str, gpu_name: str, graph_tokens: int) -> tuple[set[Any], int]:
    """The keys of the offline plan's fused MoE jobs, and how many jobs, as the child
    builds them: its request through JSON, ``engine_plan.cpu_engine`` and ``jobs``."""
    from tq_warmup_plugin.worker.warmup import plugin_manager

    experts = compat.moe_experts_of_config(model_config(family))
    request = engine_plan.EngineRequest(
        features=compat.release_features(compat.installed_vllm_version()),
        runner_v2=not has_v1_runner(),
        vocab_size=32000, model_dtype="bfloat16", block_size=16, max_model_len=8192,
        max_num_seqs=256, max_num_batched_tokens=8192, moe_experts=experts,
        graph_tokens=graph_tokens, gpu_name=gpu_name,
    )  # fmt: skip
    given = engine_plan.EngineRequest.from_dict(json.loads(json.dumps(request.to_dict())))
    assert given == request
    todo, _, errors = engine_plan.jobs(plugin_manager(load_entry_points=False),
                                       engine_plan.cpu_engine(given))  # fmt: skip
    moe = [job for job in todo if job.family == vllm_fused_moe.FAMILY]
    assert errors == [] and moe and all(job.offline and not job.real for job in moe)
    with recorded_keys() as seen:
        for job in moe:
            job.run()
    return {key for key in seen if key[0] == "fused_moe_kernel"}, len(moe)


def worker_keys(family: str, graph_tokens: int) -> set[Any]:
    """What the H200 worker's warmup forwards launch: the warmer's sizes over the built
    experts, each a step of vLLM's experts."""
    e, top_k, hidden, width = EXPERTS[family]
    layer = compat.MoeExperts((e, 2 * width, hidden), (e, hidden, width), e, top_k, "bfloat16")
    runner = _Runner(layer)
    result = engine_warmup.run(
        fakes.bare_manager(vllm_fused_moe), moe_engine(runner, graph_tokens), load=False
    )
    assert result.errors == [] and runner.ran
    return serving_keys((e, top_k, hidden, width), runner.ran)


def worker_launches(family: str, graph_tokens: int) -> set[Any]:
    """What the H200 worker's own warmer loads where its experts run ``TritonExperts``:
    its compile-only steps, recorded."""
    e, top_k, hidden, width = EXPERTS[family]
    layer = compat.MoeExperts((e, 2 * width, hidden), (e, hidden, width), e, top_k, "bfloat16")
    runner = _Runner(layer, triton_method())
    with recorded_keys() as seen:
        result = engine_warmup.run(
            fakes.bare_manager(vllm_fused_moe), moe_engine(runner, graph_tokens), load=False
        )
    assert result.errors == [] and runner.ran == []
    return {key for key in seen if key[0] == "fused_moe_kernel"}


@pytest.mark.parametrize("family", sorted(EXPERTS))
def test_the_offline_plan_builds_the_keys_the_worker_launches(family: str) -> None:
    built, jobs = offline_keys(family, "NVIDIA H200", 512)
    assert built == worker_keys(family, 512)
    assert len(built) <= 2 * jobs  # two GEMMs a step
    assert worker_launches(family, 512) == built  # the worker's own warmer, no forward


def test_the_check_fails_for_another_gpu() -> None:
    """Planned for an H100 (vLLM's default config: no tuned bf16 JSON for Mixtral-8x7B's
    experts there), the keys miss the H200 worker's, whose tuned JSON vLLM ships."""
    built, _ = offline_keys("mixtral-8x7b", "NVIDIA H100 80GB HBM3", 512)
    assert built != worker_keys("mixtral-8x7b", 512)
