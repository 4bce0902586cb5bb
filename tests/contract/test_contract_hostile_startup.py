"""Contract: a vLLM startup with hostile settings still warms, one WARNING per setting.

A fresh process loads the plugin through vLLM's own loader (``register()``) with every
setting wrong at once, then runs the worker's warmup (``install.warm_worker``, what the hook
around ``kernel_warmup`` calls) on a worker stand-in with real TurboQuant impls, compiling
for sm90 on the CPU. It must finish, write nothing into the FIFO it was given, and say each
bad setting in exactly one WARNING that names it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tq_warmup_plugin import compat

pytestmark = pytest.mark.real_vllm

CODE = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stdout)
from realvllm import activate_compile_only_driver, fake_worker, make_impl
activate_compile_only_driver()
from vllm.plugins import load_general_plugins
load_general_plugins()
from tq_warmup_plugin import compat, install
from tq_warmup_plugin.settings import load
feats = compat.release_features(compat.installed_vllm_version())
impls = {"layers.0.attn": make_impl("turboquant_4bit_nc", 128, 8, 2, 32, 1024)}
install.warm_worker(fake_worker(impls, feats, 64), load()._replace(vllm_kernels=False))
print("STARTED", flush=True)
"""

# Each hostile setting, and the words its one WARNING starts with.
HOSTILE = {
    "TQ_WARMUP_THREADS": ("abc", "TQ_WARMUP_THREADS"),
    "TQ_WARMUP_LAUNCH": ("nein", "TQ_WARMUP_LAUNCH"),
    "TQ_WARMUP_CACHE_PIN": ("md5:beef", "TQ_WARMUP_CACHE_PIN item 'md5:beef'"),
    "TQ_WARMUP_VERBOSE": ("1", "TQ_WARMUP_VERBOSE"),  # a variable the plugin does not read
    "TQ_WARMUP_CACHE_LAYERS": ("/nonexistent/layer", "TQ_WARMUP_CACHE_LAYERS"),
    "TQ_WARMUP_DRIVER_CACHE": ("/nonexistent/driver", "TQ_WARMUP_DRIVER_CACHE=/nonexistent"),
}


def test_a_startup_with_every_setting_wrong_warms_and_says_each_once(
    vllm_env: compat.Features, tmp_path: Path
) -> None:
    if vllm_env.version != compat.NEWEST:
        pytest.skip("once, on the newest release: the settings are release-independent")
    fifo = tmp_path / "report.fifo"  # a log collector not started yet
    os.mkfifo(fifo)
    here = Path(__file__).resolve()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TQ_WARMUP")}
    env.update({name: value for name, (value, _) in HOSTILE.items()})
    env.update(
        TQ_WARMUP_REPORT=str(fifo),
        TRITON_CACHE_DIR=str(tmp_path / "triton"),
        CUDA_VISIBLE_DEVICES="",
        VLLM_PLUGINS="tq_warmup",
        PYTHONPATH=os.pathsep.join([str(here.parents[1]), str(here.parents[2] / "src")]),
    )
    done = subprocess.run(
        [sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=300
    )
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and "STARTED" in lines, done.stderr[-3000:]
    warnings = [line for line in lines if line.startswith("WARNING tq-warmup")]
    for name, (_, words) in {**HOSTILE, "TQ_WARMUP_REPORT": ("", "TQ_WARMUP_REPORT=")}.items():
        said = [w for w in warnings if w.startswith(f"WARNING tq-warmup: {words}")]
        assert len(said) == 1, (name, said, warnings)
    warmed = [
        line for line in lines if line.startswith(("INFO tq-warmup: ", "WARNING tq-warmup: "))
    ]
    assert any(" keys" in line and "layers" in line for line in warmed), warmed
