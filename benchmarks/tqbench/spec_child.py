"""One spec engine in this process: start it, generate (compared, then timed), write the result.

A child (``spec --child SPEC.json``, which ``spec`` and ``shipped`` start) runs the
engine in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the Triton hooks see every
compile) on a dummy-weight model whose config.json it writes, with a fresh Triton cache
and, on vLLM >= 0.25, the JIT monitor in the mode asked. It writes its result file after
every step, so a child that crashes leaves what it had: the parent reads its status
(:data:`CHILD_FINAL`: a child that got that far; anything else means it died).

Generation: one untimed ``generate`` of all prompts, whose tokens, chosen logprobs and
top-2 margins are compared with the reference; then, per batch size b (``batches``,
default: all prompts), an untimed ``generate`` of b prompts (skipped where it would
repeat the compared one) and ``repeats`` timed ones. ``throughput[b]`` is the best of
those: output tokens over wall seconds. Prefix caching stays vLLM's default, so the
timed passes reuse the prompts' cached blocks and measure mostly decode steps.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.tqbench import engine, entry_point, logs, records
from benchmarks.tqbench.spec_configs import (
    ModelSize,
    SpecConfig,
    eagle_head_config,
    model_config,
)
from benchmarks.tqbench.verdicts import chosen_logprobs
from tq_warmup_plugin import compat

__all__ = [
    "CHILD_FINAL",
    "GUARD_VAR",
    "SPEC_COUNTERS",
    "begin_child",
    "child_argv",
    "child_env",
    "engine_kwargs",
    "generate_all",
    "read_json",
    "read_result",
    "run_child",
    "started",
    "startup_fields",
    "write_models",
]

# A child's own statuses; anything else it left behind means it died on the way.
CHILD_FINAL = ("ok", "startup-failed", "generate-failed")
GUARD_VAR = "TQ_WARMUP_SPEC_GUARD"
# generate(prompts, part) -> (wall seconds, outputs); save(**fields) -> None
Generate = Callable[[Sequence[list[int]], str], tuple[float, dict[str, list[Any]]]]
Save = Callable[..., None]
SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}


def child_env(
    cfg: SpecConfig, work: Path, share_compile_cache: bool, base: Mapping[str, str]
) -> dict[str, str]:
    """A child's environment: ``base`` (the parent's) with the in-process engine, the
    plugin on, the guard's value (unset when ``cfg.spec_guard`` is None, even where
    ``base`` sets it: unset is the plugin's auto), the report file and fresh caches."""
    env = {k: v for k, v in base.items() if k != GUARD_VAR}
    env.update(
        PYTHONUNBUFFERED="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        TQ_WARMUP="1",
        TQ_WARMUP_REPORT=str(work / "tq-warmup-report.json"),
        TRITON_CACHE_DIR=str(work / "triton"),
    )
    if cfg.spec_guard is not None:
        env[GUARD_VAR] = cfg.spec_guard
    if not share_compile_cache:
        env.update(
            VLLM_CACHE_ROOT=str(work / "vllm"), TORCHINDUCTOR_CACHE_DIR=str(work / "inductor")
        )
    return env


def engine_kwargs(
    cfg: SpecConfig,
    opts: Mapping[str, Any],
    model_dir: str,
    monitor_mode: str | None,
    head_dir: str = "",
) -> dict[str, Any]:
    """``LLM(...)`` keywords (names as in 0.22 and 0.26 entrypoints/llm.py and EngineArgs):
    the shared ones, the speculative config, the counters, ``async_scheduling`` if asked."""
    kwargs = engine.engine_kwargs(
        model=model_dir,
        preset=opts["preset"],
        max_model_len=opts["max_model_len"],
        max_num_seqs=opts["max_num_seqs"],
        gpu_mem_util=opts["gpu_mem_util"],
        kv_cache_gib=opts["kv_cache_gib"],
        cudagraph_mode=cfg.cudagraph_mode,
        enforce_eager=cfg.cudagraph_mode is None,
        monitor_mode=monitor_mode,
    )
    kwargs["disable_log_stats"] = False  # LLM.get_metrics(): the acceptance counters
    if opts.get("budget"):  # the chunked-prefill budget a precompiled plan was made for
        kwargs["max_num_batched_tokens"] = opts["budget"]
    if opts.get("async_scheduling") in ("on", "off"):
        kwargs["async_scheduling"] = opts["async_scheduling"] == "on"
    spec = cfg.speculative_config(model_dir, head_dir)
    if spec is not None:
        kwargs["speculative_config"] = spec
    return kwargs


