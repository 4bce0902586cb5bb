"""What Triton does that the plugin's keys and files depend on (Triton 3.6-3.8).

Triton is the one release line beside vLLM's that changes a kernel's key: the HIP
backend's pointer ranges, the ``FP8_E4B15`` constexpr, the GPU targets it compiles
for, and the group file that names a compiled kernel's files in a cache directory.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "AMD_BACKEND_MODULE",
    "GROUP_PREFIX",
    "LAUNCHER_NAME",
    "POINTER_RANGE_MAX",
    "SM_TARGETS",
    "Launches",
    "build_host_launcher",
    "compile_only_launches",
    "fp8_e4b15",
    "launcher_dirs",
    "no_launchers_why",
    "pin_to_callers_device",
    "pointer_in_range",
    "storage_bytes",
    "triton_pointer_ranges",
]

# Triton 3.6.0, 3.7.1 and 3.8.0 (what the supported vLLM releases pin): the HIP backend's
# ``get_tensor_specialization`` (``triton/backends/amd/compiler.py`` 3.6.0:182-186,
# 3.7.1:187-191, 3.8.0:236-240) adds "S" to a pointer's key when ``knobs.amd.use_buffer_ops``
# (``AMDGCN_USE_BUFFER_OPS``, default on: ``knobs.py`` 3.6.0/3.7.1:505, 3.8.0:517) and
# ``is_within_2gb(arg)``: ``arg.untyped_storage().size() <= 2**31 - 1``, the tensor's whole
# storage in bytes, not its view (3.6.0:164-171, 3.7.1:169-176, 3.8.0:211-225). The
# compiler then assumes 32-bit offsets (``tt.pointer_range``). CUDA has no such flag.
POINTER_RANGE_MAX = 2**31 - 1
AMD_BACKEND_MODULE = "triton.backends.amd.compiler"


def pointer_in_range(storage_bytes: int) -> bool:
    """Triton's HIP "S" answer for a tensor whose storage holds this many bytes."""
    return storage_bytes <= POINTER_RANGE_MAX


def triton_pointer_ranges() -> bool:
    """Whether the active Triton target keys pointers on their storage size: a HIP
    target, buffer ops on, and a HIP backend that has ``is_within_2gb`` (3.6-3.8)."""
    try:
        from triton import knobs
        from triton.runtime import driver

        target = driver.active.get_current_target()
        backend = importlib.import_module(AMD_BACKEND_MODULE).HIPBackend
    except (ImportError, RuntimeError, AttributeError):  # no Triton, no driver, no AMD
        return False
    return (
        getattr(target, "backend", None) == "hip"
        and hasattr(backend, "is_within_2gb")
        and bool(getattr(getattr(knobs, "amd", None), "use_buffer_ops", False))
    )


def storage_bytes(tensor: Any) -> int:
    """Bytes of a tensor's whole storage, what ``is_within_2gb`` measures (Triton
    3.6-3.8): a layer's KV view of a larger cache allocation counts it all."""
    return int(tensor.untyped_storage().size())


def fp8_e4b15(capability: tuple[int, int] | None) -> int:
    """``FP8_E4B15`` constexpr: 1 on CUDA devices below SM 8.9, else 0 (all releases)."""
    return 1 if capability is not None and capability < (8, 9) else 0


# The file that names a compiled kernel's files, ``__grp__<kernel>.json``
# (``FileCacheManager.put_group``, Triton 3.6-3.8):
# ``{"child_paths": {file name: absolute path at write time}}``.
GROUP_PREFIX = "__grp__"

# NVIDIA targets Triton's CUDA backend compiles for (3.6-3.8); anything else aborts
# inside LLVM (``tq-warmup precompile --arch 0`` exits with 134), so the CLI refuses it
# before compiling.
SM_TARGETS = (75, 80, 86, 87, 89, 90, 100, 101, 103, 110, 120, 121)


_LAUNCH_PATCH = threading.Lock()


