"""Contract: the async spec-decode warmer leaves no graph of vLLM's ``torch.compile``d
``update_num_computed_tokens_for_batch_change`` for serving to compile.

The real function of the installed vLLM runs under Dynamo on CPU tensors (inductor's C++
backend here; the graphs and their guards are the device's). The runner is a stand-in
holding the buffers vLLM's V1 runner gives it (``gpu_model_runner.py`` 0.26: int32
``num_computed_tokens``, ``num_accepted_tokens``, ``prev_num_draft_tokens``, int64
``prev_positions``, all ``max_num_reqs`` long). Serving is modelled as ``_prepare_inputs``
calls it: slices of those buffers, and tensors made in inference mode for the drafter's
counts and the CPU's computed tokens. Dynamo's frame counter says what compiled.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest
from realvllm import V1_RUNNER_ONLY, has_v1_runner

from tq_warmup_plugin import compat
from tq_warmup_plugin.warmers import vllm_async_spec

pytestmark = [
    pytest.mark.real_vllm,
    pytest.mark.skipif(not has_v1_runner(), reason=V1_RUNNER_ONLY),
]

MAX_REQS = 32


def _runner() -> Any:
    import torch

    def buffer(dtype: Any) -> Any:
        return SimpleNamespace(gpu=torch.zeros(MAX_REQS, dtype=dtype))

    return SimpleNamespace(
        use_async_spec_decode=True,
        num_computed_tokens=torch.zeros(MAX_REQS, dtype=torch.int32),
        num_accepted_tokens=buffer(torch.int32),
        prev_positions=buffer(torch.int64),
        prev_num_draft_tokens=buffer(torch.int32),
    )


def _serve(runner: Any, correction: Any, requests: int, previous: int) -> None:
    import torch

    with torch.inference_mode():
        correction(
            runner.num_computed_tokens,
            runner.num_accepted_tokens.gpu[:requests],
            runner.prev_positions.gpu[:requests],
            torch.ones(previous, dtype=torch.int32),
            runner.prev_num_draft_tokens.gpu,
            torch.zeros(requests, dtype=torch.int32),
        )


def _compiles() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


SERVED = [(n, m) for n, m in itertools.product([1, 2, 3, 5, 16, 17, MAX_REQS], repeat=2)]
"""Steps of 1 to ``MAX_REQS`` requests after steps of as many: equal sizes, unequal, 1."""


def test_warmed_shapes_leave_serving_nothing_to_compile() -> None:
    import torch._dynamo

    torch._dynamo.reset()
    runner = _runner()
    correction = compat.async_spec_correction(runner)
    assert correction is not None
    for n, m in vllm_async_spec.SHAPES:
        vllm_async_spec.warm_shape(runner, correction, n, m)
    warmed = _compiles()
    assert warmed >= 2  # 1 and past 1 are separate graphs
    for n, m in SERVED:
        _serve(runner, correction, n, m)
    assert _compiles() - warmed == 0


def test_serving_compiles_without_the_warmer() -> None:
    """The check can fail: cold, the same serving compiles graphs."""
    import torch._dynamo

    torch._dynamo.reset()
    runner = _runner()
    correction = compat.async_spec_correction(runner)
    before = _compiles()
    for n, m in SERVED:
        _serve(runner, correction, n, m)
    assert _compiles() - before >= 2


def test_a_synchronous_runner_has_nothing_to_correct() -> None:
    runner = _runner()
    runner.use_async_spec_decode = False
    assert compat.async_spec_correction(runner) is None


def test_graphs_warmed_on_inference_tensors_miss_serving() -> None:
    """Why ``warm_shape`` makes the runner's buffers outside inference mode: Dynamo keys
    a graph on its inputs' dispatch keys, and the same shapes warmed on inference tensors
    left serving every graph to compile (4 of 4, this CPU host, vLLM 0.26.0)."""
    import torch
    import torch._dynamo

    torch._dynamo.reset()
    runner = _runner()
    correction = compat.async_spec_correction(runner)
    with torch.inference_mode():
        for n, m in vllm_async_spec.SHAPES:
            correction(
                runner.num_computed_tokens.clone(),
                runner.num_accepted_tokens.gpu[:n].clone(),
                torch.full((n,), -1, dtype=torch.int64),
                torch.ones(m, dtype=torch.int32),
                runner.prev_num_draft_tokens.gpu.clone(),
                torch.zeros(n, dtype=torch.int32),
            )
    warmed = _compiles()
    for n, m in SERVED:
        _serve(runner, correction, n, m)
    assert _compiles() - warmed >= 2
