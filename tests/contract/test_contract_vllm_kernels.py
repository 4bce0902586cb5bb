"""Contract: the engine warmers compile the keys vLLM's own kernels launch when a
TurboQuant server serves, and vLLM's own warmup does not (the cause they fix).

Real vLLM code runs on CPU tensors (its ``BlockTable``, ``RejectionSampler``,
``Sampler``, V2 logprob launcher) under a compile-only sm90 driver; Triton's
``jit_cache_hook`` records each launch's cache key. Only the runner and the model
around them are stand-ins (``fake_runner``): a model whose ``compute_logits`` returns
a vocabulary of ``VOCAB`` logits.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import fakes
import pytest
from realvllm import activate_compile_only_driver, block_table, recorded_keys

from tq_warmup_plugin import compat
from tq_warmup_plugin.vllm_kernels import run as engine_warmup
from tq_warmup_plugin.vllm_kernels.jobs import Engine
from tq_warmup_plugin.warmers import vllm_rejection, vllm_top_k_top_p
from tq_warmup_plugin.worker.warmup import plugin_manager

pytestmark = pytest.mark.real_vllm

VOCAB = 1000  # not a multiple of 16, as many real vocabularies (Llama 3: 128256 is)
TOKENS = 2048
MAX_LEN = 4096


@pytest.fixture(autouse=True)
def _driver(monkeypatch: pytest.MonkeyPatch) -> None:
    activate_compile_only_driver()
    # The CPU platform has no SM count; the H200's 132 stands in (grid size only).
    try:
        import vllm.v1.sample.ops.topk_topp_triton as topk_topp
    except ImportError:  # a release without the Triton top-k/top-p path
        return
    monkeypatch.setattr(topk_topp, "num_compute_units", lambda index=None: 132, raising=False)


def feats() -> compat.Features:
    return compat.release_features(compat.installed_vllm_version())


class _Model:
    def compute_logits(self, hidden: Any) -> Any:
        import torch

        return torch.randn(hidden.shape[0], VOCAB, dtype=hidden.dtype, device=hidden.device)


def fake_runner(tables: list[Any], spec: bool = True, device: str = "cpu") -> Any:
    """The V1 runner's samplers where the release has them (0.20-0.33), else none."""
    import torch

    sampler = rejection = None
    if feats().v1_runner:
        from vllm.v1.sample.rejection_sampler import RejectionSampler
        from vllm.v1.sample.sampler import Sampler

        sampler = Sampler()
        rejection = RejectionSampler(sampler) if spec else None
    return SimpleNamespace(
        input_batch=SimpleNamespace(block_table=SimpleNamespace(block_tables=tables)),
        sampler=sampler,
        rejection_sampler=rejection,
        model=_Model(),
        model_config=SimpleNamespace(get_hidden_size=lambda: 64, dtype=torch.bfloat16),
        device=torch.device(device),
    )


def engine(runner: Any, v2: bool = False, k: int = 3) -> Engine:
    return Engine(
        features=feats(),
        runner_v2=v2,
        pooling=False,
        spec_method="ngram" if k else None,
        spec_tokens=k,
        draft_probs=False,
        max_logprobs=20,
        vocab_size=VOCAB,
        device=runner.device,
        runner=runner,
    )


def warmed(eng: Engine, family: str) -> set[tuple[str, str]]:
    """The keys the engine warmers of ``family`` compile for ``eng``."""
    jobs, _ = fakes.jobs_of(plugin_manager(load_entry_points=False), eng)
    with recorded_keys() as seen:
        for job in jobs:
            if job.family == family:
                with compat.compile_only_launches(load=False):
                    job.run()
    return seen


def serve_slot_mapping(table: Any) -> set[tuple[str, str]]:
    """What ``_prepare_inputs`` launches for steps of 1, 3 and 4 requests."""
    import torch

    with recorded_keys() as seen:
        for lens in ([1], [5, 4, 28], [16, 16, 1, 7]):
            starts = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
            positions = torch.arange(sum(lens), dtype=torch.int64)
            table.compute_slot_mapping(len(lens), starts, positions)
    return seen