def write_models(cfg: SpecConfig, opts: Mapping[str, Any], work: Path) -> tuple[Path, str]:
    """Write the model's config.json (and an EAGLE head's); (model dir, head dir or "").

    The target is the run's (``opts["method"]``), so the engines without speculation
    load the model the speculating ones verify with: for ``mtp`` a MiMo, whose Qwen2
    attention has biases a Llama has not. vLLM draws dummy weights per parameter from one
    seed (``initialize_dummy_weights``, 0.26 ``weight_utils.py``), so equal shapes give
    equal weights; a Llama reference made every MTP row diverge at token 0 (H200, 0.26.0).
    """
    size = ModelSize(**opts["model_size"])
    model_dir = work / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    config = model_config(cfg.method or opts.get("method"), size, opts["max_model_len"])
    (model_dir / "config.json").write_text(json.dumps(config, indent=1))
    if cfg.method != "eagle":
        return model_dir, ""
    head = work / "eagle-head"
    head.mkdir(parents=True, exist_ok=True)
    head_config = eagle_head_config(size, opts["max_model_len"])
    (head / "config.json").write_text(json.dumps(head_config, indent=1))
    return model_dir, str(head)


def _outputs(outs: Sequence[Any]) -> dict[str, list[Any]]:
    """Token ids, chosen logprobs and top-2 margins of ``LLM.generate``'s outputs."""
    got: dict[str, list[Any]] = {"tokens": [], "logprobs": [], "margins": []}
    for o in outs:
        c = o.outputs[0]
        lps, margins = chosen_logprobs(list(c.token_ids), c.logprobs)
        got["tokens"].append(list(c.token_ids))
        got["logprobs"].append(lps)
        got["margins"].append(margins)
    return got


def _spec_counters(llm: Any) -> dict[str, int] | None:
    counters: dict[str, int] = {}
    with contextlib.suppress(Exception):
        for m in llm.get_metrics():
            key = SPEC_COUNTERS.get(m.name)
            if key is not None:
                counters[key] = counters.get(key, 0) + int(m.value)
    return counters or None


def _runner(llm: Any) -> str | None:
    """``"V2"`` or ``"V1"``: the model runner the worker uses (``compat.worker_uses_v2``:
    ``Worker.use_v2_model_runner`` 0.20-0.33, V2 on 0.34), which decides where the verify
    batch's lengths come from; None unknown."""
    with contextlib.suppress(Exception):
        feats = compat.release_features(compat.installed_vllm_version())
        v2 = llm.collective_rpc(lambda worker: compat.worker_uses_v2(worker, feats))[0]
        return "V2" if v2 else "V1"
    return None


def begin_child(out: Path) -> tuple[dict[str, Any], Save, Any]:
    """A child's first steps: its result (``status`` importing) written to ``out`` at
    once and by every ``save(**fields)`` after, and Triton's hooks recording every
    compile from here on (``recorder.JitRecorder``, before vLLM is imported)."""
    res: dict[str, Any] = {"status": "importing", "entry_point_found": entry_point.found()}

    def save(**fields: Any) -> None:
        res.update(fields)
        records.write_json_atomic(out, res)

    save()
    import triton

    from benchmarks.tqbench.recorder import JitRecorder

    rec = JitRecorder(triton.knobs)
    rec.install()
    return res, save, rec


def started(llm: Any, rec: Any, scale: float) -> Any:
    """After ``LLM(...)``: the dummy weights times ``scale`` (in place: captured CUDA
    graphs read the same tensors), Triton's hook outermost again (vLLM's JIT monitor
    wrapped it at the end of startup), the recorder's phase ``after_startup``; returns
    the engine's ``VllmConfig``."""
    if scale != 1.0:
        llm.apply_model(lambda model: [p.data.mul_(scale) for p in model.parameters()])
    rec.ensure_outermost()
    rec.set_phase("after_startup", "")
    return llm.llm_engine.vllm_config


def startup_fields(vcfg: Any, t0: float) -> dict[str, Any]:
    """What every child records of its started engine: seconds since ``t0``, the GPU,
    vLLM's resolved CUDA-graph mode and async scheduling."""
    return {
        "startup_s": round(time.perf_counter() - t0, 3),
        "gpu": engine.gpu_name(),
        "cudagraph_mode": str(vcfg.compilation_config.cudagraph_mode),
        "async_scheduling": getattr(vcfg.scheduler_config, "async_scheduling", None),
    }


