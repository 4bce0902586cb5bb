"""vLLM's own kernels, warmed beside the TurboQuant ones (named so nothing reads as
vLLM's engine).

* ``jobs``: ``Engine`` (what vLLM's kernels specialize on in a worker), ``Job`` and
  ``Declined``, the types an engine warmer returns;
* ``run``: running the engine warmers' jobs in a worker (model forwards first, then
  Triton jobs on a pool, then ``torch.compile`` jobs);
* ``logits``: the model's logits, computed once on the worker's thread, that jobs on the
  pool copy rows of;
* ``offline``: the same warmers without a worker (``EngineRequest``, vLLM's CPU
  objects on the meta device, ``Job.offline``);
* ``ahead``, ``ahead_child``: the compile-ahead child forked from ``Worker.load_model``.

The warmers themselves are hookimpls in ``warmers/`` (``vllm_*``). Nothing is imported
here: ``register()`` loads ``ahead`` alone.
"""

from __future__ import annotations

__all__: list[str] = []
