"""Helpers for the ``real_vllm`` tests: a compile-only Triton driver for sm90 and a
recorder of the specialization keys that launches ask Triton for."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

def activate_compile_only_driver() -> None:
    """Make Triton target sm90 on a host without a GPU (cpu-ci-recipe.md, 3a)."""
    from tq_warmup_plugin.warmers.triton_jit import use_compile_only_target

    use_compile_only_target(90)


@contextlib.contextmanager
def recorded_keys() -> Iterator[set[tuple[str, str]]]:
    """Record ``(kernel, key)`` of every Triton cache miss, compiling nothing.

    Triton's ``jit_cache_hook`` runs before each compile with the exact in-memory
    cache key; returning True makes Triton skip the compile and the launch. Each
    kernel's per-device cache is cleared first so every launch is a miss.
    """
    from triton import knobs

    from tq_warmup_plugin import compat

    for name in compat.KERNEL_MODULES:
        compat.kernel_function(name).device_caches.clear()
    seen: set[tuple[str, str]] = set()

    def hook(*, key: Any, fn: Any, **_: Any) -> bool:
        seen.add((fn.name, str(key)))
        return True

    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        yield seen
    finally:
        knobs.runtime.jit_cache_hook = previous
