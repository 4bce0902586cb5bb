"""Contract: the draft-prefill warmer compiles every key vLLM's V2 draft_model speculator
launches for its first pass (0.31+).

The serving side is vLLM's own ``prepare_prefill_inputs`` (found by ``compat.draft_prefill``)
over input batches that vLLM's ``InputBatch.make_dummy`` builds on vLLM's ``InputBuffers``, as
the runner's input batch hands them over: 1 to 16 requests, longest queries of 1 to 2,048
tokens. It runs on CPU tensors under a compile-only sm90 driver, Triton's ``jit_cache_hook``
recording each launch's key. Only the speculator is a stand-in: vLLM's ``InputBuffers`` and
the buffers and constants its ``__init__`` makes.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import fakes
import pytest
from realvllm import activate_compile_only_driver, recorded_keys

from tq_warmup_plugin import compat
from tq_warmup_plugin.vllm_kernels.jobs import Engine
from tq_warmup_plugin.warmers import vllm_draft_prefill


def feats() -> compat.Features:
    return compat.release_features(compat.installed_vllm_version())


def _has_kernel() -> bool:
    version = compat.parse_version(compat.installed_vllm_version())
    return version is not None and compat.features(version).v2_draft_prefill_kernel


pytestmark = [
    pytest.mark.real_vllm,
    pytest.mark.skipif(not _has_kernel(), reason="0.31+: the V2 runner's draft_model"),
]

MAX_LEN, TOKENS, REQS = 4096, 2048, 16
STEPS = [(1, 1), (1, 2), (3, 5), (1, 3), (2, 12), (2, 14), (16, 16), (4, 120), (1, 30),
         (1, 31), (1, 126), (1, 127), (5, 300), (1, 254), (1, 255), (2, 700), (1, 2048),
         (16, 2048)]  # fmt: skip
"""``(requests, tokens)``: ``make_dummy`` spreads the tokens evenly, so each step's longest
query is ``ceil(tokens / requests)``: every block from 4 to the cap of 512, on both sides
of each power of two."""


@pytest.fixture(autouse=True)
def _driver() -> None:
    activate_compile_only_driver()


def speculator(tokens: int = TOKENS) -> Any:
    import torch
    from vllm.v1.worker.gpu.input_batch import InputBuffers

    cpu = torch.device("cpu")
    return SimpleNamespace(
        input_buffers=InputBuffers(REQS, tokens, cpu),
        expanded_input_ids=torch.zeros(tokens + REQS, dtype=torch.int32),
        expanded_positions=torch.zeros(tokens + REQS, dtype=torch.int64),
        last_token_indices=torch.zeros(REQS, dtype=torch.int64),
        max_num_reqs=REQS,
        max_model_len=MAX_LEN,
        max_num_tokens=tokens,
    )


def serve(spec: Any, steps: list[tuple[int, int]]) -> set[tuple[str, str]]:
    """What ``propose``'s first pass launches for each step (``prepare_prefill_inputs``
    with the runner's input batch and the speculator's buffers)."""
    import torch
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    found = compat.draft_prefill(SimpleNamespace(speculator=spec))
    assert found is not None
    launcher, _ = found
    runner_buffers = InputBuffers(REQS, spec.max_num_tokens, torch.device("cpu"))
    with recorded_keys() as seen:
        for reqs, tokens in steps:
            batch = InputBatch.make_dummy(reqs, tokens, runner_buffers)
            launcher(
                input_buffers=spec.input_buffers,
                input_batch=batch,
                last_sampled=torch.zeros(REQS, 1, dtype=torch.int64),
                num_rejected=torch.zeros(reqs, dtype=torch.int64),
                expanded_input_ids=spec.expanded_input_ids,
                expanded_positions=spec.expanded_positions,
                last_token_indices=spec.last_token_indices,
                max_num_reqs=spec.max_num_reqs,
                max_model_len=spec.max_model_len,
            )
    return seen


def request() -> Any:
    """The engine arguments of the served batches: V2, draft_model k=3."""
    from tq_warmup_plugin.vllm_kernels import offline as engine_plan

    return engine_plan.EngineRequest(
        features=feats(), runner_v2=True, vocab_size=1000, model_dtype="bfloat16",
        block_size=16, max_model_len=MAX_LEN, max_num_seqs=REQS,
        max_num_batched_tokens=TOKENS, spec_method="draft_model", spec_tokens=3,
    )  # fmt: skip


def built(eng: Engine) -> set[tuple[str, str]]:
    """The keys the warmer's jobs for ``eng`` launch."""
    jobs, declined = fakes.jobs_of(fakes.bare_manager(vllm_draft_prefill), eng)
    assert declined == [] and jobs
    with recorded_keys() as seen:
        for job in jobs:
            with compat.compile_only_launches(load=False):
                job.run()
    return seen


def warmed(spec: Any) -> set[tuple[str, str]]:
    """The worker's warmup: the engine of ``request()`` on a runner holding ``spec``."""
    from tq_warmup_plugin.vllm_kernels import offline as engine_plan

    live = SimpleNamespace(speculator=spec)
    return built(dataclasses.replace(engine_plan.cpu_engine(request()), runner=live, planned=False))


def test_the_warmer_covers_every_first_pass_a_step_launches() -> None:
    spec = speculator()
    served = serve(spec, STEPS)
    assert {name for name, _ in served} == {"_prepare_prefill_inputs_kernel"}
    assert len(served) == len(vllm_draft_prefill.blocks(TOKENS)) == 8
    ours = warmed(spec)
    assert served <= ours, sorted(served - ours)


def test_the_keys_follow_the_longest_query() -> None:
    """The check can fail: a budget of 126 tokens warms blocks up to 128, and a step of 127
    tokens launches the 256 block, which that warmup lacks."""
    small = speculator(126)
    big = serve(speculator(), [(1, 127)])
    assert not big <= warmed(small)
    assert serve(small, [(1, 126)]) <= warmed(small)


def test_the_offline_speculator_builds_what_serving_launches() -> None:
    """``precompile`` and the compile-ahead child rebuild the speculator from the engine
    arguments (``offline_speculator``, meta tensors): their jobs cover the keys the served
    batches above launch on the worker's buffers."""
    from tq_warmup_plugin.vllm_kernels import offline as engine_plan

    offline = engine_plan.cpu_engine(request())
    jobs, _ = fakes.jobs_of(fakes.bare_manager(vllm_draft_prefill), offline)
    assert all(job.offline for job in jobs)
    served = serve(speculator(), STEPS)
    ours = built(offline)
    assert served <= ours, sorted(served - ours)
