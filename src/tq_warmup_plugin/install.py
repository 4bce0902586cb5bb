"""Wraps vLLM's ``kernel_warmup`` wherever vLLM calls it, and puts it back.

``register()`` must stay cheap and may run before vLLM's worker modules exist, so
the defining module is patched when it is first imported (a meta-path hook), and
every call-site module that already bound the name is rebound: ``gpu_worker``
imports it by name at module level (0.20-0.33), elastic EP too (0.27+).
"""

from __future__ import annotations

import functools
import importlib.machinery
import logging
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from . import compat
from .settings import Settings

# A child of vLLM's "vllm" logger inherits its handlers and format.
logger = logging.getLogger("vllm.tq_warmup_plugin")

_ORIGINAL_ATTR = "__tq_warmup_original__"


def _emit(report: Any, settings: Settings, worker: Any) -> None:
    logger.log(logging.WARNING if report.is_problem else logging.INFO, report.line())
    if settings.report_path:
        path = settings.report_path.replace("{rank}", str(getattr(worker, "rank", 0)))
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(report.to_json())


def warm_worker(worker: Any, settings: Settings) -> None:
    """Run the warmup; outside strict mode nothing it does can stop vLLM starting."""
    from .report import Report, error_line
    from .warmup import run

    try:
        report = run(worker, settings)
    except Exception as exc:
        if settings.strict:
            raise
        report = Report(status="failed", reason=error_line(exc))
    try:
        _emit(report, settings, worker)
    except OSError as exc:
        logger.warning("tq-warmup: cannot write the JSON report: %s", exc)
    if settings.strict and (report.status == "failed" or report.errors):
        raise RuntimeError(f"tq-warmup strict mode: {report.line()}")


def wrap(original: Callable[..., Any], settings: Settings) -> Callable[..., Any]:
    """``original`` with our warmup in front; accepts 0.27+'s ``process_local_only``."""

    @functools.wraps(original)
    def kernel_warmup(worker: Any, *args: Any, **kwargs: Any) -> Any:
        warm_worker(worker, settings)
        return original(worker, *args, **kwargs)

    setattr(kernel_warmup, _ORIGINAL_ATTR, original)
    return kernel_warmup


def _patch_loaded(settings: Settings) -> None:
    source = sys.modules.get(compat.WARMUP_MODULE)
    if source is None:
        return
    current = getattr(source, "kernel_warmup", None)
    if current is None:
        return
    original = getattr(current, _ORIGINAL_ATTR, current)
    wrapped = current if original is not current else wrap(original, settings)
    for name in compat.CALL_SITE_MODULES:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "kernel_warmup", None) is original:
            setattr(module, "kernel_warmup", wrapped)  # noqa: B010 (a module, not a class)


class _PatchOnImport:
    """A ``sys.meta_path`` finder that patches the warmup module right after it
    executes, before anyone imports the name from it. (Duck-typed: subclassing
    ``importlib.abc.MetaPathFinder`` would cost register() ~20 ms of imports.)"""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != compat.WARMUP_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        exec_module = loader.exec_module
        settings = self.settings

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            module.kernel_warmup = wrap(module.kernel_warmup, settings)  # type: ignore[attr-defined]

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def install(settings: Settings) -> None:
    """Idempotently hook every call site, now and on later import."""
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport(settings))
    _patch_loaded(settings)


def uninstall() -> None:
    """Remove the import hook and give every call site vLLM's own function back."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _PatchOnImport)]
    for name in compat.CALL_SITE_MODULES:
        module = sys.modules.get(name)
        current = getattr(module, "kernel_warmup", None) if module is not None else None
        original = getattr(current, _ORIGINAL_ATTR, None)
        if original is not None:
            module.kernel_warmup = original  # type: ignore[union-attr]


def installed() -> bool:
    """Whether the defining module's ``kernel_warmup`` is currently our wrapper."""
    module = sys.modules.get(compat.WARMUP_MODULE)
    return module is not None and hasattr(module.kernel_warmup, _ORIGINAL_ATTR)


__all__ = ["install", "installed", "uninstall", "warm_worker", "wrap"]
