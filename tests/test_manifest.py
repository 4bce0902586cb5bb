"""The shipped cache's manifest (``manifest``), its installation (``precompile.install``,
``precompile.staging``) and ``tq-warmup verify``, over synthetic Triton cache
directories: no Triton, no vLLM. The real compile is in ``test_layered_cache`` and
``test_precompile_install``."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest
from fakes import STACK, key_dir, write_manifest

from tq_warmup_plugin.cli import commands as cli
from tq_warmup_plugin.shipped import manifest, precompile

K1, K2 = "A" * 52, "B" * 52  # Triton names key directories by a base32 sha256
L0 = manifest.Listed("0" * 64, 5)


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))


# --- building and reading ---------------------------------------------------------


def test_a_built_manifest_parses_back(tmp_path: Path) -> None:
    files = {K1: key_dir(tmp_path, K1)}
    data = manifest.build(STACK, {"kv_cache_dtype": "turboquant_4bit_nc"}, files)
    assert data["schema"] == manifest.SCHEMA and data["arch"] == 90
    parsed = manifest.parse(json.dumps(data))
    assert parsed.stack == STACK and parsed.files == files
    assert manifest.check(parsed, STACK, tmp_path) == []


def test_the_name_hashes_the_plan_not_the_files() -> None:
    plan = {"kv_cache_dtype": "turboquant_4bit_nc"}
    one = manifest.build(STACK, plan, {K1: {"k.cubin": L0}})
    two = manifest.build(STACK, plan, {K1: {"k.cubin": manifest.Listed("1" * 64, 5)}})
    other = manifest.build(dataclasses.replace(STACK, arch=80), plan, {})
    assert manifest.file_name(one) == manifest.file_name(two) != manifest.file_name(other)
    assert manifest.file_name(one).startswith(manifest.PREFIX)


# The manifest precompile wrote before it listed files (schema 0): not read.
OLD = {"vllm": "0.26.0", "triton": "3.6.0", "image_triton": "3.6.0", "arch": 90, "keys": []}


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("{", "not JSON"),
        ("[1]", "a JSON list, not an object"),
        (json.dumps(OLD), "schema None, this tq-warmup reads 2"),
        (json.dumps({**manifest.build(STACK, {}, {}), "arch": True}), "arch True is not"),
        (json.dumps({**manifest.build(STACK, {}, {}), "triton": None}), "triton None is not"),
        (json.dumps({**manifest.build(STACK, {}, {}), "files": []}), "no 'files' object"),
        (json.dumps(manifest.build(STACK, {}, {"..": {"x": L0}})), "files['..']"),
        (json.dumps(manifest.build(STACK, {}, {K1: {"a/b": L0}})), "'a/b'"),
        (
            json.dumps(manifest.build(STACK, {}, {K1: {"k.cubin": manifest.Listed("xyz", 5)}})),
            "a sha256",
        ),
        (json.dumps(manifest.build(STACK, {}, {K1: {}})), "not a key directory with files"),
        (
            json.dumps(manifest.build(STACK, {}, {K1: {"k": manifest.Listed("0" * 64, -1)}})),
            "a size",
        ),
        (
            json.dumps(manifest.build(STACK, {}, {K1: {"k": manifest.Listed("0" * 64, 2**40)}})),
            "a size",
        ),
        (json.dumps({**manifest.build(STACK, {}, {}), "files": {K1: {"k": "0" * 64}}}), "'k'"),
        (
            json.dumps({**manifest.build(STACK, {}, {}), "schema": 1}),
            "schema 1, this tq-warmup reads 2",
        ),
        ("[" * 100_000 + "]" * 100_000, "nested more than"),
    ],
)
def test_what_is_not_a_manifest_says_why(text: str, why: str) -> None:
    with pytest.raises(manifest.ManifestError) as info:
        manifest.parse(text)
    assert why in str(info.value), info.value


# --- checking ----------------------------------------------------------------------


@pytest.mark.parametrize("field", manifest.STACK_FIELDS)
def test_each_stack_field_that_differs_is_one_problem_naming_it(field: str) -> None:
    shipped = manifest.Manifest(STACK, {})
    value = "c" * 64 if field in ("kernel_sources", "triton_build") else 80
    running = dataclasses.replace(STACK, **{field: value})
    (problem,) = manifest.stack_problems(shipped, running)
    assert problem.what == field
    expected = str(getattr(STACK, field))
    assert problem.expected == (expected[:12] if len(expected) == 64 else expected)
    assert str(problem).startswith(f"{field}: the manifest says ")


def test_a_field_not_known_here_is_not_checked() -> None:
    shipped = manifest.Manifest(STACK, {})
    assert manifest.stack_problems(shipped, manifest.Stack()) == []
    assert manifest.stack_problems(shipped, manifest.Stack(arch="90")) == []  # as text


def test_a_corrupt_or_missing_file_is_one_problem_naming_it(tmp_path: Path) -> None:
    files = {K1: key_dir(tmp_path, K1), K2: key_dir(tmp_path, K2, "other")}
    shipped = manifest.Manifest(STACK, files)
    flip(tmp_path / K1 / "k.cubin")
    (tmp_path / K2 / "other.json").unlink()
    problems = manifest.check(shipped, STACK, tmp_path)
    assert [p.what for p in problems] == [f"{K1}/k.cubin", f"{K2}/other.json"]
    assert problems[0].expected == f"sha256 {files[K1]['k.cubin'].sha256[:12]}"
    assert problems[0].found.startswith("sha256 ") and problems[0].found != problems[0].expected
    assert problems[1].found == "no such file"
    (tmp_path / K1 / "extra").write_text("")  # Triton reads only what the group names
    assert manifest.key_dir_problems(tmp_path, K2, files[K2]) == [problems[1]]


def test_a_manifest_for_another_arch_is_left_alone_only_beside_one_for_this_arch() -> None:
    sm80 = manifest.Manifest(dataclasses.replace(STACK, arch=80), {})
    sm90 = manifest.Manifest(STACK, {})
    assert manifest.for_other_arch({"a": sm80, "b": sm90}, STACK) == {"a"}
    assert manifest.for_other_arch({"a": sm80}, STACK) == set()  # then it is a mismatch
    assert manifest.for_other_arch({"a": sm80, "b": sm90}, manifest.Stack()) == set()


# --- the installed stack -------------------------------------------------------------


def test_kernel_sources_hash_the_files_without_importing_vllm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ops = tmp_path / "vllm" / "v1" / "attention" / "ops"
    ops.mkdir(parents=True)
    (tmp_path / "vllm" / "__init__.py").write_text("raise ImportError('vLLM was imported')")
    for name in ("triton_turboquant_decode", "triton_decode_attention", "triton_turboquant_store"):
        (ops / f"{name}.py").write_text(f"# {name}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    first = manifest.kernel_sources()
    assert first is not None and "vllm" not in sys.modules
    (ops / "triton_turboquant_store.py").write_text("# changed\n")
    assert manifest.kernel_sources() not in (first, None)
    (ops / "triton_turboquant_store.py").unlink()
    assert manifest.kernel_sources() not in (first, None)  # a module gone is a difference


def test_python_abi_is_a_wheel_tag() -> None:
    assert manifest.python_abi().startswith(f"cp{sys.version_info[0]}{sys.version_info[1]}")


# --- installing into a shared directory ---------------------------------------------


def test_install_moves_key_dirs_in_and_lists_the_installed_files(tmp_path: Path) -> None:
    cache, stage = tmp_path / "cache", tmp_path / "cache" / ".stage"
    key_dir(stage, K1)
    key_dir(stage, K2, "other")
    path = precompile.install(cache, stage, {K1, K2}, {"keys": ["k", "other"]}, STACK)
    assert not (stage / K1).exists() and (cache / K1 / "k.cubin").read_bytes() == b"cubin"
    group = json.loads((cache / K1 / "__grp__k.json").read_text())["child_paths"]
    assert group == {"k.cubin": str(cache / K1 / "k.cubin"), "k.json": str(cache / K1 / "k.json")}
    shipped = manifest.read(path)
    assert shipped.stack == STACK and set(shipped.files) == {K1, K2}
    assert manifest.check(shipped, STACK, cache) == []  # hashes of the installed files
    assert not [p for p in cache.iterdir() if p.name.startswith(f".{path.name}")]


def test_install_keeps_an_equal_or_vouched_key_dir_and_replaces_a_corrupt_one(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    key_dir(cache / ".s0", K1)
    precompile.install(cache, cache / ".s0", {K1}, {"plan": 0}, STACK)
    inode = (cache / K1 / "k.cubin").stat().st_ino
    # The same build in another stage (its group names other paths until installed): kept.
    key_dir(cache / ".s1", K1)
    precompile.install(cache, cache / ".s1", {K1}, {"plan": 1}, STACK)
    assert (cache / K1 / "k.cubin").stat().st_ino == inode and (cache / ".s1" / K1).exists()
    # Another build of the key that is not byte-equal, where a manifest lists what is
    # there: kept, so that manifest stays true.
    key_dir(cache / ".s2", K1, cubin=b"rebuilt")
    precompile.install(cache, cache / ".s2", {K1}, {"plan": 2}, STACK)
    assert (cache / K1 / "k.cubin").stat().st_ino == inode
    # Corrupt: neither equal to ours nor listed anywhere: replaced by ours.
    flip(cache / K1 / "k.cubin")
    key_dir(cache / ".s3", K1)
    path = precompile.install(cache, cache / ".s3", {K1}, {"plan": 3}, STACK)
    assert (cache / K1 / "k.cubin").read_bytes() == b"cubin"
    assert manifest.check(manifest.read(path), STACK, cache) == []
    assert len(manifest.manifest_files(cache)) == 4


def test_staging_links_what_a_manifest_for_the_target_vouches_for_and_is_removed(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    files = {K1: key_dir(cache, K1), K2: key_dir(cache, K2, "other")}
    write_manifest(cache, files)
    flip(cache / K2 / "other.cubin")
    with pytest.raises(RuntimeError), precompile.staging(cache, STACK) as stage:
        assert stage.parent == cache and stage.name.startswith(precompile.STAGE_PREFIX)
        linked = stage / K1 / "k.cubin"
        assert os.path.samefile(linked, cache / K1 / "k.cubin")
        assert not (stage / K2).exists()  # corrupt: compiled again
        raise RuntimeError("a failed compile")
    assert not stage.exists()
    with precompile.staging(cache, dataclasses.replace(STACK, arch=80)) as stage:
        assert [p.name for p in stage.iterdir()] == [precompile.ALIVE_FILE]  # another target


# --- tq-warmup verify ----------------------------------------------------------------


@pytest.fixture
def shipped_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache directory with two kernels and their manifest, for a machine running
    ``STACK`` (vLLM and Triton "installed" as the manifest says)."""
    monkeypatch.setattr(
        manifest, "installed_stack", lambda arch=None: dataclasses.replace(STACK, arch=arch)
    )
    cache = tmp_path / "cache"
    write_manifest(cache, {K1: key_dir(cache, K1), K2: key_dir(cache, K2, "o")})
    return cache


