"""Shared fixtures. Real-vLLM tests need ``CUDA_VISIBLE_DEVICES=""`` before vLLM is
imported (else vLLM replaces Triton with placeholders on a GPU-less host)."""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


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
