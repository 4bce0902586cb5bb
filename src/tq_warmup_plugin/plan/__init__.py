"""The offline twin of discovery: a model's plan without a worker.

* ``rules``: the pure rules, what vLLM's code decides from a configuration's numbers
  (heads per rank, boundary layers, the KV view, the block and its table row, a hybrid's
  KV tensors, the verify rows);
* ``model``: a model read through vLLM's own ``ModelConfig`` (``ModelShape``), of a
  directory (``inspect``, ``precompile``) or of a starting worker;
* ``request``: a ``PlanRequest`` (vLLM's engine-argument names) and a model's shape to a
  ``Planned`` geometry, at the kernels' block and the V1 table's rounded row; a starting
  worker's (``worker_plan``, the compile-ahead child) and a draft model's.

Nothing is imported here.
"""

from __future__ import annotations

__all__: list[str] = []
