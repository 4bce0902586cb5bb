"""The ``shipped`` benchmark's pure parts and its read-only view of a layer."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from benchmarks.tqbench import cli, records, shipped


def _layer(root: Path) -> Path:
    for key, kernel in (("k1", "_tq_decode_stage1"), ("k0", "_tq_decode_stage1"), ("k2", "x")):
        (root / key).mkdir(parents=True)
        (root / key / f"{kernel}.cubin").write_bytes(bytes(range(256)))
        (root / key / f"{kernel}.json").write_text("{}")
    return root


def test_the_decode_cubin_is_the_first_key_directory_that_has_one(tmp_path: Path) -> None:
    layer = _layer(tmp_path / "layer")
    assert shipped.decode_cubin(layer) == layer / "k0" / "_tq_decode_stage1.cubin"
    assert shipped.decode_cubin(tmp_path / "layer" / "k2") is None


def test_corrupt_changes_content_not_size_and_the_hashes_see_it(tmp_path: Path) -> None:
    layer = _layer(tmp_path / "layer")
    before = shipped.file_hashes(layer)
    assert sorted(before) == sorted(
        f"{k}/{n}"
        for k, n in [("k0", "_tq_decode_stage1"), ("k1", "_tq_decode_stage1"), ("k2", "x")]
        for n in (f"{n}.cubin", f"{n}.json")
    )
    target = layer / "k0" / "_tq_decode_stage1.cubin"
    shipped.corrupt(target)
    assert target.stat().st_size == 256
    after = shipped.file_hashes(layer)
    assert {k for k in before if before[k] != after[k]} == {"k0/_tq_decode_stage1.cubin"}


def test_warnings_are_the_plugins_warning_lines() -> None:
    log = (
        "INFO 12-01 tq-warmup: 2 TurboQuant layers\n"
        "WARNING 12-01 [cache.py:80] tq-warmup: shipped cache /l: k0/x.cubin sha256 differs\n"
        "WARNING 12-01 something else\n"
    )
    assert shipped.warnings_in(log) == [
        "WARNING 12-01 [cache.py:80] tq-warmup: shipped cache /l: k0/x.cubin sha256 differs"
    ]


def test_read_only_view_has_the_layer_and_takes_no_writes(tmp_path: Path) -> None:
    layer = _layer(tmp_path / "layer")
    with shipped.read_only(layer, tmp_path / "ro") as how:
        view = tmp_path / "ro"
        assert shipped.file_hashes(view) == shipped.file_hashes(layer)
        if how == "read-only bind mount" or os.geteuid() != 0:
            with pytest.raises(OSError):
                (view / "k0" / "new").write_text("x")
        else:  # chmod: root ignores it, so only the mode bits can be checked
            assert not (view / "k0").stat().st_mode & 0o222
    assert how in ("read-only bind mount", "chmod -R a-w (root can still write)")


def test_shipped_refuses_a_missing_layer_and_a_corrupt_preset_it_does_not_run(
    tmp_path: Path,
) -> None:
    parser = cli.build_parser()
    with pytest.raises(SystemExit, match="not a directory"):
        shipped.cmd_shipped(parser.parse_args(["shipped", "--layer", str(tmp_path / "no")]))
    args = ["shipped", "--layer", str(tmp_path), "--presets", "turboquant_k8v4"]
    with pytest.raises(SystemExit, match="not among --presets"):
        shipped.cmd_shipped(parser.parse_args([*args, "--corrupt", "turboquant_4bit_nc"]))


def test_past_the_deadline_no_engine_starts_and_the_rows_are_saved(tmp_path: Path) -> None:
    layer = _layer(tmp_path / "layer")
    out = tmp_path / "rows.jsonl"
    argv = ["shipped", "--layer", str(layer), "--presets", "turboquant_k8v4"]
    argv += ["--work-dir", str(tmp_path / "w"), "--out", str(out), "--deadline-s", "1"]
    bench = shipped.Shipped(cli.build_parser().parse_args(argv))
    time.sleep(1)
    assert bench.run() == 1  # nothing ran, so nothing is ok
    run, rows = records.read_run(out)
    assert run["layer"] == str(layer)
    assert [(r["variant"], r["status"]) for r in rows] == [
        ("ref", "skipped"),
        ("shipped", "skipped"),
    ]


def test_a_raw_run_reads_back_as_markdown_with_its_warning_and_corrupted_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = {"preset": "turboquant_4bit_nc", "layer_mode": "chmod", "layer_unchanged": True}
    rows = [
        {**common, "variant": "ref", "status": "ok", "warmup_s": 1.234, "warnings": []},
        {
            **common,
            "variant": "corrupt",
            "status": "ok",
            "compiled": 1,
            "shipped": 5,
            "tokens_equal_ref": True,
            "corrupted_file": "KEY/_tq_decode_stage1.cubin",
            "rebuilt_in_writable_dir": True,
            "rebuilt_equals_ref": False,
            "warnings": ["WARNING tq-warmup: KEY/_tq_decode_stage1.cubin: sha256 differs"],
        },
    ]
    raw = tmp_path / "run.jsonl"
    records.write_run(raw, {"series": "s", "run_id": "r1", "geometry": "128x16x8"}, rows)
    assert cli.main(["shipped", "--report", str(raw)]) == 0
    md = raw.with_suffix(".md").read_text()
    assert md.startswith("# s (r1)\n")
    assert "| 4bit_nc | ref | ok | - | 1.23 | - | - | - | 0 | - | 0 |" in md
    assert "| 4bit_nc | corrupt | ok | - | - | 1 | 5 | - | 0 | True | 1 |" in md
    assert "rebuilt in the writable dir: True, equal to ref's: False" in md
    assert md.count("sha256 differs") == 1 and "layer: chmod, - files, unchanged: True" in md
    assert "4bit_nc  corrupt" in capsys.readouterr().out
