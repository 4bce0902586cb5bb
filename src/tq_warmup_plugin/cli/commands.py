"""The ``tq-warmup`` command: doctor, inspect, precompile, verify and driver-cache.

doctor checks the install; inspect prints the plan without a GPU; precompile builds
the plan into a Triton cache directory for a target GPU, on any machine; verify
checks such a directory's manifests against its files and the installed stack.

``inspect`` and ``precompile`` build the same ``Geometry`` the worker builds and
feed it to the same warmers, so what they print or build is what startup warms.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import tempfile
import time
from collections.abc import Hashable, Iterator, Sequence
from importlib import metadata
from pathlib import Path

import pluggy

from .. import compat, safe_io
from ..atomic import directory_problem
from ..geometry import Geometry
from ..plan import request as plan_request
from ..plan.request import Planned
from ..settings import load, parse
from ..shipped import manifest, pins
from ..vllm_kernels.jobs import Engine, Job
from ..worker import launches, warmup
from ..worker.report import CompileCounter, Report
from .flags import Parser, arch, command, engine_args, geometry_flags, report_conflicts, whole
from .inputs import CliError, geometries, geometries_from_report

__all__ = ["CliError", "build_parser", "geometries_from_report", "main"]


def _entry_point_visible() -> bool:
    eps = metadata.entry_points(group="vllm.general_plugins")
    return any(ep.name == "tq_warmup" for ep in eps)


def doctor(args: argparse.Namespace) -> int:
    """Versions, support, settings, the GPU and whether vLLM will warm (``doctor.py``):
    exit 1 where it will not, with the next steps."""
    from . import doctor as checks

    settings, problems = parse()
    found = checks.diagnose(checks.facts(_entry_point_visible(), settings, problems))
    if args.json:
        print(json.dumps({**found.to_dict(), "settings_problems": problems}, indent=1))
        return 0 if found.will_warm else 1
    width = max(len(k) for k, _ in found.rows)
    for k, v in found.rows:
        print(f"{k:<{width}}  {v}")
    for line in problems:  # the WARNING lines register() logs in every vLLM process
        print(line)
    return 0 if found.will_warm else 1


def _plan(
    args: argparse.Namespace, pm: pluggy.PluginManager
) -> tuple[warmup.Plan[Hashable], dict[str, Geometry], Planned]:
    # vLLM's import (and a model's ModelConfig) is the slow part: tens of seconds on a CPU
    if args.model is not None:
        _stage(f"importing vLLM and reading {args.model} with its ModelConfig")
    else:
        _stage("importing vLLM to plan the keys")
    named, planned = geometries(args)
    return warmup.plan_keys(pm, named), named, planned


def _layers_text(n: int) -> str:
    return f"{n} TurboQuant layer{'' if n == 1 else 's'}" if n else "TurboQuant layers"


def _boundary(planned: Planned) -> dict[str, tuple[int, int, int]]:
    """A dense model's boundary layers have the TurboQuant layers' heads; a worker only
    launches their decode if it finds them on plain FlashAttention 2. Hybrids have none."""
    g = planned.geometry
    return {"boundary": (g.num_heads, g.num_kv_heads, g.head_size)} if planned.boundary else {}


def _engine(args: argparse.Namespace, planned: Planned) -> tuple[Engine | None, str]:
    """The engine the plan's worker would read (``engine_plan``), or None and why not."""
    from ..vllm_kernels.offline import cpu_engine, planned_request

    if not planned.vocab_size:
        return None, "need --model or --vocab-size for their keys"
    wanted = planned.geometry.features.version
    installed = compat.installed_vllm_version()
    if compat.parse_version(installed) != wanted:  # their keys come from its code
        return None, (
            f"their keys come from the installed vLLM's code ({installed or 'none installed'})"
            f", not {wanted[0]}.{wanted[1]}'s: run inspect where vLLM {wanted[0]}.{wanted[1]} "
            "is installed"
        )
    spec = args.speculative_config
    request = planned_request(planned, spec, args.max_logprobs, args.gpu_name, args.runner)
    return cpu_engine(request), f"{'V2' if request.runner_v2 else 'V1'} runner" + (
        f", {spec['method']} k={spec['num_speculative_tokens']}"
        if spec
        else ", no speculative decoding"
    )


def _engine_jobs(
    args: argparse.Namespace, planned: Planned, pm: pluggy.PluginManager
) -> tuple[Engine | None, str, list[Job], list[str], list[str]]:
    """The engine, its description, its offline jobs, the lines of what is not planned and
    one error line per warmer that raised while planning."""
    from ..vllm_kernels.offline import jobs

    engine, what = _engine(args, planned)
    if engine is None:
        return None, what, [], [], []
    todo, declined, errors = jobs(pm, engine)
    notes = [f"{d.family}: {d.why}" for d in declined]
    if planned.moe and not planned.experts:
        why = planned.experts_why or "no experts in the config"
        notes.append(f"fused MoE: {why}; the worker's forwards warm it at startup")
    return engine, what, todo, notes, errors


