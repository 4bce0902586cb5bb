"""Deprecated, gone in the next release: ``from tq_warmup_plugin import Declined, Engine, Job``.

docs/writing-a-warmer.md named this module before the package was grouped; the types live
in ``vllm_kernels.jobs`` now, and the package exports them."""

from __future__ import annotations

import warnings

from .vllm_kernels.jobs import Declined, Engine, Job

__all__ = ["Declined", "Engine", "Job"]

warnings.warn(
    "tq_warmup_plugin.engine is deprecated and goes in the next release: "
    "import Declined, Engine and Job from tq_warmup_plugin",
    DeprecationWarning,
    stacklevel=2,
)
