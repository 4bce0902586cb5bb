"""The Triton warmer: compiles a ``KernelKey`` (and loads it on a GPU), launching nothing.

Triton's ``JITFunction.warmup`` runs the same binder and cache lookup as a launch
and stores the binary in the same per-device cache, but launches nothing. The tensors
it gets are a few bytes on the CPU: Triton only reads their dtype and ``data_ptr()``, so
their alignment is chosen to match what the runtime passes; on HIP also the size of
their storage, so a pointer whose key says "over 2 GiB" gets a meta tensor of that size,
which allocates nothing.
"""

from __future__ import annotations

from collections.abc import Hashable
from functools import cache
from typing import Any

from .. import compat
from ..hookspecs import hookimpl
from ..keys import Const, Int, KernelKey, Ptr

__all__ = ["compile_key", "tq_warmup_compile", "warmup_arguments"]


@cache
def _tensor(dtype: str, aligned: bool, beyond_2gb: bool = False) -> Any:
    import torch

    torch_dtype = {
        "fp32": torch.float32,
        "bf16": torch.bfloat16,
        "fp16": torch.float16,
        "u8": torch.uint8,
        "i32": torch.int32,
        "i64": torch.int64,
    }[dtype]
    if beyond_2gb:
        # Triton's is_within_2gb reads untyped_storage().size() (3.6-3.8), which a meta
        # tensor has without memory; its data_ptr() is 0 plus the offset.
        storage = torch.empty(compat.POINTER_RANGE_MAX + 65, dtype=torch.uint8, device="meta")
        base = storage[:64].view(torch_dtype)
    else:
        # CPU allocations are 64-byte aligned; one element in is never 16-byte aligned.
        base = torch.empty(32, dtype=torch_dtype)
    return base if aligned else base[1:]


def warmup_arguments(key: KernelKey) -> dict[str, Any]:
    """Keyword arguments that make Triton specialize exactly as ``key`` says."""
    out: dict[str, Any] = {}
    for name, arg in key.args:
        if isinstance(arg, Ptr):
            out[name] = _tensor(arg.dtype, arg.aligned, arg.in_range is False)
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
    build cost the first long request ~0.25 s although nothing was JIT-compiled any more
    (vLLM 0.26.0, commit 2ed4304). The compile-only driver (CLI, tests) is not
    active and loads nothing: there the launcher is built into the cache instead, where
    this Triton builds one (``compat.build_host_launcher``), for the GPU that loads it.
    """
    kernel = compat.kernel_function(key.kernel).warmup(grid=(1,), **warmup_arguments(key))
    if kernel is None:
        return
    if _gpu_driver_active():
        kernel._init_handles()
    else:
        compat.build_host_launcher(kernel)


def _gpu_driver_active() -> bool:
    from triton.runtime import driver

    return bool(driver.active.is_active())


@hookimpl
def tq_warmup_compile(key: Hashable) -> bool | None:
    if not isinstance(key, KernelKey):
        return None
    compile_key(key)
    return True
