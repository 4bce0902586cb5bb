"""vLLM's ``torch.compile``d correction of async speculative decoding, at each shape class.

With async scheduling and speculative decoding the V1 runner (``use_async_spec_decode``,
0.22-0.33) corrects each step's ``num_computed_tokens`` on the GPU from the previous
step's accepted counts: ``update_num_computed_tokens_for_batch_change``
(``v1/spec_decode/utils.py``), ``torch.compile(dynamic=True)``. Dynamo compiles a graph
the first time each size is 1 or more than 1 (it specializes sizes 0 and 1): this step's
requests and the previous step's. vLLM's startup never calls it (no step has a previous
one), so an in-process Qwen3-Next with MTP k=2 compiled it 3 times over the serve-jit
mix (vLLM 0.26.0, ``benchmarks/results/serve-jit/SUMMARY.md``). vLLM's JIT monitor does
not see these: inductor compiles without a ``@triton.jit`` launch, so a server's log names
none; Triton's compile listener does.

This warmer calls vLLM's own function with copies of the runner's own buffers (their
dtypes, sizes and strides; nothing of the runner is written), in inference mode as
``execute_model`` does (:func:`warm_shape`), for this step's and the previous step's
requests in {1, 2} x {1, 3}: distinct sizes past 1, so no graph assumes two of them
equal (Dynamo's duck sizing).
Not offline: ``torch.compile`` builds for the live device.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import Any

from .. import compat
from ..hookspecs import hookimpl
from ..vllm_kernels.jobs import Declined, Engine, Job

__all__ = ["FAMILY", "PLANNED", "SHAPES", "tq_warmup_engine_jobs", "warm_shape"]

FAMILY = "async spec-decode correction"
PLANNED = (
    "the worker's scheduling decides it: warmed at startup where async scheduling runs a drafter"
)
"""An offline plan's line: async scheduling is settled in the worker's config (0.26 turned it
off for ngram and draft_model, on for MTP), and the graphs are the device's."""
SHAPES = ((1, 1), (1, 3), (2, 1), (2, 3))
"""(this step's requests, the previous step's): each size 1 or past 1, past 1 unequal."""


def warm_shape(runner: Any, correction: Any, requests: int, previous: int) -> None:
    """One call as ``_prepare_inputs`` makes it. Dynamo keys a graph on its inputs'
    dispatch keys too, so each input is what serving passes: slices of the runner's
    buffers, made outside inference mode, as normal tensors; the drafter's int32
    ``valid_sampled_tokens_count`` (``prepare_next_token_ids_padded``) and the input
    batch's int32 computed tokens moved to the device, made in ``execute_model``'s
    inference mode, as inference tensors."""
    import torch

    device = runner.num_computed_tokens.device
    with torch.inference_mode(False):
        computed = runner.num_computed_tokens.clone()
        accepted = runner.num_accepted_tokens.gpu[:requests].clone()
        positions = torch.full((requests,), -1, dtype=runner.prev_positions.gpu.dtype,
                               device=device)  # fmt: skip
        drafts = runner.prev_num_draft_tokens.gpu.clone()
    with torch.inference_mode():
        valid = torch.ones(previous, dtype=torch.int32, device=device)
        cpu_computed = torch.zeros(requests, dtype=torch.int32, device=device)
        correction(computed, accepted, positions, valid, drafts, cpu_computed)


@hookimpl
def tq_warmup_engine_jobs(engine: Engine) -> Iterable[Job | Declined]:
    if not engine.spec_method or engine.runner_v2 or engine.runner is None:
        return []
    if engine.planned:
        return [Declined(FAMILY, PLANNED)]
    correction = compat.async_spec_correction(engine.runner)
    if correction is None:
        return [Declined(FAMILY, "the runner schedules synchronously: nothing to correct")]
    return [
        Job(
            FAMILY,
            f"{n} requests after {m}",
            partial(warm_shape, engine.runner, correction, n, m),
            graphs=True,
            offline=False,
        )
        for n, m in SHAPES
    ]
