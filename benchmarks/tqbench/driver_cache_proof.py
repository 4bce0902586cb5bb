"""The ``driver-cache-proof`` command: a fresh Hopper node starts as fast as a warm one (issue 22).

On one GPU, in one process tree, each step bounded by its own timeout and a deadline.
The first three run side by side (each pays what a fresh machine pays, so their seconds
carry some contention; the engines after them run alone):

``fresh``
    a TurboQuant engine (``turboquant_4bit_nc``, dummy weights, eager, fixed KV cache,
    plugin on) with a fresh HOME, Triton and compile caches and no driver cache: it pays
    the FA2 JIT, in the plugin's first launches;
``auto``
    the same engine with ``--kv-cache-dtype auto``, also fresh: vLLM's own Hopper path
    (FA3, sm_90a code, when the staging kept it), the start TurboQuant is to match;
``build``
    ``tq-warmup driver-cache --engine`` (``--plan-only``: without ``--engine``) from the
    dummy Llama ``spec`` engines use (8 layers, head size 128, 16/8 heads), into a fresh
    layer: on a fresh machine it pays the FA2 JIT (172 s of launches on the H200, 0.26.0):
    its seconds, per launch, the entry's size and files;
``decision``
    ``register()`` in a fresh interpreter over the layer (the INFO line and the
    ``CUDA_CACHE_PATH`` it sets) and over a copy whose manifest names another driver
    (one WARNING, nothing set); ``tq-warmup verify`` of the layer;
``read-only``
    one FA2 launch (the build's slowest) with ``CUDA_CACHE_PATH`` a read-only bind mount
    of the entry (``unshare -m``, root), beside one over a writable copy: does the driver
    use a read-only cache, and does it write on a hit;
``late-env``
    the same launch with ``CUDA_CACHE_PATH`` set only after torch initialised CUDA and
    made a context: does the driver read it at init (then ``register()`` in a process
    that already has CUDA is too late) or at the JIT;
``variants``
    FA2 calls the plan does not make (a one-token prompt; vLLM V2's warmup steps), each
    timed over a writable copy of the entry: which one compiles what the entry lacks;
``shipped``
    the ``fresh`` engine again, with a fresh HOME, Triton cache and
    ``TQ_WARMUP_DRIVER_CACHE_COPY_TO``, given only the layer: startup seconds and the
    report's "first launches N ms";
``warm``
    the same engine again over the copy the first one used and grew: the warm engine.

Expected: ``shipped`` first launches under 1000 ms and its startup within 5 s of
``warm``'s (the ``target`` lines, one per ``--pairs`` pair; ``verdict`` in the JSON);
``decision`` one WARNING naming the driver for the other manifest. Run from the repository
root on the GPU machine, in two calls of under 10 minutes (the H200 runs of 2026-12-01 are
``benchmarks/results/driver-cache/``): the build (305 s on a fresh H200), then the rest::

    source .stage/setup.sh && PYTHONPATH=$PWD/src:$PWD:$PYTHONPATH \\
        python -m benchmarks.tqbench driver-cache-proof --build-only --skip-fresh \\
        --work-dir /var/tmp/keep/dproof --out $OUT
    ... driver-cache-proof --skip-fresh --work-dir /var/tmp/keep/dproof --out $OUT

It prints a table and writes ``driver-cache-proof.json``, ``.md``, the entry's manifest and
the children's logs (tails) to ``--out``. The parent imports neither vLLM nor torch.
With ``--work-dir`` kept, ``<work-dir>/nv-engines`` is the driver cache the engines
grew: later engines on the same machine can start from it (``CUDA_CACHE_PATH``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.tqbench import entry_point, logs, phases, records, shipped, tables
from benchmarks.tqbench.children import Children
from benchmarks.tqbench.cli import Option, add_options, new_parser
from benchmarks.tqbench.driver_cache_parts import (
    DECISION_PROBE,
    LAUNCH_PROBE,
    PRESET,
    candidate_launches,
    changed_files,
    is_engine,
    label,
    mib,
    probe_out,
    slowest_launch,
    table_rows,
    tree,
    variant_launches,
    verdict,
)
from benchmarks.tqbench.spec_child import child_argv, child_env, read_result
from benchmarks.tqbench.spec_configs import (
    MODEL_SIZES,
    REFERENCE,
    ModelSize,
    SpecConfig,
    model_config,
    spec_prompts,
)

__all__ = ["OPTIONS", "Proof", "add_parser", "cmd_driver_cache_proof"]

REPO_ROOT = Path(__file__).resolve().parents[2]
CUDA_CACHE_VARS = ("CUDA_CACHE_PATH", "CUDA_CACHE_DISABLE", "CUDA_CACHE_MAXSIZE")
LOG_TAIL = 2 << 20
ENGINE_SHAPE = ("--geometry", "--max-model-len", "--max-num-seqs", "--budget", "--kv-cache-gib")


def _fresh_copy(src: Path, dst: Path) -> Path:
    """``dst`` a new copy of ``src``: a kept work dir's earlier copy is replaced."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    return dst


