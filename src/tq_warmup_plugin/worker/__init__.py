"""One worker's warmup, in the order a worker's startup runs it (inside vLLM's
``kernel_warmup``, KV cache allocated, before CUDA-graph capture).

* ``warmup``: the host; builds the plugin manager and owns the one path;
* ``plugins``: the plugin manager (the built-in warmers and third-party ones);
* ``jit_registry``: on 0.29+, the warmup as one registration of vLLM's JIT warmup phase;
* ``discovery``: the TurboQuant layers and the geometry their kernels see;
* ``verify_rows``: the rows of the batched verify launch (``guards.batched_verify`` too);
* ``spec_problem``: the speculative-decoding warning;
* ``workspace``: every ubatch/lane's workspace reserved;
* ``keyplan``: the warmers' keys, deduplicated and compiled (the CLI's and the
  compile-ahead child's way too);
* ``launches``: the paths' first non-Triton launches;
* ``report``: the one INFO line and the JSON report.

Nothing is imported here: ``register()`` loads ``verify_rows`` alone (a guard's rows).
"""

from __future__ import annotations

__all__: list[str] = []
