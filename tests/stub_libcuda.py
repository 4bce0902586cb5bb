"""A stand-in ``libcuda.so.1`` for a host without a GPU driver, so that Triton 3.6's host
launchers (``compat.build_host_launcher``) link and load on a CPU.

The launcher Triton generates links seven driver functions (``backends/nvidia/driver.py``
3.6.0, its ``make_launcher`` source); this library defines each to return 0 and is never
called: nothing launches on a CPU. Everything else (the launcher's source, its C compile,
Triton's cache lookup) is Triton's own. Use it only in a child process
(``LD_LIBRARY_PATH``): a process that has loaded it has no real driver any more.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

__all__ = ["FUNCTIONS", "build", "env"]

FUNCTIONS = (
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuDeviceGet",
    "cuDevicePrimaryCtxRetain",
    "cuFuncSetAttribute",
    "cuGetErrorString",
    "cuPointerGetAttribute",
)


def build(into: Path) -> Path | None:
    """``into/libcuda.so.1`` (soname ``libcuda.so.1``), or None without a C compiler."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return None
    into.mkdir(parents=True, exist_ok=True)
    source = into / "stub.c"
    source.write_text("".join(f"int {name}(void) {{ return 0; }}\n" for name in FUNCTIONS))
    library = into / "libcuda.so.1"
    cmd = [cc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(library), str(source)]
    subprocess.run(cmd, check=True, capture_output=True)
    return library


def env(library: Path) -> dict[str, str]:
    """The variables that make Triton link against it and the loader find it."""
    return {"TRITON_LIBCUDA_PATH": str(library.parent), "LD_LIBRARY_PATH": str(library.parent)}
