"""Contract: the host launcher Triton 3.6 builds on a kernel's first load is built where the
kernel is compiled (``compat.build_host_launcher``: ``precompile``, the compile-ahead child),
under the key Triton's own loader then looks up, and a shipped layer serves it.

Each check runs in a child process beside a stub ``libcuda.so.1`` (``stub_libcuda``): the
launcher's source, its C compile and the cache lookup are Triton's. The loader's side is
Triton's ``CudaLauncher`` with its C compiler taken away: it finds the launcher, or fails
where none was built (an empty cache), so the check can fail. Triton 3.7+ builds no launcher:
there the build says so in one line and nothing is written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import stub_libcuda

import tq_warmup_plugin

pytestmark = pytest.mark.real_vllm

SRC = str(Path(tq_warmup_plugin.__file__).parents[1])
TESTS = str(Path(__file__).parents[1])


def _child() -> None:
    """Compile ``add_one`` compile-only into ``TQ_TEST_BUILD`` (a launcher built on the way),
    then load its launcher as a GPU would, C compiler refused, over each of ``TQ_TEST_LOAD``."""
    import triton.runtime.build as build
    from unrelated_kernel import add_one

    from tq_warmup_plugin import compat
    from tq_warmup_plugin.shipped.precompile import use_compile_only_target

    use_compile_only_target(90)
    import torch

    os.environ["TRITON_CACHE_DIR"] = os.environ["TQ_TEST_BUILD"]
    with compat.compile_only_launches(load=False):
        add_one[(1,)](torch.zeros(64), 64, BLOCK=64)
    kernel = add_one.warmup(torch.zeros(64), 64, BLOCK=64, grid=(1,))
    out: dict[str, Any] = {
        "kernel": kernel is not None,
        "why": compat.no_launchers_why(),
        "built": sorted(compat.launcher_dirs(os.environ["TQ_TEST_BUILD"])),
    }

    def refused(*args: Any, **kwargs: Any) -> str:
        raise RuntimeError("the C compiler ran")

    build._build = refused
    from triton.backends.nvidia import driver

    loads = json.loads(os.environ["TQ_TEST_LOAD"]) if hasattr(driver, "make_launcher") else []
    for cache in loads:
        os.environ["TRITON_CACHE_DIR"] = cache
        try:
            driver.CudaLauncher(kernel.src, kernel.metadata)
            out[cache] = "found"
        except RuntimeError as exc:
            out[cache] = str(exc)
    print("RESULT " + json.dumps(out))


def _run(tmp: Path, extra: dict[str, str], *load: Path) -> dict[str, Any]:
    given = os.environ.get("PYTHONPATH", "")
    path = os.pathsep.join([p for p in (given, SRC, TESTS, str(Path(__file__).parent)) if p])
    env = {**os.environ, **extra, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path}
    env["TQ_TEST_BUILD"], env["TQ_TEST_LOAD"] = str(tmp / "build"), json.dumps(list(map(str, load)))
    code = [sys.executable, "-c", "from test_contract_launchers import _child; _child()"]
    done = subprocess.run(code, env=env, capture_output=True, text=True, timeout=300)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    return result


def _per_signature() -> bool:
    nvidia = pytest.importorskip("triton.backends.nvidia.driver")
    return getattr(nvidia, "make_launcher", None) is not None


@pytest.fixture(scope="module")
def libcuda(tmp_path_factory: pytest.TempPathFactory) -> Path:
    library = stub_libcuda.build(tmp_path_factory.mktemp("libcuda"))
    if library is None:
        pytest.skip("no C compiler: Triton builds no launcher here either")
    return library


def test_a_launcher_built_compile_only_is_the_one_a_gpu_loads(
    tmp_path: Path, libcuda: Path
) -> None:
    empty = tmp_path / "empty"
    result = _run(tmp_path, stub_libcuda.env(libcuda), tmp_path / "build", empty)
    if not _per_signature():
        assert result["built"] == [] and "one generic launcher" in result["why"], result
        return
    assert result["why"] is None and len(result["built"]) == 1, result
    assert result[str(tmp_path / "build")] == "found", result
    assert result[str(empty)] == "the C compiler ran", result  # none built: the check fails


def test_without_libcuda_nothing_is_built_and_the_reason_is_one_line(tmp_path: Path) -> None:
    found = subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True).stdout
    if "libcuda.so.1" in found:
        pytest.skip("this host has a CUDA driver")
    result = _run(tmp_path, {"TRITON_LIBCUDA_PATH": "", "LD_LIBRARY_PATH": ""})
    assert result["built"] == [], result
    expected = "libcuda.so.1 not found" if _per_signature() else "one generic launcher"
    assert expected in result["why"] and "\n" not in result["why"], result
    assert "cannot found" not in result["why"]  # Triton's own assertion is not for a person


@pytest.mark.parametrize("how", ["CC names none", "none on PATH"])
def test_a_failed_launcher_build_is_one_line_and_the_kernel_still_compiles(
    tmp_path: Path, libcuda: Path, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No C compiler: ``CC`` naming a missing file (an OSError), or none on ``PATH``
    (Triton's RuntimeError, which once escaped into the key's compile). The kernel is
    compiled and cached as ever, the launcher is not, why is one line; the worker builds
    its own then."""
    if not _per_signature():
        pytest.skip("this Triton builds no per-signature launcher (3.7+)")
    env = {**stub_libcuda.env(libcuda), "CC": str(tmp_path / "no-cc")}
    if how == "none on PATH":
        env = {**stub_libcuda.env(libcuda), "PATH": str(tmp_path)}
        monkeypatch.delenv("CC", raising=False)
    result = _run(tmp_path, env)
    assert result["kernel"] and result["built"] == [], result
    assert result["why"].startswith("the launcher's C build failed"), result
    assert "\n" not in result["why"]
