"""``tq-warmup``: parsing and messages only; policy lives in the modules they call.

* ``commands``: the subcommands and ``main`` (``tq-warmup = tq_warmup_plugin.cli:main``,
  ``python -m tq_warmup_plugin.cli``);
* ``flags``: the flags; ``inputs``: hostile inputs (geometry files, reports);
* ``doctor``: will this machine warm, the next step, the exit status.
"""

from __future__ import annotations

from .commands import main

__all__ = ["main"]
