"""The layered Triton cache manager (``layered_cache``).

Unit tests drive Triton's own ``get_cache_manager`` over temporary directories. The
``real_vllm`` tests compile vLLM's real TurboQuant kernels for sm90 on the CPU with
the manager active, in a child process whose shipped layer is a real read-only bind
mount (a private mount namespace: ``unshare -m``), or, where that is not allowed, a
child that drops root for ``nobody`` and finds the layer unwritable.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fakes
import pytest

from tq_warmup_plugin.shipped import manifest

MANAGER = "tq_warmup_plugin.layered_cache:LayeredCacheManager"
KEY = "ab" * 32  # a hex digest, as Triton passes it to get_cache_manager


@pytest.fixture
def lc(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Any]:
    """The module with fresh per-process state and its environment variables set."""
    pytest.importorskip("triton")
    import tempfile

    from tq_warmup_plugin.shipped import layered_cache
    from tq_warmup_plugin.shipped import trust as layer_trust

    monkeypatch.setattr(layer_trust, "_warned", set())
    monkeypatch.setattr(layer_trust, "_trusts", {})
    monkeypatch.setattr(layer_trust, "_private_roots", {})
    monkeypatch.setattr(manifest, "installed_stack", _installed_stack)
    _use_driver(monkeypatch, _driver_config(_Driver()))
    monkeypatch.setattr(layered_cache, "_unwritable", set())
    monkeypatch.setattr(layered_cache, "_fallback_root", None)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    layered_cache.layer_roots.cache_clear()
    monkeypatch.setenv("TRITON_CACHE_MANAGER", MANAGER)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "own"))
    monkeypatch.delenv(layered_cache.LAYERS_ENV, raising=False)
    yield layered_cache
    layered_cache.layer_roots.cache_clear()


class _Driver:
    """Triton's active driver, as far as the manager asks it: the target."""

    def get_current_target(self) -> Any:
        from types import SimpleNamespace

        return SimpleNamespace(backend="cuda", arch=fakes.STACK.arch, warp_size=32)


def _installed_stack(arch: int | str | None = None) -> manifest.Stack:
    """``fakes.STACK`` with the arch the manager read from the driver."""
    return dataclasses.replace(fakes.STACK, arch=arch)


def _driver_config(active: Any | None) -> Any:
    """A real ``DriverConfig`` whose driver is ``active`` (None: not created yet)."""
    from triton.runtime.driver import DriverConfig

    config = DriverConfig()
    config._active = active
    return config


def _use_driver(monkeypatch: pytest.MonkeyPatch, config: Any) -> None:
    """``config`` as Triton's driver config under both names code reaches it by."""
    import triton.runtime

    monkeypatch.setattr(triton.runtime, "driver", config)
    monkeypatch.setattr(sys.modules["triton.runtime.driver"], "driver", config)


def _manager(key: str = KEY) -> Any:
    from triton.runtime.cache import get_cache_manager

    return get_cache_manager(key)


def _store(manager: Any, name: str = "k", data: bytes = b"cubin") -> dict[str, str]:
    """What ``compile()`` stores for one kernel: files, then the group naming them."""
    group = {
        f"{name}.cubin": manager.put(data, f"{name}.cubin"),
        f"{name}.json": manager.put(json.dumps({"name": name}), f"{name}.json", binary=False),
    }
    manager.put_group(f"{name}.json", group)
    return group


def _build_layer(root: Path, monkeypatch: pytest.MonkeyPatch, key: str = KEY) -> None:
    """A cache directory written by Triton's plain ``FileCacheManager``."""
    from triton.runtime.cache import FileCacheManager, _base32

    with monkeypatch.context() as m:
        m.setenv("TRITON_CACHE_DIR", str(root))
        _store(FileCacheManager(_base32(key)))


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _copy_of(layer: Path) -> str:
    """Where this process serves ``layer``'s files from: its private copies."""
    from tq_warmup_plugin.shipped import trust as layer_trust

    private = layer_trust.private_root()
    assert private is not None
    return os.path.join(private, manifest.digest(str(layer))[:16])


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_triton_takes_it_through_its_extension_point(lc: Any) -> None:
    assert isinstance(_manager(), lc.LayeredCacheManager)


