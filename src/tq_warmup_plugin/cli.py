"""The ``tq-warmup`` command: doctor, inspect, precompile and verify.

doctor checks the install; inspect prints the plan without a GPU; precompile builds
the plan into a Triton cache directory for a target GPU, on any machine; verify
checks such a directory's manifests against its files and the installed stack.

``inspect`` and ``precompile`` build the same ``Geometry`` the worker builds and
feed it to the same warmers, so what they print or build is what startup warms.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Hashable, Sequence
from importlib import metadata
from pathlib import Path
from typing import NamedTuple, NoReturn

import pluggy

from . import compat, launches, manifest, planning, warmup
from .geometry import DTYPE_BYTES, PRESETS, Geometry, preset
from .report import Report
from .settings import load, parse

__all__ = ["CliError", "Planned", "geometries_from_report", "geometry_from_args", "main"]


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _entry_point_visible() -> bool:
    eps = metadata.entry_points(group="vllm.general_plugins")
    return any(ep.name == "tq_warmup" for ep in eps)


def doctor(_: argparse.Namespace) -> int:
    """Versions, support, settings and whether vLLM will load the plugin."""
    vllm_version = compat.installed_vllm_version()
    problem = compat.support_problem(compat.parse_version(vllm_version))
    settings, problems = parse()
    plugins = os.environ.get("VLLM_PLUGINS")
    filtered_out = plugins is not None and "tq_warmup" not in plugins.split(",")
    visible = _entry_point_visible()
    rows = [
        ("vllm", vllm_version or "not installed"),
        ("torch", _dist_version("torch") or "not installed"),
        ("triton", _dist_version("triton") or "not installed"),
        ("supported", "yes" if problem is None else f"no: {problem}"),
        ("settings", ", ".join(f"{k}={v}" for k, v in settings._asdict().items())),
        ("entry point", "visible" if visible else "missing (reinstall the package)"),
        ("VLLM_PLUGINS", plugins if plugins is not None else "unset (all plugins load)"),
    ]
    will_load = visible and not filtered_out and settings.enabled and problem is None
    rows.append(("will warm", "yes" if will_load else "no"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    for line in problems:  # the WARNING lines register() logs in every vLLM process
        print(line)
    return 0


class CliError(Exception):
    """Input the CLI refuses: the message is the one line it prints (exit code 2)."""


def _config_dir(path: str) -> str:
    """The directory vLLM reads ``config.json`` from, after the checks vLLM would fail
    on with a traceback: the path exists and its ``config.json`` is a JSON object."""
    given = Path(path)
    file = given / "config.json" if given.is_dir() else given
    if not given.exists():
        raise CliError(f"--model {path}: no such file or directory")
    if not file.is_file():
        raise CliError(f"--model {path}: no config.json in this directory")
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"--model {file}: cannot read it ({exc})") from None
    except json.JSONDecodeError as exc:
        raise CliError(f"--model {file}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CliError(f"--model {file}: a JSON {type(data).__name__}, not a model config object")
    if file.name == "config.json":
        return str(file.parent)
    # Another name (llama.json): vLLM reads a directory's config.json, so hand it one.
    tmp = Path(tempfile.mkdtemp(prefix="tq-warmup-config-"))
    (tmp / "config.json").write_text(json.dumps(data))
    return str(tmp)


class Planned(NamedTuple):
    """A geometry planned without a worker, and the layers it stands for."""

    geometry: Geometry
    layers: int
    """TurboQuant layers (all ranks see the same count)."""
    boundary: bool
    """Whether TurboQuant leaves boundary layers in the model dtype (dense models)."""
    note: str
    """Where the shape came from, for the printed plan."""
    local: Geometry | None = None
    """The geometry of the model's chunked local attention layers (Llama 4), if any."""


def _features(args: argparse.Namespace) -> compat.Features:
    installed = compat.installed_vllm_version()
    try:
        return compat.release_features(args.vllm_version or installed)
    except compat.UnsupportedRelease as exc:
        hint = "" if args.vllm_version else " (pass --vllm-version to plan for a release)"
        raise CliError(f"{exc}{hint}") from None


