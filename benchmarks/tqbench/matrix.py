"""The ``matrix`` command: one ``run`` subprocess per configuration and variant.

The parent imports neither vLLM nor torch. Every configuration runs three times, each
in a fresh process (Triton's in-memory kernel cache would otherwise hide compiles):
plugin on with a cold Triton disk cache, plugin off (``TQ_WARMUP=0``) with a cold
cache, and plugin on with the warm disk cache the first run left. With the plugin on,
vLLM's JIT monitor runs in ``error`` mode, so a kernel the plugin missed raises (a
failed phase with the message); with it off, in ``warn`` mode. Every mode and geometry
also runs once with vLLM's own KV cache (preset ``auto``, plugin on, cold): the
first-request ratio vLLM has without TurboQuant, beside each TurboQuant ratio.

Each child gets a spec file (its ``run`` options as JSON) and writes a raw run; the
parent adds what the child's log shows and stores it as
``<results-dir>/raw/<run id>/<config>.<variant>.jsonl`` as soon as the child ends, so a
matrix killed part-way keeps what it measured. Logs go to ``<results-dir>/logs/<run
id>/``. ``collect`` turns raw runs into ``SUMMARY.md``.

``--jobs N`` runs N children on the same GPU at once, each with
``gpu_memory_utilization`` about 0.9/N and a fixed KV cache size (``--kv-cache-gib``);
timings are then noisier (use ``--jobs 1`` for numbers you quote), and the first run
is made alone first so one-time costs (the CUDA driver compiling FlashAttention PTX
into ``CUDA_CACHE_PATH``) are not paid N times at once. "cold" means a fresh Triton
cache and, unless ``--share-compile-cache``, fresh vLLM / Inductor caches; "warm"
reuses the plugin-on cold run's directories. ``--deadline-s`` stops starting runs, and
kills running ones, after that many seconds (the rest are recorded as skipped/failed),
so a matrix can be split over several device calls with a time limit.

``--repeats N`` makes every on-warm run N times (each a fresh process on the same warm
caches): one request's first/steady ratio varies by about 0.3 from run to run on the
H200, so a comparison with ``auto`` needs the median of several. With ``--jobs 1`` the
runs go round-robin over the configurations after their cold runs, so TurboQuant's and
``auto``'s repeats alternate. A later matrix with ``--variants on-warm``, the same
``--work-dir`` and the same ``--series`` adds repeats to the same summary rows.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import sys
import tempfile
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.tqbench import entry_point, logs, phases, records, tables
from benchmarks.tqbench.children import Children, Deadline, Exit, child_pythonpath
from benchmarks.tqbench.cli import Option, add_options, new_parser
from benchmarks.tqbench.engine import REPO_ROOT, installed_vllm_version, nvidia_smi_name
from benchmarks.tqbench.phases import AUTO, PHASES, Geometry
from benchmarks.tqbench.run import add_common_options

__all__ = [
    "DEFAULT_RESULTS_DIR",
    "MATRIX_OPTIONS",
    "SHARED_OPTIONS",
    "Matrix",
    "RunSpec",
    "add_parser",
    "cmd_matrix",
    "interleave",
]

DEFAULT_RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
# ``run`` options every child takes from the matrix's own options, unchanged.
SHARED_OPTIONS = (
    "layers",
    "attention_chunk",
    "budget",
    "tp",
    "max_model_len",
    "max_num_seqs",
    "max_tokens",
    "kv_cache_gib",
    "jobs",
    "cudagraph_mode",
    "runner",
    "share_compile_cache",
)


@dataclass
class RunSpec:
    """One subprocess: a configuration in one variant."""

    preset: str
    mode: str
    geometry: Geometry
    variant: str  # on-cold | off-cold | on-warm
    cache_root: Path
    out: Path
    log: Path
    work_dir: Path
    config_id: str
    repeat: int = 0  # 0: the first run of this variant; k: its k-th warm repeat

    @property
    def plugin(self) -> str:
        return self.variant.split("-")[0]

    @property
    def triton_cache(self) -> str:
        return self.variant.split("-")[1]

    @property
    def spec_file(self) -> Path:
        return self.out.with_suffix(".spec.json")


class Matrix:
    """Runs the subprocesses, collects and saves their records."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run_id = dt.datetime.now().strftime("%Y%m%dT%H%M%S")
        self.series = args.series or f"matrix {self.run_id}"
        self.deadline = Deadline(args.deadline_s)
        self.children = Children()
        self.lock = threading.Lock()
        self.records: list[dict[str, Any]] = []
        results = Path(args.results_dir).resolve()
        self.log_dir = (
            Path(args.log_dir).resolve() if args.log_dir else results / "logs" / self.run_id
        )
        self.raw_dir = results / "raw" / self.run_id
        self.own_work_root = not args.work_dir
        self.work_root = Path(
            args.work_dir or tempfile.mkdtemp(prefix="tq-bench-matrix-")
        ).resolve()
        self.fallback_gpu = nvidia_smi_name()
        self.fallback_vllm = installed_vllm_version()
        # Where the children find the plugin's entry point when it is not installed.
        self.stub: list[str] = []
        if args.entry_point_stub and not entry_point.found():
            self.stub = [str(entry_point.write_stub(self.work_root / "entry-point"))]

    def _spec(
        self, preset: str, mode: str, geom: Geometry, variant: str, repeat: int = 0
    ) -> RunSpec:
        a = self.args
        cid = phases.config_id(preset, mode, geom, a.layers, a.budget, a.tp, a.attention_chunk)
        cache = "cache-on" if variant.startswith("on") else "cache-off"
        name = f"{variant}.r{repeat}" if repeat else variant
        return RunSpec(
            preset=preset,
            mode=mode,
            geometry=geom,
            variant=variant,
            cache_root=self.work_root / cid / cache,
            out=self.work_root / cid / f"{name}{records.RAW_SUFFIX}",
            log=self.log_dir / f"{cid}.{name}.log",
            work_dir=self.work_root / cid / f"work-{name}",
            config_id=cid,
            repeat=repeat,
        )

    def _chain(self, preset: str, mode: str, geom: Geometry, variants: list[str]) -> list[RunSpec]:
        """The variants of one configuration in order, each on-warm run ``--repeats`` times."""
        chain = []
        for v in variants:
            times = self.args.repeats if v == "on-warm" else 1
            chain += [self._spec(preset, mode, geom, v, k) for k in range(times)]
        return chain

    def specs(self) -> list[list[RunSpec]]:
        """Units of work: [on-cold, on-warm] chains (in order), the ``auto`` baseline of
        every mode and geometry among them (cold, and warm when on-warm runs), then the
        off-cold single runs."""
        a = self.args
        chains: list[list[RunSpec]] = []
        singles: list[list[RunSpec]] = []
        variants = phases.parse_list(a.variants, phases.VARIANTS)
        modes = phases.parse_list(a.modes, phases.MODES)
        geometries = [phases.parse_geometry(g) for g in phases.parse_list(a.geometries)]
        for preset in phases.parse_list(a.presets, phases.TQ_PRESETS):
            for mode in modes:
                for geom in geometries:
                    chain = self._chain(preset, mode, geom, variants)
                    singles.extend([s] for s in chain if s.variant == "off-cold")
                    chain = [s for s in chain if s.variant != "off-cold"]
                    if chain:
                        chains.append(chain)
        if not a.no_auto:  # the baseline in each Triton-cache state the presets run in
            auto = [v for v in variants if v != "off-cold"] or ["on-cold"]
            chains.extend(self._chain(AUTO, m, g, auto) for m in modes for g in geometries)
        # Longer chains first so they are not the stragglers.
        return chains + singles

    def child_options(self, spec: RunSpec) -> dict[str, Any]:
        """The child's ``run`` options (written to its spec file)."""
        a = self.args
        opts: dict[str, Any] = {k: getattr(a, k) for k in SHARED_OPTIONS}
        opts.update(
            preset=spec.preset,
            mode=spec.mode,
            head_size=spec.geometry.head_size,
            q_heads=spec.geometry.q_heads,
            kv_heads=spec.geometry.kv_heads,
            gpu_mem_util=a.gpu_mem_util or phases.default_gpu_mem_util(a.jobs),
            plugin=spec.plugin,
            triton_cache=spec.triton_cache,
            cache_root=str(spec.cache_root),
            work_dir=str(spec.work_dir),
            out=str(spec.out),
            run_id=self.run_id,
            config_id=spec.config_id,
            series=self.series,
        )
        if spec.plugin == "on" and spec.preset != AUTO and a.jit_monitor_mode_on:
            opts["jit_monitor_mode"] = a.jit_monitor_mode_on
        return opts

    def argv(self, spec: RunSpec) -> list[str]:
        records.write_json_atomic(spec.spec_file, self.child_options(spec))
        return [sys.executable, "-m", "benchmarks.tqbench", "run", "--spec", str(spec.spec_file)]

    def base_record(self, spec: RunSpec) -> dict[str, Any]:
        a = self.args
        return {
            "series": self.series,
            "run_id": self.run_id,
            "config_id": spec.config_id,
            "date": dt.date.today().isoformat(),
            "vllm_version": self.fallback_vllm,
            "gpu": self.fallback_gpu,
            "kv_cache_dtype": spec.preset,
            "mode": spec.mode,
            "plugin": spec.plugin,
            "triton_cache": spec.triton_cache,
            "head_size": spec.geometry.head_size,
            "q_heads": spec.geometry.q_heads,
            "kv_heads": spec.geometry.kv_heads,
            "layers": a.layers,
            "attention_chunk": a.attention_chunk,
            "budget": a.budget,
            "tp": a.tp,
            "jobs": a.jobs,
            "first_s": None,
            "steady_s": None,
            "tq_compiles_after_startup": [],
            "warmup_s": None,
            "startup_s": None,
            "log_file": str(spec.log),
            "repeat": spec.repeat,
        }

    def child_env(self, spec: RunSpec) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            PYTHONPATH=child_pythonpath(self.stub, env),
            PYTHONUNBUFFERED="1",
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            TRITON_CACHE_DIR=str(spec.cache_root / "triton"),
        )
        if not self.args.share_compile_cache:
            env["VLLM_CACHE_ROOT"] = str(spec.cache_root / "vllm")
            env["TORCHINDUCTOR_CACHE_DIR"] = str(spec.cache_root / "inductor")
        return env

    def spawn(self, spec: RunSpec, timeout: float) -> Exit:
        """Run the child with its log (the command on its first line)."""
        argv = self.argv(spec)
        print(f"[matrix] start {spec.config_id} {spec.variant} (log {spec.log})", flush=True)
        return self.children.run(argv, spec.log, self.child_env(spec), timeout, echo_argv=True)

    def run_one(self, spec: RunSpec) -> list[dict[str, Any]]:
        base = self.base_record(spec)
        left = self.deadline.left()
        if self.children.stopping or left < 30:
            why = "matrix stopped" if self.children.stopping else "deadline reached"
            skipped = [{**base, "phase": p, "status": "skipped", "error": why} for p in PHASES]
            with self.lock:  # shown in the table, not written as a raw run
                self.records.extend(skipped)
            return skipped
        if spec.triton_cache == "cold":
            shutil.rmtree(spec.cache_root, ignore_errors=True)
        elif not (spec.cache_root / "triton").is_dir():
            base["cache_warning"] = "warm run but the cold run left no Triton cache"
        spec.cache_root.mkdir(parents=True, exist_ok=True)
        spec.out.unlink(missing_ok=True)
        spec.log.parent.mkdir(parents=True, exist_ok=True)
        ended = self.spawn(spec, self.deadline.limit(self.args.timeout, margin=10))
        rc, timed_out, wall = ended.rc, ended.timed_out, ended.wall_s
        log_text = spec.log.read_text(errors="replace")
        recs = records.read_records(spec.out)
        if rc != 0 or timed_out or len(recs) < len(PHASES):
            why = "timed out" if timed_out else f"exit code {rc}"
            error = f"{why}; last log lines:\n{logs.tail_lines(log_text)}"
            seed = {**base, **records.run_level_fields(recs[0])} if recs else base
            recs = records.fill_missing_phases(recs, seed, error)
        logs.apply_log(recs, log_text)
        for r in recs:
            r.setdefault("log_file", str(spec.log))
            r.setdefault("series", self.series)
            r["rc"] = rc
            r["timed_out"] = timed_out
            r["process_wall_s"] = round(wall, 2)
            r["repeat"] = spec.repeat
            if "cache_warning" in base:
                r["cache_warning"] = base["cache_warning"]
        status = sorted(str(s) for s in {r.get("status") for r in recs})
        print(
            f"[matrix] done  {spec.config_id} {spec.variant} in {wall:.0f}s rc={rc} "
            f"status={status}",
            flush=True,
        )
        self.save(recs)
        return recs

    def run_unit(self, unit: list[RunSpec]) -> None:
        for spec in unit:
            try:
                self.run_one(spec)
            except Exception as e:  # a bug here must not stop the other runs
                traceback.print_exc()
                error = f"matrix error: {type(e).__name__}: {e}"
                self.save(records.fill_missing_phases([], self.base_record(spec), error))

    def save(self, new: list[dict[str, Any]]) -> None:
        """Keep the run's records for the tables and write them as one raw run file."""
        with self.lock:
            self.records.extend(new)
        records.write_records(self.raw_dir / records.run_file_name(new[0]), new)

    def run(self) -> int:
        self.children.stop_on_sigterm()
        units = self.specs()
        if not units:
            print("nothing to run", file=sys.stderr)
            return 2
        n_runs = sum(len(u) for u in units)
        print(
            f"[matrix] run id {self.run_id} ({self.series!r}): {n_runs} runs in {len(units)} "
            f"units, jobs={self.args.jobs}, logs in {self.log_dir}",
            flush=True,
        )
        try:
            if self.args.jobs > 1 and not self.args.no_prime:
                first, rest = units[0][0], units[0][1:]
                self.run_one(first)  # alone: pays one-time driver/PTX costs once
                units = ([rest] if rest else []) + units[1:]
            if self.args.jobs <= 1:
                for unit in interleave(units):
                    self.run_unit(unit)
            else:
                with ThreadPoolExecutor(max_workers=self.args.jobs) as pool:
                    for fut in [pool.submit(self.run_unit, u) for u in units]:
                        fut.result()
        except KeyboardInterrupt:
            self.children.kill_all()
            raise
        finally:
            if self.own_work_root and not self.args.keep_caches:
                shutil.rmtree(self.work_root, ignore_errors=True)
        print()
        tables.print_tables(self.records)
        print(f"\n[matrix] raw runs: {self.raw_dir} (then: python -m benchmarks.tqbench collect)")
        return 0 if all(r.get("status") == "ok" for r in self.records) else 1


