"""``tq-warmup driver-cache``: fill a fresh CUDA driver JIT cache on this GPU and ship it.

The driver reads ``CUDA_CACHE_PATH`` when CUDA initialises, so the launches run in a
child process started with it set to a fresh stage directory (and ``CUDA_CACHE_MAXSIZE``
at 4 GiB: the default 256 MiB could evict what was just compiled). The child launches
``launches.driver_plan`` -- the FlashAttention-2 calls of the plan ``precompile`` and the
worker use, with FA2 as TurboQuant forces it (``compat.fa2_stand_in``: no engine) -- on
device 0, and reports the GPU's facts. The parent hashes what the driver wrote, writes
the manifest (``driver_cache``) and renames the stage into ``LAYER/driver-cache/<key>``.
An existing entry of the same key that verifies seeds the stage, so a second plan
(another model, preset) adds its modules to the first's.

With ``--engine`` a second child then starts a dummy-weight vLLM engine of the model
(``engine_spec``: the plugin on, as in the fleet's pods) into the same cache and serves a
one-token and a chunk-long prompt, so the entry also holds what vLLM's own warmup and
first requests load. Why: the plan's launches alone miss a module a fresh engine's startup
loads, so an engine given only their entry was still JIT-compiling after two minutes
(vLLM 0.26.0, ``benchmarks/results/driver-cache/README.md``).

It needs the GPU kind and driver version it is for (the driver JIT-compiles for the GPU
it runs on, and a new driver invalidates its cache): unlike ``precompile``, it runs on
one GPU of each kind and driver of the fleet. The children are the only parts that touch
CUDA (``_child``, ``_engine_child``); nothing else here imports torch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..shipped import pins
from ..worker.launches import Launch
from . import compiled, host
from . import entry as driver_cache
from .startup import MAXSIZE

__all__ = ["BuildError", "build", "child_env", "engine_spec", "gpu_facts", "run_launches"]

_ENGINE_GPU_SHARE = 0.85  # the build has the GPU to itself


class BuildError(Exception):
    """A build that cannot be made here; the message is the one line the CLI prints."""


def _fa2() -> tuple[Path, driver_cache.Node]:
    fa2 = host.fa2_library()
    if fa2 is None:
        raise BuildError(
            "vLLM's FlashAttention-2 library (vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so) "
            "is not installed here: nothing for the driver to JIT-compile"
        )
    node = host.read_node("/proc", fa2, hash_fa2=True)
    if node.driver is None:
        raise BuildError(
            "no NVIDIA driver version in /proc/driver/nvidia/version: driver-cache runs on "
            "a GPU of the kind and driver the cache is for"
        )
    return fa2, node


def _seed(root: Path, key: str, node: driver_cache.Node, cache: Path) -> tuple[str, ...]:
    """Copy an existing entry of ``key`` that verifies into ``cache`` (its driver cache, and
    its ``torch.compile`` artifacts beside: another model's graphs stay); its launches."""
    entry = root / key
    try:
        shipped = driver_cache.read(entry)
    except (driver_cache.EntryError, OSError):
        return ()
    if host.match(shipped, node) or driver_cache.file_problems(entry, shipped):
        return ()  # replaced by this build
    driver_cache.copy_entry(entry, shipped, cache)
    artifacts = cache.parent / driver_cache.COMPILED_DIR
    for name, data in compiled.read(entry, shipped):
        artifacts.mkdir(exist_ok=True)
        (artifacts / _content_name(shipped.compiled[name][0])).write_bytes(data)
    return shipped.launches


def _content_name(sha256: str) -> str:
    return f"torch-compile-{sha256[:16]}.bin"


def _name_saved(artifacts: Path) -> None:
    """The engine child's file, named by its content (two builds' never collide, one
    build of the same graphs twice is one file)."""
    import hashlib

    saved = artifacts / driver_cache.COMPILED_FILE
    if saved.is_file():
        saved.replace(artifacts / _content_name(hashlib.sha256(saved.read_bytes()).hexdigest()))


def engine_spec(
    kv_cache_dtype: str,
    dtype: str | None,
    max_model_len: int | None,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    trust_remote_code: bool = False,
    speculative_config: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """What the engine child is given, but the model: ``LLM(...)`` keywords (names as in
    all releases ``EngineArgs``: dummy weights, no tokenizer) and the prompt lengths it
    serves: one token (FA2 runs a one-query call non-causal) and one chunk. One GPU: FA2
    has a module per head size, dtype, causality and split, not per head count, so it
    loads what each tensor-parallel rank of the model loads. ``speculative_config`` (the
    fleet's ``--speculative-config``) picks the runner and the graphs its warmers
    ``torch.compile`` (the V1 rank count, the async correction), which the entry ships
    (``driver.compiled``). ``extra`` (``--engine-args``) adds the fleet's other engine
    arguments, whose names ``cli_flags.engine_args`` checked do not override these."""
    kwargs: dict[str, Any] = {
        **(extra or {}),
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "kv_cache_dtype": kv_cache_dtype,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "gpu_memory_utilization": _ENGINE_GPU_SHARE,
        "trust_remote_code": trust_remote_code,
        "seed": 0,
    }
    if dtype:
        kwargs["dtype"] = dtype
    if max_model_len:
        kwargs["max_model_len"] = max_model_len
    if speculative_config:
        kwargs["speculative_config"] = dict(speculative_config)
    chunk = min(max_num_batched_tokens, (max_model_len or 4096) - 8, 2048)
    return {"engine": kwargs, "prompt_lens": [1, max(2, chunk)]}


def child_env(cache: Path, base: Mapping[str, str]) -> dict[str, str]:
    """A child's environment: ``base`` with the driver writing into ``cache`` (4 GiB, the
    default 256 MiB could evict what was just compiled), none of the plugin's own shipped
    driver cache (its ``register()`` would point the engine elsewhere), and this package
    importable."""
    env = {
        k: v
        for k, v in base.items()
        if k != "CUDA_CACHE_DISABLE" and not k.startswith("TQ_WARMUP_DRIVER_CACHE")
    }
    env.update(CUDA_CACHE_PATH=str(cache), CUDA_CACHE_MAXSIZE=MAXSIZE)
    here = str(Path(__file__).resolve().parents[1])  # the child imports this same package
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
    return env


def _run(what: str, flags: list[str], payload: dict[str, Any], cache: Path, timeout: float) -> Any:
    """One child (``python -m`` this module), its JSON result; a failure is one line."""
    spec = cache.parent / f"{what}.json"
    result = cache.parent / f"{what}-result.json"
    spec.write_text(json.dumps({**payload, "out": str(result)}))
    argv = [sys.executable, "-m", __name__, *flags, str(spec)]
    env = child_env(cache, os.environ)
    try:
        done = subprocess.run(argv, env=env, timeout=timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        raise BuildError(f"the {what} took over {timeout:.0f} s (--timeout)") from None
    try:
        return json.loads(result.read_text())
    except (OSError, ValueError):
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise BuildError(f"the {what} process failed (exit {done.returncode}): {tail[0]}") from None
    finally:
        spec.unlink(missing_ok=True)
        result.unlink(missing_ok=True)


def _run_child(todo: Mapping[Launch, str], scale: float, cache: Path, timeout: float) -> Any:
    payload = {"launches": [x._asdict() for x in todo], "scale": scale}
    return _run("launches", [], payload, cache, timeout)


def _run_engine(model: Path, spec: Mapping[str, Any], cache: Path, timeout: float) -> Any:
    """The engine child over ``model``: the directory itself, or for a config file of
    another name a temporary directory holding it as ``config.json`` (not in the stage,
    which becomes the entry)."""
    with tempfile.TemporaryDirectory(prefix="tq-warmup-engine-model-") as tmp:
        if not model.is_dir():
            shutil.copyfile(model, Path(tmp) / "config.json")
        where = str(model if model.is_dir() else tmp)
        payload = {
            **spec,
            "engine": {**spec["engine"], "model": where},
            "compiled_out": str(
                cache.parent / driver_cache.COMPILED_DIR / driver_cache.COMPILED_FILE
            ),
        }
        return _run("engine", ["--engine"], payload, cache, timeout)


def _hashed(cache: Path) -> dict[str, tuple[str, int]]:
    """What the driver (or the engine child's ``torch.compile``) wrote, hashed (every file
    plain: neither makes links); nothing where the directory is absent."""
    files: dict[str, tuple[str, int]] = {}
    if not cache.is_dir():
        return files
    for name, item in driver_cache.walk(cache):
        if item is None:
            raise BuildError(f"{cache}/{name}: not a plain file")
        size = item.stat(follow_symlinks=False).st_size
        files[name] = (driver_cache.hash_file(cache / name, size), size)
    return files


def _step(text: str) -> None:
    """One progress line on a terminal's stderr (never in a pipe or a log), as the CLI's."""
    if sys.stderr.isatty():
        print(f"tq-warmup: {text} ...", file=sys.stderr, flush=True)


def build(
    layer: Path,
    todo: Mapping[Launch, str],
    scale: float,
    timeout: float,
    engine: tuple[Path, dict[str, Any]] | None = None,
) -> int:
    """Launch ``todo`` into a fresh driver cache and install it under ``layer``; with
    ``engine`` (the model's config file or directory, :func:`engine_spec`) also start
    that engine into it."""
    start = time.perf_counter()
    if not todo:
        raise BuildError("the plan has no FlashAttention-2 launch: nothing to cache")
    _, node = _fa2()
    assert node.driver is not None and node.fa2_sha256 is not None and node.fa2_size is not None
    root = layer / driver_cache.DRIVER_DIR
    staged = driver_cache.stage(root)
    try:
        cache = staged / driver_cache.CACHE_DIR
        cache.mkdir()
        gpu = node.gpus[0] if node.gpus and len(set(node.gpus)) == 1 else None
        earlier: tuple[str, ...] = ()
        if gpu is not None:
            key = driver_cache.entry_key(node.driver, gpu, node.fa2_sha256)
            earlier = _seed(root, key, node, cache)
        _step(f"{len(todo)} FlashAttention-2 launches into a fresh driver cache (minutes)")
        facts = _run_child(todo, scale, cache, timeout)
        if facts["errors"]:
            raise BuildError(f"{len(facts['errors'])} launches failed: {facts['errors'][0]}")
        if engine is not None:
            _step(f"starting a dummy-weight vLLM engine of {engine[0]} into the same cache")
        started = _run_engine(*engine, cache, timeout) if engine is not None else {}
        _name_saved(staged / driver_cache.COMPILED_DIR)
        engine_label = (
            [f"engine {engine[0].name} {engine[1]['engine']['kv_cache_dtype']}"] if engine else []
        )
        gpu = gpu or str(facts["gpu"])
        shipped = driver_cache.DriverManifest(
            driver=node.driver,
            gpu=gpu,
            fa2_sha256=node.fa2_sha256,
            fa2_size=node.fa2_size,
            files=_hashed(cache),
            compute_capability=facts["compute_capability"],
            cuda_runtime=facts["cuda_runtime"],
            cuda_driver_api=facts["cuda_driver_api"],
            launches=tuple(dict.fromkeys([*earlier, *(x.label for x in todo), *engine_label])),
            compiled=_hashed(staged / driver_cache.COMPILED_DIR),
            extra={
                "gpu_cuda_name": facts["gpu"],
                "torch": facts["torch"],
                "vllm": facts["vllm"],
                "launch_s": facts["seconds"],
                **({"engine_s": started} if started else {}),
            },
        )
        (staged / driver_cache.MANIFEST).write_text(shipped.to_json())
        key = driver_cache.entry_key(node.driver, gpu, node.fa2_sha256)
        final = driver_cache.install(staged, root / key)
    finally:
        driver_cache.discard(staged)
    slowest = max(facts["seconds"].items(), key=lambda kv: kv[1], default=("-", 0.0))
    print(
        f"tq-warmup: driver cache for {gpu} (sm{str(shipped.compute_capability).replace('.', '')}, "
        f"driver {node.driver}) in {final}: {len(todo)} FlashAttention-2 launches in "
        f"{sum(facts['seconds'].values()):.1f} s (slowest {slowest[0]}: {slowest[1]:.1f} s), "
        + (f"an engine start {started['startup_s']:.1f} s, " if started else "")
        + _compiled_words(started.get("compiled", {}), shipped)
        + f"{len(shipped.files)} files, {shipped.size / 2**20:.1f} MiB; "
        f"{time.perf_counter() - start:.1f} s in all"
    )
    # The value a pod spec pins this entry with (``TQ_WARMUP_CACHE_PIN``).
    print(pins.line([pins.digest(shipped.to_json().encode())]))
    return 0


def _compiled_words(kinds: Mapping[str, int], shipped: driver_cache.DriverManifest) -> str:
    """The build line's words for the engine's ``torch.compile`` artifacts."""
    if not shipped.compiled:
        return ""
    size = sum(n for _, n in shipped.compiled.values())
    counts = ", ".join(f"{kind} {n}" for kind, n in sorted(kinds.items()))
    return f"torch.compile artifacts {size / 2**10:.0f} KiB ({counts or 'none listed'}), "


# --------------------------------------------------------------------------
# The child: the only code that touches CUDA
# --------------------------------------------------------------------------


def gpu_facts() -> dict[str, Any]:
    """Device 0's name and compute capability, the CUDA runtime torch was built with,
    and ``cuDriverGetVersion`` (from ``libcuda``, no context needed)."""
    import ctypes

    import torch

    api = None
    try:
        value = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(value)) == 0:
            api = value.value
    except OSError:
        pass
    major, minor = torch.cuda.get_device_capability(0)
    try:
        from importlib.metadata import version

        vllm: str | None = version("vllm")
    except Exception:
        vllm = None
    return {
        "gpu": torch.cuda.get_device_name(0),
        "compute_capability": f"{major}.{minor}",
        "cuda_runtime": torch.version.cuda,
        "cuda_driver_api": api,
        "torch": torch.__version__,
        "vllm": vllm,
    }


def run_launches(todo: list[Launch], scale: float) -> dict[str, Any]:
    """Each launch on device 0, one at a time (its seconds are its module's load and,
    on a fresh driver cache, JIT), and the GPU's facts."""
    import torch

    from .. import compat
    from ..worker import launches

    device = torch.device("cuda", 0)
    impls = {"driver-cache": compat.fa2_stand_in(scale)}
    seconds: dict[str, float] = {}
    errors: list[str] = []
    for launch in todo:
        done, took, failed = launches.launch_all({launch: "driver-cache"}, impls, device)
        errors += failed
        if not done and not failed:
            errors.append(f"launch {launch.label}: vLLM's TurboQuant backend has no FlashAttention")
        seconds[launch.label] = round(took, 3)
    return {**gpu_facts(), "seconds": seconds, "errors": errors}


def _child(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    todo = [Launch(**x) for x in spec["launches"]]
    Path(spec["out"]).write_text(json.dumps(run_launches(todo, float(spec["scale"]))))


def _engine_child(spec_path: str) -> None:
    """Start the engine, serve its prompts, write the seconds; exit at once (an engine's
    teardown can hang an interpreter's exit)."""
    spec = json.loads(Path(spec_path).read_text())
    # The engine in this process: exiting then leaves no engine-core process holding the
    # GPU or writing into the stage after it is installed.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    start = time.perf_counter()
    from vllm import LLM, SamplingParams

    llm = LLM(**spec["engine"])
    startup = time.perf_counter() - start
    prompts = [{"prompt_token_ids": [1] * n} for n in spec["prompt_lens"]]
    params = SamplingParams(max_tokens=2, ignore_eos=True, detokenize=False)
    llm.generate(prompts, params, use_tqdm=False)
    took: dict[str, Any] = {
        "startup_s": round(startup, 3),
        "total_s": round(time.perf_counter() - start, 3),
    }
    took["compiled"] = compiled.save(Path(spec["compiled_out"]))
    Path(spec["out"]).write_text(json.dumps(took))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    if sys.argv[1] == "--engine":
        _engine_child(sys.argv[2])
    else:
        _child(sys.argv[1])
