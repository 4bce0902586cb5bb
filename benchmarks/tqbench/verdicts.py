"""Tokens and logprobs against the reference: the spec benchmark's comparison, verdicts, summary.

Every configuration's greedy tokens and chosen-token logprobs are compared with the
reference (eager, no speculative decoding): per prompt the first divergent index, the
number of differing tokens, the largest |logprob difference| over the common prefix,
and the reference's top-1/top-2 margin where a prompt diverges (a tiny margin means a
near-tie, a large one a real error). ``shipped`` and ``spec`` both read this module;
neither imports the other's command.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.tqbench.spec_configs import NOSPEC_FULL, REFERENCE, kind_of

__all__ = [
    "OK_VERDICTS",
    "acceptance",
    "add_comparisons",
    "add_throughput_ratios",
    "chosen_logprobs",
    "compare",
    "summarize",
    "throughput",
    "verdict",
]

OK_VERDICTS = ("equal", "within-noise")
_NOGUARD = "full-noguard"


def chosen_logprobs(
    token_ids: Sequence[int], positions: Sequence[Mapping[int, Any] | None] | None
) -> tuple[list[float | None], list[float | None]]:
    """Per generated token: its logprob, and the margin between the two best logprobs
    at that position (None with fewer than two). Values: vLLM ``Logprob`` or floats."""
    lps: list[float | None] = []
    margins: list[float | None] = []
    for j, tok in enumerate(token_ids):
        pos = positions[j] if positions is not None and j < len(positions) else None
        values = {t: float(getattr(v, "logprob", v)) for t, v in (pos or {}).items()}
        lps.append(values.get(tok))
        best = sorted(values.values(), reverse=True)
        margins.append(best[0] - best[1] if len(best) > 1 else None)
    return lps, margins


def compare(ref: Mapping[str, Any], got: Mapping[str, Any]) -> dict[str, Any]:
    """How far ``got``'s tokens and logprobs are from ``ref``'s (rows with ``tokens``,
    ``logprobs`` and ``margins``: one list per prompt)."""
    ref_t, got_t = ref.get("tokens") or [], got.get("tokens") or []
    first: list[int | None] = []
    differing = compared = 0
    max_lp: float | None = None
    margins: list[float] = []
    at_divergence: list[float | None] = []
    for i, want in enumerate(ref_t):
        have = got_t[i] if i < len(got_t) else []
        length = max(len(want), len(have))
        diff = [j for j in range(length) if j >= min(len(want), len(have)) or want[j] != have[j]]
        differing, compared = differing + len(diff), compared + length
        first.append(diff[0] if diff else None)
        prefix = diff[0] if diff else length
        for a, b in zip(
            _nth(ref, "logprobs", i)[:prefix], _nth(got, "logprobs", i)[:prefix], strict=False
        ):
            if a is not None and b is not None:
                max_lp = max(max_lp or 0.0, abs(a - b))
        margin = _nth(ref, "margins", i)[prefix : prefix + 1] if diff else []
        margins.extend(m for m in margin if m is not None)
        if diff:  # how sure the reference was of the token this engine did not pick
            at_divergence.append(margin[0] if margin else None)
    return {
        "exact": differing == 0 and len(got_t) == len(ref_t),
        "prompts_divergent": sum(d is not None for d in first) + max(0, len(got_t) - len(ref_t)),
        "first_divergence": first,
        "tokens_differing": differing,
        "tokens_compared": compared,
        "max_lp_delta": max_lp,
        "ref_margin_at_divergence": max(margins) if margins else None,
        "divergence_margins": at_divergence,
    }


def _nth(row: Mapping[str, Any], key: str, i: int) -> list[Any]:
    values = row.get(key) or []
    return list(values[i] or []) if i < len(values) else []


def verdict(row: Mapping[str, Any], lp_tol: float, floor: float | None) -> str:
    """``equal``; ``within-noise``; ``WRONG``; or the failure status.

    ``floor`` is how far the no-spec FULL_AND_PIECEWISE engine of the same run is from
    the eager reference: the same attention through other kernels. bf16 logits put
    near-ties one ulp apart, so that engine already picks other tokens than eager where
    the reference's top-1/top-2 margin is that small (seen on the H200, 0.22 and 0.26).
    ``within-noise``: every divergence where the reference's margin is within the floor,
    and no logprob of the common prefix further off than the floor (each + ``lp_tol``).
    """
    cmp = row.get("cmp")
    if row.get("status") != "ok":
        return str(row.get("status"))
    if not cmp:
        return "no-reference"
    delta = cmp.get("max_lp_delta") or 0.0
    if cmp["exact"] and delta <= lp_tol:
        return "equal"
    if floor is None:
        return "WRONG"
    bound = floor + lp_tol
    decided = [m for m in cmp.get("divergence_margins") or [] if m is None or m > bound]
    return "WRONG" if decided or delta > bound else "within-noise"


def add_comparisons(rows: Sequence[dict[str, Any]], lp_tol: float) -> None:
    """Compare every finished row with the reference row; set ``cmp``, ``timed_cmp``
    (the timed generate against the reference), ``verdict`` and ``speedup_vs_ref``."""
    ref = next((r for r in rows if r["name"] == REFERENCE and r.get("status") == "ok"), None)
    for r in rows:
        ok = ref is not None and r.get("status") == "ok"
        r["cmp"] = compare(ref, r) if ok and ref is not None else None
        timed = {"tokens": r.get("timed_tokens"), "logprobs": r.get("timed_logprobs")}
        timed_ok = ok and ref is not None and timed["tokens"] is not None
        r["timed_cmp"] = compare(ref, timed) if timed_ok and ref is not None else None
        base = ref.get("tok_s") if ref else None
        r["speedup_vs_ref"] = round(r["tok_s"] / base, 3) if base and r.get("tok_s") else None
    floor_row = next((r for r in rows if r["name"] == NOSPEC_FULL and r.get("cmp")), None)
    floor = (floor_row["cmp"].get("max_lp_delta") or 0.0) if floor_row else None
    for r in rows:
        r["noise_floor"] = floor
        r["verdict"] = verdict(r, lp_tol, floor)
    add_throughput_ratios(rows)


def throughput(row: Mapping[str, Any], default_batch: int | None = None) -> dict[str, float]:
    """Output tokens/s by batch size (``{"8": 1639.0}``): the row's ``throughput``, or for a
    row from before ``--batch`` its one ``tok_s``, at ``default_batch`` (its prompt count)."""
    by_batch = row.get("throughput")
    if isinstance(by_batch, Mapping):
        return {str(b): float(v["tok_s"]) for b, v in by_batch.items() if v.get("tok_s")}
    if row.get("tok_s") and default_batch:
        return {str(default_batch): float(row["tok_s"])}
    return {}


def add_throughput_ratios(rows: Sequence[dict[str, Any]]) -> None:
    """``over_noguard``: each speculative row's tok/s over the ``full-noguard`` row of
    the same method and k (issue 23's target: the batched path at >= 0.9 of it), and
    ``over_noguard_by_batch`` the same per batch size."""
    by_name = {r["name"]: r for r in rows}
    for r in rows:
        kind, k = kind_of(str(r["name"]))
        base = by_name.get(re.sub(f"{re.escape(kind)}$", _NOGUARD, str(r["name"]))) if k else None
        mine, theirs = throughput(r), throughput(base) if base else {}
        r["over_noguard_by_batch"] = {
            b: round(v / theirs[b], 3) for b, v in mine.items() if theirs.get(b)
        } or None
        top = base.get("tok_s") if base else None
        r["over_noguard"] = round(r["tok_s"] / top, 3) if top and r.get("tok_s") else None


def acceptance(counters: Mapping[str, int] | None) -> str:
    """Accepted over proposed draft tokens, from vLLM's spec-decode counters."""
    if not counters or not counters.get("draft_tokens"):
        return "-"
    return f"{counters.get('accepted_tokens', 0) / counters['draft_tokens']:.2f}"


def summarize(run: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The small summary JSON: per configuration its verdict and figures, and the answers
    (guard off wrong? guard on right? batched path right, and its slowest ratio over the
    unguarded FULL graphs? TurboQuant compiles after startup?)."""
    keep: tuple[str, ...] = ("vllm_version", "gpu", "date", "run_id", "preset", "method")
    keep += ("geometry", "model_size", "layers", "batches", "repeats", "async_scheduling")
    keep += ("prompt_kind",)
    n_prompts = (run.get("prompts") or {}).get("n")
    configs = {}
    for r in rows:
        cmp = r.get("cmp") or {}
        configs[r["name"]] = {
            "verdict": r.get("verdict"),
            "status": r.get("status"),
            "tok_s": r.get("tok_s"),
            "speedup_vs_ref": r.get("speedup_vs_ref"),
            "over_noguard": r.get("over_noguard"),
            "tok_s_by_batch": throughput(r, n_prompts) or None,
            "over_noguard_by_batch": r.get("over_noguard_by_batch"),
            "prompts_divergent": cmp.get("prompts_divergent"),
            "first_divergence": cmp.get("first_divergence"),
            "tokens_differing": cmp.get("tokens_differing"),
            "max_lp_delta": cmp.get("max_lp_delta"),
            "divergence_margins": cmp.get("divergence_margins"),
            "cudagraph_mode": r.get("cudagraph_mode"),
            "runner": r.get("runner"),
            "async_scheduling": r.get("async_scheduling"),
            "acceptance": acceptance(r.get("spec_counters")),
            "tq_compiles_after_startup": r.get("tq_compiles_after_startup"),
            "error_line": r.get("error_line"),
        }

    def verdicts(suffix: str) -> list[Any]:
        return [r.get("verdict") for r in rows if str(r["name"]).endswith(suffix)]

    on, off = verdicts("-full-guard"), verdicts("-full-noguard")
    batched = verdicts("-full-batched")
    if not any(r["name"] == REFERENCE and r.get("status") == "ok" for r in rows):
        on = off = batched = []  # nothing to compare with: no answer either way
    ratios = [
        v
        for r in rows
        if str(r["name"]).endswith("-full-batched")
        for v in (r.get("over_noguard_by_batch") or {}).values()
    ]
    ok_rows = [r for r in rows if r.get("status") == "ok"]
    return {
        "run": {k: run.get(k) for k in keep},
        "configs": configs,
        "guard_off_wrong_or_crashed": all(v not in OK_VERDICTS for v in off) if off else None,
        "guard_on_right": all(v in OK_VERDICTS for v in on) if on else None,
        "batched_right": all(v in OK_VERDICTS for v in batched) if batched else None,
        "batched_min_over_noguard": min(ratios) if ratios else None,
        "noise_floor": next((r.get("noise_floor") for r in rows), None),
        "tq_compiles_after_startup": sum(
            len(r.get("tq_compiles_after_startup") or []) for r in ok_rows
        ),
    }