def inspect(args: argparse.Namespace) -> int:
    """Print the keys startup would warm, per path, deduplicated."""
    pm = warmup.plugin_manager()
    the_plan, named, planned = _plan(args, pm)
    geometry = planned.geometry
    engine, engine_text, engine_jobs, declined, errors = _engine_jobs(args, planned, pm)
    engine_notes = declined + errors
    vllm_jobs = [f"{job.family}: {job.what}" for job in engine_jobs]
    per_path: dict[str, list[str]] = {}
    for key, paths in the_plan.paths.items():
        for path in paths:
            per_path.setdefault(path, []).append(warmup.describe(key))
    first_launches = launches.describe(launches.plan(named, _boundary(planned)))
    if args.json:
        out = {
            "distinct": len(the_plan.keys),
            "turboquant_layers": planned.layers,
            "source": planned.note,
            "paths": per_path,
            "launches": first_launches,
            "geometry": geometry.to_dict(),
            "vllm_kernels": {
                "engine": engine_text if engine else None,
                "jobs": vllm_jobs,
                "not_planned": engine_notes if engine else [engine_text],
            },
        }
        print(json.dumps(out, indent=2))
        return 0
    print(
        f"{len(the_plan.keys)} distinct kernel keys for {_layers_text(planned.layers)} "
        f"({geometry.cache_dtype}, vLLM {'.'.join(map(str, geometry.features.version))}, "
        f"sm{args.arch}; {planned.note})"
    )
    listed = sum(map(len, per_path.values()))
    if listed > len(the_plan.keys):  # the same key serves decode and short continuations
        print(f"paths share keys: {listed} listed by path below, each compiled once")
    for path, described in per_path.items():
        print(f"\n{path}: {len(described)}")
        for text in described:
            print(f"  {text}")
    print(f"\nfirst launches on the GPU (TQ_WARMUP_LAUNCH): {len(first_launches)}")
    for text in first_launches:
        print(f"  {text}")
    if engine is None:
        print(f"\nvLLM's own kernels: not planned: {engine_text}")
        return 0
    print(f"\nvLLM's own kernels ({engine_text}): {len(vllm_jobs)} jobs")
    for text in vllm_jobs + [f"not here: {note}" for note in engine_notes]:
        print(f"  {text}")
    return 0


def _stage(text: str) -> None:
    """One progress line on a terminal's stderr (never in a pipe or a log)."""
    if sys.stderr.isatty():
        print(f"tq-warmup: {text} ...", file=sys.stderr, flush=True)


def _progress(done: int, total: int) -> None:
    if sys.stderr.isatty():
        filled = math.floor(30 * done / max(total, 1))
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{total}")
        sys.stderr.flush()
        if done == total:
            sys.stderr.write("\n")


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
    """Compile the plan for the target architecture into ``--cache-dir``."""
    from ..shipped.precompile import refusal

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
    the_plan, named, planned = _plan(args, pm)

    from ..shipped.precompile import (
        InstallError,
        cache_keys_for,
        install,
        staging,
        use_compile_only_target,
    )
    from ..vllm_kernels.offline import build

    use_compile_only_target(args.arch)
    report = Report(vllm_version=installed["vllm"], distinct=len(the_plan.keys))
    with contextlib.ExitStack() as stack:  # the worker's compile path: same threads, lines
        wheel_key, target = _image_stack(args.arch, args.image_triton_wheel, stack)
        if wheel_key is not None:
            stack.enter_context(cache_keys_for(wheel_key))
        try:
            stage = stack.enter_context(staging(_made(cache_dir), target))
            os.environ["TRITON_CACHE_DIR"] = str(stage)
            compile_start = time.perf_counter()
            key_dirs = warmup.compile_into(report, pm, the_plan.keys, load().threads, _progress)
            engine, engine_text, engine_jobs, _, errors = _engine_jobs(args, planned, pm)
            built: list[str] = []
            if engine is not None:
                _stage(f"vLLM's own kernels ({engine_text}): {len(engine_jobs)} jobs")
                with CompileCounter() as counter:
                    done, failed = build(engine_jobs)
                key_dirs = set(key_dirs) | counter.dirs
                built = [f"{job.family}: {job.what}" for job in done]
                report.errors.extend(errors + failed)
            launchers = compat.launcher_dirs(str(stage))  # what a GPU builds on first load
            key_dirs = set(key_dirs) | launchers
            compile_s = time.perf_counter() - compile_start
            plan = {
                "kv_cache_dtype": planned.geometry.cache_dtype,
                "geometries": [g.to_dict() for g in named.values()],
                "keys": [warmup.describe(k) for k in the_plan.keys],
                "vllm_kernels": built,
            }
            _stage(f"installing {len(key_dirs)} kernels into {cache_dir}")
            manifest_file = install(cache_dir, stage, key_dirs, plan, target)
        except (InstallError, OSError) as exc:  # a full disk: one line, nothing installed
            why = exc if isinstance(exc, InstallError) else f"{cache_dir}: {exc.strerror or exc}"
            print(f"tq-warmup: {why}", file=sys.stderr)
            return 1
    listed = manifest.read(manifest_file).files  # counted as verify counts them
    print(
        f"tq-warmup: {len(the_plan.keys)} keys for sm{args.arch} in {cache_dir}: "
        f"{report.compiled} built, {report.loaded} already there, {report.failed} failed; "
        f"vLLM's own kernels: {len(built)} jobs; host launchers: "
        f"{len(launchers) or compat.no_launchers_why() or 0}; manifest "
        f"{manifest_file.name}: {len(listed)} kernels, {sum(map(len, listed.values()))} files "
        f"(compile {compile_s:.1f} s, {time.perf_counter() - start:.1f} s in all with the "
        f"vLLM import; vLLM {installed['vllm']}, Triton {installed['triton']})"
    )
    print(pins.line([pins.digest(manifest_file.read_bytes())]))  # TQ_WARMUP_CACHE_PIN
    for line in report.errors:
        print(f"  failed: {line}", file=sys.stderr)
    return 1 if report.errors else 0