def test_a_shipped_layer_is_read_and_a_miss_goes_to_the_own_directory(
    lc: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Built in one place and shipped to another: the group's recorded paths are stale.
    _build_layer(tmp_path / "build", monkeypatch)
    shutil.move(tmp_path / "build", tmp_path / "shipped")
    monkeypatch.setenv(lc.LAYERS_ENV, str(tmp_path / "shipped"))
    monkeypatch.setenv("TQ_WARMUP_CACHE_UNVERIFIED", "1")  # a plain Triton cache
    shipped = _files(tmp_path / "shipped")

    group = _manager().get_group("k.json")
    assert group is not None and set(group) == {"k.cubin", "k.json"}
    copy = _copy_of(tmp_path / "shipped")
    assert all(p.startswith(copy) and os.path.exists(p) for p in group.values())
    assert Path(group["k.cubin"]).read_bytes() == b"cubin"
    assert _manager().get_file("k.cubin") == group["k.cubin"]

    assert _manager().get_group("other.json") is None
    written = _store(_manager(), "other")
    assert all(p.startswith(str(tmp_path / "own")) for p in written.values())
    assert _manager().get_group("other.json") == written
    assert _files(tmp_path / "shipped") == shipped
    assert not [f for f in _files(tmp_path / "own") if f.split("/")[-1].startswith("k.")]


def test_layers_are_searched_in_order_before_the_own_directory(
    lc: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("a", "b", "own"):
        _build_layer(tmp_path / name, monkeypatch)
    monkeypatch.setenv(lc.LAYERS_ENV, f"{tmp_path / 'b'}{os.pathsep}{tmp_path / 'a'}")
    monkeypatch.setenv("TQ_WARMUP_CACHE_UNVERIFIED", "1")
    group = _manager().get_group("k.json")
    assert group is not None and group["k.cubin"].startswith(_copy_of(tmp_path / "b"))


def test_an_incomplete_group_in_a_layer_is_a_miss(
    lc: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _build_layer(tmp_path / "layer", monkeypatch)
    (cubin,) = (tmp_path / "layer").rglob("k.cubin")
    cubin.unlink()
    monkeypatch.setenv(lc.LAYERS_ENV, str(tmp_path / "layer"))
    monkeypatch.setenv("TQ_WARMUP_CACHE_UNVERIFIED", "1")
    assert _manager().get_group("k.json") is None
    _build_layer(tmp_path / "layer", monkeypatch, "cd" * 32)
    (grp,) = (tmp_path / "layer" / _key_dir("cd" * 32)).glob("__grp__k.json")
    grp.write_text("[" * 10_000 + "]" * 10_000)  # deeper than json can parse on a deep stack
    assert _manager("cd" * 32).get_group("k.json") is None


def test_a_missing_layer_is_ignored_with_one_warning(
    lc: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv(
        lc.LAYERS_ENV, os.pathsep.join([str(tmp_path / "gone"), "", str(tmp_path / "a_file")])
    )
    caplog.set_level(logging.WARNING, logger="vllm.tq_warmup_plugin")
    for key in ("ab" * 32, "cd" * 32):
        assert _manager(key).layers == []
        _store(_manager(key))
    lc.layer_roots.cache_clear()  # a new value of the variable is parsed again
    _manager()
    warnings = _warnings(caplog)
    assert len(warnings) == 2, warnings
    assert "gone is not a directory" in warnings[0] and "a_file is not a directory" in warnings[1]


def test_an_unwritable_own_directory_moves_writes_to_a_private_one(
    lc: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A regular file where the directory should be: unwritable even for root.
    (tmp_path / "blocked").write_text("")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "blocked"))
    caplog.set_level(logging.WARNING, logger="vllm.tq_warmup_plugin")
    first = _store(_manager("ab" * 32))
    second = _store(_manager("cd" * 32))
    fallback = str(tmp_path / "tmp")
    assert all(p.startswith(fallback) for p in [*first.values(), *second.values()])
    assert _manager("ab" * 32).get_group("k.json") == first  # found again in this process
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "cannot write Triton's cache directory" in warnings[0]


def _key_dir(key: str = KEY) -> str:
    from triton.runtime.cache import _base32

    return str(_base32(key))


def _shipped_layer(root: Path, monkeypatch: pytest.MonkeyPatch, **stack: Any) -> list[str]:
    """Two kernels built by Triton, a manifest listing them for ``fakes.STACK`` with
    ``stack`` changed, and a third kernel no manifest lists; the key directories."""
    keys = ["ab" * 32, "cd" * 32, "ef" * 32]
    for key in keys:
        _build_layer(root, monkeypatch, key)
    listed = {_key_dir(k): manifest.key_dir_hashes(root / _key_dir(k)) for k in keys[:2]}
    fakes.write_manifest(root, listed, dataclasses.replace(fakes.STACK, **stack))
    return [_key_dir(k) for k in keys]


def _served(lc: Any, *keys: str) -> list[bool]:
    return [_manager(key).get_group("k.json") is not None for key in keys]


def test_a_layer_serves_what_its_manifest_lists_with_every_file_as_listed(
    lc: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    dirs = _shipped_layer(tmp_path / "layer", monkeypatch)
    monkeypatch.setenv(lc.LAYERS_ENV, str(tmp_path / "layer"))
    caplog.set_level(logging.WARNING, logger="vllm.tq_warmup_plugin")
    cubin = tmp_path / "layer" / dirs[1] / "k.cubin"
    cubin.write_bytes(b"flipped")  # corrupt after it was built
    keys = ["ab" * 32, "cd" * 32, "ef" * 32]
    assert _served(lc, *keys) == [True, False, False]  # unlisted: not what was shipped
    assert _served(lc, *keys) == [True, False, False]
    (warning,) = _warnings(caplog)  # once per process
    assert f"layer {tmp_path / 'layer'}, {manifest.PREFIX}" in warning
    assert f": {dirs[1]}/k.cubin: the manifest says sha256 " in warning
    assert "that kernel is not used and compiles into Triton's cache directory" in warning
    served = _manager("ab" * 32).get_group("k.json")
    assert served is not None and served["k.cubin"].startswith(_copy_of(tmp_path / "layer"))
    assert lc.served_by_layer(served["k.cubin"]) is True
    assert lc.served_by_layer(str(tmp_path / "layer" / dirs[0] / "k.cubin")) is False
    assert lc.served_by_layer(str(tmp_path / "own" / dirs[0] / "k.cubin")) is False
    monkeypatch.delenv("TRITON_CACHE_MANAGER")  # Triton's own manager reads no layer
    assert lc.served_by_layer(served["k.cubin"]) is False


@pytest.mark.parametrize("field", ["triton_build", "vllm", "kernel_sources", "python_abi", "arch"])
def test_a_manifest_for_another_stack_serves_nothing_with_one_warning(
    field: str,
    lc: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    value = 80 if field == "arch" else "e" * 64
    _shipped_layer(tmp_path / "layer", monkeypatch, **{field: value})
    monkeypatch.setenv(lc.LAYERS_ENV, str(tmp_path / "layer"))
    caplog.set_level(logging.WARNING, logger="vllm.tq_warmup_plugin")
    assert _served(lc, "ab" * 32, "cd" * 32) == [False, False]
    (warning,) = _warnings(caplog)
    assert f": {field}: the manifest says {str(value)[:12]}, found " in warning
    assert warning.endswith("none of its 2 kernels is used")


def test_a_manifest_for_another_gpu_beside_one_for_this_gpu_is_silent(
    lc: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    dirs = _shipped_layer(tmp_path / "layer", monkeypatch, arch=80)
    listed = {dirs[2]: manifest.key_dir_hashes(tmp_path / "layer" / dirs[2])}
    fakes.write_manifest(tmp_path / "layer", listed)  # sm90 (the running arch)
    monkeypatch.setenv(lc.LAYERS_ENV, str(tmp_path / "layer"))
    caplog.set_level(logging.WARNING, logger="vllm.tq_warmup_plugin")
    assert _served(lc, "ab" * 32, "ef" * 32) == [False, True]
    assert _warnings(caplog) == []


def test_a_stack_that_cannot_be_read_leaves_the_file_check(
    lc: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    dirs = _shipped_layer(tmp_path / "layer", monkeypatch, triton_build="e" * 64)
    (tmp_path / "layer" / dirs[1] / "k.cubin").write_bytes(b"flipped")

    def unreadable(active: Any) -> Any:
        raise PermissionError("vllm/v1/attention/ops")

    from tq_warmup_plugin.shipped import trust as layer_trust

    monkeypatch.setattr(layer_trust, "_running_stack", unreadable)
    monkeypatch.setenv(lc.LAYERS_ENV, str(tmp_path / "layer"))
    caplog.set_level(logging.WARNING, logger="vllm.tq_warmup_plugin")
    assert _served(lc, "ab" * 32, "cd" * 32) == [True, False]
    first, second = _warnings(caplog)
    assert "cannot read this process's vLLM/Triton stack (vllm/v1/attention/ops)" in first
    assert f"{dirs[1]}/k.cubin" in second


def test_a_lookup_made_while_triton_creates_its_driver_neither_hangs_nor_makes_another(
    lc: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Triton looks its cache up while it creates its driver (``CudaUtils``' build,
    3.6-3.8). On the H200 (vLLM 0.26.0) the layer's first lookup there asked
    ``driver.active``, which created a second driver inside the first, whose lookup
    waited on the first's lock: the engine hung at startup."""
    import threading

    _shipped_layer(tmp_path / "layer", monkeypatch)
    monkeypatch.setenv(lc.LAYERS_ENV, str(tmp_path / "layer"))
    created: list[Any] = []
    served_while_created: list[bool] = []

    class CreatedDriver(_Driver):
        def __init__(self) -> None:
            created.append(self)
            served_while_created.extend(_served(lc, "ab" * 32))  # the utils build's lookup

    config = _driver_config(None)
    _use_driver(monkeypatch, config)
    monkeypatch.setattr(sys.modules["triton.runtime.driver"], "_create_driver", CreatedDriver)
    creating = threading.Thread(target=lambda: config.active, daemon=True)
    creating.start()
    creating.join(timeout=30)
    assert not creating.is_alive(), "a cache lookup inside driver creation never returned"
    assert len(created) == 1 and config.active is created[0]
    assert served_while_created == [False]  # no manifest lists the driver's own build
    assert _served(lc, "ab" * 32, "ab" * 32) == [True, True]  # checked once the driver is up


@pytest.mark.parametrize("unverified", ["", "1"])
def test_a_layer_without_a_manifest_is_served_only_when_the_operator_says_so(
    unverified: str,
    lc: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A plain Triton cache, or what a precompile that died before its manifest left
    (on a full disk it was served unverified, issue 20)."""
    _build_layer(tmp_path / "layer", monkeypatch)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / f"{manifest.PREFIX}x.json").write_text("{")
    _build_layer(tmp_path / "bad", monkeypatch, "cd" * 32)
    monkeypatch.setenv(lc.LAYERS_ENV, f"{tmp_path / 'layer'}{os.pathsep}{tmp_path / 'bad'}")
    monkeypatch.setenv("TQ_WARMUP_CACHE_UNVERIFIED", unverified)
    caplog.set_level(logging.WARNING, logger="vllm.tq_warmup_plugin")
    served = bool(unverified)
    assert _served(lc, KEY, KEY, "cd" * 32) == [served, served, False]
    first = f"tq-warmup: Triton cache layer {tmp_path / 'layer'} has no tq-warmup manifest: "
    first += (
        "its kernels are used unverified (TQ_WARMUP_CACHE_UNVERIFIED=1)"
        if served
        else "nothing in it is used (tq-warmup precompile writes one; "
        "TQ_WARMUP_CACHE_UNVERIFIED=1 serves a plain Triton cache unverified)"
    )
    assert _warnings(caplog) == [
        first,
        f"tq-warmup: Triton cache layer {tmp_path / 'bad'}: {manifest.PREFIX}x.json is not a "
        "usable manifest (unreadable: not valid JSON (Expecting property name enclosed in "
        "double quotes: line 1 column 2 (char 1))); nothing it lists is used",
    ]


def test_override_and_dump_managers_are_tritons_own(
    lc: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from triton.runtime.cache import get_dump_manager, get_override_manager

    monkeypatch.setenv(lc.LAYERS_ENV, str(tmp_path))
    monkeypatch.setenv("TRITON_DUMP_DIR", str(tmp_path / "dump"))
    monkeypatch.setenv("TRITON_OVERRIDE_DIR", str(tmp_path / "override"))
    dump, override = get_dump_manager(KEY), get_override_manager(KEY)
    assert dump.layers == [] and dump.cache_dir.startswith(str(tmp_path / "dump"))
    assert override.layers == [] and override.cache_dir.startswith(str(tmp_path / "override"))


# --- real vLLM, real Triton: compiles for sm90 on the CPU in a child process ---------

SHIPPED, OTHER = "turboquant_4bit_nc", "turboquant_k8v4"
LAYERS, DIR = "TQ_WARMUP_CACHE_LAYERS", "TRITON_CACHE_DIR"
KERNELS = {
    "_tq_decode_stage1",
    "_fwd_kernel_stage2",
    "_tq_full_dequant_kv",
    "_tq_fused_store_mse",
    "_tq_fused_store_fp8",
}


def _child() -> None:
    """For each run of ``TQ_TEST_RUNS`` (``{"presets": [...], "env": {...}}``): set the
    run's Triton variables, clear Triton's in-memory caches, warm real impls of the
    presets through the plugin; print the reports and the plugin's warnings as JSON."""
    import vllm.logger  # noqa: F401 (its logging config would drop a handler added before)
    from realvllm import activate_compile_only_driver, fake_worker, make_impl

    from tq_warmup_plugin import compat
    from tq_warmup_plugin.settings import Settings
    from tq_warmup_plugin.worker.warmup import run

    activate_compile_only_driver()
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("vllm.tq_warmup_plugin").addHandler(handler)
    feats = compat.release_features(compat.installed_vllm_version())
    out = []
    for spec in json.loads(os.environ["TQ_TEST_RUNS"]):
        for name in ("TRITON_CACHE_DIR", "TRITON_CACHE_MANAGER", "TQ_WARMUP_CACHE_LAYERS"):
            os.environ.pop(name, None)
        os.environ.update(spec["env"])
        for name in compat.KERNEL_MODULES:
            compat.kernel_function(name).device_caches.clear()
        impls = {
            f"layers.{i}.attn": make_impl(p, 128, 8, 2, 32, 1024)
            for i, p in enumerate(spec["presets"])
        }
        report = run(
            fake_worker(impls, feats, 64), Settings(threads=1, vllm_kernels=False)
        )  # TurboQuant keys only
        result = {**json.loads(report.to_json()), "warnings": list(warnings)}
        if spec.get("unrelated"):
            from unrelated_kernel import compiles

            result["unrelated"] = compiles()
        out.append(result)
        warnings.clear()
    print("RESULT " + json.dumps(out))


def _readonly_method() -> str | None:
    """How a child process gets a read-only directory, root being able to write
    anywhere: ``mount``, a read-only bind mount in a private mount namespace (the
    host's mounts stay as they are); else ``setpriv``, root without the capabilities
    that override file permissions, over a copy mode 0555; ``chmod`` when not root;
    None: none works. ``TQ_TEST_READONLY=setpriv`` forces the second."""
    if os.geteuid() != 0:
        return "chmod"
    if os.environ.get("TQ_TEST_READONLY") != "setpriv":
        probe = (
            "d=$(mktemp -d) && mount --bind $d $d && mount -o remount,ro,bind $d && ! touch $d/x"
        )
        try:
            if (
                subprocess.run(["unshare", "-m", "sh", "-c", probe], capture_output=True).returncode
                == 0
            ):
                return "mount"
        except OSError:
            pass
    return "setpriv" if shutil.which("setpriv") else None


def _run_child(
    tmp: Path, runs: list[dict[str, Any]], readonly: dict[Path, Path]
) -> list[dict[str, Any]]:
    """Run ``_child`` seeing each source directory of ``readonly`` read-only at its target."""
    method = _readonly_method()
    if method is None:
        pytest.skip(
            "cannot make a directory read-only for root here (no unshare/mount, no setpriv)"
        )
    (tmp / "home").mkdir(exist_ok=True)
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "TQ_TEST_RUNS": json.dumps(runs),
        "HOME": str(tmp / "home"),
        "TMPDIR": str(tmp / "home"),  # the manager's fallback directory, if any
        # This directory (the child imports this module) and what this process sees.
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *(p for p in sys.path if p)]),
    }
    code = [sys.executable, "-c", "from test_layered_cache import _child; _child()"]
    if method == "mount":
        for dst in readonly.values():
            dst.mkdir(exist_ok=True)
        binds = "".join(
            f"mount --bind '{src}' '{dst}' && mount -o remount,ro,bind '{dst}' && "
            for src, dst in readonly.items()
        )
        code = ["unshare", "-m", "sh", "-c", binds + 'exec "$0" "$@"', *code]
    else:  # a copy at the target, without write permission for anyone
        for src, dst in readonly.items():
            shutil.copytree(src, dst, dirs_exist_ok=True)
            for path in [dst, *dst.rglob("*")]:
                path.chmod(0o555 if path.is_dir() else 0o444)
        if method == "setpriv":
            caps = "-dac_override,-dac_read_search"
            code = ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}", *code]
    done = subprocess.run(code, env=env, capture_output=True, text=True, timeout=540)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert done.returncode == 0 and lines, (method, done.stdout[-3000:], done.stderr[-3000:])
    result: list[dict[str, Any]] = json.loads(lines[-1][len("RESULT ") :])
    return result


def _snapshot(root: Path) -> list[tuple[str, int, int]]:
    return sorted(
        (str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")
    )


def _cubins(root: Path) -> set[str]:
    return {p.stem for p in root.rglob("*.cubin")}


def precompile(report: dict[str, Any], cache_dir: Path) -> str:
    """``tq-warmup precompile`` of what a startup's report discovered; its stdout."""
    report_file = cache_dir.parent / f"{cache_dir.name}-report.json"
    report_file.write_text(json.dumps(report))
    cmd = [sys.executable, "-m", "tq_warmup_plugin.cli", "precompile", "--geometry-json"]
    cmd += [str(report_file), "--cache-dir", str(cache_dir)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, (done.stdout, done.stderr[-3000:])
    return done.stdout


@pytest.fixture(scope="module")
def shipped(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A cache directory with one preset's kernels, built by ``tq-warmup precompile``
    from the report of a startup (plain Triton, another directory)."""
    tmp = tmp_path_factory.mktemp("shipped")
    plain = {"TRITON_CACHE_DIR": str(tmp / "plain")}
    (one,) = _run_child(tmp, [{"presets": [SHIPPED], "env": plain}], {})
    assert one["status"] == "ok" and one["compiled"] == one["distinct"] > 0, one
    out = precompile(one, tmp / "build")
    assert f"{one['distinct']} built, 0 already there, 0 failed" in out, out
    return tmp / "build", one


@pytest.mark.once_per_triton
@pytest.mark.real_vllm
def test_real_kernels_load_from_a_read_only_layer_and_misses_compile_into_the_own_dir(
    shipped: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    build, one = shipped
    before = _snapshot(build)
    layer, own = tmp_path / "opt-triton-cache", tmp_path / "own"
    env = {
        "TRITON_CACHE_MANAGER": MANAGER,
        "TQ_WARMUP_CACHE_LAYERS": os.pathsep.join([str(tmp_path / "missing"), str(layer)]),
        "TRITON_CACHE_DIR": str(own),
    }
    first = {**env, "TRITON_CACHE_DIR": str(tmp_path / "own-first")}
    hit, mixed = _run_child(
        tmp_path,
        [{"presets": [SHIPPED], "env": first}, {"presets": [SHIPPED, OTHER], "env": env}],
        {build: layer},  # shipped somewhere else than where it was built
    )
    # The shipped preset: every kernel read from the layer, nothing compiled or written.
    assert hit["status"] == "ok" and hit["failed"] == 0, hit
    assert (hit["compiled"], hit["shipped"], hit["loaded"]) == (0, one["distinct"], 0), hit
    assert not [p for p in (tmp_path / "own-first").rglob("*") if p.is_file()]
    # Another preset too: its own kernels compile into the writable directory.
    assert mixed["status"] == "ok" and mixed["failed"] == 0, mixed
    assert (mixed["shipped"], mixed["loaded"]) == (one["distinct"], 0), mixed
    assert mixed["compiled"] == mixed["distinct"] - one["distinct"] > 0, mixed
    assert _cubins(own) and _cubins(own) <= KERNELS
    assert _snapshot(build) == before  # the layer: not one file written or touched
    assert len(hit["warnings"]) == 1 and "missing is not a directory" in hit["warnings"][0]
    assert mixed["warnings"] == []  # once per process


@pytest.mark.once_per_triton
@pytest.mark.real_vllm
def test_a_read_only_cache_dir_fails_nothing_with_the_manager_and_fails_plain_triton(
    shipped: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    # The image's cache itself as TRITON_CACHE_DIR, read-only at run time.
    build, one = shipped
    before = _snapshot(build)
    ro = tmp_path / "opt-triton-cache"
    layered, plain = _run_child(
        tmp_path,
        [
            {
                "presets": [SHIPPED, OTHER],
                "env": {"TRITON_CACHE_MANAGER": MANAGER, "TRITON_CACHE_DIR": str(ro)},
            },
            {"presets": [SHIPPED, OTHER], "env": {"TRITON_CACHE_DIR": str(ro)}},
        ],
        {build: ro},
    )
    assert layered["status"] == "ok" and layered["failed"] == 0, layered
    assert layered["loaded"] == one["distinct"], layered
    assert layered["compiled"] == layered["distinct"] - one["distinct"] > 0, layered
    assert len(layered["warnings"]) == 1, layered["warnings"]
    assert "cannot write Triton's cache directory" in layered["warnings"][0]
    # Triton's own FileCacheManager: every miss fails on the read-only directory.
    assert plain["loaded"] == one["distinct"], plain
    assert plain["failed"] == plain["distinct"] - one["distinct"] > 0, plain
    assert any("Read-only" in e or "Permission" in e for e in plain["errors"]), plain["errors"]
    assert _snapshot(build) == before


@pytest.mark.once_per_triton
@pytest.mark.real_vllm
def test_a_corrupt_file_or_another_triton_build_is_one_warning_and_compiles_that(
    shipped: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    build, one = shipped
    corrupt, other = tmp_path / "corrupt-build", tmp_path / "other-build"
    shutil.copytree(build, corrupt)
    shutil.copytree(build, other)
    cubin = sorted(corrupt.rglob("_tq_full_dequant_kv.cubin"))[0]
    data = bytearray(cubin.read_bytes())
    data[100:104] = bytes(b ^ 0xFF for b in data[100:104])
    cubin.write_bytes(bytes(data))
    (manifest_file,) = other.glob(f"{manifest.PREFIX}*.json")
    changed = {**json.loads(manifest_file.read_text()), "triton_build": "0" * 64}
    manifest_file.write_text(json.dumps(changed))
    env = {"TRITON_CACHE_MANAGER": MANAGER}
    layers = {corrupt: tmp_path / "layer-corrupt", other: tmp_path / "layer-other"}
    bad, mismatched = _run_child(
        tmp_path,
        [
            {
                "presets": [SHIPPED],
                "env": {**env, LAYERS: str(layers[corrupt]), DIR: str(tmp_path / "own-c")},
            },
            {
                "presets": [SHIPPED],
                "env": {**env, LAYERS: str(layers[other]), DIR: str(tmp_path / "own-o")},
            },
        ],
        layers,
    )
    # One file changed: that kernel compiles into the writable directory, the rest ship.
    assert bad["failed"] == 0 and bad["compiled"] == 1, bad
    assert (bad["shipped"], bad["loaded"]) == (one["distinct"] - 1, 0), bad
    (warning,) = bad["warnings"]
    assert f"{cubin.parent.name}/_tq_full_dequant_kv.cubin: the manifest says sha256 " in warning
    assert _cubins(tmp_path / "own-c") == {"_tq_full_dequant_kv"}
    # Another Triton build: not one of the manifest's kernels is used.
    assert mismatched["failed"] == 0, mismatched
    assert (mismatched["compiled"], mismatched["shipped"]) == (one["distinct"], 0), mismatched
    (warning,) = mismatched["warnings"]
    assert "triton_build: the manifest says 000000000000, found " in warning, warning
    assert warning.endswith(f"none of its {one['distinct']} kernels is used")


@pytest.mark.once_per_triton
@pytest.mark.real_vllm
def test_a_hostile_manifest_beside_a_real_layer_costs_only_itself(
    shipped: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """Before (issue 20): a manifest nested 100,000 levels deep raised RecursionError
    in every Triton compile of the process: the warmup reported every key failed, and
    the good manifest beside it was not used."""
    build, one = shipped
    source = tmp_path / "hostile-build"
    shutil.copytree(build, source)
    hostile = source / f"{manifest.PREFIX}0hostile.json"
    hostile.write_text("[" * 100_000 + "]" * 100_000)
    layer = tmp_path / "layer"
    (result,) = _run_child(
        tmp_path,
        [
            {
                "presets": [SHIPPED],
                "env": {
                    "TRITON_CACHE_MANAGER": MANAGER,
                    LAYERS: str(layer),
                    DIR: str(tmp_path / "own"),
                },
                "unrelated": True,
            }
        ],
        {source: layer},
    )
    assert result["status"] == "ok" and result["failed"] == 0, result
    assert (result["shipped"], result["compiled"]) == (one["distinct"], 0), result
    (warning,) = result["warnings"]
    assert warning.startswith(f"tq-warmup: Triton cache layer {layer}: {hostile.name} is not a")
    assert "nested more than 64 levels deep" in warning, warning
    assert result["unrelated"] == "ok"
