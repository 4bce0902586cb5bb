"""A benchmark-only vLLM general plugin: scale dummy weights as they are loaded.

The in-process benchmarks scale the dummy weights after startup (``LLM.apply_model``)
so that greedy tokens are decided; ``vllm serve`` runs its engine in a process the
benchmark cannot reach, so there the scaling happens in vLLM's own loader:
``DummyModelLoader.load_weights`` (all releases), then every parameter times
``TQBENCH_WEIGHT_SCALE``. Unset (or 1): nothing is changed. Never installed with the
plugin: only the benchmark's entry-point stub declares it (``entry_point.write_stub``).
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any

__all__ = ["ENV", "register"]

ENV = "TQBENCH_WEIGHT_SCALE"
_LOADER = "vllm.model_executor.model_loader.dummy_loader"


def register() -> None:
    """Wrap ``DummyModelLoader.load_weights`` once when ``TQBENCH_WEIGHT_SCALE`` is set."""
    scale = float(os.environ.get(ENV) or 1.0)
    if scale == 1.0:
        return
    cls: Any = importlib.import_module(_LOADER).DummyModelLoader
    if getattr(cls.load_weights, "__tqbench_scaled__", False):
        return
    original = cls.load_weights

    @functools.wraps(original)
    def load_weights(self: Any, model: Any, model_config: Any) -> None:
        original(self, model, model_config)
        for p in model.parameters():
            p.data.mul_(scale)

    load_weights.__tqbench_scaled__ = True  # type: ignore[attr-defined]
    cls.load_weights = load_weights
