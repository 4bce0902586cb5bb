"""The compile-ahead child's process (``ahead``): ``python -m tq_warmup_plugin.ahead_child
JSON`` builds one worker's offline engine jobs (``engine_plan``) for its GPU architecture
into the Triton cache its environment names, host launchers included where Triton builds
them (``compat.build_host_launcher``), and prints one JSON line: the jobs built, the error
lines, the seconds, and of them those of vLLM's import and of the plan. Its own module, so
that nothing the worker imports loads it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Sequence

from .report import error_line

__all__ = ["die_with_parent", "main"]


def die_with_parent() -> None:
    """Be killed with the process that started this one (Linux ``PR_SET_PDEATHSIG``), so
    that no compile outlives its worker, nor the child that the worker stopped: the child
    sets it for itself and for each compile process it forks. Elsewhere, nothing."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


def main(argv: Sequence[str] | None = None) -> int:
    """The child: build the request's offline jobs for the target, print one JSON line."""
    argv = sys.argv[1:] if argv is None else argv
    began = time.perf_counter()
    phases: dict[str, float] = {}
    die_with_parent()
    sys.stdout.flush()
    real_stdout = os.dup(1)
    os.dup2(2, 1)  # vLLM's import talks on stdout; the result line is ours alone
    try:
        from .engine_plan import EngineRequest, build, cpu_engine, jobs
        from .shipped.precompile import use_compile_only_target
        from .warmup import plugin_manager

        given = json.loads(argv[0])
        use_compile_only_target(int(given["arch"]))
        engine = cpu_engine(EngineRequest.from_dict(given["request"]))  # vLLM's import
        phases["import"] = time.perf_counter() - began
        todo, _, errors = jobs(plugin_manager(), engine)
        phases["plan"] = time.perf_counter() - began - phases["import"]
        processes = int(given["processes"])
        done, failed = build(todo, processes=processes, each=die_with_parent)
        result = {"built": len(done), "errors": errors + failed}
    except Exception as exc:  # one line, as the worker's own errors are
        result = {"built": 0, "errors": [error_line(exc)]}
    result["seconds"] = time.perf_counter() - began
    result.update(phases)  # where its time went: the worker's report line says it
    os.write(real_stdout, (json.dumps(result) + "\n").encode())
    return 0 if not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