class Launches(list[str]):
    """The names of the kernels ``compile_only_launches`` met, and the job time spent
    in Triton, summed over threads: ``lookup_s`` in the launch itself (bind, key, the
    in-memory cache, a compile or a load from disk), ``load_s`` in ``_init_handles``
    (the C launcher and the module's load on the GPU). What is left of a job's time is
    vLLM's own code around the launch. The split found that a hybrid worker's lookups,
    nothing compiled, were six times as long beside the warmers' graph traces as after
    them (vLLM 0.26.0, ``benchmarks/results/serve-jit/SUMMARY.md``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lookup_s = 0.0
        self.load_s = 0.0
        self._lock = threading.Lock()

    def add(self, name: str, lookup_s: float, load_s: float) -> None:
        with self._lock:
            self.append(name)
            self.lookup_s += lookup_s
            self.load_s += load_s


@contextlib.contextmanager
def compile_only_launches(load: bool) -> Iterator[Launches]:
    """Inside, every ``kernel[grid](...)`` compiles (or finds) its binary and, with
    ``load``, loads it on the current GPU, and launches nothing.

    ``JITFunction.__getitem__`` returns ``lambda *a, **kw: self.run(grid=grid,
    warmup=False, *a, **kw)`` and ``run(warmup=True)`` binds, specializes, looks up and
    compiles exactly as the launch would, then returns the kernel instead of running it
    (``runtime/jit.py`` Triton 3.6.0:370/695, 3.8.0:374). So vLLM's own launcher code,
    given a few bytes of input, warms the very keys serving asks for, and no output
    buffer of the live runner is written. Yields the kernels it met (``Launches``). The
    patch is on the class, so it is held under a lock and always undone.

    Launches of one key on several threads compile it once (``_one_compile_per_key``):
    the engine warmers run side by side, and Triton has no lock between a launch's
    in-memory cache miss and its compile.
    """
    from triton.runtime.jit import JITFunction

    met = Launches()
    with _LAUNCH_PATCH, _one_compile_per_key():
        original = JITFunction.run

        def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            start = time.perf_counter()
            kernel = original(self, *args, grid=grid, warmup=True, **kwargs)
            found = time.perf_counter()
            if kernel is not None and load:
                kernel._init_handles()
            elif kernel is not None:
                build_host_launcher(kernel)
            name = str(getattr(self, "__name__", "?"))
            met.add(name, found - start, time.perf_counter() - found)
            return kernel

        JITFunction.run = run
        try:
            yield met
        finally:
            JITFunction.run = original


@contextlib.contextmanager
def _one_compile_per_key() -> Iterator[None]:
    """Inside, a kernel key that several threads miss at once compiles on one of them;
    the others wait for it and then find it in Triton's disk cache. Entered only by
    ``compile_only_launches``, whose lock also covers this patch of the class.

    Why: ``JITFunction.run`` looks the key up in its in-memory cache and, on a miss, compiles
    (``_do_compile(key, signature, device, ...)``, Triton 3.6-3.8), with no lock between the
    two. The V2 sampler's 7 logprob jobs each launch ``_ranks_kernel`` with one key, so a cold
    V2 worker compiled it on several threads at once (vLLM 0.26.0,
    ``benchmarks/results/serve-jit/SUMMARY.md``). The lock is one per (kernel, key, device)
    and lives as long as this context; distinct keys still compile side by side. Where Triton
    has no ``_do_compile``, nothing changes.
    """
    from triton.runtime.jit import JITFunction

    original = getattr(JITFunction, "_do_compile", None)
    if original is None:
        yield
        return
    locks: dict[tuple[int, str, object], threading.Lock] = {}
    guard = threading.Lock()

    def do_compile(self: Any, key: Any, signature: Any, device: Any, *rest: Any) -> Any:
        with guard:
            lock = locks.setdefault((id(self), str(key), device), threading.Lock())
        with lock:
            return original(self, key, signature, device, *rest)

    JITFunction._do_compile = do_compile
    try:
        yield
    finally:
        JITFunction._do_compile = original


def pin_to_callers_device() -> Callable[[], None] | None:
    """An initializer that moves a new thread to the caller's current device.

    Triton keys its in-memory kernel cache by the current device, and a new thread
    starts on device 0: without this, tensor-parallel rank 1 warmed device 0's cache
    and still compiled at runtime (vLLM 0.26.0). Both thread
    pools use it: the TurboQuant keys' (``warmup.compile_all``) and the engine
    warmers' (``engine_warmup.run``).
    """
    try:
        from triton.runtime import driver

        active = driver.active
        device = active.get_current_device()
    except (ImportError, RuntimeError):  # no Triton, or no active driver: nothing to pin
        return None
    return lambda: active.set_current_device(device)


LAUNCHER_NAME = "__triton_launcher"
"""The module Triton 3.6 builds per kernel signature (``backends/nvidia/driver.py`` 3.6.0:685)."""

_launcher_lock = threading.Lock()
_no_launchers: list[str] = []
"""Why this process builds no host launcher (empty: it does, or has not tried yet)."""


def build_host_launcher(kernel: Any) -> str | None:
    """Build into Triton's cache the host launcher that a GPU builds when it first loads
    ``kernel`` (a compiled kernel, not loaded); None where it is built or found, else why not.

    Why: Triton 3.6.0 (vLLM 0.20-0.26) compiles a C launcher per kernel signature with the
    host's C compiler on a kernel's first load (``CudaLauncher``, ``driver.py`` 3.6.0:676-689),
    cached on disk under ``sha256(source + platform_key())``. From a shipped layer without them
    a worker's launches of vLLM's own kernels, 0 Triton compiles, took ten times as long as
    over the Triton cache of an earlier start (vLLM 0.26.0,
    ``benchmarks/results/serve-jit/SUMMARY.md``). Building them where the kernels are
    built (the compile-ahead child, ``precompile``) leaves the worker a load. Triton 3.7.1 and
    3.8.0 launch through one generic launcher and build none (no ``make_launcher``). Linking
    needs ``libcuda.so.1`` (``libcuda_dirs``, or ``TRITON_LIBCUDA_PATH``) and a C compiler: a
    host without them (a CPU build machine) builds none and says why once."""
    if _no_launchers:
        return _no_launchers[0]
    import subprocess  # register() imports this module: not there

    if getattr(getattr(getattr(kernel, "metadata", None), "target", None), "backend", "") != "cuda":
        return "not a CUDA kernel"
    try:
        nvidia = importlib.import_module("triton.backends.nvidia.driver")
    except ImportError as exc:
        return _give_up(f"Triton's CUDA driver does not import ({exc})")
    if getattr(nvidia, "make_launcher", None) is None:  # 3.7+: one generic launcher
        return _give_up("this Triton launches through one generic launcher")
    try:
        nvidia.library_dirs()
    except (AssertionError, OSError, subprocess.SubprocessError):  # Triton's own words:
        # "libcuda.so cannot found!" and ldconfig's output, not for a person
        return _give_up("libcuda.so.1 not found (no NVIDIA driver here; TRITON_LIBCUDA_PATH)")
    try:
        nvidia.CudaLauncher(kernel.src, kernel.metadata)
    except ImportError:
        return None  # built and cached; it only loads beside a driver (a stub libcuda)
    except Exception as exc:  # no C compiler (RuntimeError), a failed build: never the key's
        first = (str(exc).splitlines() or [""])[0][:200]
        return _give_up(f"the launcher's C build failed ({type(exc).__name__}: {first})")
    return None


def _give_up(why: str) -> str:
    with _launcher_lock:
        if not _no_launchers:
            _no_launchers.append(why)
    return why


def no_launchers_why() -> str | None:
    """Why this process builds no host launcher, once it has tried; else None."""
    return _no_launchers[0] if _no_launchers else None


def launcher_dirs(root: str) -> set[str]:
    """The key directories under Triton cache ``root`` that hold a host launcher."""
    from pathlib import Path

    found = Path(root).glob(f"*/{LAUNCHER_NAME}*")
    return {path.parent.name for path in found if path.is_file() and not path.is_symlink()}
