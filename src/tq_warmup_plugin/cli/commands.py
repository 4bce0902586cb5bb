"""The ``tq-warmup`` command: doctor, inspect, precompile, verify and driver-cache.

doctor checks the install; inspect prints the plan without a GPU; precompile builds
the plan into a Triton cache directory for a target GPU, on any machine; verify
checks such a directory's manifests against its files and the installed stack. This
module is ``main``, the parser, ``doctor`` and ``inspect``; the commands that build or
read a layer are ``cli.layers``, and ``precompile``'s build itself ``shipped.build``.

``inspect`` and ``precompile`` build the same ``Geometry`` the worker builds and
feed it to the same warmers, so what they print or build is what startup warms.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from importlib import metadata
from pathlib import Path

from .. import safe_io
from ..plan import request as plan_request
from ..settings import parse
from ..worker import launches, warmup
from . import layers, plans
from .flags import Parser, arch, command, engine_args, geometry_flags, report_conflicts, whole
from .inputs import CliError

__all__ = ["CliError", "build_parser", "main"]


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


def inspect(args: argparse.Namespace) -> int:
    """Print the keys startup would warm, per path, deduplicated."""
    pm = warmup.plugin_manager()
    the_plan, named, planned = plans.plan_of(args, pm)
    geometry = planned.geometry
    engine, engine_text, engine_jobs, declined, errors = plans.engine_jobs(args, planned, pm)
    engine_notes = declined + errors
    vllm_jobs = [f"{job.family}: {job.what}" for job in engine_jobs]
    per_path: dict[str, list[str]] = {}
    for key, paths in the_plan.paths.items():
        for path in paths:
            per_path.setdefault(path, []).append(warmup.describe(key))
    first_launches = launches.describe(launches.plan(named, plans.boundary(planned)))
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
        f"{len(the_plan.keys)} distinct kernel keys for {plans.layers_text(planned.layers)} "
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
    # The engine is the default: the plan's launches alone miss an FA2 module a TurboQuant
    # engine loads, and the driver JIT-compiles it at that engine's startup (vLLM 0.26.0,
    # benchmarks/results/driver-cache/README.md).
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
        "precompile": layers.precompile,
        "verify": layers.verify,
        "driver-cache": layers.driver_cache,
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
