"""tq-warmup-plugin: compile vLLM's TurboQuant Triton kernels before serving.

vLLM calls :func:`register` (entry point ``vllm.general_plugins`` / ``tq_warmup``)
in every process it starts. Registration only installs a hook; the work happens
in the worker, inside vLLM's ``kernel_warmup``.
"""

from __future__ import annotations

import logging

from .settings import Settings, load

__version__ = "0.1.0"
__all__ = ["Settings", "__version__", "register"]

_registered = False


def register() -> None:
    """vLLM general-plugin entry point: cheap, idempotent, imports nothing heavy."""
    global _registered
    if _registered:
        return
    _registered = True
    from .multinode import forward_to_ray_workers

    forward_to_ray_workers()  # before the TQ_WARMUP check: TQ_WARMUP=0 must travel too
    settings = load()
    if not settings.enabled:
        logging.getLogger("vllm.tq_warmup_plugin").info("tq-warmup: disabled by TQ_WARMUP")
        return
    from .install import install

    install(settings)
