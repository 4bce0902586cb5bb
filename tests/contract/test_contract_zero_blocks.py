"""Contract: the KV-block zeroing warmer compiles every key vLLM's zeroer launches for the
block counts a step may zero, and vLLM 0.26's own Qwen warmup does not (the cause).

The installed vLLM's own ``KVBlockZeroer`` (its constructor, or 0.22's ``init_meta``)
builds its segment table from a stand-in attention group of two layers whose KV caches
are CPU tensors of TurboQuant's layout; ``zero_block_ids`` then runs for real under a
compile-only sm90 driver, and Triton's ``jit_cache_hook`` records each launch's key.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import pytest
from realvllm import activate_compile_only_driver, recorded_keys

from tq_warmup_plugin import compat
from tq_warmup_plugin.vllm_kernels.jobs import Engine, Job
from tq_warmup_plugin.warmers import vllm_zero_blocks

pytestmark = pytest.mark.real_vllm

BLOCKS = 64


class _Backend:
    @staticmethod
    def get_kv_cache_block_dim(*args: Any, **kwargs: Any) -> int:
        return 0  # blocks outermost, as TurboQuant's cache is


KERNEL_PAGE = 16 * 2 * 72
"""A kernel block of 16 tokens, 2 KV heads, TurboQuant's 72-byte slots, in bytes."""


def zeroer(layers: int = 2, block: int = 16) -> Any:
    """vLLM's zeroer for ``layers`` TurboQuant layers (2 KV heads of 64) whose manager
    blocks of ``block`` tokens run kernel blocks of 16, as a hybrid's do."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.utils import KVBlockZeroer

    spec = FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    group = SimpleNamespace(kv_cache_spec=spec, kv_cache_group_id=0, backend=_Backend,
                            kernel_block_stride=0,  # 0.33: not a bound view
                            layer_names=[f"layer{i}" for i in range(layers)])  # fmt: skip
    kernel_blocks = BLOCKS * (block // 16)
    context = {name: SimpleNamespace(kv_cache=torch.zeros(kernel_blocks, 16, 2, 72,
                                                          dtype=torch.uint8))
               for name in group.layer_names}  # fmt: skip
    given: dict[str, Any] = dict(device=torch.device("cpu"), pin_memory=False,
                                 attn_groups_iter=[group], kernel_block_sizes=[16],
                                 cache_dtype="turboquant_4bit_nc", static_forward_context=context,
                                 runner_only_attn_layers=set(), max_concurrency=1,
                                 num_blocks=BLOCKS)  # fmt: skip

    def chosen(fn: Any) -> dict[str, Any]:
        return {k: v for k, v in given.items() if k in inspect.signature(fn).parameters}

    made = KVBlockZeroer(**chosen(KVBlockZeroer.__init__))
    if getattr(made, "_meta", None) is None and hasattr(made, "init_meta"):  # 0.22
        made.init_meta(**chosen(made.init_meta))
    assert compat.kv_block_zeroer(SimpleNamespace(_kv_block_zeroer=made)) is made
    return made


def warmed(zero: Any) -> set[tuple[str, str]]:
    engine = Engine(features=compat.release_features(compat.installed_vllm_version()),
                    runner_v2=False, pooling=False, spec_method=None, spec_tokens=0,
                    draft_probs=False, max_logprobs=20, hybrid=True,
                    runner=SimpleNamespace(_kv_block_zeroer=zero))  # fmt: skip
    jobs = list(vllm_zero_blocks.tq_warmup_engine_jobs(engine=engine))
    assert jobs and all(isinstance(job, Job) and not job.offline for job in jobs)
    with recorded_keys() as seen:
        for job in jobs:
            assert isinstance(job, Job)
            job.run()
    return seen


def served(zero: Any, counts: range) -> set[tuple[str, str]]:
    with recorded_keys() as seen:
        for n in counts:
            zero.zero_block_ids(list(range(n)))
    return seen


@pytest.fixture(autouse=True)
def _driver(monkeypatch: pytest.MonkeyPatch) -> None:
    activate_compile_only_driver()
    # 0.3x stages block ids in pinned memory, which this GPU-less host cannot allocate
    try:
        import vllm.utils.torch_utils as torch_utils
    except ImportError:  # a release that keeps it elsewhere
        return
    monkeypatch.setattr(torch_utils, "PIN_MEMORY", False, raising=False)


def test_zeroing_warmer_covers_every_block_count() -> None:
    zero = zeroer()
    keys = warmed(zero)
    assert keys and {k for k, _ in keys} == {"_zero_kv_blocks_kernel"}
    assert served(zero, range(1, BLOCKS + 1)) <= keys


def test_vllm_qwen_warmup_misses_a_step_of_16_blocks() -> None:
    try:
        from vllm.model_executor.warmup import qwen_triton_warmup
    except ImportError:
        pytest.skip("this release has no Qwen Triton warmup")
    counts = getattr(qwen_triton_warmup, "_ZERO_KV_N_BLOCKS", None)
    if counts is None:
        pytest.skip("this release's Qwen warmup does not zero blocks")
    zero = zeroer()
    vllm_warmed = set().union(*(served(zero, range(n, n + 1)) for n in counts))
    assert not served(zero, range(16, 17)) <= vllm_warmed  # the burst of run AH


def planned(zeroing: compat.KvZeroing) -> set[tuple[str, str]]:
    """The keys of the warmer's offline jobs for a planned hybrid of ``zeroing``."""
    import torch

    engine = Engine(features=compat.release_features(compat.installed_vllm_version()),
                    runner_v2=False, pooling=False, spec_method=None, spec_tokens=0,
                    draft_probs=False, max_logprobs=20, planned=True, kv_zeroing=zeroing,
                    device=torch.device("meta"))  # fmt: skip
    jobs = list(vllm_zero_blocks.tq_warmup_engine_jobs(engine=engine))
    assert jobs and all(isinstance(job, Job) and job.offline for job in jobs)
    with recorded_keys() as seen:
        for job in jobs:
            assert isinstance(job, Job)
            job.run()
    return seen


