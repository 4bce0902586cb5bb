"""The plugin's settings reach vLLM processes on other nodes (``multinode``): unit
tests, and vLLM's real functions that choose which of the head's variables a Ray
process on another node gets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

import tq_warmup_plugin
from tq_warmup_plugin import install, multinode
from tq_warmup_plugin.multinode import forward_to_ray_workers

PREFIXES, NAMES = multinode.RAY_EXTRA_PREFIXES_VAR, multinode.RAY_EXTRA_VARS_VAR


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("", "TQ_WARMUP"),
        ("   ", "TQ_WARMUP"),
        ("MY_", "MY_,TQ_WARMUP"),
        ("MY_, OTHER_,", "MY_, OTHER_,TQ_WARMUP"),
        ("MY_, TQ_WARMUP ", "MY_, TQ_WARMUP "),  # present already: left exactly as it was
    ],
)
def test_csv_items_are_added_once_and_the_users_list_kept(value: str, expected: str) -> None:
    assert multinode.with_csv_items(value, ("TQ_WARMUP",)) == expected


def test_forwarding_adds_our_names_to_vllms_lists_once() -> None:
    env = {PREFIXES: "MY_"}
    forward_to_ray_workers(env)
    forward_to_ray_workers(env)
    assert env == {PREFIXES: "MY_,TQ_WARMUP", NAMES: "TRITON_CACHE_MANAGER"}


def test_register_forwards_even_when_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (PREFIXES, NAMES):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TQ_WARMUP", "0")  # the other nodes must be told so too
    monkeypatch.setattr(tq_warmup_plugin, "_registered", False)
    monkeypatch.setattr(install, "install", lambda settings: None)
    tq_warmup_plugin.register()
    assert os.environ[PREFIXES] == "TQ_WARMUP"
    assert os.environ[NAMES] == "TRITON_CACHE_MANAGER"


CHILD = """
import json, os, sys
if sys.argv[1] == "plugins":
    from vllm.plugins import load_general_plugins
    load_general_plugins()
from vllm.ray.ray_env import get_env_vars_to_copy
from vllm.v1.executor.ray_env_utils import get_driver_env_vars
# What RayDistributedExecutor (0.20-0.32) and the data-parallel engine-core actors
# (all releases) send: the chosen names that are set.
names = get_env_vars_to_copy(destination="test")
print(json.dumps({
    "copied": {n: os.environ[n] for n in names if n in os.environ},
    "v2": get_driver_env_vars(set()),  # RayExecutorV2 (0.21-0.32 default, 0.33 only)
}))
"""

HEAD = {
    "TQ_WARMUP": "1",
    "TQ_WARMUP_STRICT": "1",
    "TQ_WARMUP_CACHE_LAYERS": "/opt/triton-cache",
    "TRITON_CACHE_MANAGER": "tq_warmup_plugin.layered_cache:LayeredCacheManager",
}


def _head(plugins: str, **extra: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TQ_", "VLLM_", "TRITON_"))}
    env.update(HEAD, CUDA_VISIBLE_DEVICES="", VLLM_PLUGINS=plugins, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path[1:] if p)
    load = "plugins" if plugins else "none"
    done = subprocess.run(
        [sys.executable, "-c", CHILD, load], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.real_vllm
def test_vllms_ray_copy_takes_our_variables_with_the_plugin_only() -> None:
    mine = {"VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY": "MY_", "MY_SETTING": "x"}
    with_plugin = _head("tq_warmup", **mine)
    without = _head("someone_else", **mine)  # vLLM's loader skips the plugin
    for name, value in HEAD.items():
        assert with_plugin["copied"].get(name) == value, name
        assert name not in without["copied"], name
    # The user's own list still works, with or without the plugin.
    assert with_plugin["copied"]["MY_SETTING"] == without["copied"]["MY_SETTING"] == "x"
    # RayExecutorV2 passes the head's whole environment either way.
    for result in (with_plugin, without):
        assert all(result["v2"].get(name) == value for name, value in HEAD.items())


@pytest.mark.real_vllm
def test_a_disabled_plugin_still_sends_tq_warmup_0() -> None:
    result = _head("tq_warmup", TQ_WARMUP="0")
    assert result["copied"].get("TQ_WARMUP") == "0"
