"""Patches vLLM modules as they are imported (``kernel_warmup``, the guards), and undoes it.

It wraps vLLM's ``kernel_warmup`` wherever vLLM calls it, installs the import-time
guards, and puts everything back.

``register()`` must stay cheap and may run before vLLM's worker modules exist, so
each module we adjust is patched right after it is first imported (one meta-path
hook), or at once if it already is: the ``kernel_warmup`` module, whose name every
call-site module that already bound it gets rebound to (``gpu_worker`` imports it by
name at module level, all releases, elastic EP too, 0.27+), and TurboQuant's backend
module for the speculative-decoding guard (``guards/``).
"""

from __future__ import annotations

import importlib.machinery
import logging
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from . import compat, guards, patching
from .settings import Settings
from .vllm_kernels import ahead

# A child of vLLM's "vllm" logger inherits its handlers and format.
logger = logging.getLogger("vllm.tq_warmup_plugin")


def _emit(report: Any, settings: Settings, worker: Any) -> None:
    """The report's line, and its JSON at ``TQ_WARMUP_REPORT``: written by
    ``atomic.write_file`` (never through a link, into a FIFO or into a directory others
    may swap it in: one of this user's that others may write gets the sticky bit, one
    INFO line); a refusal or a failure is one WARNING and startup goes on."""
    from .atomic import UnsafeWrite, write_file
    from .safe_io import printable

    logger.log(logging.WARNING if report.is_problem else logging.INFO, report.line())
    if settings.report_path:
        path = settings.report_path.replace("{rank}", str(getattr(worker, "rank", 0)))
        try:
            claimed = write_file(path, report.to_json().encode())
        except UnsafeWrite as exc:
            logger.warning(
                "tq-warmup: TQ_WARMUP_REPORT=%s: the JSON report is not written (%s)",
                printable(path),
                printable(str(exc)),
            )
        else:
            if claimed:
                logger.info(printable(claimed))


def warm_worker(worker: Any, settings: Settings) -> None:
    """Run the warmup; outside strict mode nothing it does can stop vLLM starting.

    Strict mode (CI) fails startup on a failure, on an error (a failed key, a refused
    layer) and on an unsupported vLLM release: there nothing was warmed either."""
    from .worker.report import Report, error_line
    from .worker.warmup import run

    try:
        report = run(worker, settings)
    except Exception as exc:
        if settings.strict:
            raise
        report = Report(status="failed", reason=error_line(exc))
    _emit(report, settings, worker)
    if settings.strict and (report.status in ("failed", "unsupported") or report.errors):
        raise RuntimeError(f"tq-warmup strict mode: {report.line()}")


def _registered(worker: Any, settings: Settings) -> Any | None:
    """The warmup registered with vLLM's JIT warmup registry (``jit_registry``), or None
    where it runs beside it: 0.20-0.28, ``enable_jit_warmup`` off, an unsupported release
    (whose one line the warmup's report gives), or a registry that refused it (one
    WARNING)."""
    from .worker import jit_registry
    from .worker.report import error_line

    try:
        feats = compat.release_features(compat.installed_vllm_version())
    except compat.UnsupportedRelease:
        return None
    try:
        return jit_registry.register(worker, feats, lambda: warm_worker(worker, settings))
    except Exception as exc:
        logger.warning(
            "tq-warmup: cannot register with vLLM's JIT warmup registry (%s); warming "
            "before kernel_warmup instead",
            error_line(exc),
        )
        return None


def wrap(original: Callable[..., Any], settings: Settings) -> Callable[..., Any]:
    """``original`` with our warmup in it: in vLLM's JIT warmup phase where its registry
    compiles registrations (0.29+), else in front; accepts 0.27+'s ``process_local_only``."""

    @patching.wraps(original)
    def kernel_warmup(worker: Any, *args: Any, **kwargs: Any) -> Any:
        registration = _registered(worker, settings)
        if registration is None:
            warm_worker(worker, settings)
            return original(worker, *args, **kwargs)
        result = original(worker, *args, **kwargs)
        registration.compile()  # a registry that did not run it: once, now (else nothing)
        return result

    return kernel_warmup


Patch = Callable[[ModuleType], object]


def _hook_warmup(source: ModuleType, settings: Settings) -> None:
    """Wrap the defining module's ``kernel_warmup`` and rebind every call site."""
    if getattr(source, "kernel_warmup", None) is not None:
        patching.wrap_function(
            source,
            "kernel_warmup",
            lambda original: wrap(original, settings),
            compat.CALL_SITE_MODULES,
        )


def patches(settings: Settings) -> dict[str, list[Patch]]:
    """What to do to which vLLM module once it has executed, in order."""
    todo: dict[str, list[Patch]] = {compat.WARMUP_MODULE: [lambda m: _hook_warmup(m, settings)]}
    if settings.vllm_kernels and settings.ahead:
        todo.setdefault(ahead.MODULE, []).append(ahead.install)
    for guard in guards.active(settings):
        todo.setdefault(guard.MODULE, []).append(guard.install)
    return todo


class _PatchOnImport:
    """A ``sys.meta_path`` finder that patches a module right after it executes,
    before anyone imports a name from it. (Duck-typed: subclassing
    ``importlib.abc.MetaPathFinder`` would cost register() ~20 ms of imports.)"""

    def __init__(self, todo: dict[str, list[Patch]]) -> None:
        self.todo = todo

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        todo = self.todo.get(fullname)
        if not todo:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            for patch in todo:
                patch(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def install(settings: Settings) -> None:
    """Idempotently patch every module we adjust, now and on later import."""
    todo = patches(settings)
    if not hooked():
        sys.meta_path.insert(0, _PatchOnImport(todo))
    for name, module_patches in todo.items():
        loaded = sys.modules.get(name)
        if loaded is not None:
            for patch in module_patches:
                patch(loaded)


def uninstall() -> None:
    """Remove the import hook, give every call site vLLM's own function back and
    take the guards off."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _PatchOnImport)]
    for guard in guards.every():
        module = sys.modules.get(guard.MODULE)
        if module is not None:
            guard.remove(module)
    worker_module = sys.modules.get(ahead.MODULE)
    if worker_module is not None:
        ahead.remove(worker_module)
    patching.unwrap_function(patching.loaded(compat.CALL_SITE_MODULES), "kernel_warmup")


def hooked() -> bool:
    """Whether the import hook is on ``sys.meta_path`` (``install`` put it there)."""
    return any(isinstance(f, _PatchOnImport) for f in sys.meta_path)


def installed() -> bool:
    """Whether the defining module's ``kernel_warmup`` is currently our wrapper."""
    module = sys.modules.get(compat.WARMUP_MODULE)
    return module is not None and patching.is_ours(module.kernel_warmup)


__all__ = ["hooked", "install", "installed", "uninstall", "warm_worker", "wrap"]
