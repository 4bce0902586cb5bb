"""Import-time guards: fixes to vLLM classes that vLLM reads before ``kernel_warmup``.

A guard is a module of this package with:

* ``MODULE``: the vLLM module it adjusts (a ``compat`` name), right after that module
  executes (``install.py``'s import hook), or at once when it is loaded already;
* ``install(module) -> bool``: apply the fix where the installed release has the bug
  (``gate.install_where_needed`` with the guard's ``compat.Features`` gate); idempotent;
  never raises into vLLM's import: an unknown release or layout is one WARNING;
* ``installed(module) -> bool``: whether the fix is in place;
* ``remove(module)``: give vLLM exactly what it had (``uninstall``, the tests).

Each patch is made with ``tq_warmup_plugin.patching`` (wrap, mark, rebind, restore, log
once), and each guard's module docstring holds its bug's evidence: the releases, the
files and lines, one sentence of what was seen and its record. Which guards a process gets
is decided here, from the frozen settings; ``install.py`` applies them. A new guard joins
``every()`` and gets a ``tests/test_guard_<name>.py``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Protocol

from ..settings import Settings

__all__ = ["Guard", "active", "every"]


class Guard(Protocol):
    """What ``install.py`` needs of a guard module."""

    MODULE: str

    def install(self, module: ModuleType) -> bool: ...

    def installed(self, module: ModuleType) -> bool: ...

    def remove(self, module: ModuleType) -> None: ...


def every() -> list[Guard]:
    """Every guard there is, in the order they are applied."""
    from . import (
        batched_verify,
        draft_seq_lens,
        local_boundary,
        prefix_fast_path,
        spec_graphs,
        v1_cache_dtype,
    )

    return [
        batched_verify,
        spec_graphs,
        v1_cache_dtype,
        draft_seq_lens,
        local_boundary,
        prefix_fast_path,
    ]


def active(settings: Settings) -> list[Guard]:
    """The guards these settings turn on: for verify batches the batched path (which
    falls back to the PIECEWISE cap where it does not serve) or, on request, the cap;
    the prefix-cache guard unless ``TQ_WARMUP_PREFIX_GUARD=0``."""
    from . import batched_verify, draft_seq_lens, prefix_fast_path, spec_graphs

    if not settings.spec_guard:
        off: set[object] = {batched_verify, spec_graphs, draft_seq_lens}
    else:
        off = {batched_verify} if settings.spec_piecewise else {spec_graphs}
    if not settings.prefix_guard:
        off.add(prefix_fast_path)
    return [guard for guard in every() if guard not in off]