@pytest.mark.parametrize("block_size", [16, 32])
def test_slot_mapping_warmer_covers_serving(block_size: int) -> None:
    if feats().registry_warms_slot_mapping:
        eng = engine(fake_runner([]))
        _, declined = fakes.jobs_of(plugin_manager(load_entry_points=False), eng)
        assert any(d.family == "slot mapping" and "registry" in d.why for d in declined)
        return
    table = block_table(block_size)
    eng = engine(fake_runner([table]))
    served = serve_slot_mapping(table)
    ours = warmed(eng, "slot mapping")
    assert served and served <= ours, served - ours


def test_vllm_warmup_misses_turboquant_block_size() -> None:
    """The cause: vLLM's own V1 warmup (0.26-0.28) compiles block sizes 3 and 16; a
    table of TurboQuant's 32 serves another ``KV_CACHE_BLOCK_SIZE``, one of 16 does not."""
    import torch

    try:
        from vllm.model_executor.warmup.v1_block_table_warmup import (
            warm_v1_block_table_kernels,
        )
    except ImportError:
        pytest.skip("this release has no V1 block-table warmup (0.20-0.25: none at all)")
    if feats().registry_warms_slot_mapping:
        pytest.skip("the registry warms every table (0.29+)")
    with recorded_keys() as vllm_warmed:
        warm_v1_block_table_kernels(torch.device("cpu"), TOKENS)
    auto, turboquant = serve_slot_mapping(block_table(16)), serve_slot_mapping(block_table(32))
    assert auto <= vllm_warmed
    assert not turboquant <= vllm_warmed
    assert any("32" in key for _, key in turboquant - vllm_warmed)


MODES = vllm_rejection.MODES


def serve_rejection(runner: Any, drafts: list[list[int]], modes: list[str]) -> set[Any]:
    """A verify batch as serving has one: drafts of different lengths, each mode."""
    import torch

    tokens = sum(len(d) for d in drafts)
    with recorded_keys() as seen:
        for mode in modes:
            logits = torch.randn(tokens + len(drafts), VOCAB, dtype=torch.bfloat16)
            metadata = compat.spec_decode_metadata(drafts, runner.device)
            sampling = compat.sampling_metadata(len(drafts), *MODES[mode], runner.device)
            runner.rejection_sampler(metadata, None, logits, sampling)
    return seen


@pytest.mark.parametrize("k", [1, 2, 4])
def test_rejection_warmer_covers_serving(k: int) -> None:
    runner = fake_runner([])
    eng = engine(runner, k=k)
    if feats().registry_warms_rejection_sampler:
        _, declined = fakes.jobs_of(plugin_manager(load_entry_points=False), eng)
        assert any(d.family == "rejection sampler" and "registry" in d.why for d in declined)
        return
    drafts = [[7] * k, [3], [5] * max(1, k - 1)]
    served = serve_rejection(runner, drafts, list(MODES))
    ours = warmed(eng, "rejection sampler")
    assert served and served <= ours, served - ours
    # vLLM's own warmup verifies one mixed batch of one-token drafts; greedy is new.
    vllm_own = serve_rejection(runner, [[0]] * 3, ["mixed"])
    greedy = serve_rejection(runner, drafts, ["greedy"])
    assert not greedy <= vllm_own


def serve_v2_logprobs(counts: list[int]) -> set[Any]:
    import torch

    launch = compat.topk_logprobs_function()
    with recorded_keys() as seen:
        for n in counts:
            logits = torch.randn(3, VOCAB, dtype=torch.bfloat16)
            launch(logits, n, torch.zeros(3, dtype=torch.int64))
    return seen