def geometry_from_args(args: argparse.Namespace) -> Planned:
    """The geometry the worker would discover, from vLLM's ``ModelConfig`` of
    ``--model`` and the explicit flags, which take precedence."""
    if args.kv_cache_dtype is None:
        raise CliError("need --kv-cache-dtype (or --geometry-json)")
    feats = _features(args)
    tp = args.tensor_parallel_size
    shape: planning.ModelShape | None = None
    if args.model is not None:
        directory = _config_dir(args.model)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local config: nothing to download
        try:
            shape = planning.model_shape(
                directory, tp, args.dtype, args.max_model_len, args.trust_remote_code
            )
        except ImportError as exc:
            raise CliError(
                f"--model needs vLLM installed to read the config ({exc}); or give "
                "--head-size, --num-heads and --num-kv-heads"
            ) from None
        except planning.UnsupportedModel as exc:
            raise CliError(f"--model {args.model}: {exc}") from None
        if args.dtype is None and shape.config_dtype == "float32":
            raise CliError(
                f"--model {args.model}: config.json says float32 and TurboQuant runs the "
                "model in 16 bits: pass --dtype bfloat16 or float16 (what vLLM's --dtype is)"
            )
    heads = args.num_heads or (shape.total_heads if shape else None)
    kv_heads = args.num_kv_heads or (shape.total_kv_heads if shape else None) or heads
    head_size = args.head_size or (shape.head_size if shape else None)
    if not (heads and kv_heads and head_size):
        raise CliError("need --model, or --head-size, --num-heads and --num-kv-heads")
    try:
        hq, hk = planning.heads_per_rank(heads, kv_heads, tp)
    except planning.UnsupportedModel as exc:
        raise CliError(str(exc)) from None
    if shape is not None and not (args.num_heads or args.num_kv_heads):
        hq, hk = shape.num_heads, shape.num_kv_heads  # vLLM's own split
    max_model_len = args.max_model_len or (shape.max_model_len if shape else 4096)
    dtype = args.dtype or (shape.dtype if shape else "bfloat16")
    if dtype not in ("bfloat16", "float16"):
        raise CliError(f"model dtype {dtype}: TurboQuant runs bfloat16 or float16 models")
    try:
        skip = planning.boundary_layers(
            feats, shape.num_layers if shape else 0, shape.hybrid if shape else False
        )
    except planning.UnsupportedModel as exc:
        raise CliError(f"--model {args.model}: {exc}") from None
    if shape is not None:
        layers = len(set(shape.attention_layers) - set(skip))
        if layers == 0:
            raise CliError(
                f"--model {args.model}: all {shape.num_layers} layers are boundary layers "
                "TurboQuant leaves in the model dtype: nothing to warm"
            )
        note = f"{shape.architecture}, {len(shape.attention_layers)} attention layers"
        note += f", boundary {', '.join(map(str, skip))}" if skip else ", no boundary layers"
        if shape.hybrid:  # vLLM sizes a hybrid's attention pages to its Mamba state
            note += "; hybrid: block size and page padding may differ, --geometry-json is exact"
    else:
        layers, note = 0, "from flags"
    scale = args.scale
    if scale is None:
        scale = shape.scale if shape and shape.scale is not None else head_size**-0.5
    bs = planning.effective_block_size(feats, args.block_size, DTYPE_BYTES[dtype])
    layout = preset(args.kv_cache_dtype, head_size)
    runner = args.runner or ("v2" if feats.version >= (0, 25) else "v1")
    geometry = Geometry(
        cache_dtype=args.kv_cache_dtype,
        head_size=head_size,
        num_heads=hq,
        num_kv_heads=hk,
        block_size=bs,
        scale=scale,
        kv_strides=planning.kv_view_strides(feats, bs, hk, layout.slot_size_aligned),
        model_dtype=dtype,
        block_table_width=planning.block_table_width(feats, max_model_len, bs, runner == "v2"),
        max_num_seqs=args.max_num_seqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_splits=args.kv_splits,
        fp8_e4b15=compat.fp8_e4b15((args.arch // 10, args.arch % 10)),
        features=feats,
        ubatch_sliced=compat.ubatch_sliced(feats, args.enable_dbo, runner == "v2"),
    )
    chunk = args.attention_chunk_size
    if chunk is None:
        chunk = shape.attention_chunk if shape else None
    local = dataclasses.replace(geometry, attention_chunk=chunk) if chunk else None
    try:
        for g in filter(None, (geometry, local)):
            g.check()
    except ValueError as exc:
        raise CliError(f"not a TurboQuant geometry: {exc}") from None
    if local is not None:
        note += f"; chunked local attention of {chunk} tokens"
    return Planned(geometry, layers, bool(skip) or shape is None, note, local)


def _is_bool(value: object) -> bool:
    return isinstance(value, bool)


def _is_views(value: object) -> bool:
    views = compat.UBATCH_VIEWS_V1
    return isinstance(value, list) and all(isinstance(v, str) and v in views for v in value)


def _is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_sizes(value: object) -> bool:
    return isinstance(value, list) and all(_is_size(v) for v in value)


# Fields a report may lack (written before they existed, or left out at their default:
# ``Geometry.to_dict``): each one's check; the dataclass default stands in for it.
_OPTIONAL_FIELDS: dict[str, Callable[[object], bool]] = {
    "kv_aligned": _is_bool,
    "ubatch_sliced": _is_views,
    "pointer_ranges": _is_bool,
    "kv_storage_bytes": _is_size,
    "block_table_bytes": _is_size,
    "workspace_bytes": _is_sizes,
    "attention_chunk": _is_size,
}
_GEOMETRY_FIELDS = {
    f.name: f.type
    for f in dataclasses.fields(Geometry)
    if f.name != "features" and f.name not in _OPTIONAL_FIELDS
}


def _report_geometry(path: str, index: int, raw: object, feats: compat.Features) -> Geometry:
    where = f"--geometry-json {path}: geometries[{index}]"
    if not isinstance(raw, dict):
        raise CliError(f"{where} is not an object")
    missing = sorted(set(_GEOMETRY_FIELDS) - set(raw))
    if missing:
        raise CliError(f"{where} lacks {', '.join(missing)}")
    unknown = sorted(set(raw) - set(_GEOMETRY_FIELDS) - set(_OPTIONAL_FIELDS))
    if unknown:
        raise CliError(f"{where} has unknown fields {', '.join(unknown)}")
    for name, kind in _GEOMETRY_FIELDS.items():
        value = raw[name]
        ok = {
            "int": isinstance(value, int) and not isinstance(value, bool),
            "float": isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
            and value > 0,
            "str": isinstance(value, str),
        }.get(str(kind))
        if name == "kv_strides":
            ok = (
                isinstance(value, list)
                and len(value) == 3
                and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
            )
        if ok is False or (str(kind) == "int" and value < 0):
            raise CliError(f"{where}: {name} {value!r} is not a valid {kind}")
    for name, valid in _OPTIONAL_FIELDS.items():
        if name in raw and not valid(raw[name]):
            raise CliError(f"{where}: {name} {raw[name]!r} is not valid")
    try:
        geometry = Geometry.from_dict(raw, feats)
        geometry.check()
    except (ValueError, TypeError) as exc:
        raise CliError(f"{where}: {exc}") from None
    return geometry


def geometries_from_report(path: str) -> tuple[list[Geometry], int, str]:
    """The geometries a real startup discovered (its ``TQ_WARMUP_REPORT`` JSON), the
    TurboQuant layers they stand for, and the vLLM version the report names."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CliError(f"--geometry-json {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"--geometry-json {path}: cannot read it ({exc})") from None
    except json.JSONDecodeError as exc:
        raise CliError(f"--geometry-json {path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("geometries"), list):
        raise CliError(
            f"--geometry-json {path}: not a tq-warmup report (no 'geometries' list; "
            "write one with TQ_WARMUP_REPORT)"
        )
    if not data["geometries"]:
        raise CliError(f"--geometry-json {path}: the startup found no TurboQuant layers")
    version = data.get("vllm_version")
    try:
        feats = compat.release_features(version if isinstance(version, str) else None)
    except compat.UnsupportedRelease as exc:
        raise CliError(f"--geometry-json {path}: {exc}") from None
    found = [_report_geometry(path, i, g, feats) for i, g in enumerate(data["geometries"])]
    layers = data.get("layers")
    count = layers if isinstance(layers, int) and layers >= len(found) else len(found)
    return found, count, str(version)


def _geometries(args: argparse.Namespace) -> tuple[dict[str, Geometry], Planned]:
    """Distinct geometries by name, and the first one's plan summary."""
    if args.geometry_json:
        found, layers, version = geometries_from_report(args.geometry_json)
        named = {f"geometry{i}": g for i, g in enumerate(found)}
        note = f"startup report of vLLM {version}"
        return named, Planned(found[0], layers, True, note)
    planned = geometry_from_args(args)
    named = {"geometry0": planned.geometry}
    if planned.local is not None:
        named["local"] = planned.local
    return named, planned


def _plan(
    args: argparse.Namespace, pm: pluggy.PluginManager
) -> tuple[warmup.Plan[Hashable], dict[str, Geometry], Planned]:
    named, planned = _geometries(args)
    return warmup.plan_keys(pm, named), named, planned


def _layers_text(n: int) -> str:
    return f"{n} TurboQuant layer{'' if n == 1 else 's'}" if n else "TurboQuant layers"


def inspect(args: argparse.Namespace) -> int:
    """Print the keys startup would warm, per path, deduplicated."""
    the_plan, named, planned = _plan(args, warmup.plugin_manager())
    geometry = planned.geometry
    per_path: dict[str, list[str]] = {}
    for key, paths in the_plan.paths.items():
        for path in paths:
            per_path.setdefault(path, []).append(warmup.describe(key))
    # A dense model's boundary layers have the TurboQuant layers' heads; a worker only
    # launches their decode if it finds them on plain FlashAttention 2. Hybrids have none.
    boundary = (
        {"boundary": (geometry.num_heads, geometry.num_kv_heads, geometry.head_size)}
        if planned.boundary
        else {}
    )
    first_launches = launches.describe(launches.plan(named, boundary))
    if args.json:
        out = {
            "distinct": len(the_plan.keys),
            "turboquant_layers": planned.layers,
            "source": planned.note,
            "paths": per_path,
            "launches": first_launches,
            "geometry": geometry.to_dict(),
        }
        print(json.dumps(out, indent=2))
        return 0
    print(
        f"{len(the_plan.keys)} distinct kernel keys for {_layers_text(planned.layers)} "
        f"({geometry.cache_dtype}, vLLM {'.'.join(map(str, geometry.features.version))}, "
        f"sm{args.arch}; {planned.note})"
    )
    for path, described in per_path.items():
        print(f"\n{path}: {len(described)}")
        for text in described:
            print(f"  {text}")
    print(f"\nfirst launches on the GPU (TQ_WARMUP_LAUNCH): {len(first_launches)}")
    for text in first_launches:
        print(f"  {text}")
    return 0


def _progress(done: int, total: int) -> None:
    if sys.stderr.isatty():
        filled = math.floor(30 * done / max(total, 1))
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{total}")
        sys.stderr.flush()
        if done == total:
            sys.stderr.write("\n")


def _cache_dir(path: str) -> Path:
    """``--cache-dir``, created if needed, checked writable before anything is compiled."""
    cache_dir = Path(path).resolve()
    if cache_dir.exists() and not cache_dir.is_dir():
        raise CliError(f"--cache-dir {path}: exists and is not a directory")
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=cache_dir, prefix=".tq-warmup-probe-"):
            pass
    except OSError as exc:
        raise CliError(f"--cache-dir {path}: not writable ({exc.strerror or exc})") from None
    return cache_dir


def _wheel_tags(path: str) -> tuple[str, str]:
    """The Triton release and ABI tag (``cp312``) of ``--image-triton-wheel``, after
    checking the file is one."""
    wheel = Path(path)
    if not wheel.is_file():
        raise CliError(f"--image-triton-wheel {path}: no such file")
    # "triton-3.6.0-cp312-cp312-manylinux_2_27_x86_64.whl": name, version, tags.
    fields = wheel.name.removesuffix(".whl").split("-")
    if not wheel.name.endswith(".whl") or len(fields) < 5 or fields[0] != "triton":
        raise CliError(
            f"--image-triton-wheel {path}: not a Triton wheel name "
            "(triton-<version>-<python>-<abi>-<platform>.whl)"
        )
    try:
        with zipfile.ZipFile(wheel) as archive:
            if "triton/runtime/cache.py" not in archive.namelist():
                raise CliError(f"--image-triton-wheel {path}: has no triton/runtime/cache.py")
    except (zipfile.BadZipFile, OSError) as exc:
        raise CliError(f"--image-triton-wheel {path}: not a readable wheel ({exc})") from None
    return fields[1], fields[-2]


def _target_stack(arch: int, wheel: str | None, wheel_key: str | None) -> manifest.Stack:
    """The stack the image runs: the installed one, with the image's Triton build and
    Python when ``--image-triton-wheel`` names them."""
    here = manifest.installed_stack(arch=arch)
    if wheel is None or wheel_key is None:
        return here
    return dataclasses.replace(
        here, triton_build=manifest.triton_build(wheel_key), python_abi=_wheel_tags(wheel)[1]
    )


def precompile(args: argparse.Namespace) -> int:
    """Compile the plan for the target architecture into ``--cache-dir``."""
    start = time.perf_counter()
    installed = {"vllm": compat.installed_vllm_version(), "triton": _dist_version("triton")}
    if installed["vllm"] is None or installed["triton"] is None:
        missing = " and ".join(k for k, v in installed.items() if v is None)
        raise CliError(f"precompile compiles the installed kernels: {missing} not installed")
    image_triton = args.image_triton
    if args.image_triton_wheel is not None:
        release = _wheel_tags(args.image_triton_wheel)[0]
        if image_triton is not None and image_triton.removeprefix("v") != release:
            raise CliError(f"--image-triton {image_triton} but the wheel is Triton {release}")
        image_triton = release
    wanted = {"vllm": args.image_vllm, "triton": image_triton}
    for name, want in wanted.items():
        if want is not None and not compat.same_release(want, installed[name]):
            raise CliError(
                f"refusing: the image runs {name} {want} but {installed[name]} is "
                "installed here; Triton's cache is only valid for the same Triton and "
                "kernel sources"
            )
    if args.vllm_version is not None and not compat.same_release(
        args.vllm_version, installed["vllm"]
    ):
        raise CliError(
            f"refusing: --vllm-version {args.vllm_version} but vLLM {installed['vllm']} is "
            "installed here, and precompile builds the installed kernel sources (run it "
            f"where vLLM {args.vllm_version} is installed; inspect plans for any release)"
        )
    cache_dir = _cache_dir(args.cache_dir)
    if args.geometry_json is not None:
        found, _, version = geometries_from_report(args.geometry_json)
        if any(g.pointer_ranges for g in found):
            raise CliError(
                f"refusing: --geometry-json {args.geometry_json} comes from a ROCm (HIP) "
                "startup, whose keys carry the storage-size flag; precompile builds for a "
                "CUDA --arch"
            )
        if not compat.same_release(version, installed["vllm"]):
            raise CliError(
                f"refusing: --geometry-json {args.geometry_json} comes from vLLM {version} "
                f"but vLLM {installed['vllm']} is installed here; the geometry and kernel "
                "sources differ between releases"
            )
    args.vllm_version = installed["vllm"]  # compile with, and for, what is installed
    # Triton's own manager on a private directory (precompile.staging): a layered cache
    # configured in this shell would load kernels that --cache-dir does not hold.
    os.environ.pop("TRITON_CACHE_MANAGER", None)
    # Without a GPU, vLLM swaps Triton for placeholders unless this is set first.
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    pm = warmup.plugin_manager()
    the_plan, named, planned = _plan(args, pm)

    from .precompile import (
        cache_keys_for,
        install,
        staging,
        triton_key_of_wheel,
        use_compile_only_target,
    )

    use_compile_only_target(args.arch)
    report = Report(vllm_version=installed["vllm"], distinct=len(the_plan.keys))
    with contextlib.ExitStack() as stack:  # the worker's compile path: same threads, lines
        wheel_key = None
        if args.image_triton_wheel is not None:
            tmp = stack.enter_context(tempfile.TemporaryDirectory())
            wheel_key = triton_key_of_wheel(args.image_triton_wheel, tmp)
            stack.enter_context(cache_keys_for(wheel_key))
        target = _target_stack(args.arch, args.image_triton_wheel, wheel_key)
        stage = stack.enter_context(staging(cache_dir, target))
        os.environ["TRITON_CACHE_DIR"] = str(stage)
        compile_start = time.perf_counter()
        key_dirs = warmup.compile_into(report, pm, the_plan.keys, load().threads, _progress)
        compile_s = time.perf_counter() - compile_start
        plan = {
            "kv_cache_dtype": planned.geometry.cache_dtype,
            "geometries": [g.to_dict() for g in named.values()],
            "keys": [warmup.describe(k) for k in the_plan.keys],
        }
        manifest_file = install(cache_dir, stage, key_dirs, plan, target)
    print(
        f"tq-warmup: {len(the_plan.keys)} keys for sm{args.arch} in {cache_dir}: "
        f"{report.compiled} built, {report.loaded} already there, {report.failed} failed "
        f"(compile {compile_s:.1f} s, {time.perf_counter() - start:.1f} s in all with the "
        f"vLLM import; vLLM {installed['vllm']}, Triton {installed['triton']}; "
        f"manifest {manifest_file.name})"
    )
    for line in report.errors:
        print(f"  failed: {line}", file=sys.stderr)
    return 1 if report.errors else 0


def verify(args: argparse.Namespace) -> int:
    """Check every manifest in ``--cache-dir``: its files, and its stack against what is
    installed here (what the layered cache checks at startup, offline)."""
    root = Path(args.cache_dir)
    if not root.is_dir():
        raise CliError(f"--cache-dir {args.cache_dir}: not a directory")
    paths = manifest.manifest_files(root)
    if not paths:
        print(f"tq-warmup: no tq-warmup manifest in {root} (not built by tq-warmup precompile)")
        return 1
    here = manifest.installed_stack(arch=args.arch)
    problems, found = 0, {}
    for path in paths:
        try:
            found[path.name] = manifest.read(path)
        except manifest.ManifestError as exc:
            print(f"{path.name}: not a usable manifest: {exc}")
            problems += 1
    other = manifest.for_other_arch(found, here)
    for name, shipped in found.items():
        stack = [] if name in other else manifest.stack_problems(shipped, here)
        for problem in stack + manifest.file_problems(shipped, root):
            print(f"{name}: {problem}")
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
    print(summary)
    return 1 if problems else 0


def _whole(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is less than {minimum}")
        return value

    return parse


def _scale(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive finite number")
    return value


def _arch(text: str) -> int:
    value = _whole(0)(text.removeprefix("sm").removeprefix("sm_"))
    if value not in compat.SM_TARGETS:
        targets = ", ".join(map(str, compat.SM_TARGETS))
        raise argparse.ArgumentTypeError(
            f"sm{value} is not a target Triton compiles for ({targets})"
        )
    return value


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (exit code 2), like every other refusal."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"tq-warmup: {message} (see {self.prog} --help)\n")


def _geometry_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        help="directory of a model's config.json (read by vLLM's ModelConfig), or the file",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the model's own config code (models transformers does not know)",
    )
    p.add_argument(
        "--geometry-json",
        help="plan from the geometries in a plugin JSON report "
        "(TQ_WARMUP_REPORT) of a real startup instead of the flags below",
    )
    p.add_argument("--kv-cache-dtype", choices=sorted(PRESETS))
    p.add_argument("--head-size", type=_whole(1))
    p.add_argument("--num-heads", type=_whole(1), help="query heads (whole model)")
    p.add_argument("--num-kv-heads", type=_whole(1), help="KV heads (whole model)")
    p.add_argument("--tensor-parallel-size", "-tp", type=_whole(1), default=1)
    p.add_argument(
        "--block-size",
        type=_whole(1),
        default=16,
        help="vLLM's --block-size; the effective TurboQuant block is derived",
    )
    p.add_argument("--max-num-seqs", type=_whole(1), default=256)
    p.add_argument("--max-model-len", type=_whole(1))
    p.add_argument("--max-num-batched-tokens", type=_whole(1), default=8192)
    p.add_argument(
        "--kv-splits",
        type=_whole(1),
        default=32,
        help="attention_config.tq_max_kv_splits_for_cuda_graph",
    )
    p.add_argument(
        "--attention-chunk-size",
        type=_whole(0),
        help="chunked local attention (Llama 4): also plan layers over its virtual-batch "
        "table (default: the model's attention_chunk_size; 0: none)",
    )
    p.add_argument("--dtype", choices=["bfloat16", "float16"])
    p.add_argument("--scale", type=_scale, help="attention scale if not the model's own")
    p.add_argument("--arch", type=_arch, default=90, help="target SM, e.g. 90 for H100/H200")
    p.add_argument("--runner", choices=["v1", "v2"], help="model runner (default: release's)")
    p.add_argument(
        "--enable-dbo",
        action="store_true",
        help="vLLM's --enable-dbo (or --ubatch-size over 1): microbatches' unaligned views",
    )
    p.add_argument("--vllm-version", help="release to plan for (default: installed)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(prog="tq-warmup", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="versions, support, settings, plugin visibility")
    p_inspect = sub.add_parser("inspect", help="print the kernel keys startup would warm")
    _geometry_flags(p_inspect)
    p_inspect.add_argument("--json", action="store_true")
    p_pre = sub.add_parser("precompile", help="build the keys into a Triton cache dir")
    _geometry_flags(p_pre)
    p_pre.add_argument("--cache-dir", required=True)
    p_pre.add_argument("--image-vllm", help="vLLM version the image will run")
    p_pre.add_argument("--image-triton", help="Triton version the image will run")
    p_pre.add_argument(
        "--image-triton-wheel",
        help="the image's Triton wheel, when the image runs another Python: "
        "Triton's cache keys hash its own build, so they are computed "
        "from this wheel (same Triton release only)",
    )
    p_verify = sub.add_parser(
        "verify", help="check a precompiled cache dir's files and stack (exit 1 on a problem)"
    )
    p_verify.add_argument("--cache-dir", required=True)
    p_verify.add_argument(
        "--arch", type=_arch, help="the GPU it is for, e.g. 90 (default: arch is not checked)"
    )
    args = parser.parse_args(argv)
    # vLLM's import-time warnings (no CUDA here, no vllm._C) are not the CLI's answer.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    handlers = {"doctor": doctor, "inspect": inspect, "precompile": precompile, "verify": verify}
    handler = handlers[args.command]
    try:
        return handler(args)
    except CliError as exc:
        print(f"tq-warmup: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