def run_child(spec_path: Path) -> int:
    """Start the engine, generate (compared, then timed per batch size), write the result."""
    spec = json.loads(spec_path.read_text())
    cfg, opts, work = SpecConfig(**spec["config"]), spec["options"], Path(spec["work"])
    res, save, rec = begin_child(Path(spec["result"]))
    import torch
    import triton
    import vllm
    from vllm import LLM, SamplingParams

    from benchmarks.tqbench.recorder import JitRecorder, startup_summary

    has_mode = engine.jit_monitor_support(vllm.__version__)[1]
    model_dir, head_dir = write_models(cfg, opts, work)
    monitor = opts["jit_monitor_mode"] if has_mode else None
    kwargs = engine_kwargs(cfg, opts, str(model_dir), monitor, head_dir)
    save(
        status="starting",
        vllm_version=vllm.__version__,
        triton_version=triton.__version__,
        torch_version=torch.__version__,
        engine_kwargs=kwargs,
    )
    logs.marker(f"spec config={cfg.name} starting engine")
    t0 = time.perf_counter()
    try:
        llm = LLM(**kwargs)
    except Exception as e:
        traceback.print_exc()
        save(
            status="startup-failed",
            error=f"{type(e).__name__}: {e}"[-4000:],
            startup_s=round(time.perf_counter() - t0, 3),
            gpu=engine.gpu_name(),
        )
        return 1
    vcfg = started(llm, rec, float(opts["weight_scale"]))
    logs.marker("startup done")
    report = work / "tq-warmup-report.json"
    save(
        status="generating",
        **startup_fields(vcfg, t0),
        speculative_config=str(vcfg.speculative_config),
        runner=_runner(llm),
        block_size=vcfg.cache_config.block_size,
        plugin_report=json.loads(report.read_text()) if report.is_file() else None,
        startup_jit=startup_summary(rec.phase_events("startup")),
    )
    sp = SamplingParams(
        temperature=0.0,
        max_tokens=opts["max_tokens"],
        logprobs=opts["logprobs"],
        seed=0,
        ignore_eos=True,
        detokenize=False,
    )

    def generate(prompts: Sequence[list[int]], part: str) -> tuple[float, dict[str, list[Any]]]:
        rec.set_phase("generate", part)
        logs.marker(f"phase=generate part={part} begin")
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return time.perf_counter() - t, _outputs(outs)

    try:
        save(**generate_all(spec, opts, generate, save))
    except Exception as e:
        traceback.print_exc()
        save(status="generate-failed", error=f"{type(e).__name__}: {e}"[-4000:])
    events = rec.phase_events("after_startup") + rec.phase_events("generate")
    save(spec_counters=_spec_counters(llm), **JitRecorder.summarize(events))
    return 0 if res["status"] == "ok" else 1


def generate_all(
    spec: Mapping[str, Any], opts: Mapping[str, Any], generate: Generate, save: Save
) -> dict[str, Any]:
    """The compared generate, then the timed ones per batch size; the result's fields."""
    prompts = spec["prompts"]
    speed_prompts = spec.get("speed_prompts") or prompts
    wall, got = generate(prompts, "first")
    save(warm_s=round(wall, 4), **got)
    batches = opts.get("batches") or [len(prompts)]
    repeats = max(1, int(opts.get("repeats") or 1))
    by_batch: dict[str, dict[str, Any]] = {}
    timed: dict[str, Any] = {}
    for b in batches:
        batch = speed_prompts[:b]
        if batch != prompts:  # the compared generate was this one's untimed pass
            generate(batch, f"untimed-b{b}")
        walls = []
        for _ in range(repeats):
            wall, got = generate(batch, f"timed-b{b}")
            walls.append(round(wall, 4))
        n_out = sum(len(ids) for ids in got["tokens"])
        by_batch[str(b)] = {"tok_s": round(n_out / min(walls), 1), "timed_s": walls}
        by_batch[str(b)]["out_tokens"] = n_out
        if opts.get("profile"):  # one more, under torch's profiler: where a step's time goes
            from benchmarks.tqbench import recorder

            with recorder.profiler() as session:
                generate(batch, f"profiled-b{b}")
            by_batch[str(b)]["profile"] = recorder.breakdown(session)
        if batch == prompts:
            timed = {"timed_tokens": got["tokens"], "timed_logprobs": got["logprobs"]}
        save(throughput=by_batch)
    first = by_batch[str(batches[0])]
    return {
        "status": "ok",
        "timed_s": min(first["timed_s"]),
        "out_tokens": first["out_tokens"],
        "tok_s": first["tok_s"],
        "throughput": by_batch,
        **timed,
    }


def child_argv(spec_file: Path) -> list[str]:
    """The command that runs one engine from its spec file (``spec --child``)."""
    return [sys.executable, "-m", "benchmarks.tqbench", "spec", "--child", str(spec_file)]


def read_result(work: Path) -> dict[str, Any]:
    """A child's result file, or ``{}`` when it wrote none (killed, or failed at import)."""
    return read_json(work / "result.json")


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``, or ``{}`` where there is none (missing, cut short, not
    an object)."""
    with contextlib.suppress(OSError, ValueError):
        found = json.loads(path.read_text())
        if isinstance(found, dict):
            return found
    return {}
