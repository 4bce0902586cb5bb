"""Fakes shared by the unit tests: geometries, a vLLM-shaped worker, warmers.

Nothing heavy at import: helpers that need torch import it when called.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import pluggy

import tq_warmup_plugin
from tq_warmup_plugin import compat
from tq_warmup_plugin.geometry import PRESETS, Geometry, preset
from tq_warmup_plugin.hookspecs import hookimpl
from tq_warmup_plugin.keys import KernelKey
from tq_warmup_plugin.plan import rules as plan_rules
from tq_warmup_plugin.shipped import manifest
from tq_warmup_plugin.vllm_kernels import run as engine_warmup
from tq_warmup_plugin.vllm_kernels.jobs import Declined, Engine, Job
from tq_warmup_plugin.worker.warmup import plugin_manager

_T = TypeVar("_T")

PRESET = "turboquant_4bit_nc"
FAILING = "_tq_full_dequant_kv"

# The first release past the supported range and its one-line refusal, from ``compat``:
# a release bump moves them with NEWEST (no test names the next release itself).
BEYOND = f"{compat.NEWEST[0]}.{compat.NEWEST[1] + 1}"
BEYOND_RELEASE = f"{BEYOND}.0"
OUTSIDE = f"vLLM {BEYOND} is outside the supported releases {compat.SUPPORTED}"


def geometry(
    *,
    version: compat.Version = (0, 26),
    cache_dtype: str = PRESET,
    head_size: int = 128,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    block_size: int = 16,
    model_dtype: str = "bfloat16",
    width: int = 64,
    max_num_seqs: int = 8,
    max_model_len: int = 1024,
    batched: int = 2048,
    splits: int = 32,
    scale: float | None = None,
) -> Geometry:
    """A geometry with unpadded strides; the defaults match :func:`worker`'s."""
    feats = compat.features(version)
    slot = preset(cache_dtype, head_size).slot_size_aligned
    return Geometry(
        cache_dtype=cache_dtype,
        head_size=head_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        scale=head_size**-0.5 if scale is None else scale,
        kv_strides=plan_rules.kv_view_strides(feats, block_size, num_kv_heads, slot),
        model_dtype=model_dtype,
        block_table_width=width,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=batched,
        num_kv_splits=splits,
        fp8_e4b15=0,
        features=feats,
    )


class TurboQuantAttentionImpl:
    """Stands in for vLLM's class; discovery must match it by exact type."""

    def __init__(
        self,
        num_heads: int = 8,
        num_kv_heads: int = 2,
        head_size: int = 128,
        splits: int = 32,
        cache_dtype: str = PRESET,
    ) -> None:
        self.kv_cache_dtype = cache_dtype
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = head_size**-0.5
        self.max_num_kv_splits = splits


class UltraQuantAttentionImpl(TurboQuantAttentionImpl):
    """A subclass that runs other kernels (0.32+)."""


class FlashAttentionImpl:
    """An unrelated impl with the same attributes (a boundary layer)."""

    __init__ = TurboQuantAttentionImpl.__init__


def kv_cache(
    feats: compat.Features,
    *,
    heads: int = 2,
    head_size: int = 128,
    block_size: int = 16,
    blocks: int = 4,
    cache_dtype: str = PRESET,
    aligned: bool = True,
) -> Any:
    """A uint8 KV tensor allocated the way the release allocates it."""
    import torch

    slot = preset(cache_dtype, head_size).slot_size_aligned
    head_major = feats.kv_head_major
    shape = (blocks, heads, block_size, slot) if head_major else (blocks, block_size, heads, slot)
    count = blocks * heads * block_size * slot
    flat = torch.zeros(count + 1, dtype=torch.uint8)
    tensor = (flat[:count] if aligned else flat[1:]).view(shape)
    if feats.kv_view_transposed and not head_major:
        return tensor.transpose(1, 2)  # 0.29+: token-major storage, head-major view
    return tensor


def layer(feats: compat.Features, impl: Any = None, **kv: Any) -> SimpleNamespace:
    """An ``Attention`` layer; ``kv`` overrides the cache geometry."""
    impl = TurboQuantAttentionImpl() if impl is None else impl
    dtype = impl.kv_cache_dtype
    kv.setdefault("heads", impl.num_kv_heads)
    kv.setdefault("head_size", impl.head_size)
    kv.setdefault("cache_dtype", dtype if dtype in PRESETS else PRESET)
    return SimpleNamespace(impl=impl, kv_cache=kv_cache(feats, **kv), kv_cache_dtype=dtype)


def table(width: int, rows: int = 8) -> Any:
    import torch

    return torch.zeros(rows, width, dtype=torch.int32)


def worker(
    layers: dict[str, Any],
    tables: list[Any],
    *,
    v2_tables: list[Any] | None = None,
    use_v2: bool = False,
    kernel_table: Any = None,
    groups: list[tuple[list[str], int]] | None = None,
    runner_type: str = "generate",
    dtype: Any = None,
    max_num_seqs: int = 8,
    max_model_len: int = 1024,
    max_num_batched_tokens: int = 2048,
) -> SimpleNamespace:
    """A worker exposing exactly what discovery reads (V1 and V2 block tables)."""
    import torch

    attn_groups = []
    for names, gid in groups or [(list(layers), 0)]:
        group = SimpleNamespace(layer_names=names, kv_cache_group_id=gid)
        if kernel_table is not None:  # only 0.32+ groups have the attribute
            group.kernel_block_table = kernel_table
        attn_groups.append([group])
    runner = SimpleNamespace(
        attn_groups=attn_groups,
        input_batch=SimpleNamespace(
            block_table=[SimpleNamespace(block_table=SimpleNamespace(gpu=t)) for t in tables]
        ),
        block_tables=SimpleNamespace(input_block_tables=list(v2_tables or [])),
    )
    config = SimpleNamespace(
        model_config=SimpleNamespace(
            runner_type=runner_type,
            dtype=torch.bfloat16 if dtype is None else dtype,
            max_model_len=max_model_len,
        ),
        scheduler_config=SimpleNamespace(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
        ),
        compilation_config=SimpleNamespace(static_forward_context=dict(layers)),
    )
    return SimpleNamespace(
        vllm_config=config, model_runner=runner, use_v2_model_runner=use_v2, rank=0
    )


