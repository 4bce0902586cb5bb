"""The speculative-decoding setups whose TurboQuant sequence lengths no guard fixes.

``draft_seq_lens`` fixes the V1 draft pass and the batched verify path the verify
batches under async scheduling; what is left (async scheduling where the path does not
serve, the V2 runner's draft_model, the guard turned off) gets one WARNING at warmup,
built here.
"""

from __future__ import annotations

from ..compat import Features

__all__ = ["spec_decode_problem"]


def spec_decode_problem(
    feats: Features,
    method: str | None,
    async_scheduling: bool,
    runner_v2: bool,
    draft_guarded: bool = True,
    verify_batched: bool = False,
) -> str | None:
    """The one-line warning for a speculative-decoding setup whose TurboQuant sequence
    lengths the plugin does not fix, else None. ``method`` is
    ``speculative_config.method`` (None without speculative decoding).

    All causes need TurboQuant to read the CPU bound (``prefill_host_copies``, 0.21+); the
    draft_model causes need ``draft_cpu_seq_lens_stale`` too (it ends where the V2 first
    draft pass takes the bound plus its correction token):
    * async scheduling: the bound "assumes every draft was accepted" (``backend.py``
      0.22:405-409; V1 ``gpu_model_runner.py`` 0.22:1985-1993, V2 takes the scheduler's
      optimistic ``num_computed_tokens``, ``model_runner.py`` 0.33:1534-1542), so after
      a rejected draft a verify batch's ``cached_len`` is too large;
    * draft_model on V2 (0.31+): the first draft pass gets the target's bound
      (``step=0``, ``standalone_ar/speculator.py`` 0.33:230, ``speculator.py``
      0.33:362-368) for queries one token longer, the same -1 as on V1;
    * draft_model on V1 without the guard (``TQ_WARMUP_SPEC_GUARD=0``).

    ``verify_batched`` (the batched verify path serves this worker's layers) retires the
    async cause: the rows take every verify request's length from the device
    ``seq_lens``, which vLLM corrects after a rejected draft, and the requests still in
    the loop are prefill chunks, whose bound is exact. What is left of the bound is a
    drafter's own pass, which can cost acceptance, never a verified token. With nearly
    every draft rejected, batched engines of draft_model on V1 and EAGLE and MTP on V2 stayed
    within the no-spec noise while guard off was WRONG (vLLM 0.26.0,
    ``benchmarks/results/spec/SUMMARY-batched.md``).
    """
    if method is None or not feats.prefill_host_copies:
        return None
    causes = []
    draft_short = method == "draft_model" and feats.draft_cpu_seq_lens_stale
    if draft_short and runner_v2:
        causes.append(
            "the V2 runner's first draft pass reads a CPU sequence length one short of "
            "its query (step=0), so a fresh prompt over 128 tokens crashes "
            '("expanded size ... (0)") and shorter ones attend wrong lengths'
        )
    elif draft_short and not draft_guarded:
        causes.append(
            "extend_all_queries_by_N leaves the CPU sequence lengths one short, so a fresh "
            'prompt over 128 tokens crashes ("expanded size ... (0)"); '
            "TQ_WARMUP_SPEC_GUARD=0 turned the plugin's fix off"
        )
    if async_scheduling and not verify_batched:
        causes.append(
            "TurboQuant reads seq_lens_cpu_upper_bound, which assumes every draft was "
            "accepted, as the exact length: after a rejected draft it attends past the "
            "context (--no-async-scheduling avoids it)"
        )
    if not causes:
        return None
    setup = " with async scheduling" if async_scheduling else ""
    runner = "V2" if runner_v2 else "V1"
    return (
        f"tq-warmup: speculative decoding {method!r}{setup} on the {runner} runner with "
        f"TurboQuant on vLLM {feats.version[0]}.{feats.version[1]}: {'; '.join(causes)}; "
        "the plugin does not fix this"
    )
