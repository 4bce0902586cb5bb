"""tq-warmup-plugin: compile vLLM's TurboQuant Triton kernels before serving.

vLLM calls :func:`register` (entry point ``vllm.general_plugins`` / ``tq_warmup``)
in every process it starts. Registration only installs a hook; the work happens
in the worker, inside vLLM's ``kernel_warmup``.
"""

from __future__ import annotations

import logging

from .settings import Settings, parse

__version__ = "0.1.0"
__all__ = ["Settings", "__version__", "register"]

_registered = False


def register() -> None:
    """vLLM general-plugin entry point: cheap, idempotent, imports nothing heavy."""
    global _registered
    if _registered:
        return
    _registered = True
    settings, problems = parse()
    logger = logging.getLogger("vllm.tq_warmup_plugin")
    for problem in problems:
        logger.warning(problem)
    if not settings.enabled:
        logger.info("tq-warmup: disabled by TQ_WARMUP")
        return
    from .install import install

    install(settings)
