"""TurboQuant's kernel paths as warmer keys: decode, short and long continuation, store."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping

from ..geometry import Geometry
from ..hookspecs import hookimpl
from ..keys import turboquant_contributions


@hookimpl
def tq_warmup_keys(geometries: Mapping[str, Geometry]) -> Iterable[tuple[str, str, Hashable]]:
    return list(turboquant_contributions(geometries))
