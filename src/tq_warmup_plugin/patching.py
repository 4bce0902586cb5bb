"""How the plugin changes vLLM's code and puts it back: wrap, mark, rebind, restore, log once.

The ``kernel_warmup`` hook (``install.py``) and every guard follow the same rules, so
installing twice changes nothing and removing gives vLLM exactly what it had:

* a replacement is built with ``wraps(original)``: ``functools.wraps``, and *marked*
  with the object it replaces (``__tq_warmup_original__``), which is how a patch is
  recognised as the plugin's and undone without a registry;
* a module's function is replaced where it is defined and *rebound* in each loaded
  module that imported it by name (``from m import f`` copies the object: vLLM's
  ``gpu_worker`` does so for ``kernel_warmup``, ``llm_base_proposer`` for
  ``extend_all_queries_by_N``, 0.20-0.33);
* a class attribute is replaced in the class's own ``__dict__``, keeping what the
  class held there, or nothing when it inherited the name; ``restore`` puts exactly
  that back (a ``staticmethod`` or ``classmethod`` stays one);
* a patch for the length of a block (``swapped``: vLLM's ops module and
  ``current_platform`` while the fused MoE steps run in a live worker, vLLM's device
  count while an offline plan reads it) is built and marked the same way, and put back
  as it was on the way out, even when the block raises;
* an INFO or WARNING about a patch at work is said once per process (``Once``), and
  once more after the patch is removed and installed again.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import ModuleType
from typing import Any, TypeVar

__all__ = [
    "ORIGINAL",
    "Once",
    "is_ours",
    "loaded",
    "original_of",
    "replace",
    "restore",
    "swapped",
    "unwrap_function",
    "wrap_function",
    "wraps",
]

F = TypeVar("F", bound=Callable[..., Any])

ORIGINAL = "__tq_warmup_original__"
"""The attribute of a replacement that holds what it replaced."""
_REPLACED = "__tq_warmup_replaced__"
"""The attribute of a class-attribute replacement that holds what the class's own
``__dict__`` held under that name (None: the class inherited it)."""


def wraps(original: Callable[..., Any]) -> Callable[[F], F]:
    """``functools.wraps(original)``, and mark the wrapper as the plugin's."""

    def mark(wrapper: F) -> F:
        functools.update_wrapper(wrapper, original)
        setattr(wrapper, ORIGINAL, original)
        return wrapper

    return mark


def _function(obj: Any) -> Any:
    """The function of a ``staticmethod`` or ``classmethod``, else ``obj``."""
    return getattr(obj, "__func__", obj)


def original_of(obj: Any) -> Any | None:
    """What ``obj`` (a function, or a static or class method of one) replaced, when it
    is the plugin's; else None."""
    return getattr(_function(obj), ORIGINAL, None)


def is_ours(obj: Any) -> bool:
    """Whether ``obj`` is a replacement built with ``wraps``."""
    return original_of(obj) is not None


def loaded(names: Iterable[str]) -> list[ModuleType]:
    """The modules of ``names`` that are imported already (absent ones are skipped)."""
    return [sys.modules[name] for name in names if name in sys.modules]


def wrap_function(
    module: ModuleType, name: str, make: Callable[[Any], Any], call_sites: Iterable[str] = ()
) -> None:
    """Replace ``module.name`` with ``make(original)`` (built with ``wraps``) unless it
    is the plugin's already, and rebind each loaded call-site module that still holds
    the original: it imported the name before the replacement."""
    current = getattr(module, name)
    original = original_of(current)
    if original is None:
        original, current = current, make(current)
    for site in (module, *loaded(call_sites)):
        if getattr(site, name, None) is original:
            setattr(site, name, current)


def unwrap_function(modules: Iterable[ModuleType], name: str) -> None:
    """Give each module that holds the plugin's replacement of ``name`` the original."""
    for module in modules:
        original = original_of(getattr(module, name, None))
        if original is not None:
            setattr(module, name, original)


def replace(cls: type, name: str, new: Any) -> None:
    """Put ``new`` (built with ``wraps``, or a static or class method of such a
    function) on ``cls`` as ``name``, keeping what ``cls`` itself held there."""
    setattr(_function(new), _REPLACED, cls.__dict__.get(name))
    setattr(cls, name, new)


def restore(cls: type, name: str) -> None:
    """Undo ``replace``: what ``cls`` held back in place, or the name deleted so that
    the inherited one shows again. Nothing when ``name`` is not the plugin's."""
    current = cls.__dict__.get(name)
    if not is_ours(current):
        return
    replaced = getattr(_function(current), _REPLACED, None)
    if replaced is None:
        delattr(cls, name)
    else:
        setattr(cls, name, replaced)


@contextlib.contextmanager
def swapped(target: Any, values: Mapping[str, Callable[..., Any]]) -> Iterator[None]:
    """``target``'s attributes replaced by ``values``' callables inside the block, each
    as a stand-in built with ``wraps`` (so marked with what it replaced, and
    ``is_ours``), then put back as they were: an attribute ``target`` did not hold itself
    (say a class's method) is deleted again."""
    missing = object()
    saved = {name: target.__dict__.get(name, missing) for name in values}
    for name, value in values.items():
        original = getattr(target, name, None)

        def stand_in(*args: Any, _value: Any = value, **kwargs: Any) -> Any:
            return _value(*args, **kwargs)

        setattr(target, name, stand_in if original is None else wraps(original)(stand_in))
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is missing:
                delattr(target, name)
            else:
                setattr(target, name, old)


class Once:
    """Which of a module's one-time messages this process has said."""

    def __init__(self) -> None:
        self._said: set[str] = set()

    def first(self, message: str) -> bool:
        """True the first time ``message`` is asked about (say it then), False after."""
        if message in self._said:
            return False
        self._said.add(message)
        return True

    def reset(self) -> None:
        """Forget every message (the patch was removed: say them again when it works)."""
        self._said.clear()
