"""One token-oracle engine in this process: start it, run its steps, write what it served.

A child (``tokens --child SPEC.json``) runs vLLM's engine in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the Triton hooks see every compile, and the
prefix-cache guard is a class attribute of this process's ``TurboQuantAttentionImpl``,
so a step can turn it on or off between two ``generate`` calls of the same engine (the
same weights, graphs and caches: the guard is the only difference). TurboQuant's
prefill branch runs outside CUDA graphs (``UNIFORM_BATCH``: the graphs are of decode
batches), so a step sees the state it asked for.

A probe under the guard counts, per step, the ``_prefill_attention`` calls vLLM's test
sends to the fast path (``max_query_len == max_seq_len``), those among them whose batch
has a request with cached context (the #46460 event: a lost prefix), and the calls that
take the per-request loop; it keeps the lengths of the first event.
"""

from __future__ import annotations

import functools
import itertools
import json
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.tqbench import engine, spec_child
from benchmarks.tqbench.spec_configs import FULL, SpecConfig
from benchmarks.tqbench.tokens_workload import EngineRow, Request, Step
from benchmarks.tqbench.verdicts import chosen_logprobs

__all__ = ["BranchProbe", "engine_kwargs", "finish", "run_child", "start_engine"]


class BranchProbe:
    """Counts where vLLM's ``_prefill_attention`` sends each batch (see the module doc)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.example: dict[str, Any] | None = None

    def reset(self) -> dict[str, Any]:
        """The counts so far (and the first lost-prefix batch), then start again."""
        out = {**self.counts, "lost_prefix_example": self.example}
        self.counts, self.example = {"fast": 0, "fast_with_cached": 0, "loop": 0}, None
        return out

    def see(self, meta: Any) -> None:
        from tq_warmup_plugin.guards.prefix_fast_path import first_chunks_only

        if meta.max_query_len != meta.max_seq_len:
            self.counts["loop"] = self.counts.get("loop", 0) + 1
            return
        self.counts["fast"] = self.counts.get("fast", 0) + 1
        qsl, seqs = meta.query_start_loc_cpu, meta.seq_lens_cpu
        if qsl is None or seqs is None or first_chunks_only(qsl, seqs):
            return
        self.counts["fast_with_cached"] = self.counts.get("fast_with_cached", 0) + 1
        if self.example is None:
            q = [int(b) - int(a) for a, b in itertools.pairwise(qsl)]
            self.example = {"query_lens": q, "seq_lens": [int(s) for s in seqs]}

    def install(self, impl_cls: type) -> None:
        """Under vLLM's own method, below the guard (removing the guard leaves it)."""
        inner = impl_cls.__dict__["_prefill_attention"]

        @functools.wraps(inner)
        def _prefill_attention(
            self_: Any, q: Any, k: Any, v: Any, kv: Any, meta: Any, *args: Any, **kwargs: Any
        ) -> Any:
            self.see(meta)
            return inner(self_, q, k, v, kv, meta, *args, **kwargs)

        impl_cls._prefill_attention = _prefill_attention  # type: ignore[attr-defined]


def guard_switch(probe: BranchProbe) -> Callable[[str], bool]:
    """``switch("on"|"off"|"")``: the prefix-cache guard in that state (""; as started),
    the probe beneath it; returns whether the guard is in place."""
    from vllm.v1.attention.backends import turboquant_attn as backend

    from tq_warmup_plugin.guards import prefix_fast_path as guard

    started_on = guard.installed(backend)
    guard.remove(backend)
    probe.install(backend.TurboQuantAttentionImpl)
    if started_on:
        guard.install(backend)

    def switch(state: str) -> bool:
        if state == "on":
            guard.install(backend)
        elif state == "off":
            guard.remove(backend)
        return guard.installed(backend)

    return switch


def engine_kwargs(
    row: EngineRow, opts: dict[str, Any], work: Path, monitor: str | None
) -> dict[str, Any]:
    """``LLM(...)`` keywords of the row: the spec benchmark's, and the row's feature."""
    cfg = SpecConfig(row.name, row.method or None, row.k, None if row.eager else FULL)
    model_opts = {**opts, "method": "mtp" if "mtp" in row.name else None}
    model_dir, head_dir = spec_child.write_models(cfg, model_opts, work)
    kwargs = spec_child.engine_kwargs(cfg, opts, str(model_dir), monitor, head_dir)
    kwargs["enable_prefix_caching"] = row.prefix_caching
    if row.budget:
        kwargs.update(max_num_batched_tokens=row.budget, enable_chunked_prefill=True)
    if row.async_scheduling:
        kwargs["async_scheduling"] = row.async_scheduling == "on"
    if row.gpu_blocks:
        kwargs["num_gpu_blocks_override"] = row.gpu_blocks
    return kwargs


