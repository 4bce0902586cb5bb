"""Entry point of ``python -m benchmarks.tqbench``."""

from __future__ import annotations

import sys

from benchmarks.tqbench.cli import main

sys.exit(main())
