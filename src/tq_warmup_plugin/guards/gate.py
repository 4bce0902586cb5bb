"""A guard's install step: only where the release has the bug, never raising into vLLM."""

from __future__ import annotations

import logging
from collections.abc import Callable

from .. import compat

__all__ = ["install_where_needed"]

logger = logging.getLogger("vllm.tq_warmup_plugin")


def install_where_needed(
    what: str, needed: Callable[[compat.Features], bool], apply: Callable[[], bool]
) -> bool:
    """A guard's ``install``: ``apply()`` where the installed release has the bug
    ``needed`` names, else nothing. Never raises into vLLM's import: an unknown release
    or layout is one WARNING and vLLM starts unguarded."""
    try:
        if not needed(compat.release_features(compat.installed_vllm_version())):
            return False
        return apply()
    except Exception as exc:
        logger.warning("tq-warmup: %s guard not installed: %s", what, exc)
        return False
