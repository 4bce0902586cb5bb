"""``TQ_WARMUP_CACHE_PIN``: which manifests a shipped cache may be served by (issue 30).

A manifest proves that a layer's files are the ones it lists, not who wrote it: whoever
can rewrite a cubin can rewrite its manifest beside it. A pin closes that, as an image
digest does: ``TQ_WARMUP_CACHE_PIN=sha256:<hex>[,sha256:<hex>...]`` names the sha256 of
each manifest *file* that may be served (a Triton layer's ``tq-warmup-manifest-*.json``,
a driver-cache entry's ``manifest.json``), set in the pod spec from the build's output
(``tq-warmup precompile``, ``driver-cache`` and ``verify --print-pin`` print the value).
When it is set, a manifest whose digest is not listed is refused in one WARNING, and what
it lists is not served; unset, any manifest that matches its files is served. The digest
is taken of the very bytes that are then parsed (one read), so nothing can be swapped in
between. Read from the environment at each use, not from ``Settings``: Triton's compile
workers read layers without ever running ``register()``.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping

__all__ = ["PIN_ENV", "Pins", "current", "describe", "digest", "line", "parse", "refusal", "said"]

logger = logging.getLogger("vllm.tq_warmup_plugin")

PIN_ENV = "TQ_WARMUP_CACHE_PIN"
_ITEM = re.compile(r"^sha256:([0-9a-f]{64})$")

Pins = frozenset[str] | None
"""The pinned digests (lowercase hex), or None: not pinned."""


def parse(text: str | None) -> tuple[Pins, list[str]]:
    """The pins in ``text``, and one line per item that is not ``sha256:<64 hex>``. A
    malformed item pins nothing: it matches no manifest (refusing is the safe side). Blank
    is unset, as for every setting; a value that names no manifest (``,``) serves nothing
    shipped, said in one line."""
    if text is None or not text.strip():
        return None, []
    found, problems = set(), []
    for raw in text.split(","):
        item = raw.strip().lower()
        match = _ITEM.match(item)
        if match:
            found.add(match.group(1))
        elif item:
            problems.append(
                f"tq-warmup: {PIN_ENV} item {raw.strip()[:80]!r} is not sha256:<64 hex digits>: "
                "it pins nothing"
            )
    if not found and not problems:
        problems.append(
            f"tq-warmup: {PIN_ENV}={text.strip()[:80]!r} names no manifest: nothing shipped "
            "is served (unset it to serve any manifest that matches its files)"
        )
    return frozenset(found), problems


def describe(pinned: Pins, unverified: bool = False) -> str:
    """What a shipped cache may serve, as ``doctor`` shows it."""
    if pinned is None:
        what = "any manifest that matches its files"
        return what + ("; a layer without one, unchecked" if unverified else "")
    if not pinned:
        return f"nothing shipped ({PIN_ENV} names no valid manifest digest)"
    return f"only the {len(pinned)} manifest(s) {PIN_ENV} names"


_said: set[tuple[int, str]] = set()
"""(process, value) whose problems this process said: one WARNING per item, each process."""


def said(text: str | None) -> None:
    """Note that this process said the problems of ``text`` (``register()`` says every
    setting's), so that ``current`` does not say them again."""
    if text is not None:
        _said.add((os.getpid(), text))


def current(env: Mapping[str, str] | None = None) -> Pins:
    """The pins set in the environment now. A malformed item is one WARNING in each
    process that reads the pins, ``register()`` or not (a process that only inherits the
    cache manager): it pins nothing, so the layer serves nothing, never silently."""
    text = (os.environ if env is None else env).get(PIN_ENV)
    pinned, problems = parse(text)
    if problems and text is not None and (os.getpid(), text) not in _said:
        said(text)
        for line in problems:
            logger.warning(line)
    return pinned


def digest(data: bytes) -> str:
    """The sha256 a pin names: of a manifest file's bytes (``sha256sum`` agrees)."""
    import hashlib  # not at module level: register() without a pin hashes nothing

    return hashlib.sha256(data).hexdigest()


def refusal(pins: Pins, data: bytes) -> str | None:
    """Why a manifest of these bytes may not be served, or None (not pinned, or pinned)."""
    if pins is None:
        return None
    found = digest(data)
    return None if found in pins else f"sha256:{found} is not pinned by {PIN_ENV}"


def line(digests: Iterable[str]) -> str:
    """The setting that pins exactly these manifests."""
    return f"{PIN_ENV}=" + ",".join(f"sha256:{d}" for d in sorted(set(digests)))
