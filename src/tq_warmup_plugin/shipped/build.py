"""``tq-warmup precompile``'s build: a plan compiled for the target into a private stage
and installed into the layer, the same compile path as the worker's (its threads, its
error lines), then vLLM's own kernels (the engine warmers' offline jobs), the host
launchers Triton builds on a kernel's first load, and the manifest. The CLI refuses what
cannot be built and prints the ``Built`` this returns.

Triton runs with its own cache manager on the stage (``precompile.staging``): a layered
cache configured in this shell would load kernels that the layer does not hold.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pluggy

from .. import compat
from ..geometry import Geometry
from ..plan.request import Planned
from ..vllm_kernels.jobs import Job
from ..worker.keyplan import Plan, compile_into, describe
from ..worker.report import CompileCounter, Report
from . import manifest, precompile
from .precompile import InstallError

__all__ = ["Built", "EngineJobs", "build_layer"]


@dataclass(frozen=True)
class EngineJobs:
    """The engine warmers' offline jobs of a plan, or why there are none (``jobs`` None)."""

    jobs: Sequence[Job] | None
    what: str
    """The engine (its runner, its speculation), or why it is not planned."""
    errors: Sequence[str] = ()
    """One line per warmer that raised while planning."""


@dataclass
class Built:
    """What ``build_layer`` installed: the counts the CLI prints."""

    cache_dir: Path
    keys: int
    report: Report
    manifest_file: Path
    vllm_kernels: list[str] = field(default_factory=list)
    """``family: what`` of each engine job built."""
    launchers: int = 0
    compile_s: float = 0.0

    @property
    def kernels(self) -> dict[str, list[str]]:
        """The manifest's kernels and their files, counted as ``verify`` counts them."""
        return {k: list(v) for k, v in manifest.read(self.manifest_file).files.items()}


def build_layer(
    cache_dir: Path,
    target: manifest.Stack,
    arch: int,
    pm: pluggy.PluginManager,
    plan: Plan[Hashable],
    named: dict[str, Geometry],
    planned: Planned,
    engine_jobs: Callable[[], EngineJobs],
    threads: int,
    vllm_version: str,
    progress: Callable[[int, int], None] | None = None,
    say: Callable[[str], None] = lambda line: None,
) -> Built:
    """Compile ``plan``'s keys for ``arch`` into a stage of ``cache_dir`` (which exists)
    and install them for ``target``. ``engine_jobs`` is asked once the stage is Triton's
    cache, as the worker asks its warmers. Raises InstallError with one line where
    nothing was installed (a full disk among them); a key that failed is an error line
    of the result's report, not an exception."""
    precompile.use_compile_only_target(arch)  # read at call time: tests stub it
    report = Report(vllm_version=vllm_version, distinct=len(plan.keys))
    try:
        with precompile.staging(cache_dir, target) as stage:
            os.environ["TRITON_CACHE_DIR"] = str(stage)
            start = time.perf_counter()
            key_dirs = set(compile_into(report, pm, plan.keys, threads, progress))
            engine = engine_jobs()
            built: list[str] = []
            if engine.jobs is not None:
                from ..vllm_kernels.offline import build

                say(f"vLLM's own kernels ({engine.what}): {len(engine.jobs)} jobs")
                with CompileCounter() as counter:
                    done, failed = build(list(engine.jobs))
                key_dirs |= counter.dirs
                built = [f"{job.family}: {job.what}" for job in done]
                report.errors.extend([*engine.errors, *failed])
            launchers = compat.launcher_dirs(str(stage))  # what a GPU builds on first load
            key_dirs |= launchers
            compile_s = time.perf_counter() - start
            described = {
                "kv_cache_dtype": planned.geometry.cache_dtype,
                "geometries": [g.to_dict() for g in named.values()],
                "keys": [describe(k) for k in plan.keys],
                "vllm_kernels": built,
            }
            say(f"installing {len(key_dirs)} kernels into {cache_dir}")
            manifest_file = precompile.install(cache_dir, stage, key_dirs, described, target)
    except OSError as exc:  # a full disk: one line, nothing installed
        raise InstallError(f"{cache_dir}: {exc.strerror or exc}") from None
    return Built(cache_dir, len(plan.keys), report, manifest_file, built, len(launchers), compile_s)
