"""The commands that build or read a layer: ``precompile`` (the plan compiled for a target
by ``shipped.build``, its result printed), ``driver-cache`` (``driver.build`` on a GPU) and
``verify`` (a layer's manifests against its files and this stack), with the checks of the
directories and wheels they are given."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

from .. import compat, safe_io
from ..atomic import directory_problem
from ..settings import load
from ..shipped import manifest, pins
from ..worker import launches, warmup
from . import plans
from .inputs import CliError, geometries, geometries_from_report

__all__ = ["driver_cache", "precompile", "verify"]


def _cache_dir(path: str, inside: str | None = None) -> Path:
    """``--cache-dir``, checked writable before anything is compiled and not created: a
    command that refuses later leaves no directory behind (``_made`` creates it). Where it
    exists it must be one that no other user can swap what is built in
    (``atomic.directory_problem``: this user's or root's, closed to others unless sticky),
    as must its directory ``inside`` (``driver-cache``, where entries are staged). A
    ``current`` link to a layer is followed: what is built goes into the layer it names now."""
    cache_dir = Path(path).resolve()
    if cache_dir.exists() and not cache_dir.is_dir():
        raise CliError(f"--cache-dir {path}: exists and is not a directory")
    existing = cache_dir
    while not existing.exists():  # the directory that creating it would write into
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(f"{existing} is not a directory")
        problem = directory_problem(existing.stat(), str(existing))
        sub = cache_dir / inside if inside else None
        if not problem and sub is not None and os.path.lexists(sub):
            if sub.is_symlink() or not sub.is_dir():
                problem = f"{sub} is not a directory of its own (a link?)"
            else:
                problem = directory_problem(sub.stat(), str(sub))
        if problem:
            raise CliError(f"--cache-dir {path}: {problem}: another user could swap the build")
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".tq-warmup-probe-"):
            pass
    except OSError as exc:
        raise CliError(f"--cache-dir {path}: not writable ({exc.strerror or exc})") from None
    return cache_dir


def _made(cache_dir: Path) -> Path:
    """``cache_dir`` created, once the command is about to write into it."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CliError(f"--cache-dir {cache_dir}: {exc.strerror or exc}") from None
    return cache_dir


def _wheel_tags(path: str) -> tuple[str, str]:
    """``precompile.wheel_tags`` of ``--image-triton-wheel``, refused in one line."""
    from ..shipped.precompile import WheelError, wheel_tags

    try:
        return wheel_tags(path)
    except WheelError as exc:
        raise CliError(f"--image-triton-wheel {path}: {exc}") from None


def _image_stack(
    arch: int | None, wheel: str | None, stack: contextlib.ExitStack
) -> tuple[str | None, manifest.Stack]:
    """The image's Triton build key (None without ``--image-triton-wheel``) and the
    stack it runs: this host's, with that wheel's build and Python. The wheel, which the
    caller has checked (``_wheel_tags``), is unpacked into a directory ``stack`` removes."""
    from ..shipped.precompile import target_stack, triton_key_of_wheel

    if wheel is None:
        return None, target_stack(arch, None, None)
    key = triton_key_of_wheel(wheel, stack.enter_context(tempfile.TemporaryDirectory()))
    return key, target_stack(arch, wheel, key)


def precompile(args: argparse.Namespace) -> int:
    """Compile the plan for the target architecture into ``--cache-dir``
    (``shipped.build``) and print what was installed, its pin and its failures."""
    from ..shipped.build import EngineJobs, build_layer
    from ..shipped.precompile import InstallError, cache_keys_for, refusal

    start = time.perf_counter()
    installed = {
        "vllm": compat.installed_vllm_version(),
        "triton": compat.distribution_version("triton"),
    }
    wheel = _wheel_tags(args.image_triton_wheel)[0] if args.image_triton_wheel else None
    startup = None
    if args.geometry_json is not None and installed["vllm"] and installed["triton"]:
        found, _, version = geometries_from_report(args.geometry_json)
        startup = (args.geometry_json, version, any(g.pointer_ranges for g in found))
    refused = refusal(
        installed, args.image_vllm, args.image_triton, wheel, args.vllm_version, startup
    )
    if refused is not None or installed["vllm"] is None:
        raise CliError(refused or "vLLM is not installed")
    cache_dir = _cache_dir(args.cache_dir)
    args.vllm_version = installed["vllm"]  # compile with, and for, what is installed
    # Triton's own manager on a private directory (precompile.staging): a layered cache
    # configured in this shell would load kernels that --cache-dir does not hold.
    os.environ.pop("TRITON_CACHE_MANAGER", None)
    # Without a GPU, vLLM swaps Triton for placeholders unless this is set first.
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    pm = warmup.plugin_manager()
    the_plan, named, planned = plans.plan_of(args, pm)

    def engine_jobs() -> EngineJobs:
        engine, what, todo, _, errors = plans.engine_jobs(args, planned, pm)
        return EngineJobs(None if engine is None else todo, what, errors)

    with contextlib.ExitStack() as stack:
        wheel_key, target = _image_stack(args.arch, args.image_triton_wheel, stack)
        if wheel_key is not None:
            stack.enter_context(cache_keys_for(wheel_key))
        try:
            built = build_layer(
                _made(cache_dir), target, args.arch, pm, the_plan, named, planned,
                engine_jobs, load().threads, installed["vllm"], plans.progress, plans.stage,
            )  # fmt: skip
        except InstallError as exc:  # nothing installed: one line
            print(f"tq-warmup: {exc}", file=sys.stderr)
            return 1
    report, listed = built.report, built.kernels
    print(
        f"tq-warmup: {built.keys} keys for sm{args.arch} in {cache_dir}: "
        f"{report.compiled} built, {report.loaded} already there, {report.failed} failed; "
        f"vLLM's own kernels: {len(built.vllm_kernels)} jobs; host launchers: "
        f"{built.launchers or compat.no_launchers_why() or 0}; manifest "
        f"{built.manifest_file.name}: {len(listed)} kernels, "
        f"{sum(map(len, listed.values()))} files (compile {built.compile_s:.1f} s, "
        f"{time.perf_counter() - start:.1f} s in all with the vLLM import; "
        f"vLLM {installed['vllm']}, Triton {installed['triton']})"
    )
    print(pins.line([pins.digest(built.manifest_file.read_bytes())]))  # TQ_WARMUP_CACHE_PIN
    for line in report.errors:
        print(f"  failed: {line}", file=sys.stderr)
    return 1 if report.errors else 0


