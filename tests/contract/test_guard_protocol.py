"""Every guard keeps the ``Guard`` protocol on vLLM's real modules, on each CI release:
install where the release has its bug (idempotent), remove to give vLLM exactly the
objects it had (every loaded ``vllm`` module's names, every class of the guard's module),
install again; and a guard that logs says its lines again after a remove (its ``Once``
is reset), so nothing a test or an undo leaves behind silences the next install."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tq_warmup_plugin import compat, guards
from tq_warmup_plugin import patching as _patching

pytestmark = pytest.mark.real_vllm

GATES = {
    "batched_verify": "spec_verify_batched",
    "spec_graphs": "spec_graphs_unsafe",
    "v1_cache_dtype": "v1_tq_cache_dtype_lost",
    "draft_seq_lens": "draft_cpu_seq_lens_stale",
    "local_boundary": "local_boundary_tq_backend",
    "prefix_fast_path": "prefix_fast_path_unsafe",
}


def _name(guard: Any) -> str:
    return str(guard.__name__.rsplit(".", 1)[-1])


def snapshot(module: Any) -> dict[str, dict[str, Any]]:
    """Every loaded vLLM module's names and every class of ``module``'s own attributes."""
    out = {name: dict(vars(m)) for name, m in list(sys.modules.items()) if name.startswith("vllm")}
    for attr, value in vars(module).items():
        if isinstance(value, type) and value.__module__ == module.__name__:
            out[f"{module.__name__}.{attr}"] = dict(vars(value))
    return out


def changed(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> list[str]:
    return [
        f"{where}.{name}"
        for where, names in before.items()
        for name in set(names) | set(after.get(where, {}))
        if after.get(where, {}).get(name, names.get(name)) is not names.get(name)
        or (name in names) != (name in after.get(where, {}))
    ]


def present(guards_: list[Any]) -> list[Any]:
    """The guards whose vLLM module this release has (0.34 removed the V1 drafters')."""
    return [g for g in guards_ if importlib.util.find_spec(g.MODULE) is not None]


@pytest.fixture
def pristine(vllm_env: compat.Features) -> Iterator[compat.Features]:
    """Every guard off (vLLM's plugin loading may have installed them), and off again after."""
    for guard in present(guards.every()):
        guard.remove(importlib.import_module(guard.MODULE))
    yield vllm_env
    for guard in present(guards.every()):
        guard.remove(importlib.import_module(guard.MODULE))


def module_of(feats: compat.Features, guard: Any) -> Any:
    """The guard's vLLM module; where the release has none, its gate must be off."""
    if not present([guard]):
        assert not getattr(feats, GATES[_name(guard)]), f"{guard.MODULE} is gone, its gate on"
        pytest.skip(f"{guard.MODULE} is not in vLLM {feats.version}: nothing to guard")
    return importlib.import_module(guard.MODULE)


def test_the_gate_table_names_every_guard() -> None:
    assert sorted(_name(g) for g in guards.every()) == sorted(GATES)


@pytest.mark.parametrize("guard", guards.every(), ids=_name)
def test_install_remove_install(pristine: compat.Features, guard: Any) -> None:
    module = module_of(pristine, guard)
    before = snapshot(module)
    needed = getattr(pristine, GATES[_name(guard)])
    assert guard.install(module) is needed
    assert guard.installed(module) is needed
    if needed:
        assert changed(before, snapshot(module))  # something of vLLM's is the guard's now
        once = snapshot(module)
        assert guard.install(module)  # idempotent: nothing wrapped twice
        assert not changed(once, snapshot(module))
    guard.remove(module)
    assert not guard.installed(module)
    assert not changed(before, snapshot(module)), "remove left the guard's objects behind"
    assert guard.install(module) is needed and guard.installed(module) is needed


@pytest.mark.parametrize("guard", guards.every(), ids=_name)
def test_a_remove_lets_the_guard_speak_again(pristine: compat.Features, guard: Any) -> None:
    """A guard's one-time lines live in its module's ``Once``, which ``remove`` resets."""
    once = getattr(guard, "_once", None)
    if once is None:  # says nothing, so nothing to reset
        with open(guard.__file__) as source:
            assert "logger.info(" not in source.read()
        return
    assert isinstance(once, _patching.Once)
    module = module_of(pristine, guard)
    once.first("said before the remove")
    guard.remove(module)
    assert once.first("said before the remove")
