"""Contract: the compile-ahead child and ``precompile`` build, on vLLM's own CPU objects, the
keys the engine warmers then launch in the worker, so the worker compiles none of them.

The child runs for real (forked from this process as from a worker: Triton's compile for
sm90) into a fresh Triton cache; then the warmers run in this process on the
contract runner of ``test_contract_vllm_kernels`` (the keys that module holds to serving),
with Triton's compile listener counting compiles and disk loads; over an empty cache the
same launches compile, so the count can fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import fakes
import pytest
import stub_libcuda
from realvllm import V1_RUNNER_ONLY, block_table, clear_vllm_kernel_caches, has_v1_runner
from test_contract_vllm_kernels import VOCAB, engine, fake_runner, feats
from test_contract_vllm_kernels import _driver as _driver  # autouse: sm90, the SM count

import tq_warmup_plugin
from tq_warmup_plugin import compat
from tq_warmup_plugin.vllm_kernels import ahead
from tq_warmup_plugin.vllm_kernels import offline as engine_plan
from tq_warmup_plugin.worker.report import CompileCounter
from tq_warmup_plugin.worker.warmup import plugin_manager

pytestmark = pytest.mark.real_vllm

MAX_LEN, TOKENS, REQS = 4096, 2048, 8  # realvllm.block_table's defaults
V2 = not has_v1_runner()
"""The contract runner is V1's where the release has it (0.20-0.33), else V2's (0.34)."""
RUNNER = "V2" if V2 else "V1"


def request(block_size: int, k: int) -> engine_plan.EngineRequest:
    return engine_plan.EngineRequest(
        features=feats(),
        runner_v2=V2,
        vocab_size=VOCAB,
        model_dtype="bfloat16",
        block_size=block_size,
        max_model_len=MAX_LEN,
        max_num_seqs=REQS,
        max_num_batched_tokens=TOKENS,
        spec_method="ngram" if k else None,
        spec_tokens=k,
    )


def run_child(req: engine_plan.EngineRequest) -> str:
    """The worker's own way: fork this process (vLLM imported) into the real child, which
    builds into this process's ``TRITON_CACHE_DIR``; its report line."""
    ahead.spawn({"request": req.to_dict(), "arch": 90, "processes": 2})
    return ahead.wait(600)


def _per_signature_launchers() -> bool:
    """Triton 3.6 builds a C launcher per kernel signature; 3.7+ one generic launcher."""
    from triton.backends.nvidia import driver

    return hasattr(driver, "make_launcher")


def warm_in_process(block_size: int, k: int) -> CompileCounter:
    """The worker's side: every offline job of the warmers on the contract runner."""
    # The meta device stands in for the GPU's: vLLM's top-k/top-p launcher tiles a CPU
    # tensor otherwise than any other (0.26+), and a worker's logits are on its GPU.
    tables = [] if V2 else [block_table(block_size, MAX_LEN, TOKENS, REQS)]
    eng = engine(fake_runner(tables, device="meta"), v2=V2, k=k)
    jobs, _ = fakes.jobs_of(plugin_manager(load_entry_points=False), eng)
    clear_vllm_kernel_caches()  # an earlier test's binaries in memory would hide a miss
    with CompileCounter() as counter, compat.compile_only_launches(load=False):
        for job in jobs:
            if job.offline and not job.real:
                job.run()
    return counter


def test_after_the_child_the_warmers_compile_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    line = run_child(request(32, 3))
    offline, _, _ = engine_plan.jobs(
        plugin_manager(load_entry_points=False), engine_plan.cpu_engine(request(32, 3))
    )
    assert len(offline) > 0
    assert line.startswith(f"compile-ahead child: {len(offline)} jobs in "), line
    assert "failed" not in line, line
    counter = warm_in_process(32, 3)
    assert counter.loaded > 0
    assert counter.compiled == 0
    # The count can fail: over an empty cache the same launches compile.
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "empty"))
    cold = warm_in_process(32, 3)
    assert cold.compiled == counter.loaded == sum(cold.names.values())  # named, each