def interleave(units: list[list[RunSpec]]) -> list[list[RunSpec]]:
    """One process at a time: every unit's first run, then the rest round-robin.

    A unit's runs stay in order (a warm run after the cold run that filled its cache), and
    the warm repeats of TurboQuant and of ``auto`` alternate, so a drift of the GPU over
    the run (clocks, temperature) reaches both alike: the comparison is made in one run.
    """
    rounds = max((len(u) for u in units), default=0)
    return [[u[k]] for k in range(rounds) for u in units if k < len(u)]


def cmd_matrix(args: argparse.Namespace) -> int:
    """Validate the lists, then run the matrix."""
    phases.parse_list(args.presets, phases.TQ_PRESETS)
    phases.parse_list(args.modes, phases.MODES)
    phases.parse_list(args.variants, phases.VARIANTS)
    for g in phases.parse_list(args.geometries):
        geom = phases.parse_geometry(g)
        if geom.q_heads % args.tp or geom.kv_heads % args.tp:
            raise SystemExit(f"geometry {g}: heads must be divisible by --tp {args.tp}")
    phases.plan_phases(args.budget, 16, args.max_tokens)  # validates the budget
    try:
        phases.check_attention_chunk(args.attention_chunk)
    except ValueError as e:
        raise SystemExit(f"matrix: --attention-chunk: {e}") from None
    if args.repeats < 1:
        raise SystemExit("matrix: --repeats must be at least 1")
    plugin_on = any(v.startswith("on") for v in phases.parse_list(args.variants, phases.VARIANTS))
    if plugin_on:
        entry_point.require("matrix", args.entry_point_stub)
    return Matrix(args).run()