def driver_cache(args: argparse.Namespace) -> int:
    """Launch the plan's FlashAttention-2 kernels on this GPU into a fresh CUDA driver
    JIT cache and install it under ``--cache-dir`` (``driver_build``)."""
    if args.engine and not args.model:
        raise CliError("--engine starts an engine of --model: give --model")
    if args.model is not None:
        plans.stage(f"importing vLLM and reading {args.model} with its ModelConfig")
    named, planned = geometries(args)
    from ..driver.build import BuildError, build, engine_spec
    from ..driver.entry import DRIVER_DIR

    todo = launches.driver_plan(named, plans.boundary(planned))
    engine = None
    if not args.model or args.plan_only:
        print(
            "tq-warmup: driver-cache without an engine (no --model, or --plan-only): the "
            "entry holds the plan's FlashAttention-2 launches only, which may leave out "
            "modules a TurboQuant engine loads (give --model for the engine's too)",
            file=sys.stderr,
        )
    else:
        spec = engine_spec(
            planned.geometry.cache_dtype,
            args.dtype,
            args.max_model_len,
            args.max_num_seqs,
            args.max_num_batched_tokens,
            args.trust_remote_code,
            args.speculative_config,
            args.engine_args,
        )
        engine = (Path(args.model).resolve(), spec)
    try:
        layer = _cache_dir(args.cache_dir, DRIVER_DIR)
        return build(layer, todo, planned.geometry.scale, args.timeout, engine)
    except BuildError as exc:
        raise CliError(str(exc)) from None


def _manifest_digests(root: Path, triton: list[Path]) -> list[str]:
    """The sha256 of every manifest file ``verify`` read: the Triton layer's, and each
    driver-cache entry's ``manifest.json`` (``TQ_WARMUP_CACHE_PIN``'s items)."""
    from ..driver import entry as dc

    files = [*triton, *(e / dc.MANIFEST for e in dc.entries(root / dc.DRIVER_DIR))]
    return [pins.digest(safe_io.read_bytes(str(p), safe_io.MAX_JSON_BYTES)) for p in files]


def _say(line: str) -> None:
    """One line of ``verify``'s report: what a layer's author controls is escaped."""
    print(safe_io.printable(line))


def verify(args: argparse.Namespace) -> int:
    """Check every manifest in ``--cache-dir``: its files, and its stack against what is
    installed here (what the layered cache checks at startup, offline), the driver
    cache entries of ``driver-cache/``, and stages a killed precompile left."""
    root = Path(args.cache_dir)
    if not root.is_dir():
        raise CliError(f"--cache-dir {args.cache_dir}: not a directory")
    if args.image_triton_wheel is not None:
        _wheel_tags(args.image_triton_wheel)  # a bad wheel is one line, before any work
    from ..driver import verify as driver_verify
    from ..shipped.precompile import stale_stages

    stale = stale_stages(root)
    for stage in stale:
        _say(f"{stage.name}: left by a precompile that did not finish (the next one removes it)")
    driver_problems = driver_verify.print_verify(root)
    paths = manifest.manifest_files(root)
    if not paths:
        if driver_problems is not None:
            if args.print_pin:  # a layer of driver-cache entries alone is pinned too
                _say(pins.line(_manifest_digests(root, [])))
            return 1 if driver_problems or stale else 0
        _say(f"tq-warmup: no tq-warmup manifest in {root} (not built by tq-warmup precompile)")
        return 1
    with contextlib.ExitStack() as unpacked:
        here = _image_stack(args.arch, args.image_triton_wheel, unpacked)[1]
    problems, found = len(stale), {}
    pinned = pins.current()
    for path in paths:
        try:
            found[path.name] = manifest.read(path, pinned)
        except manifest.ManifestError as exc:
            _say(f"{path.name}: not a usable manifest: {exc}")
            problems += 1
    other = manifest.for_other_arch(found, here)
    for name, shipped in found.items():
        stack = [] if name in other else manifest.stack_problems(shipped, here)
        for problem in stack + manifest.file_problems(shipped, root):
            asked = isinstance(problem, manifest.Problem) and problem.what == "arch"
            _say(f"{name}: {problem.line('asked for') if asked else problem}")
            problems += 1
    kernels = sum(len(m.files) for m in found.values())
    files = sum(len(f) for m in found.values() for f in m.files.values())
    unchecked = [f for f in manifest.STACK_FIELDS if getattr(here, f) is None]
    summary = (
        f"tq-warmup: {root}: {len(paths)} manifests, {kernels} kernels, {files} files: "
        f"{problems} problem{'' if problems == 1 else 's'}"
    )
    if other:
        summary += f"; {len(other)} for another arch than sm{args.arch}"
    if unchecked:
        summary += f"; not checked (not known here): {', '.join(unchecked)}"
    _say(summary)
    if args.print_pin:
        _say(pins.line(_manifest_digests(root, [root / n for n in found])))
    return 1 if problems or driver_problems else 0
