"""Helpers for the ``real_vllm`` tests: a compile-only Triton driver for sm90 and a
recorder of the specialization keys that launches ask Triton for."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

SM90 = ("cuda", 90, 32)


def activate_compile_only_driver() -> None:
    """Make Triton target sm90 on a host without a GPU (cpu-ci-recipe.md, 3a)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class CompileOnlyDriver(DriverBase):  # type: ignore[misc]
        def __init__(self) -> None:
            self.target = GPUTarget(*SM90)

        @classmethod
        def is_active(cls) -> bool:
            return False

        def get_current_target(self) -> Any:
            return self.target

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: Any = None) -> int:
            return 0

        def get_active_torch_device(self) -> Any:
            return torch.device("cpu")

        def get_device_interface(self) -> Any:
            return torch.cuda

        def get_benchmarker(self) -> Any:
            raise NotImplementedError

        def map_python_to_cpp_type(self, ty: str) -> str:
            raise NotImplementedError

    triton.runtime.driver.set_active(CompileOnlyDriver())


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