class Proof:
    """Runs the steps in order, keeping one row each; every step is time-bounded."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t0 = time.monotonic()
        self.work = Path(args.work_dir or tempfile.mkdtemp(prefix="tq-driver-proof-")).resolve()
        self.out = Path(args.out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.layer = self.work / "layer"
        self.rows: list[dict[str, Any]] = []
        self.path = [str(REPO_ROOT / "src"), str(REPO_ROOT)]
        if not entry_point.found():
            self.path.insert(0, str(entry_point.write_stub(self.work / "entry-point")))
        self.model = self.work / "model"
        self.model.mkdir(parents=True, exist_ok=True)
        self.geometry = phases.parse_geometry(args.geometry)
        # The engines' model (spec_child.write_models writes the same config.json).
        small = asdict(MODEL_SIZES["small"])
        self.size = {**small, "geometry": args.geometry, "layers": args.layers}
        config = model_config(None, ModelSize(**self.size), args.max_model_len)
        (self.model / "config.json").write_text(json.dumps(config, indent=1))
        self.entry: Path | None = None
        self.manifest: dict[str, Any] = {}
        self.lock = threading.Lock()
        self.children = Children()

    def left(self, cap: float) -> float:
        return min(cap, float(self.args.deadline_s) - (time.monotonic() - self.t0))

    def env(self, home: str, **extra: str) -> dict[str, str]:
        """The caller's environment without any CUDA cache variable (the staging may set
        one), a fresh HOME (so ``~/.nv`` is empty), the plugin importable and loadable."""
        env = {k: v for k, v in os.environ.items() if k not in CUDA_CACHE_VARS}
        env.update({"HOME": str(self.work / home), "PYTHONUNBUFFERED": "1", **extra})
        shutil.rmtree(self.work / home, ignore_errors=True)  # a kept work dir's is not fresh
        (self.work / home).mkdir(parents=True)
        env["PYTHONPATH"] = os.pathsep.join([*self.path, env.get("PYTHONPATH", "")])
        return env

    def run(self, name: str, argv: list[str], env: dict[str, str], cap: float) -> dict[str, Any]:
        """One child in its own process group (``Children``: killed with its engine core
        and compile workers at its limit), its log's tail under ``--out``, rc (None:
        timed out) and seconds."""
        limit = self.left(cap)
        if limit < 10:
            return {"rc": None, "wall_s": 0.0, "text": "", "skipped": "deadline"}
        log = self.work / "logs" / f"{name}.log"
        ended = self.children.run(argv, log, env, limit)
        text = log.read_text(errors="replace")
        (self.out / f"{name}.log").write_text(text[-LOG_TAIL:])
        rc = None if ended.timed_out else ended.rc
        return {"rc": rc, "wall_s": round(ended.wall_s, 1), "text": text}

    def add(self, row: dict[str, Any]) -> None:
        row.pop("text", None)
        with self.lock:  # the first steps run side by side
            self.rows.append(row)
            records.write_json_atomic(self.out / "driver-cache-proof.json", {"rows": self.rows})
        print(f"[driver-cache-proof] {row['step']}: {json.dumps(row)[:600]}", flush=True)

    # -- the steps ------------------------------------------------------------------------

    def build(self) -> None:
        a = self.args
        argv = [sys.executable, "-m", "tq_warmup_plugin.cli", "driver-cache"]
        argv += ["--model", str(self.model), "--kv-cache-dtype", PRESET, "--dtype", "bfloat16"]
        argv += ["--max-model-len", str(a.max_model_len), "--max-num-seqs", str(a.max_num_seqs)]
        argv += ["--max-num-batched-tokens", str(a.budget), "--cache-dir", str(self.layer)]
        if a.plan_only:  # the plan's launches alone missed a module (H200, 2026-12-01)
            argv.append("--plan-only")
        got = self.run("build", argv, self.env("home-build"), a.build_timeout)
        row: dict[str, Any] = {"step": "build", **got, "line": got["text"].strip()[-600:]}
        found = self.take_entry()
        if found is not None:
            assert self.entry is not None
            du = subprocess.run(
                ["du", "-sh", str(self.entry / "cache")], capture_output=True, text=True
            )
            row.update(found, du=du.stdout.split("\t")[0])
        self.add(row)

    def take_entry(self) -> dict[str, Any] | None:
        """The layer's entry, if it has one (its manifest copied to ``--out``): the build
        row's facts about it."""
        found = sorted((self.layer / "driver-cache").glob("*/manifest.json"))
        if not found:
            return None
        self.entry = found[0].parent
        self.manifest = json.loads(found[0].read_text())
        shutil.copy(found[0], self.out / "manifest.json")
        files = tree(self.entry / "cache")
        extra = self.manifest.get("extra") or {}
        return {
            "entry": self.entry.name,
            "files": len(files),
            "mib": round(sum(files.values()) / 2**20, 1),
            "launch_s": extra.get("launch_s"),
            "engine_s": extra.get("engine_s"),
            "driver": self.manifest.get("driver"),
            "gpu": self.manifest.get("gpu"),
            "cuda_driver_api": self.manifest.get("cuda_driver_api"),
        }

    def decision(self) -> None:
        assert self.entry is not None
        other = _fresh_copy(
            self.entry, self.work / "layer-other" / "driver-cache" / self.entry.name
        )
        data = json.loads((other / "manifest.json").read_text())
        (other / "manifest.json").write_text(json.dumps({**data, "driver": "1.0.0"}))
        for name, root in (("decision-shipped", self.layer), ("decision-other", other.parents[1])):
            env = self.env(f"home-{name}", TQ_WARMUP_DRIVER_CACHE=str(root / "driver-cache"))
            env["TQ_WARMUP_DRIVER_CACHE_COPY_TO"] = str(self.work / f"nv-{name}")
            got = self.run(name, [sys.executable, "-c", DECISION_PROBE], env, 60)
            lines = [ln for ln in got["text"].splitlines() if "tq-warmup" in ln]
            set_to = (
                json.loads(got["text"].strip().splitlines()[-1] or "{}") if got["rc"] == 0 else {}
            )
            self.add(
                {
                    "step": name,
                    "rc": got["rc"],
                    "warnings": [ln for ln in lines if ln.startswith("WARNING")],
                    "info": [ln for ln in lines if ln.startswith("INFO")],
                    "cuda_cache_path": set_to.get("CUDA_CACHE_PATH"),
                }
            )
        argv = [sys.executable, "-m", "tq_warmup_plugin.cli", "verify", "--cache-dir"]
        got = self.run("verify", [*argv, str(self.layer)], self.env("home-verify"), 60)
        self.add(
            {"step": "verify", "rc": got["rc"], "lines": got["text"].strip().splitlines()[-4:]}
        )

    def engine(self, name: str, copy_to: Path | None, preset: str = PRESET) -> dict[str, Any]:
        """One eager engine, fresh but for the driver cache: the layer's, copied to
        ``copy_to``, or none (``copy_to`` None: the driver JITs into the fresh HOME)."""
        a = self.args
        work = self.work / name
        shutil.rmtree(work, ignore_errors=True)  # no earlier run's result.json
        cfg = SpecConfig(REFERENCE)  # eager, no speculation
        options = shipped.engine_options(a, preset)
        records.write_json_atomic(
            work / "spec.json",
            {
                "config": asdict(cfg),
                "options": options,
                "prompts": spec_prompts(4, 0),
                "work": str(work),
                "result": str(work / "result.json"),
            },
        )
        shipped_cache = {}
        if copy_to is not None:
            shipped_cache = {
                "TQ_WARMUP_DRIVER_CACHE": str(self.layer / "driver-cache"),
                "TQ_WARMUP_DRIVER_CACHE_COPY_TO": str(copy_to),
            }
        env = self.env(f"home-{name}", **child_env(cfg, work, False, {}), **shipped_cache)
        cap = a.build_timeout + 60 if copy_to is None else a.engine_timeout
        got = self.run(name, child_argv(work / "spec.json"), env, cap)
        result = read_result(work)
        report = result.get("plugin_report") or {}
        plugin = logs.plugin_log_lines(got["text"])
        return {
            "step": name,
            "preset": preset,
            "rc": got["rc"],
            "wall_s": got["wall_s"],
            "status": result.get("status", "no result"),
            "startup_s": result.get("startup_s"),
            "first_launches": report.get("launches"),
            "first_launches_ms": round(1000 * report["launch_s"]) if "launch_s" in report else None,
            "report_line": next((ln for ln in plugin if "first launches" in ln), None),
            "driver_cache_line": next((ln for ln in plugin if "driver cache" in ln), None),
            "error": None if result.get("status") == "ok" else logs.last_error_line(got["text"]),
            "copy_files": len(tree(copy_to)) if copy_to and copy_to.is_dir() else 0,
            "copy_mib": mib(copy_to) if copy_to else 0.0,
            "home_driver_cache_mib": mib(self.work / f"home-{name}" / ".nv"),
        }

    def probe(self, name: str, path: Path, late: bool, read_only: Path | None = None) -> None:
        a = self.args
        g = self.geometry
        pick = slowest_launch(
            (self.manifest.get("extra") or {}).get("launch_s") or {},
            candidate_launches(g.head_size, g.q_heads, g.kv_heads, a.budget, a.max_model_len),
        )
        if pick is None:
            self.add({"step": name, "skipped": "no build seconds to pick a launch from"})
            return
        probe = {"path": str(path), "late": late, "launches": [pick], "scale": g.head_size**-0.5}
        argv = [sys.executable, "-c", LAUNCH_PROBE, json.dumps(probe)]
        if read_only is not None:  # a private mount namespace: nothing outside sees it
            mount = (
                'mount --bind "$1" "$2" && mount -o remount,bind,ro "$2" && shift 2 && exec "$@"'
            )
            unshare = ["unshare", "-m", "--propagation", "private", "sh", "-c", mount, "sh"]
            argv = [*unshare, str(read_only), str(path), *argv]
            path.mkdir(parents=True, exist_ok=True)
        before = tree(path) if read_only is None else None
        got = self.run(name, argv, self.env(f"home-{name}"), a.probe_timeout)
        out = probe_out(got)
        row = {
            "step": name,
            "rc": got["rc"],
            "wall_s": got["wall_s"],
            "launch": label(pick),
            "build_s": self.manifest["extra"]["launch_s"][label(pick)],
            "probe_s": (out.get("seconds") or {}).get(label(pick)),
            "writable": out.get("writable"),
            "errors": out.get("errors"),
            "tail": None if got["rc"] == 0 else got["text"].strip()[-300:],
        }
        if before is not None:
            row["files_added_or_changed"] = changed_files(path, before)
        self.add(row)

    def reuse(self) -> bool:
        """A kept ``--work-dir`` whose layer already holds an entry (a ``--build-only``
        run): its row again, from the manifest, and no second build."""
        found = self.take_entry()
        if found is not None:
            self.add({"step": "build", "reused": str(self.entry), **found})
        return found is not None

    def fresh_machine(self) -> None:
        """``fresh``, ``auto`` and ``build`` side by side: each starts from nothing
        (``--skip-fresh``: the build alone; a kept work dir's entry: no build)."""
        built = self.args.work_dir and not self.args.build_only and self.reuse()
        with ThreadPoolExecutor(max_workers=3) as pool:
            jobs = [] if built else [pool.submit(self.build)]
            if not self.args.skip_fresh:
                jobs.append(pool.submit(lambda: self.add(self.engine("fresh", None))))
                jobs.append(pool.submit(lambda: self.add(self.engine("auto", None, preset="auto"))))
            for job in jobs:
                job.result()

    def variants(self) -> None:
        """:func:`variant_launches` over a writable copy of the entry, in one process: a
        launch that takes seconds and adds files compiles a module the entry lacks (a
        fresh engine filled 15.5 MiB more than the entry on the H200, 2026-12-01)."""
        assert self.entry is not None
        g = self.geometry
        path = _fresh_copy(self.entry / "cache", self.work / "variants-copy")
        todo = variant_launches(g.head_size, g.q_heads, g.kv_heads)
        probe = {"path": str(path), "late": False, "launches": todo, "scale": g.head_size**-0.5}
        before = tree(path)
        argv = [sys.executable, "-c", LAUNCH_PROBE, json.dumps(probe)]
        got = self.run("variants", argv, self.env("home-variants"), 3 * self.args.probe_timeout)
        out = probe_out(got)
        self.add(
            {
                "step": "variants",
                "rc": got["rc"],
                "wall_s": got["wall_s"],
                "seconds": out.get("seconds"),
                "errors": out.get("errors"),
                "files_added_or_changed": changed_files(path, before),
                "tail": None if got["rc"] == 0 else got["text"].strip()[-300:],
            }
        )

    def go(self) -> int:
        """Every step; a SIGTERM (the device call's limit) kills the children's groups."""
        self.children.stop_on_sigterm()
        try:
            return self._steps()
        except BaseException:
            self.children.kill_all()
            raise

    def _steps(self) -> int:
        self.fresh_machine()
        if self.entry is None:
            print("[driver-cache-proof] the build made no entry: nothing else to run", flush=True)
            return self.save(1)
        if self.args.build_only:
            return self.save(0)
        self.decision()
        # The probes first: a minute in all, and on the H200 (2026-12-01) an engine that
        # still JIT-compiled ran past its limit and the deadline left them out.
        rw = _fresh_copy(self.entry / "cache", self.work / "rw-copy")
        self.probe("writable", rw, late=False)
        self.probe("read-only", self.work / "ro-mount", late=False, read_only=self.entry / "cache")
        late = _fresh_copy(self.entry / "cache", self.work / "late-copy")
        self.probe("late-env", late, late=True)
        self.variants()
        self.pairs()
        return self.save(0)

    def pairs(self) -> None:
        """``--pairs`` shipped/warm pairs, each over its own fresh copy: one pair's gap
        ran from -1.7 to 5.5 s on the H200 (2026-12-01), so one pair is no verdict."""
        for k in range(1, self.args.pairs + 1):
            tag = "" if k == 1 else f"-{k}"
            copy_to = self.work / f"nv-engines{tag}"
            shutil.rmtree(copy_to, ignore_errors=True)  # register() makes it from the entry
            self.add(self.engine(f"shipped{tag}", copy_to))
            self.add(self.engine(f"warm{tag}", copy_to))

    def save(self, rc: int) -> int:
        judged = verdict(self.rows)
        records.write_json_atomic(
            self.out / "driver-cache-proof.json", {"rows": self.rows, "verdict": judged}
        )
        lines = table_rows(self.rows)
        for x in judged["pairs"]:
            lines.append(
                [
                    "target",
                    f"{x['pair']} {x['shipped_s']} s vs warm {x['warm_s']} s: gap {x['gap_s']} s "
                    f"(<= 5), first launches {x['first_launches_ms']} ms (< 1000): "
                    + ("met" if x["met"] else "NOT met"),
                ]
            )
        print(tables.render(["step", "result"], lines), flush=True)
        (self.out / "driver-cache-proof.md").write_text(
            tables.render_markdown(["step", "result"], lines) + "\n"
        )
        if not self.args.work_dir:
            shutil.rmtree(self.work, ignore_errors=True)
        if self.args.build_only:
            return rc or (0 if self.entry is not None else 1)
        ok = [r for r in self.rows if is_engine(r["step"])]
        return rc or (0 if ok and all(r.get("status") == "ok" for r in ok) else 1)