def driver_cache(args: argparse.Namespace) -> int:
    """Launch the plan's FlashAttention-2 kernels on this GPU into a fresh CUDA driver
    JIT cache and install it under ``--cache-dir`` (``driver_build``)."""
    if args.engine and not args.model:
        raise CliError("--engine starts an engine of --model: give --model")
    if args.model is not None:
        _stage(f"importing vLLM and reading {args.model} with its ModelConfig")
    named, planned = geometries(args)
    from ..driver.build import BuildError, build, engine_spec
    from ..driver.entry import DRIVER_DIR

    todo = launches.driver_plan(named, _boundary(planned))
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


IMAGE_WHEEL_HELP = (
    "the image's Triton wheel, when the image runs another Python: Triton's cache keys "
    "hash its own build, so they are computed from this wheel (same Triton release only)"
)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line, every subcommand's flags (the docs' commands are checked
    against it: ``tests/test_docs_commands.py``)."""
    parser = Parser(
        prog="tq-warmup",
        description="Warm vLLM's TurboQuant kernels: doctor checks this machine; inspect "
        "prints the kernel keys startup would warm (no GPU needed); precompile builds them "
        "into a Triton cache directory for a target GPU; verify checks such a directory; "
        "driver-cache fills a CUDA driver JIT cache on a GPU. inspect and precompile plan "
        "exactly what a worker's startup warms.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    p_doctor = command(
        sub,
        "doctor",
        help="will this machine's vLLM warm? versions, settings, GPU; exit 1 if not",
        description="Checks the installed vLLM, torch and Triton, the plugin's settings, "
        "vLLM's plugin filter and entry point, and the GPUs; prints the next step where "
        "the plugin will not warm, and exits 1 there (0 where it will).",
    )
    p_doctor.add_argument("--json", action="store_true", help="one JSON object instead of rows")
    p_inspect = command(sub, "inspect", help="print the kernel keys startup would warm")
    geometry_flags(p_inspect)
    p_inspect.add_argument("--json", action="store_true", help="the plan as JSON")
    p_pre = command(sub, "precompile", help="build the keys into a Triton cache dir")
    geometry_flags(p_pre)
    p_pre.add_argument("--cache-dir", required=True, help="the Triton cache layer to build")
    p_pre.add_argument("--image-vllm", help="vLLM version the image will run")
    p_pre.add_argument("--image-triton", help="Triton version the image will run")
    p_pre.add_argument("--image-triton-wheel", help=IMAGE_WHEEL_HELP)
    p_verify = command(
        sub, "verify", help="check a precompiled cache dir's files and stack (exit 1 on a problem)"
    )
    p_verify.add_argument("--cache-dir", required=True, help="a layer tq-warmup precompile built")
    p_verify.add_argument(
        "--print-pin",
        action="store_true",
        help="also print the TQ_WARMUP_CACHE_PIN value that pins every manifest it read",
    )
    p_verify.add_argument(
        "--arch", type=arch, help="the GPU it is for, e.g. 90 (default: arch is not checked)"
    )
    p_verify.add_argument(
        "--image-triton-wheel",
        help="check the stack against this Triton wheel's build and Python (the one "
        "precompile was given), not this host's",
    )
    p_driver = command(
        sub,
        "driver-cache",
        help="on a GPU: fill a CUDA driver JIT cache with the plan's FlashAttention-2 "
        "kernels, into --cache-dir/driver-cache",
    )
    geometry_flags(p_driver)
    p_driver.add_argument("--cache-dir", required=True, help="the shipped layer")
    p_driver.add_argument(
        "--timeout",
        type=whole(1),
        default=1200,
        help="seconds the launches may take (and the engine, each)",
    )
    # The engine is the default: the plan's launches alone filled 3 of the 4 FA2 modules a
    # TurboQuant engine loads, and an engine given that entry was still JIT-compiling after
    # 120 s (benchmarks/results/driver-cache/README.md).
    how = p_driver.add_mutually_exclusive_group()
    how.add_argument(
        "--engine",
        action="store_true",
        help="after the plan's launches, start a dummy-weight vLLM engine of --model into "
        "the same cache and serve two prompts (the default with --model): what vLLM's own "
        "warmup and first requests load, which the plan's launches alone do not all reach",
    )
    p_driver.add_argument(
        "--engine-args",
        type=engine_args,
        default={},
        metavar="JSON",
        help="more of the fleet's engine arguments for the engine, a JSON object by vLLM's "
        'EngineArgs names (e.g. \'{"gdn_prefill_backend": "triton"}\'): what changes the '
        "kernels and graphs its workers load",
    )
    how.add_argument(
        "--plan-only",
        action="store_true",
        help="the plan's launches alone, no engine (where vLLM's engine cannot start here)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: every way it ends is an exit code and, where it did not do
    what was asked, one ``tq-warmup:`` line on stderr; exit 2 where it could not run
    (refused input, a closed or broken stdout, any unforeseen error), never a traceback."""
    _tolerant_streams()
    if sys.stdout is None:  # `tq-warmup doctor >&-`: Python starts without one
        _error("standard output is closed: there is nowhere to print the answer")
        return 2
    args = build_parser().parse_args(argv)
    conflicts = report_conflicts(sys.argv[1:] if argv is None else argv)
    if conflicts:
        _error(
            f"--geometry-json plans from a startup report, which fixes "
            f"{', '.join(conflicts)}: drop them"
        )
        return 2
    # vLLM's import-time warnings (no CUDA here, no vllm._C) are not the CLI's answer.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    handlers = {
        "doctor": doctor,
        "inspect": inspect,
        "precompile": precompile,
        "verify": verify,
        "driver-cache": driver_cache,
    }
    handler = handlers[args.command]
    with _sigterm_interrupts():
        try:
            rc = handler(args)
            sys.stdout.flush()  # inside the try: a reader that went away is one case below
            return rc
        except (CliError, plan_request.PlanError) as exc:
            _error(str(exc))
            return 2
        except BrokenPipeError:  # `tq-warmup inspect | head`: the reader has gone
            with contextlib.suppress(Exception):  # nothing more reaches it at exit either
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            _error(f"{args.command}: standard output was closed before the answer was printed")
            return 2
        except KeyboardInterrupt:  # SIGINT, or SIGTERM (below): the stacks have unwound
            _error(
                f"{args.command} interrupted: its stage is removed and nothing "
                "it had not finished installing was installed"
            )
            return 130
        except Exception as exc:  # a case nobody foresaw is still one line, not a traceback
            _error(f"{args.command} failed: {_crash(exc)}")
            return 2


