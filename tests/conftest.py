"""Shared fixtures. Real-vLLM tests need ``CUDA_VISIBLE_DEVICES=""`` before vLLM is
imported (else vLLM replaces Triton with placeholders on a GPU-less host)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
# Under pytest-xdist each worker compiles into its own Triton cache below the caller's, so
# a test that expects a kernel to compile never finds it compiled by the other worker.
if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("TRITON_CACHE_DIR"):
    os.environ["TRITON_CACHE_DIR"] = os.path.join(
        os.environ["TRITON_CACHE_DIR"], os.environ["PYTEST_XDIST_WORKER"]
    )

HAVE_VLLM = importlib.util.find_spec("vllm") is not None

# vLLM inspects a model class in a child process (a vLLM import, 10-15 s on 2 cores) the
# first time it meets it, and keeps the result in VLLM_CACHE_ROOT/modelinfos; the tests
# meet these classes in about 20 such children. One child inspects them all first, through
# vLLM's own inspection and cache, so those tests find them cached.
MODEL_ARCHITECTURES = {
    "EagleLlamaForCausalLM",
    "MiMoForCausalLM",
    "MiMoMTPModel",
    "NemotronHForCausalLM",
}  # besides those of the test data's config.json files
_FILL_MODEL_INFO_CACHE = """
import json, sys
from vllm.model_executor.models import registry

registry._run_in_subprocess = lambda fn: fn()  # in this child, not one more each
for arch in json.loads(sys.argv[1]):
    model = registry.ModelRegistry.models.get(arch)
    if isinstance(model, registry._LazyRegisteredModel):
        model.inspect_model_cls()
"""


def pytest_sessionstart(session: pytest.Session) -> None:
    """Fill vLLM's model info cache once (in the xdist controller, before the workers)."""
    if not HAVE_VLLM or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if session.config.getoption("markexpr", "") == "not real_vllm":
        return
    archs = set(MODEL_ARCHITECTURES)
    for config in (Path(__file__).parent / "data").rglob("config.json"):
        with contextlib.suppress(ValueError, OSError):
            archs.update(json.loads(config.read_text()).get("architectures") or [])
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-c", _FILL_MODEL_INFO_CACHE, json.dumps(sorted(archs))],
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode:  # the tests inspect what they need themselves, as before
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"vLLM's model info cache not filled: {done.stderr[-2000:]}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAVE_VLLM:
        return
    skip = pytest.mark.skip(reason="vLLM is not installed (see docs/testing.md)")
    for item in items:
        if "real_vllm" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _without_the_callers_tq_warmup() -> Iterator[None]:
    """No test sees a ``TQ_WARMUP*`` variable the caller exported (``TQ_WARMUP=0`` would
    turn the plugin off in every subprocess); each test sets its own. Session scope, so
    module fixtures and subprocesses started by any test see the cleaned environment."""
    with pytest.MonkeyPatch.context() as mp:
        for name in [name for name in os.environ if name.startswith("TQ_WARMUP")]:
            mp.delenv(name)
        yield


@pytest.fixture(autouse=True)
def _plugin_hooks_restored() -> Iterator[None]:
    """Each test leaves the plugin's import hook as it found it. A test that lets vLLM
    load its plugins in-process (``EngineArgs.create_model_config`` does) installs this
    plugin's hook and guards for the rest of the session; a later test that installs its
    own, on stand-in modules, then found one in place and patched nothing."""
    from tq_warmup_plugin import install

    before = install.hooked()
    yield
    if not before and install.hooked():
        install.uninstall()


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    """Each test leaves ``os.environ`` as it found it. ``cli.main()`` run in-process sets
    ``VLLM_LOGGING_LEVEL=ERROR`` and ``TRITON_CACHE_DIR`` for its own (normally
    short-lived) process; left behind, the first silenced the plugin's WARNING lines in
    later tests' child processes."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def vllm_env() -> Any:
    from realvllm import activate_compile_only_driver

    activate_compile_only_driver()
    import torch
    from vllm.v1.worker import workspace

    # A workspace resize frees cached accelerator memory, which a CPU host lacks.
    torch.accelerator.empty_cache = lambda: None

    from tq_warmup_plugin import compat

    feats = compat.release_features(compat.installed_vllm_version())
    if not workspace.is_workspace_manager_initialized():
        workspace.init_workspace_manager(torch.device("cpu"))
    return feats


Log = Callable[[], list[tuple[int, str]]]


@pytest.fixture
def log(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> Iterator[Log]:
    """(level, message) of the plugin's records so far, even where vLLM's logging
    config stops propagation."""
    logger = logging.getLogger("vllm.tq_warmup_plugin")
    monkeypatch.setattr(logger, "propagate", False)
    caplog.set_level(logging.INFO, logger=logger.name)
    logger.addHandler(caplog.handler)
    yield lambda: [(r.levelno, r.getMessage()) for r in caplog.records]
    logger.removeHandler(caplog.handler)