MATRIX_OPTIONS: tuple[Option, ...] = (
    ("--presets", "all", f"comma list of {phases.TQ_PRESETS} or 'all'"),
    ("--modes", "eager,cudagraph", f"comma list of {phases.MODES} or 'all'"),
    ("--geometries", "128x16x8,64x16x2", "comma list of HEADSIZExQHEADSxKVHEADS"),
    ("--variants", "all", f"comma list of {phases.VARIANTS} or 'all'"),
    ("--no-auto", False, "skip the baseline runs with vLLM's own KV cache (preset auto)"),
    ("--timeout", 600.0, "seconds per subprocess"),
    (
        "--repeats",
        1,
        "run each on-warm configuration this many times (a single request's first/steady "
        "ratio varies by about 0.3 between runs; the summary shows the median)",
    ),
    ("--deadline-s", 0.0, "stop starting runs / kill running ones after this many seconds"),
    ("--no-prime", False, "with --jobs > 1, do not run the first run alone first"),
    ("--log-dir", "", "default: <results-dir>/logs/<run id>"),
    ("--results-dir", str(DEFAULT_RESULTS_DIR), "raw runs go to <results-dir>/raw/<run id>/"),
    (
        "--work-dir",
        "",
        "caches and model configs (default: a tmp dir, removed afterwards; a given dir is kept)",
    ),
    ("--keep-caches", False, "keep the default tmp work dir"),
    (
        "--entry-point-stub",
        False,
        "if the plugin's entry point is not installed, declare it for the children",
    ),
)


def add_parser(subparsers: Any) -> None:
    """The ``matrix`` subcommand."""
    m = new_parser(subparsers, "matrix", "one subprocess per configuration and variant", __doc__)
    add_options(m, MATRIX_OPTIONS)
    m.add_argument(
        "--jit-monitor-mode-on",
        choices=("warn", "error"),
        default="",
        help="JIT monitor mode for plugin-on TurboQuant runs (default error)",
    )
    add_common_options(m)
    m.set_defaults(func=cmd_matrix)
