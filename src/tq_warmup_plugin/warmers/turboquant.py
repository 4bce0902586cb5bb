"""The TurboQuant warmer: every layer's kernel keys, path by path.

Decode, short and long continuation, store: the pure derivations in ``keys`` (``PATHS``)
applied to each layer's ``Geometry``.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping

from ..geometry import Geometry
from ..hookspecs import hookimpl
from ..keys import PATHS, KernelKey

__all__ = ["tq_warmup_keys", "turboquant_contributions"]


def turboquant_contributions(
    geometries: Mapping[str, Geometry],
) -> Iterable[tuple[str, str, KernelKey]]:
    """Every ``(layer, path, key)`` the TurboQuant paths need for these layers."""
    for layer, geometry in geometries.items():
        for path, derive in PATHS.items():
            for key in derive(geometry):
                yield layer, path, key


@hookimpl
def tq_warmup_keys(geometries: Mapping[str, Geometry]) -> Iterable[tuple[str, str, Hashable]]:
    return list(turboquant_contributions(geometries))
