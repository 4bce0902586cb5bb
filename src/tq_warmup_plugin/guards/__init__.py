"""Import-time guards: fixes to vLLM classes that vLLM reads before ``kernel_warmup``.

Each guard is a module with ``MODULE`` (the vLLM module it adjusts, right after that
module executes), ``install(module) -> bool`` (never raises into vLLM's import),
``installed(module) -> bool`` and ``remove(module)``. Which guards a process gets is
decided here, from the frozen settings; ``install.py`` applies them.
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
    from . import draft_seq_lens, local_boundary, spec_graphs, v1_cache_dtype

    return [spec_graphs, v1_cache_dtype, draft_seq_lens, local_boundary]


def active(settings: Settings) -> list[Guard]:
    """The guards these settings turn on."""
    from . import draft_seq_lens, spec_graphs

    off = set() if settings.spec_guard else {spec_graphs, draft_seq_lens}
    return [guard for guard in every() if guard not in off]
