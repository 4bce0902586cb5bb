"""Contract: the V1 logprobs warmer leaves serving no graph of vLLM's ``torch.compile``d
rank count (``batched_count_greater_than``) to compile.

The real V1 ``Sampler`` of the installed vLLM samples on CPU logits (inductor's C++
backend here; the graphs and their guards are the device's) from a stand-in runner whose
model returns logits of a Qwen3-Next's vocabulary. Serving is modelled as
``execute_model`` samples: in inference mode, batches of 1 to 7 rows. Dynamo's graph
counter says what compiled.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from realvllm import V1_RUNNER_ONLY, has_v1_runner

from tq_warmup_plugin import compat
from tq_warmup_plugin.vllm_kernels.jobs import Engine
from tq_warmup_plugin.warmers import vllm_logprobs

pytestmark = [
    pytest.mark.real_vllm,
    pytest.mark.skipif(not has_v1_runner(), reason=V1_RUNNER_ONLY),
]

VOCAB = 151936  # Qwen3-Next's: the rank count's reduction is looped (``triton_red_*``)


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _engine() -> Engine:
    import torch
    from vllm.v1.sample.sampler import Sampler

    model = SimpleNamespace(
        compute_logits=lambda hidden: torch.zeros(hidden.shape[0], VOCAB, dtype=hidden.dtype)
    )
    runner = SimpleNamespace(
        sampler=Sampler(),
        model=model,
        model_config=SimpleNamespace(get_hidden_size=lambda: 8, dtype=torch.bfloat16),
        device=torch.device("cpu"),
    )
    return Engine(features=compat.release_features(compat.installed_vllm_version()),
                  runner_v2=False, pooling=False, spec_method=None, spec_tokens=0,
                  draft_probs=False, max_logprobs=20, device=runner.device,
                  runner=runner)  # fmt: skip


def _serve(engine: Engine) -> int:
    """Graphs compiled by batches of 1, 2, 3 and 7 rows with logprobs, as served."""
    import torch

    before = _graphs()
    for rows in (1, 2, 3, 7):
        with torch.inference_mode():
            logits = compat.logits_of(engine.runner, rows)
            sampling = compat.sampling_metadata(rows, True, False, engine.device, 5)
            engine.runner.sampler(logits=logits, sampling_metadata=sampling)
    return _graphs() - before


def _reset() -> None:
    import torch._dynamo

    torch._dynamo.reset()


def test_the_warmed_rank_count_is_the_one_serving_runs() -> None:
    _reset()
    engine = _engine()
    before = _graphs()
    vllm_logprobs.warm_v1(engine)
    assert _graphs() - before >= 1
    assert _serve(engine) == 0


def test_a_rank_count_warmed_outside_inference_mode_is_compiled_again() -> None:
    """The check can fail: the same batches sampled outside inference mode (the warmer
    before run AJ) leave serving a graph to compile."""
    _reset()
    engine = _engine()
    runner: Any = engine.runner
    for rows, logprobs in ((2, 1), (3, 2)):
        logits = compat.logits_of(runner, rows)
        sampling = compat.sampling_metadata(rows, True, False, engine.device, logprobs)
        runner.sampler(logits=logits, sampling_metadata=sampling)
    assert _serve(engine) >= 1
