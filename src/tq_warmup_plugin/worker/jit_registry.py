"""The plugin's warmup as one registration in vLLM's JIT warmup registry (0.29+).

Why: from 0.29 a worker's ``kernel_warmup`` first compiles every kernel the model runner
registered (``JitWarmupRegistry.warmup``: "JIT kernel warmup (N compile keys)", then
"JIT kernel warmup finished in X s"), and vLLM's own slot-mapping, rejection-sampler and
EAGLE-helper kernels are there (``compat.Features.registry_warms_*``). The plugin's warmup
belongs in that phase, in vLLM's own line and progress bar, rather than beside it: it is
registered as one kernel with one key per ``kernel_warmup`` call, not a key per Triton
binary, because it is one step (the layers found, their keys compiled side by side, the
workspace reserved, the first launches, the engine warmers) whose report counts them
together, and whose TurboQuant keys vLLM's dispatch tracer cannot express (they are read
from the live layers).

The registry aborts vLLM's startup on any exception of a registered kernel
(``kernel_warmup.py`` 0.30:179-186: ``logger.exception``, ``raise``); the plugin's contract
is one WARNING and start anyway. ``install.warm_worker`` keeps it: it raises only in strict
mode, where an abort is what was asked for. Where the registry will not call it
(0.20-0.28, ``enable_jit_warmup`` off) the plugin runs before ``kernel_warmup`` as always,
and where a registry that should have called it did not, right after it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import cache
from typing import Any

from .. import compat

__all__ = ["KEY", "Registration", "register"]

KEY = ("tq-warmup",)
"""The one compile key of a registration."""


class Registration:
    """One ``kernel_warmup`` call's registration: whether vLLM's registry ran it."""

    def __init__(self, run: Callable[[], None]) -> None:
        self.run = run
        self.pending = True

    def compile(self) -> None:
        """Run the warmup once; a registration left by an earlier call (elastic EP calls
        ``kernel_warmup`` again, 0.27+) stays in the registry and does nothing."""
        if self.pending:
            self.pending = False
            self.run()


@cache
def _kernel_class() -> type:
    """``VllmJitKernel`` for the plugin's warmup, made once vLLM's module is imported (a
    subclass of vLLM's own class: ``register()`` must not import vLLM)."""
    base = importlib.import_module(compat.JIT_WARMUP_MODULE).VllmJitKernel

    class TqWarmupKernel(base):  # type: ignore[misc, valid-type]
        """The plugin's warmup in vLLM's registry: one key, ``Registration.compile``."""

        CompileKey = tuple

        def __init__(self, registration: Registration) -> None:
            super().__init__()
            self.registration = registration

        def get_warmup_keys(self) -> list[tuple[str, ...]]:
            return [KEY] if self.registration.pending else []

        def compile(self, compile_key: tuple[str, ...]) -> None:
            self.registration.compile()

    return TqWarmupKernel


def register(worker: Any, feats: compat.Features, run: Callable[[], None]) -> Registration | None:
    """Register ``run`` with the worker's JIT warmup registry, where ``kernel_warmup`` will
    compile it; None where it will not (then the caller runs it itself)."""
    registry = compat.jit_registry(worker, feats)
    if registry is None:
        return None
    registration = Registration(run)
    kernel = _kernel_class()(registration)
    with registry.activate():
        kernel.register_warmup()
    return registration
