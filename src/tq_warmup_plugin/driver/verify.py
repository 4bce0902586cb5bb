"""``tq-warmup verify`` of a layer's ``driver-cache/``: each entry's manifest (pinned where
``TQ_WARMUP_CACHE_PIN`` is set), its files against it, and whether an entry is for this
node; the lines it prints, escaped (a layer's author wrote the names)."""

from __future__ import annotations

from pathlib import Path

from .. import safe_io
from ..shipped.pins import current as pin_current
from . import host
from .entry import (
    DRIVER_DIR,
    MAX_ENTRIES,
    EntryError,
    Node,
    file_problems,
    listing,
    read,
    stale_stages,
)
from .host import match

__all__ = ["print_verify", "verify_layer"]


def verify_layer(layer: str | Path, node: Node) -> tuple[str, list[str]] | None:
    """``tq-warmup verify`` of ``layer/driver-cache``: a summary and one line per problem
    (an unusable manifest, a file that differs, no entry for ``node`` where ``node``
    knows enough to say); ``None`` without a driver-cache directory. Entries for another
    GPU or driver beside one for this node are not problems (a layer for two fleets)."""
    root = Path(layer, DRIVER_DIR)
    if not root.is_dir():
        return None
    problems: list[str] = []
    usable: dict[str, list[str]] = {}  # each readable entry's match problems on ``node``
    found, left_out = listing(root, node)
    if left_out:
        problems.append(
            f"{DRIVER_DIR}: {left_out} entries past the first {MAX_ENTRIES} not checked"
        )
    problems += [
        f"{DRIVER_DIR}/{stage.name}: left by a driver-cache build that did not finish "
        "(the next one removes it)"
        for stage in stale_stages(root)
    ]
    files = 0
    pinned = pin_current()
    for entry in found:
        try:
            shipped = read(entry, pinned)
        except EntryError as exc:
            problems.append(f"{DRIVER_DIR}/{entry.name}: not a usable manifest: {exc}")
            continue
        files += len(shipped.files)
        problems += [f"{DRIVER_DIR}/{entry.name}: {p}" for p in file_problems(entry, shipped)]
        usable[entry.name] = match(shipped, node, strict=False)
    other = {name: why for name, why in usable.items() if why}
    if usable and len(other) == len(usable):  # not one entry for this node
        problems += [f"{DRIVER_DIR}/{name}: {p}" for name, why in other.items() for p in why]
        other = {}
    unknown = [n for n, v in (("driver", node.driver), ("gpu", node.gpus)) if not v]
    summary = (
        f"tq-warmup: {root}: {len(found)} driver cache entr{'y' if len(found) == 1 else 'ies'}, "
        f"{files} files: {len(problems)} problem{'' if len(problems) == 1 else 's'}"
    )
    if other:
        summary += f"; {len(other)} for another GPU or driver"
    if unknown:
        summary += f"; not checked (not known here): {', '.join(unknown)}"
    return summary, problems


def print_verify(root: Path) -> int | None:
    """``tq-warmup verify``'s lines for ``root/driver-cache`` on this node: printed, and
    the problem count returned; None where the layer has no driver cache."""
    # Read through the module: a test stands in for the node's FA2 library there.
    node = host.read_node("/proc", host.fa2_library(), hash_fa2=True)
    checked = verify_layer(root, node)
    if checked is None:
        return None
    summary, problems = checked
    for line in problems:  # names and fields the layer's author wrote: escaped
        print(safe_io.printable(line))
    print(safe_io.printable(summary))
    return len(problems)