def verify(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], str]:
    rc = cli.main(["verify", *argv])
    out, err = capsys.readouterr()
    return rc, out.splitlines(), err


def test_verify_passes_a_clean_directory(
    shipped_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, lines, _ = verify(capsys, "--cache-dir", str(shipped_dir))
    assert rc == 0 and lines == [
        f"tq-warmup: {shipped_dir}: 1 manifests, 2 kernels, 6 files: 0 problems; "
        "not checked (not known here): arch"
    ]
    rc, lines, _ = verify(capsys, "--cache-dir", str(shipped_dir), "--arch", "90")
    assert rc == 0 and lines[-1].endswith(": 0 problems")


def test_verify_names_each_problem(
    shipped_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    flip(shipped_dir / K1 / "k.cubin")
    (shipped_dir / K2 / "o.json").unlink()
    (shipped_dir / f"{manifest.PREFIX}old.json").write_text(json.dumps(OLD))
    rc, lines, _ = verify(capsys, "--cache-dir", str(shipped_dir), "--arch", "sm80")
    (name,) = [p.name for p in manifest.manifest_files(shipped_dir) if "old" not in p.name]
    assert rc == 1
    assert lines[0].startswith(f"{manifest.PREFIX}old.json: not a usable manifest: schema None")
    assert lines[1] == f"{name}: arch: the manifest says 90, asked for 80"
    assert lines[2].startswith(f"{name}: {K1}/k.cubin: the manifest says sha256 ")
    assert " found sha256 " in lines[2]
    assert lines[3].startswith(f"{name}: {K2}/o.json: the manifest says sha256 ")
    assert lines[3].endswith(" found no such file")
    assert lines[4:] == [f"tq-warmup: {shipped_dir}: 2 manifests, 2 kernels, 6 files: 4 problems"]


def test_verify_refuses_what_is_not_a_directory_and_fails_one_without_manifest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, lines, err = verify(capsys, "--cache-dir", str(tmp_path / "missing"))
    assert rc == 2 and err == f"tq-warmup: --cache-dir {tmp_path / 'missing'}: not a directory\n"
    rc, lines, _ = verify(capsys, "--cache-dir", str(tmp_path))
    assert rc == 1 and lines == [
        f"tq-warmup: no tq-warmup manifest in {tmp_path} (not built by tq-warmup precompile)"
    ]


@pytest.mark.parametrize("name", ["x\ntq-warmup: forged: 0 problems", "\ud800", "bad\x1b[2Jname"])
def test_verify_escapes_what_the_layers_author_wrote(
    shipped_dir: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """A listed file name holding a newline cannot forge a verify line, nor a lone
    surrogate (valid JSON) or an escape sequence raise or reach the terminal raw."""
    (path,) = manifest.manifest_files(shipped_dir)
    data = json.loads(path.read_text())
    data["files"][K1][name] = {"sha256": "0" * 64, "size": 1}
    path.write_text(json.dumps(data))
    rc, lines, _ = verify(capsys, "--cache-dir", str(shipped_dir))
    assert rc == 1
    assert len(lines) == 2 and lines[1].endswith("1 problem; not checked (not known here): arch")
    assert all(line.isprintable() for line in lines)
    assert ascii(name)[1:-1] in lines[0] and not lines[0].startswith("tq-warmup:")


def test_a_pin_serves_only_the_manifests_it_names(
    shipped_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``verify --print-pin`` prints the value; with it set the layer verifies, with
    another digest its manifest is refused (the read every served lookup makes)."""
    from tq_warmup_plugin.shipped import pins

    rc, lines, _ = verify(capsys, "--cache-dir", str(shipped_dir), "--print-pin")
    (path,) = manifest.manifest_files(shipped_dir)
    value = f"{pins.PIN_ENV}=sha256:{pins.digest(path.read_bytes())}"
    assert rc == 0 and lines[-1] == value
    monkeypatch.setenv(pins.PIN_ENV, value.split("=", 1)[1])
    assert verify(capsys, "--cache-dir", str(shipped_dir))[0] == 0
    monkeypatch.setenv(pins.PIN_ENV, "sha256:" + "0" * 64)
    rc, lines, _ = verify(capsys, "--cache-dir", str(shipped_dir))
    assert rc == 1 and "is not pinned by TQ_WARMUP_CACHE_PIN" in lines[0]
    with pytest.raises(manifest.ManifestError, match="not pinned"):
        manifest.read(path, frozenset({"0" * 64}))
    assert manifest.read(path, None).files  # unpinned: served on its files alone


@pytest.mark.parametrize(
    ("text", "pinned", "problems"),
    [
        (None, None, 0),
        ("", None, 0),
        ("sha256:" + "a" * 64, {"a" * 64}, 0),
        (" SHA256:" + "A" * 64 + " , sha256:" + "b" * 64, {"a" * 64, "b" * 64}, 0),
        ("md5:abc", set(), 1),  # pins nothing: every manifest refused
        ("sha256:" + "a" * 63, set(), 1),
    ],
)
def test_pin_values(text: str | None, pinned: set[str] | None, problems: int) -> None:
    from tq_warmup_plugin.shipped import pins

    found, lines = pins.parse(text)
    assert (found if found is None else set(found)) == pinned and len(lines) == problems


def test_a_layer_reached_through_a_current_link_serves_its_listed_files(tmp_path: Path) -> None:
    """What a worker reads for a key (``shipped.trust``) when ``TQ_WARMUP_CACHE_LAYERS``
    names a ``current`` link to the layer, as fleets roll layers. Before: the root was
    opened O_NOFOLLOW and every key was refused ('found a symlink'). A key directory
    that is a link is still refused."""
    layer = tmp_path / "layer-v2"
    key_dir(layer, K1)
    listed = manifest.key_dir_hashes(layer / K1)
    (tmp_path / "current").symlink_to("layer-v2")
    data, problems = manifest.load_key_dir(tmp_path / "current", K1, listed)
    assert problems == [] and sorted(data) == sorted(listed)
    (layer / K1).rename(tmp_path / "elsewhere")
    (layer / K1).symlink_to(tmp_path / "elsewhere")
    data, problems = manifest.load_key_dir(tmp_path / "current", K1, listed)
    assert data == {} and "found a symlink" in str(problems[0])


READS_PINS = (
    "import logging, sys\n"
    "logging.basicConfig(level=logging.WARNING, format='%(message)s', stream=sys.stdout)\n"
    "from tq_warmup_plugin.shipped import pins\n"
    "if sys.argv[1] == 'register':\n"
    "    import tq_warmup_plugin\n"
    "    tq_warmup_plugin.register()\n"
    "for _ in range(3):  # every lookup reads the pins\n"
    "    assert pins.current() == frozenset({'a' * 64})\n"
)


@pytest.mark.parametrize("process", ["no-register", "register"])
def test_a_malformed_pin_is_one_warning_in_every_process_that_reads_it(process: str) -> None:
    """A process that only inherits the cache manager (Triton's compile workers) never runs
    ``register()``: its first read of the pins says the malformed item, once; a vLLM
    process says it in ``register()`` and not again."""
    import subprocess
    import sys

    src = str(Path(manifest.__file__).resolve().parents[2])
    env = {k: v for k, v in os.environ.items() if not k.startswith("TQ_WARMUP")}
    env.update(
        PYTHONPATH=src, TQ_WARMUP_CACHE_PIN="sha256:" + "a" * 64 + ",md5:beef", TQ_WARMUP="0"
    )
    done = subprocess.run(
        [sys.executable, "-c", READS_PINS, process], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stdout.splitlines() if "TQ_WARMUP_CACHE_PIN" in line]
    assert said == [
        "tq-warmup: TQ_WARMUP_CACHE_PIN item 'md5:beef' is not sha256:<64 hex digits>: "
        "it pins nothing"
    ]
