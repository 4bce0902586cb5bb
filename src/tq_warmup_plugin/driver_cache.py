"""Alias of ``tq_warmup_plugin.driver.entry``, where the module moved (the package
is grouped by concern): it is that very module, so the old name keeps working for
imports, attribute patches and ``importlib``."""

from __future__ import annotations

import sys

from .driver import entry as _moved

sys.modules[__name__] = _moved
