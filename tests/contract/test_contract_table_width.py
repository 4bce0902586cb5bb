"""Contract: the planned block-table row (``plan.rules.block_table_width``) is the row vLLM's
own code gives a V2 worker, and on 0.32+ the kernel table of any runner's attention group.

V1's ``MultiGroupBlockTable`` is held in ``test_contract_worker_plan``. The V2 runner sizes
its rows in manager blocks with vLLM's ``get_block_table_width`` (``gpu/model_runner.py``
0.27:469, 0.34:704), called here; 0.26's computes them inline (0.26:433-440), not callable.
Where a hybrid's kernel blocks are smaller than its manager blocks, the V2 runner's own
``BlockTables`` split each row (0.26-0.31), run here for real on host buffers; 0.32+ build
the kernel table in ``AttentionGroup.create_metadata_builders``, run here for real over
TurboQuant's backend, whose builder alone is a stand-in (it would need a whole engine's
config). Until session 26 a V2 plan of a hybrid said 2 blocks of 2160 where vLLM's table
has 1080 blocks of 16; Triton keys the row by its stride's divisibility by 16 and its rows'
16-byte alignment, which that changed in 5 of the 10 cases here on 0.27+ (none on 0.26).
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import Any

import pytest
from test_contract_hybrid_block import vllm_kernel_block
from test_contract_vllm_kernels import feats

from tq_warmup_plugin import compat
from tq_warmup_plugin.plan import rules as plan_rules

pytestmark = pytest.mark.real_vllm

MAX_LENS = (900, 4096)
BLOCKS = (16, 32, 48, 304, 2160)
"""TurboQuant's own blocks (16, 32 for a bf16 model on 0.26+), one past 32 that is no power
of two, and two hybrid manager blocks (Jamba's 304, the serve-jit Qwen3-Next's 2160)."""


def vllm_width_function() -> Any:
    """vLLM's ``get_block_table_width``: ``v1/worker/block_table.py`` 0.27-0.33,
    ``v1/kv_cache_interface.py`` 0.34 (the V1 module went with the V1 runner)."""
    for module in ("vllm.v1.kv_cache_interface", "vllm.v1.worker.block_table"):
        function = getattr(importlib.import_module(module), "get_block_table_width", None)
        if function is not None:
            return function
    raise AssertionError("no get_block_table_width in a release that rounds with it")


class _Builder:
    """Stands in for TurboQuant's metadata builder, which the group builds last."""

    requires_block_table_width = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


def _host_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The V2 ``BlockTables``' staging buffers on a host without an accelerator: no pinned
    memory, and the "device view" of a host buffer is the buffer itself."""
    import torch

    def unpinned(function: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            pinned = "pin_memory" in kwargs
            return function(*args, **({**kwargs, "pin_memory": False} if pinned else kwargs))

        return call

    for name in ("empty", "zeros", "tensor", "empty_like", "zeros_like", "full", "ones"):
        monkeypatch.setattr(torch, name, unpinned(getattr(torch, name)))
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
    for module in ("vllm.v1.worker.gpu.buffer_utils", "vllm.utils.torch_utils"):
        loaded = importlib.import_module(module)
        if hasattr(loaded, "get_accelerator_view_from_cpu_tensor"):
            monkeypatch.setattr(loaded, "get_accelerator_view_from_cpu_tensor", lambda t: t)


def v2_split_width(block: int, manager_blocks: int, monkeypatch: pytest.MonkeyPatch) -> int:
    """The row of the V2 runner's own ``BlockTables`` (0.26-0.31) for ``manager_blocks``
    blocks of ``block`` tokens at vLLM's kernel block."""
    import inspect

    import torch

    _host_only(monkeypatch)
    tables = importlib.import_module("vllm.v1.worker.gpu.block_table").BlockTables
    offered = dict(block_sizes=[block], max_num_reqs=4, max_num_batched_tokens=64,
                   max_num_blocks_per_group=[manager_blocks], device=torch.device("cpu"),
                   kernel_block_sizes=[vllm_kernel_block(block)])  # fmt: skip
    accepted = inspect.signature(tables.__init__).parameters
    built = tables(**{k: v for k, v in offered.items() if k in accepted})
    return int(built.input_block_tables[0].shape[-1])


def _v2_tables_split() -> bool:
    """Whether the V2 ``BlockTables`` take kernel block sizes, and split rows by them."""
    import inspect

    tables = importlib.import_module("vllm.v1.worker.gpu.block_table").BlockTables
    return "kernel_block_sizes" in inspect.signature(tables.__init__).parameters


def group_kernel_width(block: int, max_len: int) -> int | None:
    """The row of the kernel table vLLM's ``AttentionGroup`` builds for TurboQuant layers
    of ``block``-token manager blocks (None where the kernel takes the whole block)."""
    import torch
    from vllm.config import ParallelConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.utils import AttentionGroup

    tq = getattr(importlib.import_module(compat.BACKEND_MODULE), compat.BACKEND_CLASS)
    backend = type("Backend", (tq,), {"get_builder_cls": staticmethod(lambda: _Builder)})
    spec = FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=128, dtype=torch.uint8)
    config = SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=max_len),
        scheduler_config=SimpleNamespace(max_num_seqs=4),
        parallel_config=ParallelConfig(),  # one rank: no context parallelism
    )
    group = AttentionGroup(backend=backend, layer_names=["l"], kv_cache_spec=spec,
                           kv_cache_group_id=0)  # fmt: skip
    group.create_metadata_builders(config, torch.device("cpu"), vllm_kernel_block(block))
    table = group.kernel_block_table
    return None if table is None else int(table.shape[-1])


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("max_len", MAX_LENS)
def test_the_v2_row_is_vllms(block: int, max_len: int) -> None:
    if not feats().block_table_rounded:
        pytest.skip("0.26's V2 runner computes its row inline (0.20-0.26: nothing to call)")
    own = vllm_width_function()(-(-max_len // block), block)
    assert plan_rules.block_table_width(feats(), max_len, block, True) == own


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("max_len", MAX_LENS)
def test_the_kernel_table_is_the_groups(block: int, max_len: int) -> None:
    """0.32+: the row both runners' split layers read; the check fails where the plan
    forgets the split (the V2 plan before session 26) or the rounding."""
    from vllm.v1.worker.utils import AttentionGroup

    if "kernel_block_table" not in AttentionGroup.__dataclass_fields__:
        pytest.skip("0.20-0.31: no kernel table on the attention group")
    kernel = vllm_kernel_block(block)
    served = group_kernel_width(block, max_len)
    if kernel == block:
        assert served is None
        return
    assert served is not None
    for v2 in (True, False):
        assert plan_rules.block_table_width(feats(), max_len, block, v2, kernel) == served
    unsplit = plan_rules.block_table_width(feats(), max_len, block, True)
    assert unsplit != served  # what the V2 plan said before


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("max_len", MAX_LENS)
def test_the_v2_runners_own_tables_split_the_row(
    block: int, max_len: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """0.26-0.31: the V2 runner's ``BlockTables`` hold each manager block as its kernel
    blocks; its manager-block count is the plan's own (``test_the_v2_row_is_vllms``)."""
    if not _v2_tables_split():
        pytest.skip("0.32+: the attention group's kernel table splits the row instead")
    kernel = vllm_kernel_block(block)
    unsplit = plan_rules.block_table_width(feats(), max_len, block, True)
    served = v2_split_width(block, unsplit, monkeypatch)
    assert plan_rules.block_table_width(feats(), max_len, block, True, kernel) == served
    if kernel != block:
        assert unsplit != served  # what the V2 plan said before
