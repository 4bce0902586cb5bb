"""The token benchmark's verdicts: each request against its reference, over a noise floor.

Pure. A request's outputs (``tokens``, chosen ``logprobs``, top-2 ``margins``) are
compared with ``verdicts.compare``; the noise floor is the largest chosen-token logprob
difference of the run's noise comparison (the same requests through other batches or
graphs, where the bug cannot fire), and ``verdicts.verdict`` calls a row
``within-noise`` only where every divergence sits at a reference margin within it.

* ``prefix-mixed``: per guard state, each hit of ``mixed`` and of ``control`` against the
  same hit served alone in the same engine; the floor is ``control``'s.
* ``oracle``: every row's ``batch-on`` / ``batch-off`` step against the reference row's
  ``alone`` step (``ref``: eager, each request alone after the prefix is cached again;
  ``ref-mtp`` for the MTP rows; ``ref-nocache`` for the rows without prefix caching);
  the floor is the ``noise`` row's (FULL graphs, one batch, prefix caching off) against
  ``ref-nocache``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from benchmarks.tqbench.verdicts import OK_VERDICTS, compare, verdict

__all__ = ["compare_outputs", "judge_oracle", "judge_prefix_mixed", "noise_floor"]

Outputs = Mapping[str, Mapping[str, Any]]


def _one(row: Mapping[str, Any] | None) -> dict[str, list[Any]]:
    row = row or {}
    return {k: [row.get(k) or []] for k in ("tokens", "logprobs", "margins")}


def compare_outputs(
    ref: Outputs, got: Outputs, lp_tol: float, floor: float | None
) -> dict[str, dict[str, Any]]:
    """Per request of ``ref``: diverged or not, the first divergent index, the
    reference's margin there, the largest logprob difference before it, the verdict."""
    out = {}
    for name in ref:
        cmp = compare(_one(ref[name]), _one(got.get(name)))
        first = cmp["first_divergence"][0] if cmp["first_divergence"] else None
        margins = cmp["divergence_margins"]
        out[name] = {
            "diverged": first is not None,
            "first_divergence": first,
            "ref_margin_at_divergence": margins[0] if margins else None,
            "tokens_differing": cmp["tokens_differing"],
            "max_lp_delta": cmp["max_lp_delta"],
            "verdict": verdict({"status": "ok", "cmp": cmp}, lp_tol, floor),
        }
    return out


def noise_floor(ref: Outputs, noise: Outputs) -> float:
    """The largest chosen-token logprob difference of a noise comparison."""
    deltas = [compare(_one(ref[n]), _one(noise.get(n)))["max_lp_delta"] for n in ref]
    return max((d for d in deltas if d is not None), default=0.0)


def _row_verdict(per: Mapping[str, Mapping[str, Any]], unstable: frozenset[str]) -> str:
    verdicts = [p["verdict"] for n, p in per.items() if n not in unstable]
    if all(v == "equal" for v in verdicts):
        return "equal"
    return "within-noise" if all(v in OK_VERDICTS for v in verdicts) else "WRONG"


def _summary(
    per: Mapping[str, Mapping[str, Any]], unstable: frozenset[str] = frozenset()
) -> dict[str, Any]:
    judged = {n: p for n, p in per.items() if n not in unstable}
    diverged = {n: p for n, p in judged.items() if p["diverged"]}
    deltas = [p["max_lp_delta"] for p in judged.values() if p["max_lp_delta"] is not None]
    return {
        "verdict": _row_verdict(per, unstable),
        "unjudged": sorted(unstable & set(per)),
        "requests": len(per),
        "diverged": sorted(diverged),
        "first_divergence": {n: p["first_divergence"] for n, p in diverged.items()},
        "ref_margin_at_divergence": {n: p["ref_margin_at_divergence"] for n, p in diverged.items()},
        "max_lp_delta": max(deltas, default=None),
        "per_request": dict(per),
    }


def judge_prefix_mixed(
    steps: Mapping[str, Mapping[str, Any]], lp_tol: float
) -> dict[str, dict[str, Any]]:
    """``{"mixed-off": {...}, "control-off": ..., "mixed-on": ..., ...}`` for the
    guard states the run has, each with its floor and the probe's branch counts."""
    judged = {}
    for g in ("off", "on"):
        alone = steps.get(f"alone-{g}")
        if not alone:
            continue
        ref = alone["outputs"]
        control = steps.get(f"control-{g}", {}).get("outputs", {})
        floor = noise_floor(ref, control) if control else None
        for kind in ("mixed", "control"):
            step = steps.get(f"{kind}-{g}")
            if step:
                per = compare_outputs(ref, step["outputs"], lp_tol, floor)
                judged[f"{kind}-{g}"] = {
                    **_summary(per),
                    "noise_floor": floor,
                    "guard_in_place": step.get("guard_in_place"),
                    "branches": step.get("branches"),
                }
    return judged


def _reference_of(name: str) -> str:
    """The reference row a row is judged against: the MTP target's for MTP rows, the
    cache-less one for the rows without prefix caching (``noise``), else ``ref``."""
    if "mtp" in name:
        return "ref-mtp"
    return "ref-nocache" if name in ("noise", "ref") else "ref"


def judge_oracle(rows: Mapping[str, Mapping[str, Any]], lp_tol: float) -> dict[str, Any]:
    """Per row and guard state, the verdict against the row's reference (``ref`` itself
    against ``ref-nocache``: what a lossy cache's hit changes); the noise floor is the
    ``noise`` row against ``ref-nocache`` (FULL graphs and one batch, no hit to lose).
    A request the noise row itself gets WRONG (a decided token changes with batching or
    graphs alone) cannot be judged by this floor: it is listed ``unjudged`` in every row
    and left out of the row verdicts."""
    alone = {n: (r.get("steps") or {}).get("alone") for n, r in rows.items()}
    noise_step = (rows.get("noise", {}).get("steps") or {}).get("batch-on")
    base = alone.get("ref-nocache")
    floor = noise_floor(base["outputs"], noise_step["outputs"]) if base and noise_step else None
    unstable: frozenset[str] = frozenset()
    if base and noise_step:
        noise = compare_outputs(base["outputs"], noise_step["outputs"], lp_tol, floor)
        unstable = frozenset(n for n, p in noise.items() if p["verdict"] not in OK_VERDICTS)
    judged: dict[str, Any] = {}
    for name, row in rows.items():
        if name.startswith("ref") and name != "ref":
            continue
        ref = alone.get(_reference_of(name))
        entry: dict[str, Any] = {"status": row.get("status"), "reference": _reference_of(name)}
        steps = row.get("steps") or {}
        for g, step in (("on", steps.get("batch-on") or steps.get("alone")),
                        ("off", steps.get("batch-off"))):  # fmt: skip
            if ref and step:
                per = compare_outputs(ref["outputs"], step["outputs"], lp_tol, floor)
                entry[g] = {**_summary(per, unstable), "branches": step.get("branches")}
        judged[name] = entry
    return {"noise_floor": floor, "lp_tol": lp_tol, "unjudged": sorted(unstable), "rows": judged}
