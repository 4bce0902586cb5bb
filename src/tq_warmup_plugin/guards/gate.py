"""A guard's install step: only where the release has the bug, never raising into vLLM."""

from __future__ import annotations

import logging
from collections.abc import Callable

from .. import compat

__all__ = ["install_where_needed"]

logger = logging.getLogger("vllm.tq_warmup_plugin")


def install_where_needed(
    what: str,
    needed: Callable[[compat.Features], bool],
    apply: Callable[[], bool],
    risk: str = "",
) -> bool:
    """A guard's ``install``: ``apply()`` where the installed release has the bug
    ``needed`` names, else nothing. Never raises into vLLM's import: an unknown release
    or layout is one WARNING and vLLM starts unguarded. A release newer than the plugin
    knows is unguarded too, and ``risk`` (what the bug does on every release the plugin
    knows, and how an operator avoids it) goes into that WARNING: a new release may keep the
    bug (0.34.0 left TurboQuant's backend as 0.33 had it but for one unused attribute), and
    a user who upgrades vLLM before the plugin must learn that the wrong tokens are theirs
    to avoid."""
    try:
        if not needed(compat.release_features(compat.installed_vllm_version())):
            return False
        return apply()
    except Exception as exc:
        beyond = isinstance(exc, compat.UnsupportedRelease) and compat.beyond_newest(
            compat.parse_version(compat.installed_vllm_version())
        )
        tail = f"; {risk}" if risk and beyond else ""
        logger.warning("tq-warmup: %s guard not installed: %s%s", what, exc, tail)
        return False
