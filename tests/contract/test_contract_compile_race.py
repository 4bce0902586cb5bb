"""Contract: launches of one kernel key that race on the engine warmers' threads compile
it once (inside ``compat.compile_only_launches``).

The V2 sampler's 7 logprob jobs each launch ``_ranks_kernel`` with one key; side by side,
a cold V2 worker compiled it 4 times on 4 threads and 7 times on 16 (H200, vLLM 0.26.0,
serve-jit runs T and W). Here four threads launch one key of a real Triton kernel at once,
compiled for sm90 by Triton on the CPU, with Triton's own ``compile`` slowed so that every
thread misses the in-memory cache before the first compile ends: without the per-key lock
each compiles (the check can fail), with it one compiles and three load the binary from the
disk cache. Distinct keys still compile side by side.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from realvllm import activate_compile_only_driver

from tq_warmup_plugin import compat
from tq_warmup_plugin.worker.report import CompileCounter

pytestmark = pytest.mark.real_vllm

THREADS = 4


class Overlap:
    """How many of Triton's ``compile`` calls ran at once, at most."""

    def __init__(self) -> None:
        self.now = self.most = 0
        self.lock = threading.Lock()


@pytest.fixture(autouse=True)
def overlap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Overlap:
    activate_compile_only_driver()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    import triton.compiler

    slow = triton.compiler.compile  # what a kernel's binder takes as its ``compile``
    seen = Overlap()

    def compile_slowly(*args: Any, **kwargs: Any) -> Any:
        with seen.lock:
            seen.now += 1
            seen.most = max(seen.most, seen.now)
        try:
            time.sleep(0.5)  # a wide window: every thread misses before one is done
            return slow(*args, **kwargs)
        finally:
            with seen.lock:
                seen.now -= 1

    monkeypatch.setattr(triton.compiler, "compile", compile_slowly)
    return seen


def race(launch: Callable[[int], None]) -> CompileCounter:
    """``launch(i)`` on ``THREADS`` threads released together, compile-only."""
    import unrelated_kernel

    unrelated_kernel.add_one.device_caches.clear()
    start = threading.Barrier(THREADS)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            start.wait()
            launch(i)
        except BaseException as exc:  # reported below
            errors.append(exc)

    with CompileCounter() as counter, compat.compile_only_launches(load=False):
        threads = [threading.Thread(target=one, args=(i,)) for i in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []
    return counter


def same_key(i: int) -> None:
    import torch
    import unrelated_kernel

    unrelated_kernel.add_one[(1,)](torch.zeros(64), 64, BLOCK=64)


def own_key(i: int) -> None:
    import torch
    import unrelated_kernel

    unrelated_kernel.add_one[(1,)](torch.zeros(64), 64, BLOCK=64 * 2**i)


def test_a_key_raced_on_four_threads_compiles_once(overlap: Overlap) -> None:
    counter = race(same_key)
    assert (counter.compiled, counter.loaded) == (1, THREADS - 1)
    assert overlap.most == 1


def test_without_the_lock_each_thread_compiles(
    overlap: Overlap, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check can fail: Triton alone compiles the raced key on every thread."""
    monkeypatch.setattr(compat.triton, "_one_compile_per_key", _no_lock)
    assert race(same_key).compiled == THREADS
    assert overlap.most > 1


def test_distinct_keys_still_compile_side_by_side(overlap: Overlap) -> None:
    assert race(own_key).compiled == THREADS
    assert overlap.most > 1  # in Triton's compile together, not one at a time


def _no_lock() -> Any:
    import contextlib

    return contextlib.nullcontext()
