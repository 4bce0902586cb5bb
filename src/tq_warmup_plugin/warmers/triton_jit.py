"""Compiles a ``KernelKey`` through Triton's ``JITFunction.warmup``.

``warmup`` runs the same binder and cache lookup as a launch and stores the
binary in the same per-device cache, but launches nothing. The tensors it gets
are a few bytes on the CPU: Triton only reads their dtype and ``data_ptr()``, so
their alignment is chosen to match what the runtime passes.
"""

from __future__ import annotations

import contextlib
import types
import zipfile
from collections.abc import Hashable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

from .. import compat
from ..hookspecs import hookimpl
from ..keys import Const, Int, KernelKey, Ptr


@cache
def _tensor(dtype: str, aligned: bool) -> Any:
    import torch

    torch_dtype = {
        "fp32": torch.float32,
        "bf16": torch.bfloat16,
        "fp16": torch.float16,
        "u8": torch.uint8,
        "i32": torch.int32,
        "i64": torch.int64,
    }[dtype]
    # CPU allocations are 64-byte aligned; one element in is never 16-byte aligned.
    base = torch.empty(32, dtype=torch_dtype)
    return base if aligned else base[1:]


def warmup_arguments(key: KernelKey) -> dict[str, Any]:
    """Keyword arguments that make Triton specialize exactly as ``key`` says."""
    out: dict[str, Any] = {}
    for name, arg in key.args:
        if isinstance(arg, Ptr):
            out[name] = _tensor(arg.dtype, arg.aligned)
        elif isinstance(arg, Int | Const):
            out[name] = arg.value
    out["num_warps"] = key.num_warps
    if key.num_stages is not None:
        out["num_stages"] = key.num_stages
    return out


def compile_key(key: KernelKey) -> None:
    """Compile (or load from Triton's disk cache) one specialization, and on a GPU
    also load it there.

    A compiled kernel is loaded on its first launch (``CompiledKernel._init_handles``,
    Triton 3.x): the binary goes to the current device and Triton builds its C
    launcher with the host compiler, cached on disk. With a cold Triton cache that
    build cost the first long request ~0.25 s on the H200 (vLLM 0.26.0) although
    nothing was JIT-compiled any more. The compile-only driver (CLI, tests) is not
    active and loads nothing.
    """
    kernel = compat.kernel_function(key.kernel).warmup(grid=(1,), **warmup_arguments(key))
    if kernel is not None and _gpu_driver_active():
        kernel._init_handles()


def _gpu_driver_active() -> bool:
    from triton.runtime import driver

    return bool(driver.active.is_active())


@hookimpl
def tq_warmup_compile(key: Hashable) -> bool | None:
    if not isinstance(key, KernelKey):
        return None
    compile_key(key)
    return True


def use_compile_only_target(arch: int) -> None:
    """Point Triton at ``cuda:sm<arch>`` on a host without that GPU.

    Triton needs an active driver to pick the compile target and a device for its
    in-memory cache; this one provides both and can launch nothing, which
    ``warmup`` never asks it to (process-wide, so only for the CLI and tests).
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