def test_v2_logprobs_warmer_covers_every_count() -> None:
    runner = fake_runner([], spec=False)
    served = serve_v2_logprobs(list(range(21)))
    ours = warmed(engine(runner, v2=True, k=0), "logprobs")
    assert served and served <= ours, served - ours
    # Each power of two of 1 + n is its own key: a warmup without logprobs covers none.
    assert not serve_v2_logprobs([5]) <= serve_v2_logprobs([0])


def test_v1_logprobs_job_runs_the_real_sampler() -> None:
    if not feats().v1_runner:
        pytest.skip("0.34 removed the V1 runner and its sampler")
    runner = fake_runner([], spec=False)
    pm = plugin_manager(load_entry_points=False)
    with recorded_keys() as seen:  # nothing compiles, so no later test finds it cached
        result = engine_warmup.run(pm, engine(runner, k=0), False)
    assert seen and result.kernels >= len(seen)
    assert result.errors == []
    assert result.jobs.get("logprobs") == 1
    # 3 variants x 2 batch classes, float32, and top-p with and without top-k at the
    # fewest rows of each split count 16 and 17 rows do not reach (none before 0.30)
    found = compat.topp_split_count(None)
    split = vllm_top_k_top_p.split_rows(lambda r: found[0](r, VOCAB), found[1]) if found else []
    assert result.jobs.get("top-k/top-p") == 6 + 2 * len(split)


def serve_top_k_top_p(rows: int, top_k: bool, top_p: bool) -> set[Any]:
    """What a sampler asks of ``apply_top_k_top_p`` for one batch (V1: float32)."""
    import torch

    apply = compat.top_k_top_p_function()
    with recorded_keys() as seen:
        logits = torch.randn(rows, VOCAB, dtype=torch.float32)
        k = torch.randint(1, 50, (rows,), dtype=torch.int32) if top_k else None
        p = torch.rand(rows, dtype=torch.float32) if top_p else None
        apply(logits, k, p)
    return seen


def test_top_k_top_p_warmer_covers_each_combination() -> None:
    ours = warmed(engine(fake_runner([], spec=False), k=0), "top-k/top-p")
    served: set[Any] = set()
    for rows in (8, 16, 40, 64):
        for top_k, top_p in ((True, False), (False, True), (True, True)):
            served |= serve_top_k_top_p(rows, top_k, top_p)
    if not served:
        pytest.skip("this release's top-k/top-p has no Triton kernel")
    assert served <= ours, served - ours
    # vLLM's own sampler warmup sets both; top-p alone is another binary.
    assert not serve_top_k_top_p(16, False, True) <= serve_top_k_top_p(16, True, True)


@pytest.mark.parametrize("mode", ["warn", "error"])
def test_the_engine_reads_the_jit_monitor_mode_of_vllms_own_config(
    vllm_env: compat.Features, mode: str
) -> None:
    """``--jit-monitor-mode`` lands in ``ObservabilityConfig`` (0.25+); before, no
    monitor: never error mode."""
    from vllm.config import ObservabilityConfig

    if "jit_monitor_mode" in getattr(ObservabilityConfig, "__dataclass_fields__", {}):
        observability = ObservabilityConfig(jit_monitor_mode=mode)
    else:  # 0.20-0.24: no JIT monitor
        assert vllm_env.version < (0, 25)
        observability, mode = ObservabilityConfig(), "none"
    config = SimpleNamespace(
        observability_config=observability,
        speculative_config=None,
        model_config=SimpleNamespace(max_logprobs=20),
    )
    worker = SimpleNamespace(vllm_config=config, model_runner=SimpleNamespace())
    engine = Engine(**compat.engine_of(worker, vllm_env))
    assert engine.jit_monitor_error is (mode == "error")


