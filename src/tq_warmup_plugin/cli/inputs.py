"""What the CLI reads that it did not write: JSON inputs, model configs and startup
reports, read as hostile files and turned into the geometries to plan.

``inspect``, ``precompile`` and ``driver-cache`` take ``--model`` (a ``config.json``) or
``--geometry-json`` (a startup report); a FIFO, a device, huge or deeply nested JSON is
one ``tq-warmup:`` line (``safe_io``), never a hang or a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .. import safe_io
from ..geometry import Geometry, Reported, read_report
from ..plan import request as planning
from ..plan.request import Planned

__all__ = [
    "CliError",
    "geometries",
    "geometries_from_report",
    "model_dir",
    "plan_request",
    "read_json",
]


class CliError(Exception):
    """Input the CLI refuses: the message is the one line it prints (exit code 2)."""


def read_json(path: Path, flag: str) -> object:
    """The JSON value in the file ``flag`` names: the CLI's one read of a JSON file it
    did not write, as a hostile file (``safe_io``: a FIFO, a device, huge or deeply
    nested JSON is refused); a symlink is followed. Anything else is one CliError line."""
    try:
        return safe_io.read_json(str(path), follow=True)
    except safe_io.UnsafeFile as exc:
        why = "no such file" if exc.missing else f"cannot read it ({exc})"
        raise CliError(f"{flag} {path}: {why}") from None


@contextlib.contextmanager
def model_dir(path: str) -> Iterator[str]:
    """The directory vLLM reads ``config.json`` from, after the checks vLLM would fail
    on with a traceback: the path exists and its ``config.json`` is a JSON object. A
    file of another name (``llama.json``) is copied as ``config.json`` into a temporary
    directory that is removed when the block ends."""
    given = Path(path)
    file = given / "config.json" if given.is_dir() else given
    if not given.exists():
        raise CliError(f"--model {path}: no such file or directory")
    if given.is_dir() and not file.is_file():
        raise CliError(f"--model {path}: no config.json in this directory")
    data = read_json(file, "--model")
    if not isinstance(data, dict):
        raise CliError(f"--model {file}: a JSON {type(data).__name__}, not a model config object")
    if file.name == "config.json":
        yield str(file.parent)
        return
    with tempfile.TemporaryDirectory(prefix="tq-warmup-config-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(data))
        yield tmp


def geometries_from_report(path: str) -> Reported:
    """The geometries a real startup discovered (its ``TQ_WARMUP_REPORT`` JSON), the
    TurboQuant layers they stand for, and the vLLM version the report names."""
    data = read_json(Path(path), "--geometry-json")
    try:
        return read_report(data)
    except ValueError as exc:
        raise CliError(f"--geometry-json {path}: {exc}") from None


def plan_request(args: argparse.Namespace) -> planning.PlanRequest:
    """The flags ``cli_flags.geometry_flags`` defines, as planning's request."""
    names = (f.name for f in dataclasses.fields(planning.PlanRequest))
    return planning.PlanRequest(**{name: getattr(args, name) for name in names})


def geometries(args: argparse.Namespace) -> tuple[dict[str, Geometry], Planned]:
    """Distinct geometries by name, and the first one's plan summary."""
    if args.geometry_json:
        found, layers, version = geometries_from_report(args.geometry_json)
        named = {f"geometry{i}": g for i, g in enumerate(found)}
        note = f"startup report of vLLM {version}"
        return named, Planned(found[0], layers, True, note, vocab_size=args.vocab_size or 0)
    request = plan_request(args)
    with contextlib.ExitStack() as stack:  # vLLM reads --model's config in here
        model = None if args.model is None else stack.enter_context(model_dir(args.model))
        if model is not None:  # a local config: nothing to download
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
        planned = planning.plan_geometry(request, model)
        draft = planning.draft_model(request.speculative_config)
        if draft is not None:  # its own layers: read from a local config only
            here = Path(draft).is_dir() or Path(draft).is_file()
            drafter = stack.enter_context(model_dir(draft)) if here else None
            planned = planning.plan_draft(request, planned, drafter)
    return planning.named_geometries(planned), planned
