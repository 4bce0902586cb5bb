"""One ``serve-jit`` row as an engine in this process (``serve-jit --in-process``).

``python -m benchmarks.tqbench.inproc_mix GIVEN.json`` reads ``{flags, result, seed,
vocab}``: the row's engine flags, which vLLM's own ``EngineArgs`` parser takes as
``vllm serve`` does (a flag this release does not know, ``--jit-monitor-mode`` before
0.25, is dropped and named), its result file, and the mix's seed and vocabulary. It
installs the recorder (:mod:`benchmarks.tqbench.recorder`) before vLLM is imported,
starts ``LLMEngine`` with the engine core in this process (the parent sets
``VLLM_ENABLE_V1_MULTIPROCESSING=0``), then sends :func:`serve_jit_workload.mix` wave by wave,
each request with the sampling its HTTP body asks for. Every compile after startup is
recorded, by kernel, whoever owns it; in ``error`` mode vLLM's monitor raises on the
first one, which ends the mix with that error as the status. The result file is written
at the end and after startup, so a child that dies leaves how far it got.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.tqbench import recorder, records
from benchmarks.tqbench.serve_jit_workload import mix

__all__ = ["engine_args_of", "known_flags", "main", "sampling_of"]

SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "seed", "logprobs", "prompt_logprobs",
                 "n", "stop_token_ids")  # fmt: skip
"""The keys of a mix body that are ``SamplingParams`` fields of the same name."""


def sampling_of(body: dict[str, Any]) -> dict[str, Any]:
    """The ``SamplingParams`` keywords of one ``/v1/completions`` body of the mix (its
    ``ignore_eos`` as ``serve-jit`` sends it; ``return_tokens_as_token_ids`` is the
    server's, not the engine's)."""
    return {"ignore_eos": True, **{k: body[k] for k in SAMPLING_KEYS if k in body}}


def known_flags(flags: Sequence[str], known: set[str]) -> tuple[list[str], list[str]]:
    """``(flags kept, flags dropped)``: a ``--flag VALUE`` pair or a ``--switch`` whose
    flag is not in ``known`` is dropped (with its value, where the next item is not a
    flag)."""
    kept: list[str] = []
    dropped: list[str] = []
    i = 0
    while i < len(flags):
        item = flags[i]
        has_value = i + 1 < len(flags) and not flags[i + 1].startswith("--")
        take = flags[i : i + 2] if has_value else flags[i : i + 1]
        (kept if not item.startswith("--") or item.split("=")[0] in known else dropped).extend(take)
        i += len(take)
    return kept, [f for f in dropped if f.startswith("--")]


def engine_args_of(flags: Sequence[str]) -> tuple[Any, list[str]]:
    """``(vLLM's EngineArgs of flags, the flags this release does not know)``, through
    vLLM's own parser, as ``vllm serve`` reads them."""
    from vllm.engine.arg_utils import EngineArgs

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser  # 0.24+
    except ImportError:  # 0.20-0.23
        from vllm.utils import FlexibleArgumentParser  # type: ignore[no-redef,unused-ignore]

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    kept, dropped = known_flags(flags, set(parser._option_string_actions))
    return EngineArgs.from_cli_args(parser.parse_args(kept)), dropped


def _engine(flags: Sequence[str], result: dict[str, Any]) -> Any:
    from vllm.v1.engine.llm_engine import LLMEngine

    engine_args, result["dropped_flags"] = engine_args_of(flags)
    started = time.perf_counter()
    engine = LLMEngine.from_engine_args(engine_args)
    result["startup_s"] = round(time.perf_counter() - started, 1)
    config = engine.vllm_config
    result["async_scheduling"] = getattr(config.scheduler_config, "async_scheduling", None)
    result["prefix_caching"] = config.cache_config.enable_prefix_caching
    result["chunked_prefill"] = config.scheduler_config.enable_chunked_prefill
    return engine


def _wave(engine: Any, index: int, wave: Sequence[dict[str, Any]]) -> None:
    from vllm import SamplingParams

    for j, body in enumerate(wave):
        prompt = {"prompt_token_ids": body["prompt"]}
        engine.add_request(f"w{index}-{j}", prompt, SamplingParams(**sampling_of(body)))
    while engine.has_unfinished_requests():
        engine.step()


def main(argv: Sequence[str] | None = None) -> int:
    given = json.loads(Path((sys.argv[1:] if argv is None else argv)[0]).read_text())
    written = Path(given["result"])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the hooks see the engine core
    import triton

    rec = recorder.JitRecorder(triton.knobs)
    rec.install()
    result: dict[str, Any] = {"status": "startup-failed", "served": 0, "failed": 0}
    try:
        engine = _engine(given["flags"], result)
    except Exception as exc:
        traceback.print_exc()
        result["error"] = f"{type(exc).__name__}: {exc}"[-500:]
        records.write_json_atomic(written, result)
        return 1
    import vllm

    result.update(status="ok", vllm_version=vllm.__version__)
    startup = rec.phase_events("startup")
    result["startup_compiled"] = sum(e["cache_hit"] is not True for e in startup)
    records.write_json_atomic(written, result)
    rec.ensure_outermost()  # vLLM's monitor wrapped the post-compile hook at its end
    waves = mix(int(given["seed"]), int(given["vocab"]))
    for i, wave in enumerate(waves):
        rec.set_phase(f"wave-{i}", "")
        try:
            _wave(engine, i, wave)
        except Exception as exc:
            traceback.print_exc()
            left = sum(len(w) for w in waves[i:])
            result.update(status="engine-failed", failed=left,
                          error=f"{type(exc).__name__}: {exc}"[-500:])  # fmt: skip
            break
        result["served"] += len(wave)
    after = [e for e in rec.events if e["phase"] != "startup"]
    result["compiled_after_startup"] = [e["kernel"] for e in after if e["cache_hit"] is not True]
    result["loaded_after_startup"] = [e["kernel"] for e in after if e["cache_hit"] is True]
    result["events_after_startup"] = after
    records.write_json_atomic(written, result)
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