def test_full_decode_graphs_is_vllms_own_decode_mode(vllm_env: compat.Features) -> None:
    """``compat.full_decode_graphs`` (the Mamba/GDN decline) for each of vLLM's own graph
    modes: FULL decode graphs where vLLM's ``decode_mode()`` says FULL, none when eager."""
    from vllm.config import CUDAGraphMode

    def config(mode: Any, eager: bool = False) -> Any:
        graphs = SimpleNamespace(cudagraph_mode=mode, cudagraph_capture_sizes=[1, 8])
        return SimpleNamespace(compilation_config=graphs,
                               model_config=SimpleNamespace(enforce_eager=eager))  # fmt: skip

    for mode in CUDAGraphMode:
        want = mode.decode_mode() == CUDAGraphMode.FULL
        assert compat.full_decode_graphs(config(mode)) is want, mode
        assert compat.full_decode_graphs(config(mode, eager=True)) is False, mode
    assert compat.full_decode_graphs(config(CUDAGraphMode.FULL_AND_PIECEWISE))  # the default


@pytest.mark.parametrize(
    ("family", "moe", "hybrid"),
    [("llama-3-8b", False, False), ("jamba-v0.1", True, True), ("deepseek-v2-lite", True, False)],
)
def test_the_engine_reads_moe_and_hybrid_from_vllms_model_config(
    vllm_env: compat.Features, family: str, moe: bool, hybrid: bool
) -> None:
    """What names the unwarmed MoE and Mamba/GDN kernels (``warmers/vllm_unwarmed``):
    vLLM's own ``ModelConfig.is_moe`` and ``is_hybrid`` of the model's config."""
    from pathlib import Path

    from vllm.config import ModelConfig

    model = Path(__file__).parents[1] / "data" / "models" / family
    config = SimpleNamespace(
        model_config=ModelConfig(model=str(model), skip_tokenizer_init=True),
        speculative_config=None,
    )
    worker = SimpleNamespace(vllm_config=config, model_runner=SimpleNamespace())
    engine = Engine(**compat.engine_of(worker, vllm_env))
    assert (engine.moe, engine.hybrid) == (moe, hybrid)


def split_counts() -> tuple[Any, int]:
    """vLLM's split count of its split-row top-p pipeline (0.30+) for this test's 132 SMs."""
    found = compat.topp_split_count(None)
    if found is None:
        pytest.skip("this release has no split-row top-p pipeline (0.26 and before)")
    return found


@pytest.mark.parametrize("vocab", [VOCAB, 128256])
def test_top_k_top_p_warmer_reaches_every_split_count(vocab: int) -> None:
    count, most = split_counts()
    served = {count(rows, vocab) for rows in range(1, most + 1)}
    warmed_rows = [
        *vllm_top_k_top_p.ROWS,
        *vllm_top_k_top_p.split_rows(lambda r: count(r, vocab), most),
    ]
    assert {count(rows, vocab) for rows in warmed_rows} == served
    if vocab == VOCAB:  # 16 and 17 rows alone miss the small batches' counts (the bug)
        assert {count(rows, vocab) for rows in vllm_top_k_top_p.ROWS} < served


def serve_topp_split(rows: int, top_k: bool) -> set[Any]:
    """The keys of vLLM's split-row top-p pipeline for one batch: what a GPU batch of
    ``rows`` top-p rows runs (a CPU tensor never takes it, so it is called directly)."""
    import torch
    import vllm.v1.sample.ops.topk_topp_triton as topk_topp

    logits = torch.randn(rows, VOCAB, dtype=torch.float32)
    k = torch.randint(1, 50, (rows,), dtype=torch.int32) if top_k else None
    p = torch.rand(rows, dtype=torch.float32)
    with recorded_keys() as seen:
        topk_topp._apply_topp_split(logits, k, p, float("-inf"), 132)
    return seen


def test_split_top_p_keys_follow_the_split_count_alone() -> None:
    count, _ = split_counts()
    assert count(9, VOCAB) == count(16, VOCAB) != count(17, VOCAB)
    for top_k in (False, True):
        # one batch size per split count builds every binary of that count
        assert serve_topp_split(9, top_k) == serve_topp_split(16, top_k)
        assert serve_topp_split(16, top_k) != serve_topp_split(17, top_k)
