"""A Triton kernel that is not TurboQuant's: every Triton compile of a process goes
through the layered cache, so a hostile layer must not fail this one either."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["add_one", "compiles"]


@triton.jit
def add_one(x_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + 1, mask=mask)


def compiles() -> str:
    """Compile it for the active target (no launch): ``ok``, or the error."""
    try:
        kernel = add_one.warmup(torch.zeros(64), 64, BLOCK=64, grid=(1,))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok" if kernel is not None else "not compiled"
