"""Contract: one step per ``vllm_fused_moe.signature`` reaches every ``fused_moe_kernel``
key that vLLM's own launcher asks Triton for, over every step size of the range.

vLLM's real config lookup (``try_get_optimal_moe_config``, the H200's tuned JSONs where
a shape has one), its expert assignment (``_prepare_expert_assignment`` /
``moe_align_block_size``) and its launcher (``dispatch_fused_moe_kernel``, or
``invoke_fused_moe_kernel`` before it) run on meta tensors, called as ``TritonExperts``
calls them (``compat.fused_moe_launch``, the warmer's own launches); Triton's
``jit_cache_hook`` records each key and compiles nothing. The stand-ins: the CUDA
alignment op (``ops.moe_align_block_size``: it fills the buffers vLLM sized, which
no key reads) and the platform's device name.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace
from typing import Any

import pytest
from realvllm import activate_compile_only_driver, recorded_keys

from tq_warmup_plugin import compat, engine_warmup
from tq_warmup_plugin.engine import Engine
from tq_warmup_plugin.warmers import vllm_fused_moe
from tq_warmup_plugin.warmup import plugin_manager

pytestmark = pytest.mark.real_vllm

# (experts, top_k, hidden, intermediate): the serve-jit Mixtral (4 experts, top-2);
# many experts and top-6 (DeepSeek-V2-Lite's routing), whose tiny steps take the
# small-batch clauses; Mixtral-8x7B's own shape, which has a tuned H200 config.
SHAPES = [(4, 2, 2048, 1024), (64, 6, 256, 128), (8, 2, 4096, 14336)]


@pytest.fixture(autouse=True)
def _cpu_stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    activate_compile_only_driver()
    from vllm import _custom_ops as ops
    from vllm.platforms import current_platform

    monkeypatch.setattr(ops, "moe_align_block_size", lambda *a, **k: None, raising=False)
    monkeypatch.setattr(current_platform, "get_device_name", lambda *a, **k: "NVIDIA H200")


def experts_of(shape: tuple[int, int, int, int]) -> compat.MoeExperts:
    import torch

    e, top_k, hidden, inter = shape
    w13, w2 = (e, 2 * inter, hidden), (e, hidden, inter)
    weights = tuple(torch.empty(w, dtype=torch.bfloat16, device="meta") for w in (w13, w2))
    return compat.MoeExperts(w13, w2, e, top_k, "bfloat16", weights=weights)


def keys_at(layer: compat.MoeExperts, sizes: list[int]) -> set[tuple[str, str]]:
    with recorded_keys() as seen:
        for tokens in sizes:
            compat.fused_moe_launch(layer, tokens, "meta")
    return {key for key in seen if key[0] == "fused_moe_kernel"}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"E{s[0]}-top{s[1]}")
@pytest.mark.parametrize(("first", "last"), [(1, 600), (513, 2200)])
def test_one_step_per_signature_reaches_every_key_of_the_range(
    shape: tuple[int, int, int, int], first: int, last: int
) -> None:
    layer = experts_of(shape)
    config_of = compat.moe_config_function()
    chosen = vllm_fused_moe.token_counts(
        first, last, partial(vllm_fused_moe.signature, experts=[layer], config_of=config_of)
    )
    every = keys_at(layer, list(range(first, last + 1)))
    assert keys_at(layer, chosen) == every
    assert len(chosen) <= 160 < last - first  # tens of steps, not the range
    # The check can fail: without the residue mod 16, one step per config misses keys.
    coarse = vllm_fused_moe.token_counts(
        first, last, lambda n: str(config_of(layer.w13, layer.w2, layer.top_k, None, n))
    )
    assert keys_at(layer, coarse) < every


class _Runner:
    """The runner around the experts: a model of modules, and ``_dummy_run`` recorded."""

    def __init__(self, dtype: Any) -> None:
        import torch

        experts = SimpleNamespace(
            w13_weight=torch.empty(4, 2048, 2048, dtype=dtype, device="meta"),
            w2_weight=torch.empty(4, 2048, 1024, dtype=dtype, device="meta"),
            moe_config=SimpleNamespace(num_experts=4, experts_per_token=2),
        )
        self.model = SimpleNamespace(modules=lambda: [SimpleNamespace(), experts, experts])
        self.ran: list[tuple[int, dict[str, Any]]] = []

    def _dummy_run(self, tokens: int, **kwargs: Any) -> None:
        self.ran.append((tokens, kwargs))


def only_this_warmer() -> Any:
    import pluggy

    from tq_warmup_plugin import hookspecs

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(vllm_fused_moe)
    return pm


def moe_engine(runner: Any, graph_tokens: int, max_tokens: int = 8192) -> Engine:
    return Engine(
        features=compat.release_features(compat.installed_vllm_version()),
        runner_v2=False, pooling=False, spec_method=None, spec_tokens=0,
        draft_probs=False, max_logprobs=20, moe=True, graph_tokens=graph_tokens,
        max_tokens=max_tokens, runner=runner, device="meta",
    )  # fmt: skip


def test_the_warmer_launches_then_runs_vllms_warmup_forward_at_each_chosen_size() -> None:
    """Past the largest CUDA graph (512), the serve-jit Mixtral's 11 sizes: each size's
    launches side by side (the keys of those sizes, of one layer two modules hold), then
    the worker's own compile-size forward at each, for real and serially."""
    import torch

    runner = _Runner(torch.bfloat16)
    assert vllm_fused_moe in plugin_manager(load_entry_points=False).get_plugins()
    with recorded_keys() as seen:
        result = engine_warmup.run(only_this_warmer(), moe_engine(runner, 512), load=False)
    sizes = [tokens for tokens, _ in runner.ran]
    assert sizes == list(range(513, 524)) and runner.ran[0][1] == {
        "skip_eplb": True,
        "remove_lora": False,
    }
    assert result.jobs == {"fused MoE": 11, "MoE warmup forwards": 11} and result.errors == []
    assert result.forwards[:2] == (11, 0)  # the stand-in forward compiles nothing
    layer = experts_of((4, 2, 2048, 1024))
    assert {k for k in seen if k[0] == "fused_moe_kernel"} == keys_at(layer, sizes)


@pytest.mark.parametrize(
    ("dtype", "graph_tokens", "reason"),
    [("float8_e4m3fn", 512, "experts of dtype float8_e4m3fn"), ("bfloat16", 8192, "CUDA graph")],
)
def test_the_warmer_declines_in_one_line(dtype: str, graph_tokens: int, reason: str) -> None:
    import torch

    runner = _Runner(getattr(torch, dtype))
    jobs, declined, errors = engine_warmup.plan(
        only_this_warmer(), moe_engine(runner, graph_tokens)
    )
    assert jobs == [] and errors == [] and len(declined) == 1
    assert reason in declined[0].why and "\n" not in declined[0].why