def test_the_offline_engine_plans_what_the_worker_plans() -> None:
    """Same jobs (family and configuration) from the CPU engine as from the contract
    runner, but the V1 sampler's torch.compile'd logprobs, which need the worker (0.20-0.33)."""
    pm = plugin_manager(load_entry_points=False)
    offline, declined, errors = engine_plan.jobs(pm, engine_plan.cpu_engine(request(32, 3)))
    tables = [] if V2 else [block_table(32, MAX_LEN, TOKENS, REQS)]
    live, _ = fakes.jobs_of(pm, engine(fake_runner(tables), v2=V2))
    assert errors == []
    assert [(j.family, j.what) for j in offline] == [
        (j.family, j.what) for j in live if j.offline and not j.real
    ]
    assert any(d.family == "logprobs" and "worker" in d.why for d in declined) is not V2


NGRAM = '{"method": "ngram", "num_speculative_tokens": 3}'
# The contract runner's engine, as ``tq-warmup`` flags (a bf16 model: its TurboQuant block is
# 32 on every release, what ``request(32, 3)`` and the runner's table have).
FLAGS = ["--kv-cache-dtype", "turboquant_4bit_nc", "--head-size", "128", "--num-heads", "16",
         "--num-kv-heads", "8", "--dtype", "bfloat16", "--max-model-len", str(MAX_LEN),
         "--max-num-seqs", str(REQS), "--max-num-batched-tokens", str(TOKENS),
         "--vocab-size", str(VOCAB), "--runner", RUNNER.lower(), "--block-size", "32"]  # fmt: skip


