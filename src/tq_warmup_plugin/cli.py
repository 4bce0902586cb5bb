"""The ``tq-warmup`` command: doctor, inspect and precompile.

doctor checks the install; inspect prints the plan without a GPU; precompile builds
the plan into a Triton cache directory for a target GPU, on any machine.

``inspect`` and ``precompile`` build the same ``Geometry`` the worker builds and
feed it to the same warmers, so what they print or build is what startup warms.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Hashable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import pluggy

from . import compat, launches, warmup
from .geometry import DTYPE_BYTES, PRESETS, Geometry, preset
from .report import Report
from .settings import load

__all__ = ["geometries_from_report", "geometry_from_args", "main"]


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
    settings = load()
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
    return 0


def _model_shape(path: str | None) -> dict[str, Any]:
    if path is None:
        return {}
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    config: dict[str, Any] = json.loads(file.read_text())
    text = config.get("text_config")
    return dict(text) if isinstance(text, dict) else config


def geometry_from_args(args: argparse.Namespace) -> tuple[Geometry, int]:
    """The geometry the worker would discover, from a config and explicit flags,
    and the number of TurboQuant layers (TurboQuant leaves two at each end)."""
    if args.kv_cache_dtype is None:
        raise SystemExit("tq-warmup: need --kv-cache-dtype (or --geometry-json)")
    cfg = _model_shape(args.model)
    heads = args.num_heads or cfg.get("num_attention_heads")
    kv_heads = args.num_kv_heads or cfg.get("num_key_value_heads") or heads
    head_size = args.head_size or cfg.get("head_dim")
    if head_size is None and heads and cfg.get("hidden_size"):
        head_size = cfg["hidden_size"] // heads
    if not (heads and kv_heads and head_size):
        raise SystemExit("tq-warmup: need --model or --head-size/--num-heads/--num-kv-heads")
    try:
        feats = compat.release_features(args.vllm_version or compat.installed_vllm_version())
    except compat.UnsupportedRelease as exc:
        raise SystemExit(f"tq-warmup: {exc} (pass --vllm-version)") from None
    tp = args.tensor_parallel_size
    hq, hk = heads // tp, max(1, kv_heads // tp)  # vLLM replicates KV heads when tp > hk
    max_model_len = args.max_model_len or cfg.get("max_position_embeddings") or 4096
    dtype = args.dtype or str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    bs = compat.effective_block_size(feats, args.block_size, DTYPE_BYTES.get(dtype, 2))
    layout = preset(args.kv_cache_dtype, head_size)
    runner = args.runner or ("v2" if feats.version >= (0, 25) else "v1")
    geometry = Geometry(
        cache_dtype=args.kv_cache_dtype,
        head_size=head_size,
        num_heads=hq,
        num_kv_heads=hk,
        block_size=bs,
        scale=args.scale if args.scale is not None else head_size**-0.5,
        kv_strides=compat.kv_view_strides(feats, bs, hk, layout.slot_size_aligned),
        model_dtype=dtype,
        block_table_width=compat.block_table_width(feats, max_model_len, bs, runner == "v2"),
        max_num_seqs=args.max_num_seqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_splits=args.kv_splits,
        fp8_e4b15=compat.fp8_e4b15((args.arch // 10, args.arch % 10)),
        features=feats,
    )
    geometry.check()
    return geometry, max(0, int(cfg.get("num_hidden_layers", 5)) - 4)


def geometries_from_report(path: str) -> list[Geometry]:
    """The geometries a real startup discovered (its ``TQ_WARMUP_REPORT`` JSON)."""
    data = json.loads(Path(path).read_text())
    try:
        feats = compat.release_features(data.get("vllm_version"))
    except compat.UnsupportedRelease as exc:
        raise SystemExit(f"tq-warmup: {path}: {exc}") from None
    return [Geometry.from_dict(g, feats) for g in data["geometries"]]


def _geometries(args: argparse.Namespace) -> tuple[dict[str, Geometry], int]:
    """Distinct geometries by name, and how many TurboQuant layers they stand for."""
    if args.geometry_json:
        found = geometries_from_report(args.geometry_json)
        return {f"geometry{i}": g for i, g in enumerate(found)}, len(found)
    geometry, layers = geometry_from_args(args)
    return {"geometry0": geometry}, layers


def _plan(
    args: argparse.Namespace, pm: pluggy.PluginManager
) -> tuple[warmup.Plan[Hashable], dict[str, Geometry], int]:
    named, layers = _geometries(args)
    return warmup.plan_keys(pm, named), named, layers


def inspect(args: argparse.Namespace) -> int:
    """Print the keys startup would warm, per path, deduplicated."""
    the_plan, named, layers = _plan(args, warmup.plugin_manager())
    geometry = next(iter(named.values()))
    per_path: dict[str, list[str]] = {}
    for key, paths in the_plan.paths.items():
        for path in paths:
            per_path.setdefault(path, []).append(warmup.describe(key))
    # A dense model's boundary layers have the TurboQuant layers' heads; a worker only
    # launches their decode if it finds them on plain FlashAttention 2.
    boundary = {"boundary": (geometry.num_heads, geometry.num_kv_heads, geometry.head_size)}
    first_launches = launches.describe(launches.plan(named, boundary))
    if args.json:
        out = {
            "distinct": len(the_plan.keys),
            "turboquant_layers": layers,
            "paths": per_path,
            "launches": first_launches,
            "geometry": {k: v for k, v in vars(geometry).items() if k != "features"},
        }
        print(json.dumps(out, indent=2))
        return 0
    print(
        f"{len(the_plan.keys)} distinct kernel keys for {layers} TurboQuant layers "
        f"({geometry.cache_dtype}, vLLM {'.'.join(map(str, geometry.features.version))}, "
        f"sm{args.arch})"
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


def precompile(args: argparse.Namespace) -> int:
    """Compile the plan for the target architecture into ``--cache-dir``."""
    installed = {"vllm": compat.installed_vllm_version(), "triton": _dist_version("triton")}
    wheel = Path(args.image_triton_wheel) if args.image_triton_wheel else None
    image_triton = args.image_triton
    if wheel is not None:
        # "triton-3.6.0-cp312-...whl": the release is the second field.
        image_triton = image_triton or wheel.name.split("-")[1]
    wanted = {"vllm": args.image_vllm, "triton": image_triton}
    for name, want in wanted.items():
        if want is not None and want != installed[name]:
            print(
                f"tq-warmup: refusing: the image runs {name} {want} but {installed[name]} is "
                f"installed here; Triton's cache is only valid for the same Triton and "
                f"kernel sources",
                file=sys.stderr,
            )
            return 2
    if args.geometry_json is None:
        args.vllm_version = None  # compile with, and for, what is installed
    cache_dir = Path(args.cache_dir).resolve()
    cache_dir.mkdir(parents=True, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = str(cache_dir)
    # Without a GPU, vLLM swaps Triton for placeholders unless this is set first.
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    pm = warmup.plugin_manager()
    the_plan, named, _ = _plan(args, pm)
    geometry = next(iter(named.values()))

    from .precompile import cache_keys_for, triton_key_of_wheel, use_compile_only_target

    use_compile_only_target(args.arch)
    report = Report(vllm_version=installed["vllm"] or "", distinct=len(the_plan.keys))
    start = time.perf_counter()
    keys_as: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if wheel is not None:
        with tempfile.TemporaryDirectory() as tmp:
            keys_as = cache_keys_for(triton_key_of_wheel(wheel, tmp))
    with keys_as:  # the worker's compile path: same threads, same error lines
        warmup.compile_into(report, pm, the_plan.keys, load().threads, _progress)
    manifest = {
        "vllm": installed["vllm"],
        "triton": installed["triton"],
        "arch": args.arch,
        "kv_cache_dtype": geometry.cache_dtype,
        "keys": [warmup.describe(k) for k in the_plan.keys],
    }
    manifest_file = cache_dir / f"tq-warmup-manifest-{geometry.cache_dtype}.json"
    manifest_file.write_text(json.dumps(manifest, indent=2))
    print(
        f"tq-warmup: {len(the_plan.keys)} keys for sm{args.arch} in {cache_dir}: "
        f"{report.compiled} built, {report.loaded} already there, {report.failed} failed "
        f"({time.perf_counter() - start:.1f} s; vLLM {installed['vllm']}, "
        f"Triton {installed['triton']})"
    )
    for line in report.errors:
        print(f"  failed: {line}", file=sys.stderr)
    return 1 if report.errors else 0


def _geometry_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="config.json, or a directory holding one")
    p.add_argument(
        "--geometry-json",
        help="plan from the geometries in a plugin JSON report "
        "(TQ_WARMUP_REPORT) of a real startup instead of the flags below",
    )
    p.add_argument("--kv-cache-dtype", choices=sorted(PRESETS))
    p.add_argument("--head-size", type=int)
    p.add_argument("--num-heads", type=int, help="query heads (whole model)")
    p.add_argument("--num-kv-heads", type=int, help="KV heads (whole model)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="vLLM's --block-size; the effective TurboQuant block is derived",
    )
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument(
        "--kv-splits", type=int, default=32, help="attention_config.tq_max_kv_splits_for_cuda_graph"
    )
    p.add_argument("--dtype", choices=["bfloat16", "float16"])
    p.add_argument("--scale", type=float, help="attention scale if not head_size**-0.5")
    p.add_argument("--arch", type=int, default=90, help="target SM, e.g. 90 for H100/H200")
    p.add_argument("--runner", choices=["v1", "v2"], help="model runner (default: release's)")
    p.add_argument("--vllm-version", help="release to plan for (default: installed)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tq-warmup", description=__doc__)
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
    args = parser.parse_args(argv)
    handler = {"doctor": doctor, "inspect": inspect, "precompile": precompile}[args.command]
    return handler(args)


if __name__ == "__main__":
    raise SystemExit(main())
