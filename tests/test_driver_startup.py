"""register()'s use of a shipped driver cache: the decision (pure), and ``apply`` on fake
``/proc`` files and real directories: it sets ``CUDA_CACHE_PATH`` only where an entry
matches, copies once, keeps what the user set, and says a mismatch in one WARNING."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import fakes
import pytest
from test_driver_cache import FA2, fake_proc, make_entry

from tq_warmup_plugin.driver import entry as dc
from tq_warmup_plugin.driver import startup as driver_startup
from tq_warmup_plugin.driver.entry import Node
from tq_warmup_plugin.settings import Settings, parse

NODE = Node("570.86.15", ("NVIDIA H200",), len(FA2))


PRIVATE = Path("/tmp/t/tq-warmup-driver-0")


def decide(
    tmp_path: Path,
    env: dict[str, str],
    node: Node = NODE,
    private: Path | str = PRIVATE,
    **kw: object,
) -> driver_startup.Decision:
    root = tmp_path / dc.DRIVER_DIR
    entry = make_entry(root)
    settings = Settings(driver_cache=str(root), **kw)  # type: ignore[arg-type]
    found = [(entry, dc.read(entry))]
    return driver_startup.decide(settings, env, node, found, lambda: private)


def copy_name(entry: Path) -> str:
    return f"{entry.name}-{dc.content_digest(dc.read(entry))[:12]}"


def refused_once(
    root: Path, copy_to: Path, layer: tuple[Path, Path, Path], caplog: pytest.LogCaptureFixture
) -> str:
    """``apply`` over ``root`` copying to ``copy_to``: nothing set, exactly one WARNING,
    whose text is returned."""
    _, proc, fa2 = layer
    settings = Settings(driver_cache=str(root), driver_cache_copy_to=str(copy_to))
    env: dict[str, str] = {}
    with caplog.at_level(logging.INFO, "vllm.tq_warmup_plugin"):
        driver_startup.apply(settings, env, proc, fa2)
    assert env == {}
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    return record.getMessage()


def test_a_matching_entry_is_always_copied_into_the_private_directory(tmp_path: Path) -> None:
    """Never the entry in place (issue 30): a checked copy, named by what it holds."""
    entry = tmp_path / dc.DRIVER_DIR / "NVIDIA_H200-570.86.15-fa2-x"
    copied = decide(tmp_path, {})
    assert (copied.action, copied.path) == ("copy", str(PRIVATE / copy_name(entry)))
    assert copied.line.endswith(
        f"a checked copy of {entry.name} (2 files, 0.0 MiB; NVIDIA H200, driver 570.86.15)"
    )
    refused = decide(tmp_path / "b", {}, private="/x is writable by others")
    assert refused.action == "warn" and "not used, /x is writable by others" in refused.line


def test_another_driver_is_one_warning_and_nothing_set(tmp_path: Path) -> None:
    other = decide(tmp_path, {}, Node("580.95.05", ("NVIDIA H200",), len(FA2)))
    assert other.action == "warn" and other.path is None
    assert other.line == (
        f"tq-warmup: shipped CUDA driver cache {tmp_path / dc.DRIVER_DIR}: no entry for this "
        f"node (driver 580.95.05, GPU NVIDIA H200, FA2 library {len(FA2)} bytes): "
        "NVIDIA_H200-570.86.15-fa2-x: driver: the manifest says 570.86.15, found 580.95.05: "
        "the CUDA driver JIT-compiles FlashAttention-2 as before"
    )
    no_driver = decide(tmp_path / "b", {}, Node(fa2_size=len(FA2)))
    assert "driver: the manifest says 570.86.15, not known here" in no_driver.line


def test_a_cuda_cache_path_the_user_set_is_kept_unless_overridden(tmp_path: Path) -> None:
    kept = decide(tmp_path, {"CUDA_CACHE_PATH": "/mine"})
    assert kept.action == "warn" and "CUDA_CACHE_PATH=/mine is set" in kept.line
    over = decide(tmp_path / "b", {"CUDA_CACHE_PATH": "/mine"}, driver_cache_override=True)
    assert over.action == "copy"
    ours = decide(tmp_path / "c", {"CUDA_CACHE_PATH": over.path or ""})
    assert ours.action == "keep" and ours.line == ""  # set by this process's parent
    assert ours.path == over.path and ours.manifest == over.manifest  # whose artifacts it loads
    disabled = decide(tmp_path / "d", {"CUDA_CACHE_DISABLE": "1"})
    assert disabled.action == "warn" and "CUDA_CACHE_DISABLE is set" in disabled.line


def test_an_unreadable_entry_is_a_reason_and_the_next_is_tried(tmp_path: Path) -> None:
    root = tmp_path / dc.DRIVER_DIR
    good = make_entry(root, key="b")
    settings = Settings(driver_cache=str(root))
    found = [(root / "a", "manifest: not JSON"), (good, dc.read(good))]
    chosen = driver_startup.decide(settings, {}, NODE, found, lambda: PRIVATE)
    assert (chosen.action, chosen.entry) == ("copy", good)
    alone = driver_startup.decide(settings, {}, NODE, found[:1], lambda: PRIVATE)
    assert "a: manifest: not JSON" in alone.line
    none = driver_startup.decide(settings, {}, NODE, [], lambda: PRIVATE)
    assert none.action == "warn" and "holds no entry" in none.line


@pytest.mark.parametrize(
    ("where", "why"),
    [
        ("missing", "names no directory"),
        ("file", "names no directory"),
        ("empty", "holds no entry (tq-warmup driver-cache builds them)"),
        ("layer", "holds no entry (the entries are in {root}/driver-cache: name that)"),
    ],
)
def test_a_driver_cache_setting_that_names_no_entry_is_one_warning(
    where: str, why: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: a path that did not exist, or a directory without entries, was one INFO
    line (``no entry``) that a fleet's log level hides, and the driver JIT-compiled on
    every node; the layer named instead of its ``driver-cache`` directory was a WARNING
    about the missing ``manifest.json`` of an "entry" called ``driver-cache``."""
    root = tmp_path / "layer"
    if where == "file":
        root.write_text("")
    elif where == "empty":
        root.mkdir()
    elif where == "layer":
        make_entry(root / dc.DRIVER_DIR)
    env: dict[str, str] = {}
    proc, fa2 = fake_proc(tmp_path), tmp_path / "fa2.so"
    fa2.write_bytes(FA2)
    with caplog.at_level(logging.INFO, "vllm.tq_warmup_plugin"):
        driver_startup.apply(Settings(driver_cache=str(root)), env, proc, fa2)
    assert env == {}
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        f"tq-warmup: TQ_WARMUP_DRIVER_CACHE={root} {why.format(root=root)}: {driver_startup.TAIL}"
    )


