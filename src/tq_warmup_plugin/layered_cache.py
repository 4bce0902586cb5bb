"""Alias of ``tq_warmup_plugin.shipped.layered_cache``, where the module moved (the package
is grouped by concern): it is that very module, so the old name keeps working for
imports, attribute patches and ``importlib``.

``TRITON_CACHE_MANAGER=tq_warmup_plugin.layered_cache:LayeredCacheManager`` is the
name operators write (README, ``deploy/``): it stays, and names the same class."""

from __future__ import annotations

import sys

from .shipped import layered_cache as _moved

sys.modules[__name__] = _moved