def test_inspect_lists_vllms_own_kernels(capsys: pytest.CaptureFixture[str]) -> None:
    from tq_warmup_plugin.cli import commands as cli

    assert cli.main(["inspect", *FLAGS, "--speculative-config", NGRAM, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["vllm_kernels"]
    assert planned["engine"] == f"{RUNNER} runner, ngram k=3"
    assert "top-k/top-p: float32, top-p, 17 rows" in planned["jobs"]
    rejection = [j for j in planned["jobs"] if j.startswith("rejection sampler")]
    assert len(rejection) == (0 if feats().registry_warms_rejection_sampler else 3)
    need_worker = "logprobs: 1 job need the worker: warmed at startup"
    assert (need_worker in planned["not_planned"]) is not V2
    assert cli.main(["inspect", *FLAGS, "--speculative-config", NGRAM]) == 0
    text = capsys.readouterr().out
    head = f"vLLM's own kernels ({RUNNER} runner, ngram k=3): "
    listed = text[text.index(f"\n{head}") :].splitlines()
    assert listed[1] == f"{head}{len(planned['jobs'])} jobs"
    assert listed[2 : 2 + len(planned["jobs"])] == [f"  {job}" for job in planned["jobs"]]
    assert cli.main(["inspect", *FLAGS, "--json"]) == 0  # no speculation: no verify batches
    plain = json.loads(capsys.readouterr().out)["vllm_kernels"]["jobs"]
    assert plain and not any(j.startswith("rejection sampler") for j in plain)
    no_vocab = [f for i, f in enumerate(FLAGS) if "--vocab-size" not in FLAGS[i - 1 : i + 1]]
    assert cli.main(["inspect", *no_vocab, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["vllm_kernels"]["not_planned"] == [
        "need --model or --vocab-size for their keys"
    ]


def test_inspect_for_another_release_plans_its_keys_not_vllms(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """vLLM's own kernels come from the installed vLLM's code: for another release (0.26's
    V1 sampler, which 0.34 removed) they are one line, and TurboQuant's keys are planned."""
    from tq_warmup_plugin.cli import commands as cli

    other = "0.22" if feats().version == (0, 26) else "0.26"
    argv = ["inspect", *FLAGS, "--speculative-config", NGRAM, "--vllm-version", f"{other}.0"]
    assert cli.main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (why,) = out["vllm_kernels"]["not_planned"]
    assert out["distinct"] > 0 and out["vllm_kernels"]["jobs"] == []
    assert "installed vLLM" in why and f"not {other}'s" in why
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert f", vLLM {other}, sm" in text.splitlines()[0]
    assert f"vLLM's own kernels: not planned: {why}" in text


@pytest.mark.parametrize(
    ("spec", "why"),
    [('{"method": "ngram"}', '"num_speculative_tokens" of 1 or more'),
     ("[3]", "not a JSON object"), ("{nope", "is not JSON"),
     ('{"num_speculative_tokens": 2}', 'needs a "method"')],
)  # fmt: skip
def test_a_bad_speculative_config_is_one_line(
    spec: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from tq_warmup_plugin.cli import commands as cli

    with pytest.raises(SystemExit) as exited:
        cli.main(["inspect", *FLAGS, "--speculative-config", spec])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and why in err and len(err.strip().splitlines()) == 1


def test_precompile_ships_them_and_the_worker_compiles_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tq_warmup_plugin.shipped import manifest

    layer = tmp_path / "layer"
    src = str(Path(tq_warmup_plugin.__file__).parents[1])
    argv = [sys.executable, "-m", "tq_warmup_plugin.cli", "precompile", *FLAGS,
            "--speculative-config", NGRAM, "--cache-dir", str(layer)]  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": src}
    libcuda = stub_libcuda.build(tmp_path / "libcuda")  # a GPU host's driver, for the launchers
    env.update(stub_libcuda.env(libcuda) if libcuda is not None else {})
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    offline, _, _ = engine_plan.jobs(
        plugin_manager(load_entry_points=False), engine_plan.cpu_engine(request(32, 3))
    )
    assert f"vLLM's own kernels: {len(offline)} jobs" in done.stdout
    (file,) = manifest.manifest_files(layer)
    listed = manifest.read(file)
    launchers = compat.launcher_dirs(str(layer))
    if libcuda is not None and _per_signature_launchers():  # Triton 3.6: built and shipped
        assert f"host launchers: {len(launchers)};" in done.stdout and launchers, done.stdout
        assert launchers <= set(listed.files)
    else:
        assert not launchers and "host launchers: " in done.stdout, done.stdout
    assert len(json.loads(file.read_text())["vllm_kernels"]) == len(offline)  # the plan
    monkeypatch.setenv("TRITON_CACHE_DIR", str(layer))  # the layer as Triton's own cache
    monkeypatch.delenv("TRITON_CACHE_MANAGER", raising=False)
    counter = warm_in_process(32, 3)
    assert counter.compiled == 0 and counter.loaded > 0
    assert counter.dirs <= set(listed.files)  # every key it loaded, the manifest vouches for


@pytest.mark.once_per_triton
@pytest.mark.skipif(not has_v1_runner(), reason=V1_RUNNER_ONLY)
def test_the_child_ends_after_the_worker_ran_a_parallel_cpu_operator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker whose OpenMP team has run forks the child, whose request's V1 block tables
    (512 rows of 4,096 blocks: a parallel zero-fill) are then built. Without
    ``ahead_child.serial_cpu_ops`` the fork waits forever on the team it did not inherit,
    and ``wait`` kills it at its timeout."""
    import dataclasses

    import torch

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    served = dataclasses.replace(request(16, 0), max_num_seqs=512, max_model_len=65536)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.ones(1 << 22).add_(1)  # the worker's team runs a parallel region
        ahead.spawn({"request": served.to_dict(), "arch": 90, "processes": 2})
        line = ahead.wait(240)
    finally:
        torch.set_num_threads(threads)
    assert line.startswith("compile-ahead child: ") and "failed" not in line, line
