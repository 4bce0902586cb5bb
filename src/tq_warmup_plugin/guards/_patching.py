"""Moved to ``tq_warmup_plugin.patching`` (``install.py`` uses it too): this alias keeps
``from tq_warmup_plugin.guards import _patching`` working."""

from __future__ import annotations

from ..patching import *  # noqa: F403
from ..patching import __all__ as __all__
