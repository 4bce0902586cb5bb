"""``python -m tq_warmup_plugin.cli``: the same ``main`` as the ``tq-warmup`` script."""

from __future__ import annotations

import sys

from .commands import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
