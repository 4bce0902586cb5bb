"""Moved to ``tq_warmup_plugin.worker.spec_problem`` (a warmup warning, not a guard): this alias
keeps ``from tq_warmup_plugin.guards import spec_problem`` working."""

from __future__ import annotations

from ..worker.spec_problem import *  # noqa: F403
from ..worker.spec_problem import __all__ as __all__