def cmd_driver_cache_proof(args: argparse.Namespace) -> int:
    if args.layers < 6:
        raise SystemExit("driver-cache-proof: --layers must be >= 6")
    return Proof(args).go()


OPTIONS: tuple[Option, ...] = (
    ("--out", "benchmarks/results/driver-cache", "directory for the JSON, table, manifest, logs"),
    ("--layers", 8, "hidden layers (>= 6)"),
    # The engine shape of the shipped-cache proof; the build is given the same.
    *(o for o in shipped.SHIPPED_OPTIONS if o[0] in ENGINE_SHAPE),
    ("--build-timeout", 420.0, "seconds the build may take"),
    ("--plan-only", False, "build from the plan's launches alone (no --engine)"),
    # Two device calls instead of one of 10 minutes: the build alone took 305 s on a
    # fresh H200 (2026-12-01, with its engine), and the deadline must not cut the engines.
    (
        "--build-only",
        False,
        "build into --work-dir and stop; a later run with the same --work-dir reuses it",
    ),
    (
        "--skip-fresh",
        False,
        "leave out the fresh and auto engines (measured on the H200, "
        "benchmarks/results/driver-cache/)",
    ),
    # 120 s was too short on the H200 (2026-12-01): an engine whose driver cache lacked a
    # module was still JIT-compiling it when stopped, and so wrote nothing for the next.
    ("--engine-timeout", 300.0, "seconds the shipped and warm engines may take each"),
    # 60 s and 110 s both ended the read-only and late-env probes on the H200 (2026-12-01):
    # a miss there JIT-compiles the launch again (87.6 s in the build).
    ("--probe-timeout", 150.0, "seconds each one-launch probe may take"),
    ("--pairs", 1, "shipped/warm engine pairs, each over a fresh copy of the entry"),
    ("--deadline-s", 560.0, "no step runs past this many seconds"),
    ("--work-dir", "", "kept if given (default: a tmp dir, removed)"),
)


def add_parser(subparsers: Any) -> None:
    """The ``driver-cache-proof`` subcommand."""
    summary = "GPU: ship the CUDA driver's FA2 JIT cache and start engines from it (issue 22)"
    p = new_parser(subparsers, "driver-cache-proof", summary, __doc__)
    add_options(p, OPTIONS)
    p.set_defaults(func=cmd_driver_cache_proof)
