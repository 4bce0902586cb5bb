"""The token benchmark's tables (markdown) and the cost case's figures. Pure."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

__all__ = ["cost_figures", "render"]


def _f(x: Any, digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def cost_figures(steps: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Per on/off pair (``cost-on-i``, ``cost-off-i``): output tok/s of each and the
    ratio on/off; the mean and the worst ratio."""
    pairs = sorted({name.rsplit("-", 1)[1] for name in steps if name.startswith("cost-")})
    rows = []
    for i in pairs:
        on, off = steps.get(f"cost-on-{i}"), steps.get(f"cost-off-{i}")
        if not on or not off:
            continue
        tokens = sum(len(o["tokens"]) for o in on["outputs"].values())
        rate_on, rate_off = tokens / on["wall_s"], tokens / off["wall_s"]
        rows.append(
            {
                "pair": int(i),
                "tok_s_on": round(rate_on, 1),
                "tok_s_off": round(rate_off, 1),
                "on_over_off": round(rate_on / rate_off, 4),
                "fast_with_cached_off": (off.get("branches") or {}).get("fast_with_cached"),
                "fast_with_cached_on": (on.get("branches") or {}).get("fast_with_cached"),
            }
        )
    ratios = [r["on_over_off"] for r in rows]
    return {
        "pairs": rows,
        "mean_on_over_off": round(statistics.fmean(ratios), 4) if ratios else None,
        "min_on_over_off": min(ratios, default=None),
    }


def _prefix_mixed(verdicts: Mapping[str, Any]) -> list[str]:
    lines = [
        "| step | guard | request | diverged | first divergence | ref margin there "
        "| max abs logprob diff | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for step, v in verdicts.items():
        for name, p in v["per_request"].items():
            lines.append(
                f"| {step} | {'on' if v.get('guard_in_place') else 'off'} | {name} "
                f"| {'yes' if p['diverged'] else 'no'} | {_f(p['first_divergence'])} "
                f"| {_f(p['ref_margin_at_divergence'])} | {_f(p['max_lp_delta'])} "
                f"| {p['verdict']} |"
            )
    lines += [
        "",
        "| step | verdict | noise floor | fast-path calls | of them with cached "
        "context | loop calls | first lost-prefix batch (query, seq lens) |",
        "|---|---|---|---|---|---|---|",
    ]
    for step, v in verdicts.items():
        b = v.get("branches") or {}
        ex = b.get("lost_prefix_example") or {}
        shown = f"{ex.get('query_lens')} / {ex.get('seq_lens')}" if ex else "-"
        lines.append(
            f"| {step} | {v['verdict']} | {_f(v['noise_floor'])} | {b.get('fast')} "
            f"| {b.get('fast_with_cached')} | {b.get('loop')} | {shown} |"
        )
    return lines


def _oracle(verdicts: Mapping[str, Any], rows: Mapping[str, Mapping[str, Any]]) -> list[str]:
    unjudged = ", ".join(verdicts.get("unjudged") or []) or "none"
    lines = [
        f"noise floor (max abs chosen-token logprob diff, FULL one batch vs eager alone): "
        f"{_f(verdicts.get('noise_floor'))}; tolerance over it {_f(verdicts.get('lp_tol'))}",
        f"unjudged (WRONG in the noise row itself): {unjudged}",
        "",
        "| row | feature | against | guard on | max abs logprob diff | diverged (first index) "
        "| guard off | max abs logprob diff | diverged (first index) "
        "| lost-prefix fast-path calls off / on | TQ compiles after startup |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, v in verdicts["rows"].items():
        row = rows.get(name, {})
        cells = [name, str(row.get("feature", "")), str(v.get("reference"))]
        lost = []
        for g in ("on", "off"):
            s = v.get(g)
            if not s:
                cells += [str(v.get("status")) if g == "on" else "-", "-", "-"]
                lost.append("-")
                continue
            div = ", ".join(f"{n} ({i})" for n, i in s["first_divergence"].items()) or "none"
            cells += [s["verdict"], _f(s["max_lp_delta"]), div]
            lost.append(str((s.get("branches") or {}).get("fast_with_cached")))
        compiles = row.get("tq_compiles_after_startup")
        cells += [f"{lost[1]} / {lost[0]}", "-" if compiles is None else str(len(compiles))]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _cost(verdicts: Mapping[str, Any]) -> list[str]:
    lines = [
        "| pair | tok/s guard on | tok/s guard off | on / off | lost-prefix fast-path "
        "calls off / on |",
        "|---|---|---|---|---|",
    ]
    for r in verdicts["pairs"]:
        lines.append(
            f"| {r['pair']} | {r['tok_s_on']} | {r['tok_s_off']} | {r['on_over_off']} "
            f"| {r['fast_with_cached_off']} / {r['fast_with_cached_on']} |"
        )
    lines.append(
        f"\nmean on/off {_f(verdicts['mean_on_over_off'])}, worst {_f(verdicts['min_on_over_off'])}"
    )
    return lines


def render(
    case: str,
    run: Mapping[str, Any],
    verdicts: Mapping[str, Any],
    rows: Mapping[str, Mapping[str, Any]],
) -> str:
    """The case's markdown table under a line naming the run."""
    head = [
        f"# tokens --case {case}: vLLM {run.get('vllm_version')}, {run.get('gpu')}, "
        f"{run.get('date')} (run {run.get('run_id')})",
        "",
    ]
    if case == "oracle":
        body = _oracle(verdicts, rows)
    elif case == "cost":
        body = _cost(verdicts)
    else:
        body = _prefix_mixed(verdicts)
    failed = [
        f"{n}: {r.get('status')} {r.get('error_line') or ''}"
        for n, r in rows.items()
        if r.get("status") != "ok"
    ]
    tail = ["", "Engines that did not finish:", *failed] if failed else []
    return "\n".join(head + body + tail) + "\n"
