"""The one alias: ``TRITON_CACHE_MANAGER=tq_warmup_plugin.layered_cache:LayeredCacheManager``
is the name operators write (README, ``deploy/``), and it stays. This module *is*
``shipped.layered_cache`` (``sys.modules``), so Triton resolves it to the same class."""

from __future__ import annotations

import sys

from .shipped import layered_cache as _moved

sys.modules[__name__] = _moved