def test_planned_keys_are_the_keys_vllms_zeroer_launches() -> None:
    """Three layers of 32-token manager blocks (2 kernel blocks each): the plan's segments
    and pages give the keys the live zeroer launches at every block count; one segment or
    kernel page off gives others, so the comparison can fail."""
    serving = served(zeroer(layers=3, block=32), range(1, BLOCKS + 1))
    right = compat.KvZeroing(segments=3, page_bytes=2 * KERNEL_PAGE, kernel_page_bytes=KERNEL_PAGE)
    assert planned(right) == serving
    quarter = KERNEL_PAGE // 4
    small = compat.KvZeroing(segments=3, page_bytes=2 * quarter, kernel_page_bytes=quarter)
    assert planned(small).isdisjoint(serving)
    if compat.kv_zeroing_counts() != (1,):
        other = compat.KvZeroing(segments=2, page_bytes=2 * KERNEL_PAGE,
                                 kernel_page_bytes=KERNEL_PAGE)  # fmt: skip
        assert planned(other).isdisjoint(serving)  # N_SEGS is a constexpr on 0.22-0.26


def test_planned_segments_are_vllms_kv_tensors() -> None:
    """``planning.attention_kv_tensors`` against vLLM's own grouping and tensor sharing
    (``_get_kv_cache_groups_uniform_page_size``, ``get_kv_cache_config_from_groups``) for
    every mix of 1-13 attention and 1-39 Mamba layers, where the count is in the key."""
    import torch
    from vllm.config import DeviceConfig, VllmConfig
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    from tq_warmup_plugin.plan.rules import attention_kv_tensors

    if compat.kv_zeroing_counts() == (1,):
        pytest.skip("this release's zeroing kernel does not key on its segments")
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    attn = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    mamba = MambaSpec(shapes=((4, 8),), dtypes=(torch.float32,), block_size=16,
                      page_size_padded=attn.page_size_bytes)  # fmt: skip

    def vllms(attention: int, state: int) -> int:
        specs = {**{f"a{i}": attn for i in range(attention)},
                 **{f"m{i}": mamba for i in range(state)}}  # fmt: skip
        groups = kv_cache_utils._get_kv_cache_groups_uniform_page_size(specs)
        memory = attn.page_size_bytes * 64 * max(attention, state)
        made = kv_cache_utils.get_kv_cache_config_from_groups(config, groups, memory)
        return sum(any(n.startswith("a") for n in t.shared_by) for t in made.kv_cache_tensors)

    mixes = [(a, m) for a in range(1, 14) for m in range(1, 40)]
    wrong = [(a, m) for a, m in mixes if attention_kv_tensors(a, m) != vllms(a, m)]
    assert not wrong
    assert vllms(6, 4) == 3 and vllms(7, 18) == 7  # the serve-jit Qwen3-Next with MTP: 7
