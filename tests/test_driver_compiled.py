"""A driver-cache entry's ``torch.compile`` artifacts (``driver.compiled``): listed in the
manifest, read as hostile files, remembered by the startup, reported by the warmup. The
round trip through torch itself (a graph compiled in one process is a cache hit in the
next) is ``test_driver_compiled_torch.py``."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import pytest
from test_driver_cache import FA2, make_entry
from test_driver_startup import layer  # noqa: F401

from tq_warmup_plugin.driver import build, compiled
from tq_warmup_plugin.driver import entry as dc
from tq_warmup_plugin.driver import startup as driver_startup
from tq_warmup_plugin.driver.entry import EntryError
from tq_warmup_plugin.settings import Settings
from tq_warmup_plugin.worker.report import Report

BLOB = b"torch-compile artifacts stand-in" * 64


def with_artifacts(root: Path, data: bytes = BLOB, listed: bytes | None = None) -> Path:
    """An entry whose ``compiled`` directory holds ``data``; its manifest lists ``listed``
    (default: ``data``) by sha256 and size."""
    listed = data if listed is None else listed
    shipped = {dc.COMPILED_FILE: (hashlib.sha256(listed).hexdigest(), len(listed))}
    entry = make_entry(root, compiled=shipped)
    (entry / dc.COMPILED_DIR).mkdir()
    (entry / dc.COMPILED_DIR / dc.COMPILED_FILE).write_bytes(data)
    return entry


def test_the_manifest_lists_them_and_an_entry_without_keeps_its_digest(tmp_path: Path) -> None:
    entry = with_artifacts(tmp_path)
    shipped = dc.read(entry)
    assert shipped.compiled == {dc.COMPILED_FILE: (hashlib.sha256(BLOB).hexdigest(), len(BLOB))}
    assert dc.parse(shipped.to_json()) == shipped
    plain = dc.read(make_entry(tmp_path / "old"))
    assert plain.compiled == {} and "compiled" not in json.loads(plain.to_json())


@pytest.mark.parametrize(
    ("compiled_field", "why"),
    [
        ({"a/b.bin": {"sha256": "0" * 64, "size": 1}}, "is not a relative path"),
        ({"..": {"sha256": "0" * 64, "size": 1}}, "is not a relative path"),
        ({"x.bin": {"sha256": "zz", "size": 1}}, "is not a relative path with a sha256"),
        ({f"{i}.bin": {"sha256": "0" * 64, "size": 1} for i in range(17)}, "at most 16 files"),
        ({"x.bin": {"sha256": "0" * 64, "size": dc.MAX_COMPILED_BYTES + 1}}, "over 256 MiB"),
        ([1, 2], "is not an object"),
    ],
)
def test_a_listing_that_reaches_out_or_is_too_big_is_refused(
    tmp_path: Path, compiled_field: object, why: str
) -> None:
    data = json.loads(dc.read(make_entry(tmp_path)).to_json())
    data["compiled"] = compiled_field
    with pytest.raises(EntryError, match=why):
        dc.parse(json.dumps(data))


def test_read_checks_each_file_against_its_hash(tmp_path: Path) -> None:
    entry = with_artifacts(tmp_path / "good")
    assert compiled.read(entry, dc.read(entry)) == [(dc.COMPILED_FILE, BLOB)]
    changed = with_artifacts(tmp_path / "changed", BLOB[:-1] + b"!", listed=BLOB)
    with pytest.raises(EntryError, match=r"sha256 .*, the manifest says"):
        compiled.read(changed, dc.read(changed))
    longer = with_artifacts(tmp_path / "longer", BLOB + b"x", listed=BLOB)
    with pytest.raises(EntryError, match=f"not {len(BLOB)}"):
        compiled.read(longer, dc.read(longer))
    problems = dc.file_problems(changed, dc.read(changed))  # what verify reports
    assert problems == [
        f"{dc.COMPILED_DIR}/{dc.COMPILED_FILE}: the manifest says sha256 "
        f"{hashlib.sha256(BLOB).hexdigest()[:12]}, found "
        f"{hashlib.sha256(BLOB[:-1] + b'!').hexdigest()[:12]}"
    ]


@pytest.mark.parametrize("kind", ["file link", "directory link", "fifo", "missing"])
def test_a_link_a_fifo_or_nothing_is_refused_in_one_line(tmp_path: Path, kind: str) -> None:
    """The bytes torch unpickles come from the entry itself: a symlinked file or
    ``compiled`` directory (which could point at a file the build never wrote, of the
    same hash only by accident: still refused), a FIFO (which would block) or a missing
    file is one line, read without blocking."""
    entry = with_artifacts(tmp_path)
    target = entry / dc.COMPILED_DIR / dc.COMPILED_FILE
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / dc.COMPILED_FILE).write_bytes(BLOB)
    if kind == "file link":
        target.unlink()
        target.symlink_to(elsewhere / dc.COMPILED_FILE)
    elif kind == "directory link":
        target.unlink()
        (entry / dc.COMPILED_DIR).rmdir()
        (entry / dc.COMPILED_DIR).symlink_to(elsewhere)
    elif kind == "fifo":
        target.unlink()
        os.mkfifo(target)
    else:
        target.unlink()
    with pytest.raises(EntryError) as refused:
        compiled.read(entry, dc.read(entry))
    assert "\n" not in str(refused.value) and str(refused.value).startswith(dc.COMPILED_DIR)


def test_a_bad_file_is_a_warning_line_and_torch_is_never_handed_it(tmp_path: Path) -> None:
    entry = with_artifacts(tmp_path, BLOB[:-1] + b"!", listed=BLOB)
    line, ok = compiled.load(compiled.Chosen(entry, dc.read(entry))) or ("", True)
    assert not ok and line.startswith(f"torch.compile artifacts of {entry.name}: not loaded (")
    assert line.endswith("): their graphs compile here")
    assert compiled.load(compiled.Chosen(entry, dc.read(make_entry(tmp_path / "none")))) is None


def test_the_startup_remembers_the_entry_it_uses(
    tmp_path: Path,
    layer: tuple[Path, Path, Path],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """For its own process, and for a process vLLM starts after it (whose variable the
    parent set): each worker reads the artifacts from the entry itself."""
    root, proc, fa2 = layer
    monkeypatch.setattr(compiled, "_chosen", [])
    settings = Settings(driver_cache=str(root), driver_cache_copy_to=str(tmp_path / "nv"))
    env: dict[str, str] = {}
    assert driver_startup.apply(settings, env, proc, fa2).action == "copy"
    first = compiled.chosen()
    assert first is not None and first.entry == next(root.iterdir())
    monkeypatch.setattr(compiled, "_chosen", [])
    assert driver_startup.apply(settings, dict(env), proc, fa2).action == "keep"
    assert compiled.chosen() == first
    monkeypatch.setattr(compiled, "_chosen", [])
    driver_startup.apply(settings, {"CUDA_CACHE_PATH": "/mine"}, proc, fa2)  # not used
    assert compiled.chosen() is None


def test_the_warmup_reports_the_load_and_warns_on_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from tq_warmup_plugin.worker import warmup

    entry = with_artifacts(tmp_path, b"changed", listed=BLOB)
    monkeypatch.setattr(compiled, "_chosen", [compiled.Chosen(entry, dc.read(entry))])
    report = Report()
    with caplog.at_level(logging.INFO, "vllm.tq_warmup_plugin"):
        warmup._load_compiled(report)
    assert len(report.notes) == 1 and "not loaded" in report.notes[0]
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert report.errors == []  # strict mode does not fail on it: the graphs compile


def test_the_build_hashes_what_the_engine_saved_and_nothing_where_it_saved_none(
    tmp_path: Path,
) -> None:
    assert build._hashed(tmp_path / "absent") == {}
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / dc.COMPILED_FILE).write_bytes(BLOB)
    assert build._hashed(tmp_path / "c") == {
        dc.COMPILED_FILE: (hashlib.sha256(BLOB).hexdigest(), len(BLOB))
    }
    spec = build.engine_spec("turboquant_4bit_nc", None, None, 8, 2048, False, {"method": "ngram"})
    assert spec["engine"]["speculative_config"] == {"method": "ngram"}
    assert (
        "speculative_config"
        not in build.engine_spec("turboquant_4bit_nc", None, None, 8, 2048)["engine"]
    )


def test_a_seeded_build_keeps_the_earlier_builds_artifacts_beside_its_own(tmp_path: Path) -> None:
    """Two models built into one entry (the second seeded by the first): each one's
    graphs ship, under names of their content."""
    root = tmp_path / "layer" / dc.DRIVER_DIR
    entry = with_artifacts(root)
    node = dc.Node("570.86.15", ("NVIDIA H200",), len(FA2), hashlib.sha256(FA2).hexdigest())
    stage = tmp_path / "stage"
    (stage / dc.CACHE_DIR).mkdir(parents=True)
    assert build._seed(root, entry.name, node, stage / dc.CACHE_DIR)
    (stage / dc.COMPILED_DIR / dc.COMPILED_FILE).write_bytes(b"the second model's graphs")
    build._name_saved(stage / dc.COMPILED_DIR)
    names = sorted(p.name for p in (stage / dc.COMPILED_DIR).iterdir())
    assert names == sorted(
        f"torch-compile-{hashlib.sha256(d).hexdigest()[:16]}.bin"
        for d in (BLOB, b"the second model's graphs")
    )
