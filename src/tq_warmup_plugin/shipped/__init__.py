"""Serving a shipped Triton cache layer: what ``tq-warmup precompile`` builds and what
every vLLM process reads back, as files it did not write.

* ``manifest``: the manifest of a build (stack, files, hashes) and its checks;
* ``pins``: ``TQ_WARMUP_CACHE_PIN``, the manifests an operator vouches for;
* ``trust``: what a layer may serve (regular files, bounded reads, hashed private
  copies, pins);
* ``layered_cache``: Triton's cache manager over the read-only layers
  (``TRITON_CACHE_MANAGER``);
* ``precompile``: compiling for another machine and installing into a layer.

Nothing is imported here: ``register()`` and Triton's manager load only what they use.
"""

from __future__ import annotations

__all__: list[str] = []
