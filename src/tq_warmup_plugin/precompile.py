"""Compiling for a GPU this machine does not have, into a cache another Triton reads.

A compile-only Triton target, and the disk-cache keys another Triton build of the
same release computes. Used by ``tq-warmup precompile``, the ``real_vllm`` tests and
``.ci/check-vllm.py``; never by a worker, which compiles for the GPU it runs on
(``warmers/triton_jit``).
"""

from __future__ import annotations

import contextlib
import types
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["cache_keys_for", "triton_key_of", "triton_key_of_wheel", "use_compile_only_target"]


def use_compile_only_target(arch: int) -> None:
    """Point Triton at ``cuda:sm<arch>`` on a host without that GPU.

    Triton needs an active driver to pick the compile target and a device for its
    in-memory cache; this one provides both and can launch nothing, which
    ``warmup`` never asks it to (process-wide, so only for ``precompile``, the tests
    and CI's smoke check).
    """
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class CompileOnlyDriver(DriverBase):  # type: ignore[misc]
        def __init__(self) -> None:
            self.target = GPUTarget("cuda", arch, 32)

        @classmethod
        def is_active(cls) -> bool:
            return False

        def get_current_target(self) -> Any:
            return self.target

        def get_current_device(self) -> int:
            return 0

        def set_current_device(self, device: int) -> None:
            pass

        def get_current_stream(self, device: Any = None) -> int:
            return 0

        def get_active_torch_device(self) -> Any:
            return torch.device("cpu")

        def get_device_interface(self) -> Any:
            return torch.cuda

        def get_benchmarker(self) -> Any:
            raise NotImplementedError("compile-only driver")

        def map_python_to_cpp_type(self, ty: str) -> str:
            raise NotImplementedError("compile-only driver")

    triton.runtime.driver.set_active(CompileOnlyDriver())


def triton_key_of(site_packages: str | Path) -> str:
    """``triton_key()`` of another installation of the same Triton release.

    Triton's on-disk cache key starts with ``triton_key()``, a hash of the files of
    the installation it runs from, ``libtriton`` included, which differs between
    the wheels for two Python versions. Triton's own function (3.6-3.8, in
    ``triton.runtime.cache``) is re-run with ``__file__`` pointing into the other tree.
    """
    from triton.runtime import cache as triton_cache

    fn = triton_cache.triton_key.__wrapped__
    scope = dict(fn.__globals__)
    scope["__file__"] = str(Path(site_packages) / "triton" / "runtime" / "cache.py")
    return str(types.FunctionType(fn.__code__, scope)())


def triton_key_of_wheel(wheel: str | Path, into: str | Path) -> str:
    """``triton_key()`` of a Triton wheel, unpacked under ``into``."""
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(into)
    return triton_key_of(into)


@contextlib.contextmanager
def cache_keys_for(key: str) -> Iterator[None]:
    """Store compiled kernels under the disk-cache keys another Triton build of the
    same release computes (the binaries are identical; only the key differs)."""
    from triton.runtime import cache as triton_cache

    original = triton_cache.triton_key
    triton_cache.triton_key = lambda: key
    try:
        yield
    finally:
        triton_cache.triton_key = original
