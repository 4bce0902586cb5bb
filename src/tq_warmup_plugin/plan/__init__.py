"""The offline twin of discovery: a model's plan without a worker.

* ``model``: a ``PlanRequest`` (vLLM's engine-argument names) to a ``Geometry``, from
  vLLM's ``ModelConfig`` of a directory (``inspect``, ``precompile``) or of a starting
  worker (``worker_plan``, the compile-ahead child).

Nothing is imported here.
"""

from __future__ import annotations

__all__: list[str] = []
