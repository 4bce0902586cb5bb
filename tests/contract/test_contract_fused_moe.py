"""Contract: the fused MoE warmer's step sizes, one per ``vllm_fused_moe.signature``,
reach every ``fused_moe_kernel`` key that serving launches over every step size of the
range.

Serving is vLLM's own ``TritonExperts.apply`` (the experts a bf16 MoE layer runs on
Hopper: its config lookup with the H200's tuned JSONs where a shape has one, its
workspaces, expert assignment and both GEMMs), on meta tensors. Triton's
``jit_cache_hook`` records each key and compiles nothing. The stand-ins: the CUDA ops
that fill buffers no key reads (``ops.moe_align_block_size``, ``ops.moe_sum``, the
activation), and the platform's device name. The warmer runs the same code at those
sizes through the worker's own warmup forward (GPU only; the runner is a stand-in here).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial
from types import SimpleNamespace
from typing import Any

import fakes
import pytest
from realvllm import activate_compile_only_driver, recorded_keys

from tq_warmup_plugin import compat
from tq_warmup_plugin.vllm_kernels import run as engine_warmup
from tq_warmup_plugin.vllm_kernels.jobs import Engine
from tq_warmup_plugin.warmers import vllm_fused_moe
from tq_warmup_plugin.worker.warmup import plugin_manager

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

    for op in ("moe_align_block_size", "moe_sum"):
        monkeypatch.setattr(ops, op, lambda *a, **k: None, raising=False)
    monkeypatch.setattr(current_platform, "get_device_name", lambda *a, **k: "NVIDIA H200")


def meta(*shape: int, dtype: Any = None) -> Any:
    import torch

    return torch.empty(*shape, dtype=dtype or torch.bfloat16, device="meta")


def experts_of(shape: tuple[int, int, int, int]) -> compat.MoeExperts:
    e, top_k, hidden, inter = shape
    return compat.MoeExperts((e, 2 * inter, hidden), (e, hidden, inter), e, top_k, "bfloat16")


def serving_keys(shape: tuple[int, int, int, int], sizes: list[int]) -> set[tuple[str, str]]:
    """What vLLM's ``TritonExperts.apply`` asks Triton for, one step of each size, on the
    H200 (``compat.moe_steps``: vLLM's experts on meta tensors)."""
    with recorded_keys() as seen:
        compat.moe_steps(experts_of(shape), sizes, "NVIDIA H200")
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
    every = serving_keys(shape, list(range(first, last + 1)))
    assert serving_keys(shape, chosen) == every
    assert len(chosen) <= 160 < last - first  # tens of steps, not the range
    # The check can fail: one step per config alone misses keys.
    coarse = vllm_fused_moe.token_counts(
        first, last, lambda n: str(config_of(layer.w13, layer.w2, layer.top_k, None, n))
    )
    assert serving_keys(shape, coarse) < every


def triton_method() -> Any:
    """A layer's ``quant_method`` whose kernel runs vLLM's own ``TritonExperts`` (the
    instance is never called: the warmer reads its class)."""
    import importlib

    triton = importlib.import_module(compat.vllm_paths.TRITON_EXPERTS_MODULE).TritonExperts
    return SimpleNamespace(moe_kernel=SimpleNamespace(fused_experts=object.__new__(triton)))


class _Runner:
    """The runner around the experts: a model of modules, and ``_dummy_run`` recorded.
    With ``method``, the experts' ``quant_method`` (else a layer without one)."""

    def __init__(self, dtype: Any, method: Any = None) -> None:
        import torch

        experts = SimpleNamespace(
            w13_weight=torch.empty(4, 2048, 2048, dtype=dtype, device="meta"),
            w2_weight=torch.empty(4, 2048, 1024, dtype=dtype, device="meta"),
            moe_config=SimpleNamespace(num_experts=4, experts_per_token=2),
            quant_method=method,
        )
        self.model = SimpleNamespace(modules=lambda: [SimpleNamespace(), experts, experts])
        self.ran: list[tuple[int, dict[str, Any]]] = []

    def _dummy_run(self, tokens: int, **kwargs: Any) -> None:
        self.ran.append((tokens, kwargs))


def moe_engine(runner: Any, graph_tokens: int, ubatch: bool = False) -> Engine:
    return Engine(
        features=compat.release_features(compat.installed_vllm_version()),
        runner_v2=False, pooling=False, spec_method=None, spec_tokens=0,
        draft_probs=False, max_logprobs=20, moe=True, graph_tokens=graph_tokens,
        max_tokens=8192, runner=runner, device="meta", micro_batches=ubatch,
    )  # fmt: skip


def test_a_worker_on_triton_experts_launches_the_steps_and_runs_no_forward() -> None:
    """Past the largest CUDA graph (512), the serve-jit Mixtral's 5 sizes, one per pair of
    its 10 keys up to 8192 tokens: in a worker whose experts run ``TritonExperts``, each
    size is a compile-only step of vLLM's experts, side by side with the other warmers,
    and the keys are those serving launches at those sizes. No forward runs."""
    import torch

    runner = _Runner(torch.bfloat16, triton_method())
    with recorded_keys() as seen:
        result = engine_warmup.run(
            fakes.bare_manager(vllm_fused_moe), moe_engine(runner, 512), load=False
        )
    assert runner.ran == [] and result.forwards[0] == 0
    assert result.jobs == {"fused MoE": 5} and result.errors == []
    launched = {key for key in seen if key[0] == "fused_moe_kernel"}
    assert launched == serving_keys((4, 2, 2048, 1024), [513, 514, 516, 520, 522])
    assert len(launched) == 10


def test_other_experts_get_vllms_warmup_forward_at_each_chosen_size() -> None:
    """Experts of another backend (here: a layer without a Triton kernel) launch what
    only a forward reaches: the same 5 sizes, each the worker's own compile-size
    forward, run for real and serially by the host, which counts them."""
    import torch

    runner = _Runner(torch.bfloat16, SimpleNamespace(moe_kernel=None))
    assert not compat.moe_runs_triton_experts(runner)
    assert vllm_fused_moe in plugin_manager(load_entry_points=False).get_plugins()
    result = engine_warmup.run(
        fakes.bare_manager(vllm_fused_moe), moe_engine(runner, 512), load=False
    )
    sizes = [tokens for tokens, _ in runner.ran]
    assert sizes == [513, 514, 516, 520, 522] and runner.ran[0][1] == {
        "skip_eplb": True,
        "remove_lora": False,
    }
    assert result.jobs == {"fused MoE": 5} and result.errors == []
    assert result.forwards[:2] == (5, 0)  # the stand-in forward compiles nothing


@pytest.mark.parametrize(
    ("dtype", "graph_tokens", "ubatch", "reason"),
    [
        ("float8_e4m3fn", 512, False, "experts of dtype float8_e4m3fn"),
        ("bfloat16", 8192, False, "CUDA graph"),
        ("bfloat16", 512, True, "microbatches"),
    ],
)
def test_the_warmer_declines_in_one_line(
    dtype: str, graph_tokens: int, ubatch: bool, reason: str
) -> None:
    import torch

    engine = moe_engine(_Runner(getattr(torch, dtype)), graph_tokens, ubatch)
    jobs, declined, errors = engine_warmup.plan(fakes.bare_manager(vllm_fused_moe), engine)
    assert jobs == [] and errors == [] and len(declined) == 1
    assert reason in declined[0].why and "\n" not in declined[0].why


@pytest.mark.parametrize(
    ("mode", "eager", "expected"),
    [("FULL_AND_PIECEWISE", False, 512), ("NONE", False, 0), ("FULL_AND_PIECEWISE", True, 0)],
)
def test_the_eager_range_starts_past_vllms_largest_captured_size(
    mode: str, eager: bool, expected: int
) -> None:
    """``compat.graph_tokens`` on vLLM's own ``CompilationConfig``: a step up to the
    largest captured size is padded into a graph; with graphs off every size is eager."""
    from vllm.config import CompilationConfig, CUDAGraphMode

    graphs = CompilationConfig(
        cudagraph_capture_sizes=[1, 2, 4, 8, 16, 512], cudagraph_mode=CUDAGraphMode[mode]
    )
    config = SimpleNamespace(compilation_config=graphs,
                             model_config=SimpleNamespace(enforce_eager=eager))  # fmt: skip
    assert compat.graph_tokens(config) == expected


def test_steps_on_several_threads_patch_vllms_ops_one_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The warmers run side by side: ``moe_steps`` patches vLLM's ops module, so two
    overlapping steps would save each other's stand-in as the original and leave it in
    the worker. Under its lock no two are inside at once, and the ops are put back."""
    import threading
    import time

    from vllm import _custom_ops as ops

    from tq_warmup_plugin.compat import vllm_moe

    before = ops.moe_align_block_size, ops.moe_sum
    inside, most = [0], [0]
    lock = threading.Lock()
    real = vllm_moe.named_gpu

    @contextlib.contextmanager
    def counted(name: str) -> Iterator[None]:
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.05)
        try:
            with real(name):
                yield
        finally:
            with lock:
                inside[0] -= 1

    monkeypatch.setattr(vllm_moe, "named_gpu", counted)
    layer = experts_of(SHAPES[0])
    with recorded_keys():
        threads = [threading.Thread(target=compat.moe_steps, args=(layer, [513], "NVIDIA H200"))
                   for _ in range(4)]  # fmt: skip
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert most[0] == 1
    assert (ops.moe_align_block_size, ops.moe_sum) == before