def start_engine(
    row: EngineRow, opts: dict[str, Any], work: Path, save: Any, rec: Any
) -> tuple[Any, Any, dict[str, Any]] | None:
    """The row's engine, started (its keywords and status saved), with the fields every
    serving child records; None, the failure saved, when it does not start."""
    import vllm
    from vllm import LLM

    monitor = opts["jit_monitor_mode"] if engine.jit_monitor_support(vllm.__version__)[1] else None
    kwargs = engine_kwargs(row, opts, work, monitor)
    save(status="starting", vllm_version=vllm.__version__, engine_kwargs=kwargs)
    t0 = time.perf_counter()
    try:
        llm = LLM(**kwargs)
    except Exception as e:
        traceback.print_exc()
        save(status="startup-failed", error=f"{type(e).__name__}: {e}"[-4000:])
        return None
    vcfg = spec_child.started(llm, rec, float(opts["weight_scale"]))
    fields = {
        "status": "serving",
        **spec_child.startup_fields(vcfg, t0),
        "prefix_caching": vcfg.cache_config.enable_prefix_caching,
        "budget": vcfg.scheduler_config.max_num_batched_tokens,
    }
    return llm, vcfg, fields


def _served(outs: list[Any], group: list[Request]) -> dict[str, dict[str, Any]]:
    got: dict[str, dict[str, Any]] = {}
    for req, out in zip(group, outs, strict=True):
        for i, c in enumerate(out.outputs):
            name = req.name if req.n == 1 else f"{req.name}#{i}"
            lps, margins = chosen_logprobs(list(c.token_ids), c.logprobs)
            got[name] = {"tokens": list(c.token_ids), "logprobs": lps, "margins": margins}
    return got


def run_step(
    llm: Any,
    step: Step,
    params: Callable[[int], Any],
    probe: BranchProbe,
    switch: Callable[[str], bool],
) -> dict[str, Any]:
    """One step: the guard's state, then per group a prefix-cache reset, the warm
    prompt, and the group in one ``generate``."""
    guarded = switch(step.guard)
    groups = [[r] for r in step.requests] if step.alone else [step.requests]
    probe.reset()
    served: dict[str, dict[str, Any]] = {}
    wall = 0.0  # the groups' own generate calls, not the resets and warm prompts
    for group in groups:
        llm.reset_prefix_cache()
        if step.warm:
            llm.generate([{"prompt_token_ids": step.warm}], params(1), use_tqdm=False)
        prompts = [{"prompt_token_ids": r.prompt} for r in group]
        t = time.perf_counter()
        outs = llm.generate(prompts, [params(r.n) for r in group], use_tqdm=False)
        wall += time.perf_counter() - t
        served.update(_served(outs, group))
    tokens = sum(len(r.prompt) for r in step.requests)
    return {
        "guard_in_place": guarded,
        "wall_s": round(wall, 4),
        "prompt_tokens": tokens,
        "branches": probe.reset(),
        "outputs": served,
    }


def run_child(spec_path: Path) -> int:
    """Start the engine, run every step, write the result after each."""
    spec = json.loads(spec_path.read_text())
    row, opts, work = EngineRow(**spec["row"]), spec["options"], Path(spec["work"])
    steps = [
        Step(**{**s, "requests": [Request(**r) for r in s["requests"]]}) for s in spec["steps"]
    ]
    res, save, rec = spec_child.begin_child(Path(spec["result"]))
    from vllm import SamplingParams

    from benchmarks.tqbench.recorder import startup_summary

    started = start_engine(row, opts, work, save, rec)
    if started is None:
        return 1
    llm, vcfg, fields = started
    report = work / "tq-warmup-report.json"
    save(
        **fields,
        block_size=vcfg.cache_config.block_size,
        plugin_report=json.loads(report.read_text()) if report.is_file() else None,
        startup_jit=startup_summary(rec.phase_events("startup")),
    )

    def params(n: int) -> Any:
        # vLLM refuses n > 1 with greedy sampling: a temperature of 1e-4 (logits x1e4,
        # just above vLLM's greedy threshold) samples the argmax unless two logits are
        # within ~1e-3; at 0.01 the samples differed from the reference in the noise row
        # too (H200, 0.26.0).
        return SamplingParams(
            temperature=0.0 if n == 1 else 1e-4,
            max_tokens=opts["max_tokens"],
            n=n,
            logprobs=opts["logprobs"],
            seed=0,
            ignore_eos=True,
            detokenize=False,
        )

    probe = BranchProbe()
    steps_out: dict[str, Any] = {}

    def serve_steps() -> None:
        switch = guard_switch(probe)
        for step in steps:
            rec.set_phase("generate", step.name)
            steps_out[step.name] = run_step(llm, step, params, probe, switch)
            save(steps=steps_out)

    return finish(serve_steps, res, save, rec)


def finish(body: Callable[[], None], res: dict[str, Any], save: Any, rec: Any) -> int:
    """Run a started child's ``body``, then save its status and the compiles it saw;
    the child's exit code."""
    from benchmarks.tqbench.recorder import JitRecorder

    try:
        body()
        save(status="ok")
    except Exception as e:
        traceback.print_exc()
        save(status="generate-failed", error=f"{type(e).__name__}: {e}"[-4000:])
    events = rec.phase_events("after_startup") + rec.phase_events("generate")
    save(**JitRecorder.summarize(events))
    return 0 if res["status"] == "ok" else 1
