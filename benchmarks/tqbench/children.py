"""The benchmark's children: each in its own process group, logged, time-limited.

``matrix``, ``spec`` and ``shipped`` run every engine in a child process, so that a crash
(an illegal memory access, a hang in a CUDA graph) ends only that child. A child is
started in a new session (``start_new_session``): vLLM's engine core and compile workers
are its descendants, and killing the group takes them along, where killing only the child
would leave them holding the GPU.
A parent killed from outside (a device call's time limit sends SIGTERM) kills its
children first: :meth:`Children.stop_on_sigterm`. Every child of a benchmark starts here
(``run`` to a log, ``spawn`` a server, ``capture`` what a short child prints), so each
is in its own group and reached by ``kill_all`` (``tests/test_bench_children.py`` holds
the other modules to it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from benchmarks.tqbench.engine import REPO_ROOT

__all__ = ["Children", "Deadline", "Exit", "Output", "child_pythonpath", "exit_now"]


class Deadline:
    """Seconds left of ``--deadline-s`` (0: no deadline) since this object was made."""

    def __init__(self, seconds: float) -> None:
        self.seconds = float(seconds or 0.0)
        self.t0 = time.monotonic()

    def left(self) -> float:
        """Seconds left; ``inf`` without a deadline."""
        if not self.seconds:
            return float("inf")
        return self.seconds - (time.monotonic() - self.t0)

    def limit(self, timeout: float, margin: float = 0.0) -> float:
        """A child's time limit: ``timeout``, within the deadline less ``margin``, at least 1 s."""
        return max(1.0, min(float(timeout), self.left() - margin))


@dataclass(frozen=True)
class Exit:
    """How a child ended: its exit code (negative: killed by that signal), whether it
    was killed at its time limit, and its wall seconds."""

    rc: int
    timed_out: bool
    wall_s: float


@dataclass(frozen=True)
class Output:
    """A captured child: its command, how it ended, and its stdout and stderr apart."""

    argv: tuple[str, ...]
    exit: Exit
    stdout: str
    stderr: str

    @property
    def rc(self) -> int:
        return self.exit.rc

    def check(self) -> Output:
        """Itself, where the child exited 0; else ``CalledProcessError``."""
        if self.rc != 0:
            raise subprocess.CalledProcessError(self.rc, self.argv, self.stdout, self.stderr)
        return self


def child_pythonpath(first: Sequence[str], env: Mapping[str, str]) -> str:
    """A child's ``PYTHONPATH``: ``first`` (an entry-point stub, another plugin tree),
    the repository root, then what the parent's already had."""
    return os.pathsep.join([*first, str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])


class Children:
    """The running children of one benchmark, each killed with its process group."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.stopping = False

    def run(
        self,
        argv: Sequence[str],
        log: Path,
        env: Mapping[str, str],
        timeout: float,
        *,
        echo_argv: bool = False,
    ) -> Exit:
        """Run ``argv`` from the repository root, stdout and stderr to ``log``; kill its
        group after ``timeout`` seconds. ``echo_argv``: the log starts with the command."""
        log.parent.mkdir(parents=True, exist_ok=True)
        t = time.monotonic()
        timed_out = False
        with log.open("wb") as logf:
            if echo_argv:
                logf.write(("$ " + " ".join(argv) + "\n").encode())
                logf.flush()
            rc, timed_out = self._wait(self._start(argv, logf, env), timeout)
        return Exit(rc, timed_out, time.monotonic() - t)

    def capture(self, argv: Sequence[str], env: Mapping[str, str], timeout: float) -> Output:
        """Run ``argv`` as :meth:`run` does (its own group, from the repository root,
        killed after ``timeout`` seconds) and return what it printed, stdout and stderr
        apart: a short child whose output is its answer (a build's summary line, a pin)."""
        t = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="tqbench-child-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            with out.open("wb") as outf, err.open("wb") as errf:
                rc, timed_out = self._wait(self._start(argv, outf, env, errf), timeout)
            ended = Exit(rc, timed_out, time.monotonic() - t)
            return Output(
                tuple(argv), ended, out.read_text(errors="replace"), err.read_text(errors="replace")
            )

    def _wait(self, proc: subprocess.Popen[bytes], timeout: float) -> tuple[int, bool]:
        """``proc``'s exit code, its group killed after ``timeout`` seconds (then True)."""
        try:
            return proc.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return proc.wait(), True
        finally:
            with self.lock:
                self.procs.pop(proc.pid, None)

    def spawn(
        self, argv: Sequence[str], log: Path, env: Mapping[str, str]
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` (a server) in its own process group, output to ``log``, and
        return at once; :meth:`stop` (or :meth:`kill_all`) ends it with its group."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as logf:
            return self._start(argv, logf, env)

    def _start(
        self, argv: Sequence[str], logf: Any, env: Mapping[str, str], errf: Any = None
    ) -> subprocess.Popen[bytes]:
        """``argv`` from the repository root in a new session (its own process group),
        output to ``logf`` (stderr too, unless ``errf``), registered so that
        :meth:`kill_all` reaches it."""
        proc = subprocess.Popen(
            list(argv),
            cwd=REPO_ROOT,
            env=dict(env),
            stdout=logf,
            stderr=subprocess.STDOUT if errf is None else errf,
            start_new_session=True,
        )
        with self.lock:
            self.procs[proc.pid] = proc
        return proc

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        """Kill a spawned child's group and reap it."""
        _kill_group(proc)
        proc.wait()
        with self.lock:
            self.procs.pop(proc.pid, None)

    def first_then_together(self, work: Sequence[Any], run: Any, jobs: int) -> None:
        """``run(item)`` for the first item alone (on a fresh machine the CUDA driver
        compiles FlashAttention's sm90 PTX in the first engine, 2-5 min on the H200, and
        engines starting together would each pay it), then the rest ``jobs`` at a time;
        any exception (a SIGTERM's SystemExit too) kills every child's group first."""
        from concurrent.futures import ThreadPoolExecutor

        if not work:
            return
        try:
            run(work[0])
            with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
                for fut in [pool.submit(run, item) for item in work[1:]]:
                    fut.result()
        except BaseException:
            self.kill_all()
            raise

    def kill_all(self) -> None:
        """Kill every running child's group; children asked for later are not started."""
        self.stopping = True
        with self.lock:
            procs = list(self.procs.values())
        for p in procs:
            _kill_group(p)

    def stop_on_sigterm(self) -> None:
        """On SIGTERM, kill the children, then exit 128 + 15 (main thread only)."""

        def handler(signum: int, _frame: Any) -> None:
            self.kill_all()
            raise SystemExit(128 + signum)

        with contextlib.suppress(ValueError):  # only possible in the main thread
            signal.signal(signal.SIGTERM, handler)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill the process group of a child we started (it and its workers)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def exit_now(rc: int) -> NoReturn:
    """End a child process at once, its output flushed: a broken CUDA context can hang
    the interpreter's exit."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
