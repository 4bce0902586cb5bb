"""Every way ``tq-warmup`` ends is an exit code and one ``tq-warmup:`` line, never a
traceback (issue 53, item 6): deeply nested JSON in a JSON flag, a standard output that
is closed or whose reader went away (a real pipe), a file name that is not UTF-8, a
``--cache-dir`` that is a ``current`` link to a layer or a directory others may write,
and an error nobody foresaw. In-process (``cli.main``) on real files and pipes; the one
fresh interpreter is ``test_cli``'s ``tq-warmup doctor`` into a closed pipe."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import fakes
import pytest
from test_cli import H200_FLAGS, stubbed_precompile

from tq_warmup_plugin.cli import commands as cli
from tq_warmup_plugin.cli import layers
from tq_warmup_plugin.shipped import manifest

__all__ = ["stubbed_precompile"]  # the fixture, shared with test_cli

DEEP = "[" * 100_000 + "]" * 100_000


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and err.startswith("tq-warmup: "), err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "--speculative-config", DEEP],
        ["driver-cache", "--cache-dir", "x", "--engine-args", '{"a":' * 5000 + "1" + "}" * 5000],
    ],
    ids=["speculative-config", "engine-args"],
)
def test_deep_json_in_a_flag_is_a_usage_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: RecursionError out of argparse, a traceback (argparse catches only
    ValueError and TypeError from a flag's type)."""
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    err = one_line(capsys.readouterr().err)
    assert exited.value.code == 2
    assert ": not usable JSON: nested more than 64 levels deep (see tq-warmup " in err


def test_a_closed_stdout_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tq-warmup verify ... >&-``: Python starts without ``sys.stdout``. Before:
    AttributeError ('NoneType' object has no attribute 'flush'), a traceback."""
    monkeypatch.setattr(sys, "stdout", None)
    assert cli.main(["verify", "--cache-dir", str(tmp_path)]) == 2
    err = one_line(capsys.readouterr().err)
    assert err == "tq-warmup: standard output is closed: there is nowhere to print the answer\n"


def test_a_stdout_whose_reader_went_away_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tq-warmup verify ... | head -0``, on a real pipe whose read end is closed.
    Before: exit 141 and nothing said."""
    read, write = os.pipe()
    os.close(read)
    with open(write, "w") as pipe:
        monkeypatch.setattr(sys, "stdout", pipe)
        rc = cli.main(["verify", "--cache-dir", str(tmp_path)])
        monkeypatch.undo()
    assert rc == 2
    assert one_line(capsys.readouterr().err) == (
        "tq-warmup: verify: standard output was closed before the answer was printed\n"
    )


def test_a_cache_dir_whose_name_is_not_utf8_is_printed_escaped(
    tmp_path: Path, stubbed_precompile: fakes.RecordingWarmer, capsys: pytest.CaptureFixture[str]
) -> None:
    """A name of bytes that are not UTF-8 reaches Python as lone surrogates. Before:
    precompile built and installed everything, then its summary line raised
    UnicodeEncodeError on a UTF-8 stdout, a traceback."""
    cache_dir = tmp_path / os.fsdecode(b"layer\xff")
    assert cli.main(["precompile", *H200_FLAGS[:-2], "--cache-dir", str(cache_dir)]) == 1
    out = capsys.readouterr().out
    assert f"in {tmp_path}/layer\\udcff: 3 built" in out, out


@pytest.mark.parametrize("mode", [0o777, 0o770])
def test_a_cache_dir_others_may_write_is_refused_before_anything_is_built(
    mode: int,
    tmp_path: Path,
    stubbed_precompile: fakes.RecordingWarmer,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Before: built into a 0777 directory (an emptyDir) where another user could swap a
    key directory or the manifest between the build and the install."""
    cache_dir = tmp_path / "shared"
    cache_dir.mkdir()
    cache_dir.chmod(mode)
    assert cli.main(["precompile", *H200_FLAGS[:-2], "--cache-dir", str(cache_dir)]) == 2
    err = one_line(capsys.readouterr().err)
    assert err == (
        f"tq-warmup: --cache-dir {cache_dir}: directory {cache_dir} is writable by others "
        f"(mode {mode:o}) without the sticky bit: another user could swap the build\n"
    )
    assert list(cache_dir.iterdir()) == [] and stubbed_precompile.seen == []


def test_verify_through_a_current_link_checks_the_layer_it_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fleets roll layers by pointing a ``current`` link at the new one. Before: every
    kernel of the layer was 'found a symlink' (the root was opened O_NOFOLLOW): verify
    exited 1, and a worker served nothing from it."""
    monkeypatch.setattr(manifest, "installed_stack", lambda arch=None: fakes.STACK)
    layer = tmp_path / "layer-v2"
    fakes.key_dir(layer, "A" * 52)
    fakes.write_manifest(layer, {"A" * 52: manifest.key_dir_hashes(layer / ("A" * 52))})
    (tmp_path / "current").symlink_to("layer-v2")
    assert cli.main(["verify", "--cache-dir", str(tmp_path / "current")]) == 0
    out = capsys.readouterr().out
    assert out == f"tq-warmup: {tmp_path}/current: 1 manifests, 1 kernels, 3 files: 0 problems\n"
    # A key directory that is a link stays refused, through the link as without it.
    (layer / ("A" * 52)).rename(tmp_path / "elsewhere")
    (layer / ("A" * 52)).symlink_to(tmp_path / "elsewhere")
    assert cli.main(["verify", "--cache-dir", str(tmp_path / "current")]) == 1
    assert "found a symlink" in capsys.readouterr().out


def test_an_error_nobody_foresaw_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last resort: the type, the first line and where it was raised."""

    def broken(args: object) -> int:
        raise KeyError("first\nsecond")

    monkeypatch.setattr(layers, "verify", broken)
    assert cli.main(["verify", "--cache-dir", str(tmp_path)]) == 2
    err = one_line(capsys.readouterr().err)
    assert err.startswith("tq-warmup: verify failed: KeyError: 'first\\nsecond' (at ")
    assert err.endswith(f"{Path(__file__).name}:{broken.__code__.co_firstlineno + 1})\n")


@pytest.mark.parametrize("make", ["open", "link"])
def test_a_driver_cache_directory_others_could_swap_is_refused_before_any_launch(
    make: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``driver-cache`` stages its entry in ``LAYER/driver-cache``. Before: a 0777 one
    (or a link elsewhere) was staged in, where another user could rename the stage."""
    layer = tmp_path / "layer"
    layer.mkdir()
    if make == "open":
        (layer / "driver-cache").mkdir()
        (layer / "driver-cache").chmod(0o777)
        why = f"directory {layer}/driver-cache is writable by others (mode 777) without the "
        why += "sticky bit"
    else:
        (tmp_path / "elsewhere").mkdir()
        (layer / "driver-cache").symlink_to(tmp_path / "elsewhere")
        why = f"{layer}/driver-cache is not a directory of its own (a link?)"
    flags = ["--kv-cache-dtype", "turboquant_4bit_nc", "--head-size", "128", "--num-heads", "16"]
    flags += ["--num-kv-heads", "8", "--vllm-version", "0.26.0", "--cache-dir", str(layer)]
    assert cli.main(["driver-cache", *flags]) == 2
    note, line = capsys.readouterr().err.splitlines()
    assert note.startswith("tq-warmup: driver-cache without an engine")
    assert line == f"tq-warmup: --cache-dir {layer}: {why}: another user could swap the build"
