"""``tq-warmup``: parsing and messages only; policy lives in the modules they call.

* ``commands``: ``main`` (``tq-warmup = tq_warmup_plugin.cli:main``, ``python -m
  tq_warmup_plugin.cli``), the parser, ``doctor`` and ``inspect``;
* ``layers``: ``precompile`` (built by ``shipped.build``), ``driver-cache``, ``verify``;
* ``plans``: the keys and engine jobs a command prints or builds;
* ``flags``: the flags; ``inputs``: hostile inputs (geometry files, reports);
* ``doctor``: will this machine warm, the next step, the exit status.
"""

from __future__ import annotations

from .commands import main

__all__ = ["main"]
