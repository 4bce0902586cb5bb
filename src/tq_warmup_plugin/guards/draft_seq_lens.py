"""The draft-pass guard: a V1 draft pass's CPU sequence lengths follow its queries.

Why: a draft pass that lengthens every query by N (draft_model: N=1,
``llm_base_proposer.py`` 0.22:98-101, 823; parallel-drafting EAGLE: N=k-1) calls
``extend_all_queries_by_N``, which raises ``query_start_loc``, the GPU ``seq_lens`` and
``max_seq_len`` by N but leaves ``seq_lens_cpu_upper_bound`` and ``_seq_lens_cpu``
as they were (``spec_decode/utils.py`` 0.22:293-303, 0.33:413-423). TurboQuant's
prefill loop takes each request's length from that bound (``turboquant_attn.py``
0.22:238, 607-608), so a fresh prompt gets ``cached_len = seq_len - q_len = -1``: over
128 tokens ``_continuation_prefill`` allocates 0 cached rows and raises "The expanded
size of the tensor (191) must match the existing size (0)" (vLLM 0.22.0, draft_model;
``tests/test_guard_draft_seq_lens.py``); at 128 or fewer it attends with every length one
short. 0.20 reads the GPU ``seq_lens`` (``turboquant_attn.py`` 0.20:571) and is not affected.

Which setups reach it (``compat.Features.draft_cpu_seq_lens_stale``):
draft_model runs on the V1 runner up to 0.30 (V2 refuses it, ``config/vllm.py``
0.23:2011, 0.30:2844) and on request (``VLLM_USE_V2_MODEL_RUNNER=0``) in 0.31-0.33;
scheduling is async by default from 0.28, where the bound's prefill rows are still exact
(``backend.py`` 0.22:405-409): all of them need the guard. What it leaves (async
scheduling, the V2 runner's first draft pass) is ``spec_problem``'s WARNING.

What: ``extend_all_queries_by_N`` of the defining module is wrapped so that, after
vLLM's own function, the CPU lengths of the metadata it returns are raised by N too,
as new tensors (vLLM's own are views of the runner's buffers); two fields that shared
one tensor share the new one. The only call site, ``llm_base_proposer`` (0.20-0.33),
imports the name at module level after the defining module executed, so it binds the
wrapper; a call site loaded before the guard is rebound.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from .. import compat, patching
from .gate import install_where_needed

__all__ = ["CALL_SITES", "MODULE", "bumped", "in_place", "install", "installed", "remove"]


MODULE = compat.SPEC_UTILS_MODULE
"""The vLLM module this guard adjusts once it has executed."""

CALL_SITES = compat.DRAFT_CALL_SITE_MODULES
"""Modules that import ``extend_all_queries_by_N`` by name (0.20-0.33: only this one)."""

NAME = compat.EXTEND_QUERIES_FUNCTION
# ``_seq_lens_cpu`` is gone from 0.30 (``backend.py`` 0.30:393-473); absent fields are skipped.
CPU_FIELDS = ("seq_lens_cpu_upper_bound", "_seq_lens_cpu")


def bumped(metadata: Any, n: int) -> Any:
    """``metadata`` with every CPU length field that exists and is set raised by ``n``
    (new tensors; fields that shared one tensor share the new one)."""
    names = {f.name for f in dataclasses.fields(metadata)}
    changes: dict[str, Any] = {}
    done: dict[int, Any] = {}
    for name in CPU_FIELDS:
        value = getattr(metadata, name, None) if name in names else None
        if value is not None:
            changes[name] = done.setdefault(id(value), value + n)
    return dataclasses.replace(metadata, **changes) if changes else metadata


def _guard(original: Callable[..., Any]) -> Callable[..., Any]:
    @patching.wraps(original)
    def extend_all_queries_by_N(
        common_attn_metadata: Any, N: int, *args: Any, **kwargs: Any
    ) -> Any:
        return bumped(original(common_attn_metadata, N, *args, **kwargs), N)

    return extend_all_queries_by_N


def install(utils: ModuleType) -> bool:
    """Wrap ``utils.extend_all_queries_by_N`` when the installed release needs it.
    Returns whether the guard is in place; never raises into vLLM's import."""
    return install_where_needed(
        "draft-pass sequence-length",
        lambda feats: feats.draft_cpu_seq_lens_stale,
        lambda: _apply(utils),
    )


def _apply(utils: ModuleType) -> bool:
    patching.wrap_function(utils, NAME, _guard, CALL_SITES)
    return True


def installed(utils: ModuleType) -> bool:
    """Whether ``utils.extend_all_queries_by_N`` is the guard."""
    return patching.is_ours(getattr(utils, NAME, None))


def in_place() -> bool:
    """Whether this process's ``extend_all_queries_by_N`` is the guard."""
    utils = sys.modules.get(MODULE)
    return utils is not None and installed(utils)


def remove(utils: ModuleType) -> None:
    """Give the defining module and every call site vLLM's own function back."""
    patching.unwrap_function([utils, *patching.loaded(CALL_SITES)], NAME)