class RecordingWarmer:
    """Handles every KernelKey instead of Triton; raises for one kernel."""

    def __init__(self, failing: str | None = FAILING) -> None:
        self.failing = failing
        self.seen: list[Hashable] = []
        self.threads: set[int] = set()

    @hookimpl
    def tq_warmup_compile(self, key: Hashable) -> bool | None:
        if not isinstance(key, KernelKey):
            return None
        self.seen.append(key)
        self.threads.add(threading.get_ident())
        if key.kernel == self.failing:
            raise RuntimeError("ptxas died\nstack")
        return True


class StubCounter:
    def __enter__(self) -> StubCounter:
        self.compiled, self.shipped, self.loaded = 3, 2, 4
        self.dirs: set[str] = set()
        self.names: dict[str, int] = {}
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def bare_manager(*warmers: object) -> pluggy.PluginManager:
    """A manager of the hook specs and only these warmers (no built-in one)."""
    from tq_warmup_plugin import hookspecs

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for warmer in warmers:
        pm.register(warmer)
    return pm


def manager(*warmers: object) -> pluggy.PluginManager:
    """The built-in warmers and these (bound at import: tests may patch the module's)."""
    pm = plugin_manager(load_entry_points=False)
    for warmer in warmers:  # registered last, called first
        pm.register(warmer)
    return pm


def fresh_python(code: str) -> str:
    """The stdout of ``code`` in a new interpreter that imports this tree's package,
    without the operator's ``TQ_WARMUP*`` settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TQ_WARMUP")}
    src = str(Path(tq_warmup_plugin.__file__).parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return done.stdout


@contextlib.contextmanager
def package_on_path(tmp_path: Path, monkeypatch: Any, name: str, source: str) -> Iterator[None]:
    """``pkg.mod`` (``name``) with ``source``, importable inside the block and dropped from
    ``sys.modules`` after it: a module for the plugin's import hook to patch on import."""
    package, module = name.split(".")
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / package / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, package, raising=False)
    try:
        yield
    finally:
        sys.modules.pop(name, None)
        sys.modules.pop(package, None)


# A stack a test's process "runs" (tests patch the functions that read the real one).
STACK = manifest.Stack(
    vllm="0.26.0",
    kernel_sources="a" * 64,
    triton="3.6.0",
    triton_build="b" * 64,
    python_abi="cp311",
    arch=90,
)


def key_dir(root: Path, key: str, kernel: str = "k", cubin: bytes = b"cubin") -> dict[str, str]:
    """A Triton cache key directory as ``compile()`` leaves it (a kernel's files, then the
    group naming them by absolute path); returns its files' sha256."""
    directory = root / key
    directory.mkdir(parents=True)
    (directory / f"{kernel}.cubin").write_bytes(cubin)
    (directory / f"{kernel}.json").write_text(json.dumps({"name": kernel}))
    children = {n: str(directory / n) for n in (f"{kernel}.cubin", f"{kernel}.json")}
    (directory / f"__grp__{kernel}.json").write_text(json.dumps({"child_paths": children}))
    return manifest.key_dir_hashes(directory)


def write_manifest(
    root: Path, files: dict[str, dict[str, str]], stack: manifest.Stack = STACK
) -> Path:
    """A manifest for these key directories, as ``precompile`` writes it."""
    data = manifest.build(stack, {"keys": sorted(files)}, files)
    path = root / manifest.file_name(data)
    path.write_text(json.dumps(data))
    return path


def tmpfs_in_private_namespace() -> bool:
    """Whether this machine lets a test mount a small tmpfs in a private mount namespace
    (``unshare -m``): a real full file system, the host's mounts untouched."""
    probe = "d=$(mktemp -d) && mount -t tmpfs -o size=64k tmpfs $d && umount $d"
    try:
        return (
            subprocess.run(["unshare", "-m", "sh", "-c", probe], capture_output=True).returncode
            == 0
        )
    except OSError:
        return False


def jobs_of(pm: pluggy.PluginManager, engine: Engine) -> tuple[list[Job], list[Declined]]:
    """``engine_warmup.plan``'s jobs and declines, for a test whose warmers all plan."""
    jobs, declined, errors = engine_warmup.plan(pm, engine)
    assert errors == [], errors
    return jobs, declined


class ThreadDevices:
    """A Triton driver whose current device is per thread, as CUDA's is: a new thread
    starts on device 0 (``set_active`` it with ``monkeypatch`` on ``driver._active``)."""

    def __init__(self, caller: int) -> None:
        self.current = threading.local()
        self.current.device = caller

    def get_current_device(self) -> int:
        return int(getattr(self.current, "device", 0))

    def set_current_device(self, device: int) -> None:
        self.current.device = device


def within(seconds: float, call: Callable[[], _T]) -> _T:
    """``call()`` in a thread; a failure if it has not returned in ``seconds``."""
    out: list[_T] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            out.append(call())
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"blocked for more than {seconds} s"
    if errors:
        raise errors[0]
    return out[0]
