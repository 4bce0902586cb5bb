"""The CUDA driver's JIT cache, shipped beside the Triton layer (FlashAttention 2's
PTX, which the driver compiles on a fresh node).

* ``entry``: an entry of the shipped driver cache (its manifest, hashing, copying);
* ``host``: this node's driver, GPUs and FA2 library, and an entry's match with them;
* ``startup``: in ``register()``, before CUDA starts, a private hashed copy of the
  matching entry for ``CUDA_CACHE_PATH``;
* ``build``: ``tq-warmup driver-cache``, filling an entry on a GPU;
* ``verify``: ``tq-warmup verify``'s reading of the entries.

Nothing is imported here: ``register()`` loads ``startup`` only when the cache is set.
"""

from __future__ import annotations

__all__: list[str] = []
