"""vLLM's entry point into the plugin (``register``) and the API for warmer authors.

tq-warmup-plugin compiles vLLM's TurboQuant Triton kernels before serving. vLLM calls
:func:`register` (entry point ``vllm.general_plugins`` / ``tq_warmup``) in every
process it starts. Registration only installs a hook; the work happens in the worker,
inside vLLM's ``kernel_warmup``.

``__all__`` names what a warmer needs (the ``hookimpl`` marker of ``hookspecs``, the
``Geometry`` its ``tq_warmup_keys`` receives, the ``KernelKey`` the built-in warmers
use, the ``Engine`` its ``tq_warmup_engine_jobs`` receives and the ``Job`` or
``Declined`` it returns, the frozen ``Settings``, ``register`` and ``__version__``): the
package's one public surface, with what operators write down (the entry point
``tq_warmup_plugin:register``, the ``tq-warmup`` script ``tq_warmup_plugin.cli:main``,
``TRITON_CACHE_MANAGER=tq_warmup_plugin.layered_cache:LayeredCacheManager`` and the
``TQ_WARMUP*`` settings). Other module paths are internal. All but ``register``
and ``Settings`` load on first access (PEP 562 ``__getattr__``): vLLM imports this
package in every process, and ``hookimpl`` costs pluggy, ``__version__`` the package
metadata (``importlib.metadata`` alone is ~10 ms), neither of which ``register()`` needs.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from .settings import Settings, parse

if TYPE_CHECKING:
    from .geometry import Geometry
    from .hookspecs import hookimpl
    from .keys import KernelKey
    from .vllm_kernels.jobs import Declined, Engine, Job

    __version__: str

__all__ = [
    "Declined",
    "Engine",
    "Geometry",
    "Job",
    "KernelKey",
    "Settings",
    "__version__",
    "hookimpl",
    "register",
]

_DISTRIBUTION = "tq-warmup-plugin"

# Exported on first access: name -> (submodule, attribute).
_LAZY = {
    "Declined": ("vllm_kernels.jobs", "Declined"),
    "Engine": ("vllm_kernels.jobs", "Engine"),
    "Job": ("vllm_kernels.jobs", "Job"),
    "Geometry": ("geometry", "Geometry"),
    "KernelKey": ("keys", "KernelKey"),
    "hookimpl": ("hookspecs", "hookimpl"),
}

_registered = False


def register() -> None:
    """vLLM general-plugin entry point: cheap, idempotent, imports nothing heavy."""
    global _registered
    if _registered:
        return
    _registered = True
    from .multinode import forward_to_ray_workers

    forward_to_ray_workers()  # before the TQ_WARMUP check: TQ_WARMUP=0 must travel too
    settings, problems = parse()
    logger = logging.getLogger("vllm.tq_warmup_plugin")
    for problem in problems:
        logger.warning(problem)
    if os.environ.get("TQ_WARMUP_CACHE_PIN"):  # its problems said: not again at each read
        from .shipped import pins

        pins.said(os.environ["TQ_WARMUP_CACHE_PIN"])
    if not settings.enabled:
        logger.info("tq-warmup: disabled by TQ_WARMUP")
        return
    if settings.driver_cache is not None:  # before any CUDA context: the driver reads it then
        from .driver.startup import apply

        apply(settings)
    from .install import install

    install(settings)


def __getattr__(name: str) -> Any:
    """The lazily exported names of ``__all__``, imported once and then cached."""
    value: Any
    if name == "__version__":
        from importlib import metadata

        try:
            value = metadata.version(_DISTRIBUTION)
        except metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
            value = "0+unknown"
    elif name in _LAZY:
        from importlib import import_module

        module, attribute = _LAZY[name]
        value = getattr(import_module(f"{__name__}.{module}"), attribute)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