@pytest.fixture
def layer(tmp_path: Path) -> Iterator[tuple[Path, Path, Path]]:
    """A read-only layer with one entry, a fake /proc and a fake FA2 library."""
    root = tmp_path / "layer" / dc.DRIVER_DIR
    entry = make_entry(root)
    for path in [*entry.rglob("*"), entry]:
        path.chmod(path.stat().st_mode & ~0o222)
    (tmp_path / "fa2.so").write_bytes(FA2)
    yield root, fake_proc(tmp_path), tmp_path / "fa2.so"
    for path in [entry, *entry.rglob("*")]:
        path.chmod(path.stat().st_mode | 0o200)


def test_apply_copies_verifies_a_reused_copy_and_sets_the_environment(
    tmp_path: Path, layer: tuple[Path, Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    root, proc, fa2 = layer
    settings = Settings(driver_cache=str(root), driver_cache_copy_to=str(tmp_path / "nv"))
    env: dict[str, str] = {}
    with caplog.at_level(logging.INFO, "vllm.tq_warmup_plugin"):
        decision = driver_startup.apply(settings, env, proc, fa2)
    private = tmp_path / "nv" / f"{driver_startup.PRIVATE_PREFIX}{os.getuid()}"
    target = private / copy_name(next(root.iterdir()))
    assert env == {"CUDA_CACHE_PATH": str(target), "CUDA_CACHE_MAXSIZE": str(4 << 30)}
    assert (private.stat().st_mode & 0o777) == 0o700 and Path(env["CUDA_CACHE_PATH"]).is_absolute()
    assert (target / "ab/cd/1234").read_bytes() == b"sass" * 100
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert caplog.records[0].getMessage() == decision.line and "; copied in " in decision.line
    caplog.clear()
    child = dict(env)  # a process vLLM starts: inherits the variable, changes nothing
    assert driver_startup.apply(settings, child, proc, fa2).action == "keep"
    assert child == env and caplog.records == []
    fresh: dict[str, str] = {"CUDA_CACHE_MAXSIZE": "1000"}  # another process, same pod
    with caplog.at_level(logging.INFO, "vllm.tq_warmup_plugin"):
        driver_startup.apply(settings, fresh, proc, fa2)
    assert "; reused in " in caplog.records[-1].getMessage()  # re-hashed, kept
    assert fresh["CUDA_CACHE_MAXSIZE"] == "1000"
    # Anything planted in the copy (or the driver's later writes) is thrown away.
    (target / "planted").write_bytes(b"not from the build")
    (target / "ab/cd/1234").write_bytes(b"changed")
    driver_startup.apply(settings, {}, proc, fa2)
    assert not (target / "planted").exists()
    assert (target / "ab/cd/1234").read_bytes() == b"sass" * 100
    assert not [p for p in private.iterdir() if p.name.startswith(".")]


def test_a_copy_name_that_is_a_link_is_replaced_not_followed(
    tmp_path: Path, layer: tuple[Path, Path, Path]
) -> None:
    root, proc, fa2 = layer
    settings = Settings(driver_cache=str(root), driver_cache_copy_to=str(tmp_path / "nv"))
    private = tmp_path / "nv" / f"{driver_startup.PRIVATE_PREFIX}{os.getuid()}"
    private.mkdir(parents=True, mode=0o700)
    victim = tmp_path / "victim"
    victim.mkdir()
    (private / copy_name(next(root.iterdir()))).symlink_to(victim)
    env: dict[str, str] = {}
    driver_startup.apply(settings, env, proc, fa2)
    target = Path(env["CUDA_CACHE_PATH"])
    assert not target.is_symlink() and (target / "ab/cd/1234").is_file()
    assert list(victim.iterdir()) == []


@pytest.mark.parametrize(
    "case", ["others-world-writable", "others-own", "private-is-a-link", "private-open"]
)
def test_a_copy_directory_others_could_write_is_refused_in_one_warning(
    tmp_path: Path, layer: tuple[Path, Path, Path], caplog: pytest.LogCaptureFixture, case: str
) -> None:
    """Refused: the copy goes to the private temporary directory instead, said once."""
    root, proc, fa2 = layer
    base = tmp_path / "nv"
    base.mkdir()
    private = base / f"{driver_startup.PRIVATE_PREFIX}{os.getuid()}"
    if case == "others-world-writable":
        if os.geteuid() != 0:
            pytest.skip("chown to another user needs root")
        base.chmod(0o777)  # another user's, no sticky bit: they could rename the copy away
        os.chown(base, 65534, 65534)
    elif case == "others-own":  # 0755, but its owner can rename the copy away (was used)
        if os.geteuid() != 0:
            pytest.skip("chown to another user needs root")
        os.chown(base, 65534, 65534)
    elif case == "private-is-a-link":
        (tmp_path / "elsewhere").mkdir()
        private.symlink_to(tmp_path / "elsewhere")
    else:
        private.mkdir(mode=0o700)
        private.chmod(0o777)
    settings = Settings(driver_cache=str(root), driver_cache_copy_to=str(base))
    env: dict[str, str] = {}
    with caplog.at_level(logging.INFO, "vllm.tq_warmup_plugin"):
        driver_startup.apply(settings, env, proc, fa2)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "TQ_WARMUP_DRIVER_CACHE_COPY_TO not used" in warnings[0]
    assert not env.get("CUDA_CACHE_PATH", "").startswith(str(base))
    if case == "private-is-a-link":
        assert list((tmp_path / "elsewhere").iterdir()) == []


def test_a_world_writable_directory_of_ours_gets_the_sticky_bit(
    tmp_path: Path, layer: tuple[Path, Path, Path]
) -> None:
    """A Kubernetes emptyDir is 0777 and root's: used, with the sticky bit set, so that no
    other user can rename the private directory away."""
    root, proc, fa2 = layer
    base = tmp_path / "nv"
    base.mkdir()
    base.chmod(0o777)
    env: dict[str, str] = {}
    settings = Settings(driver_cache=str(root), driver_cache_copy_to=str(base))
    driver_startup.apply(settings, env, proc, fa2)
    assert base.stat().st_mode & 0o7777 == 0o1777
    assert env["CUDA_CACHE_PATH"].startswith(str(base))


def test_a_sticky_shared_directory_holds_a_private_one(tmp_path: Path) -> None:
    base = tmp_path / "shared"
    base.mkdir()
    base.chmod(0o1777)  # like /tmp
    private = driver_startup.private_dir(str(base))
    assert isinstance(private, Path) and (private.stat().st_mode & 0o777) == 0o700
    relative = os.path.relpath(base)
    assert driver_startup.private_dir(relative) == private  # always absolute


@pytest.mark.parametrize("planted", ["open mode", "symlink", "another user's"])
def test_a_private_directory_someone_made_first_is_refused(tmp_path: Path, planted: str) -> None:
    """The temporary default's name is predictable (``/tmp/tq-warmup-driver-<uid>``):
    one made first by someone else, or left open, or a link, is never copied into."""
    base = tmp_path / "tmp"
    base.mkdir()
    base.chmod(0o1777)
    uid = os.getuid()
    private = base / f"{driver_startup.PRIVATE_PREFIX}{uid}"
    if planted == "open mode":
        private.mkdir(mode=0o755)
        private.chmod(0o755)
    elif planted == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        private.symlink_to(tmp_path / "elsewhere")
    else:
        if os.geteuid() != 0:
            pytest.skip("chown to another user needs root")
        private.mkdir(mode=0o700)
        os.chown(private, 65534, 65534)
    refused = driver_startup.private_dir(str(base), uid)
    assert isinstance(refused, str) and str(private) in refused and "\n" not in refused


def test_an_entry_whose_cache_holds_a_linked_directory_is_not_copied(
    tmp_path: Path, layer: tuple[Path, Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """startup and verify agree: a symlinked sub-directory of ENTRY/cache is a problem."""
    root = layer[0]
    cache = next(root.iterdir()) / dc.CACHE_DIR
    cache.chmod(0o700)
    outside = tmp_path / "outside"
    (outside / "cd").mkdir(parents=True)
    (outside / "cd" / "1234").write_bytes(b"sass" * 100)
    moved = tmp_path / "moved-ab"
    (cache / "ab").rename(moved)
    (cache / "ab").symlink_to(outside)
    warning = refused_once(root, tmp_path / "nv", layer, caplog)
    assert "not a plain file" in warning
    (cache / "ab").unlink()
    moved.rename(cache / "ab")


def test_an_entry_over_the_drivers_cache_limit_is_a_reason(tmp_path: Path) -> None:
    root = tmp_path / dc.DRIVER_DIR
    entry = make_entry(root)
    shipped = dc.read(entry)
    big = dataclasses.replace(shipped, files={"huge": ("0" * 64, 5 << 30)})
    settings = Settings(driver_cache=str(root))
    got = driver_startup.decide(settings, {}, NODE, [(entry, big)], lambda: PRIVATE)
    assert got.action == "warn" and "5.00 GiB, over the driver's 4 GiB cache" in got.line


def test_apply_refuses_a_tampered_entry_in_one_warning(
    tmp_path: Path, layer: tuple[Path, Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    root = layer[0]
    index = next(root.glob("*/cache/index"))
    index.chmod(0o600)
    index.write_bytes(b"IDX")
    warning = refused_once(root, tmp_path / "nv", layer, caplog)
    assert "copy to" in warning and "cache/index: sha256" in warning
    assert not (tmp_path / "nv" / index.parents[1].name).exists()


def test_apply_on_another_driver_sets_nothing(
    tmp_path: Path, layer: tuple[Path, Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    root, _, fa2 = layer
    proc = fake_proc(tmp_path / "b", "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.95.05  x")
    env: dict[str, str] = {}
    with caplog.at_level(logging.INFO, "vllm.tq_warmup_plugin"):
        driver_startup.apply(Settings(driver_cache=str(root)), env, proc, fa2)
    assert env == {}
    assert [(r.levelno, "found 580.95.05" in r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, True)
    ]


def test_the_settings_are_read_once_with_the_others() -> None:
    env = {
        "TQ_WARMUP_DRIVER_CACHE": "/opt/tq-warmup/cache/driver-cache",
        "TQ_WARMUP_DRIVER_CACHE_COPY_TO": " ",
        "TQ_WARMUP_DRIVER_CACHE_OVERRIDE": "yes",
    }
    settings, problems = parse(env)
    assert settings.driver_cache == "/opt/tq-warmup/cache/driver-cache"
    assert settings.driver_cache_copy_to is None and settings.driver_cache_override
    assert problems == [
        "tq-warmup: TQ_WARMUP_DRIVER_CACHE_COPY_TO=' ' is blank: unset (accepted: a directory)"
    ]


def test_register_with_a_driver_cache_imports_no_heavy_module(
    tmp_path: Path, layer: tuple[Path, Path, Path]
) -> None:
    """What register() pays with the setting on: the stdlib, no torch / Triton / vLLM."""
    root, _, _ = layer
    code = (
        "import json, os, sys\n"
        f"os.environ['TQ_WARMUP_DRIVER_CACHE'] = {str(root)!r}\n"
        "before = set(sys.modules)\n"
        "import tq_warmup_plugin; tq_warmup_plugin.register()\n"
        "new = sorted(set(sys.modules) - before)\n"
        "print(json.dumps([new, os.environ.get('CUDA_CACHE_PATH')]))\n"
    )
    new, path = json.loads(fakes.fresh_python(code).splitlines()[-1])
    assert {m.split(".")[0] for m in new} & {"torch", "triton", "vllm", "pluggy"} == set()
    assert "tq_warmup_plugin.driver.startup" in new and "hashlib" not in new
    assert path is None  # no node has the fake entry's driver: one WARNING, nothing set


def test_a_pin_refuses_an_entry_it_does_not_name(
    tmp_path: Path, layer: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tq_warmup_plugin.shipped import pins

    root, proc, fa2 = layer
    entry = next(root.iterdir())
    settings = Settings(driver_cache=str(root), driver_cache_copy_to=str(tmp_path / "nv"))
    monkeypatch.setenv(pins.PIN_ENV, "sha256:" + "0" * 64)
    refused = driver_startup.apply(settings, {}, proc, fa2)
    assert refused.action == "warn" and "is not pinned by TQ_WARMUP_CACHE_PIN" in refused.line
    digest = pins.digest((entry / dc.MANIFEST).read_bytes())
    monkeypatch.setenv(pins.PIN_ENV, f"sha256:{digest}")
    env: dict[str, str] = {}
    assert driver_startup.apply(settings, env, proc, fa2).action == "copy" and env


def test_no_directory_is_made_or_changed_where_no_entry_matches(
    tmp_path: Path, layer: tuple[Path, Path, Path]
) -> None:
    root, _, fa2 = layer
    other_node = fake_proc(tmp_path / "other", gpus=("NVIDIA A100",))
    base = tmp_path / "nv"
    base.mkdir()
    base.chmod(0o777)  # would get the sticky bit if a copy were made
    settings = Settings(driver_cache=str(root), driver_cache_copy_to=str(base))
    assert driver_startup.apply(settings, {}, other_node, fa2).action == "warn"
    assert list(base.iterdir()) == [] and base.stat().st_mode & 0o7777 == 0o777


def test_entries_past_the_limit_are_one_warning_and_this_nodes_entry_is_read_first(
    tmp_path: Path, layer: tuple[Path, Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    _, proc, fa2 = layer
    root = tmp_path / "many" / dc.DRIVER_DIR
    for i in range(dc.MAX_ENTRIES + 6):  # another fleet's, named before ours
        make_entry(root, key=f"A100-{i:03d}-535.0.0-fa2-x", driver="535.0.0", gpu="NVIDIA A100")
    make_entry(root, key="ZZ_H200-570.86.15-fa2-x")  # last by name
    settings = Settings(driver_cache=str(root), driver_cache_copy_to=str(tmp_path / "nv"))
    env: dict[str, str] = {}
    with caplog.at_level(logging.INFO, "vllm.tq_warmup_plugin"):
        driver_startup.apply(settings, env, proc, fa2)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"tq-warmup: shipped CUDA driver cache {root}: 7 entries past the first "
        f"{dc.MAX_ENTRIES} not read (this driver's first, then by name): ship one layer per fleet"
    ]
    assert "ZZ_H200-570.86.15-fa2-x" in env["CUDA_CACHE_PATH"]  # found all the same


def test_reading_manifests_stops_at_the_time_budget_in_one_warning(
    tmp_path: Path,
    layer: tuple[Path, Path, Path],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, proc, fa2 = layer
    root = tmp_path / "slow" / dc.DRIVER_DIR
    make_entry(root, key="NVIDIA_H200-570.86.15-fa2-a")
    for i in range(3):
        make_entry(root, key=f"NVIDIA_H200-570.86.15-fa2-b{i}")
    monkeypatch.setattr(driver_startup, "READ_BUDGET_S", 0.0)
    env: dict[str, str] = {}
    settings = Settings(driver_cache=str(root), driver_cache_copy_to=str(tmp_path / "nv"))
    with caplog.at_level(logging.INFO, "vllm.tq_warmup_plugin"):
        driver_startup.apply(settings, env, proc, fa2)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"tq-warmup: shipped CUDA driver cache {root}: reading manifests took over 0 s, "
        "3 entries not read"
    ]
    assert env["CUDA_CACHE_PATH"].rsplit("/", 1)[1].startswith("NVIDIA_H200-570.86.15-fa2-a-")


def test_the_override_does_not_open_the_pin(
    tmp_path: Path, layer: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``TQ_WARMUP_DRIVER_CACHE_OVERRIDE`` replaces a ``CUDA_CACHE_PATH`` only with a
    pinned entry's copy: an unpinned one is refused and nothing is copied or set."""
    from tq_warmup_plugin.shipped import pins

    root, proc, fa2 = layer
    settings = Settings(
        driver_cache=str(root),
        driver_cache_copy_to=str(tmp_path / "nv"),
        driver_cache_override=True,
    )
    monkeypatch.setenv(pins.PIN_ENV, "sha256:" + "0" * 64)
    env = {"CUDA_CACHE_PATH": "/elsewhere"}
    refused = driver_startup.apply(settings, env, proc, fa2)
    assert refused.action == "warn" and "is not pinned by TQ_WARMUP_CACHE_PIN" in refused.line
    assert env == {"CUDA_CACHE_PATH": "/elsewhere"} and not (tmp_path / "nv").exists()