def _error(line: str) -> None:
    """One ``tq-warmup:`` line on stderr, if there is a stderr; what a layer's author or
    a file name controls is escaped (``safe_io.printable``)."""
    if sys.stderr is not None:
        with contextlib.suppress(OSError):
            print(f"tq-warmup: {safe_io.printable(line)}", file=sys.stderr, flush=True)


def _crash(exc: BaseException) -> str:
    """An unforeseen exception in one line: its type, first line and where it was raised."""
    import traceback

    text = str(exc).strip().splitlines()
    where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    at = f" (at {Path(where[0].filename).name}:{where[0].lineno})" if where else ""
    return f"{type(exc).__name__}{': ' + text[0] if text else ''}{at}"


def _tolerant_streams() -> None:
    """stdout and stderr escape what they cannot encode (a file name that is not UTF-8
    arrives as lone surrogates) instead of raising UnicodeEncodeError mid-answer."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            with contextlib.suppress(Exception):
                reconfigure(errors="backslashreplace")


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM (a kubelet, ``timeout``) unwinds like Ctrl-C, so ``precompile`` and
    ``driver-cache`` remove their stages and roll back a half-done install instead of
    dying with them in place. SIGKILL cannot be caught: its stage is left, and the next
    ``precompile`` removes it and ``verify`` names it (``precompile.stale_stages``)."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    raise SystemExit(main())
