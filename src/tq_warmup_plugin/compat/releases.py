"""The release table: which vLLM releases the plugin supports and what each one does.

``features()`` is the one place a release's behaviour is decided, one line per gate:
gates are ranges of releases, so the table is not split per release. Everything here
is pure except ``installed_vllm_version``, which reads the installed distribution's
metadata without importing vLLM. Source: the released wheels of 0.20.0-0.34.0, read
file by file; the ``real_vllm`` contract tests pin each gate down against the real code
of the releases CI installs.

"All releases" in the package's comments and docstrings means every supported one
(``SUPPORTED``), each statement read in every supported wheel; this file alone states
the range. Moving ``NEWEST`` fails ``tests/test_compat.py``'s release-bump test, which
names the gates to re-judge and asks for those statements to be read again in the new
wheel (``grep -rn "all releases" src``).
"""

from __future__ import annotations

import re
from typing import NamedTuple

__all__ = [
    "JUDGED_ENDINGS",
    "NEWEST",
    "OLDEST",
    "RECOMMENDED",
    "RECOMMENDED_TRITON",
    "SUPPORTED",
    "V2_SPEC_METHODS",
    "Features",
    "UnsupportedRelease",
    "Version",
    "beyond_newest",
    "distribution_version",
    "features",
    "gates_ending_at_newest",
    "installed_vllm_version",
    "parse_version",
    "release_features",
    "rewarm_cause",
    "runs_v2",
    "same_release",
    "support_problem",
]

Version = tuple[int, int]

OLDEST: Version = (0, 20)
NEWEST: Version = (0, 34)
SUPPORTED = f"{OLDEST[0]}.{OLDEST[1]}-{NEWEST[0]}.{NEWEST[1]}"
"""The supported releases as a person reads them: ``"0.20-0.34"``."""
RECOMMENDED = f"{NEWEST[0]}.{NEWEST[1]}.0"
"""The release to install, everywhere the package or its docs name one: ``NEWEST``'s ``.0``."""
RECOMMENDED_TRITON = "3.8.0"
"""The Triton ``RECOMMENDED`` pins, for the CPU recipe (``.ci/vllm-env.sh``), which installs
vLLM without its dependencies; ``.ci/vllm-releases`` lists it first (``tests/test_house.py``)."""


def parse_version(text: str | None) -> Version | None:
    """``"0.26.0"``, ``"0.26.1rc1.dev3+g12ab"`` -> ``(0, 26)``; anything else -> None."""
    match = re.match(r"^\s*(\d+)\.(\d+)", text or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


class UnsupportedRelease(ValueError):
    """The installed (or named) vLLM release is not one the plugin knows; the message
    is the one-line reason."""


def support_problem(version: Version | None) -> str | None:
    """None when the release is supported, else a one-line reason."""
    if version is None:
        return "cannot determine the installed vLLM version"
    if not OLDEST <= version <= NEWEST:
        return f"vLLM {version[0]}.{version[1]} is outside the supported releases {SUPPORTED}"
    return None


def beyond_newest(version: Version | None) -> bool:
    """Whether ``version`` is a release after ``NEWEST``: one the plugin has not read,
    where it warms and guards nothing (``support_problem``)."""
    return version is not None and version > NEWEST


class Features(NamedTuple):
    """What a release does, as far as TurboQuant warmup is concerned. One line a gate;
    the evidence (files, lines, measurements) is where the gate acts."""

    version: Version
    kv_view_transposed: bool
    """0.26+: ``forward()`` hands the kernels ``kv_cache.transpose(1, 2)``."""
    kv_head_major: bool
    """0.26-0.28: the cache is physically (blocks, heads, tokens, slot)."""
    stage2_output_fp16: bool
    """0.21+: stage 2 has ``OUTPUT_FP16`` and writes the query dtype; 0.20 writes fp32."""
    continuation_seq_lens_sliced: bool
    """0.21+: the continuation fast path slices a cached arange, so its ``seq_lens``
    pointer is 16-byte aligned for some chunks and not for others; 0.20 allocates."""
    uses_workspace: bool
    """0.21+: decode and long continuation take scratch from the WorkspaceManager."""
    unrotate_fp16: bool
    """0.21+: a long continuation un-rotates MSE keys with an fp16 GEMM
    (``layer._tq_Pi_half``); 0.20 does it in fp32."""
    spec_graphs_unsafe: bool
    """0.20-0.34: a FULL graph of a verify batch ignores the context (guards/spec_graphs.py).
    0.34's backend differs from 0.33's by one unused attribute, and its
    ``resolve_cudagraph_mode_and_sizes`` still captures FULL verify graphs from
    ``UNIFORM_BATCH`` (``compilation.py`` 0.34:1615)."""
    spec_verify_batched: bool
    """0.21-0.34: verify batches run as decode rows in FULL graphs (guards/batched_verify.py);
    0.34's V2 runner orders them with the same ``sort_batch_req_ids`` (0.34:2579)."""
    v1_tq_cache_dtype_lost: bool
    """0.25-0.26: V1 asks TurboQuant for the shape of dtype "auto" (guards/v1_cache_dtype.py)."""
    prefill_buffers_cached: bool
    """0.21+: the prefill loop caches its buffers on the impl (live.preallocate_prefill_buffers)."""
    draft_cpu_seq_lens_stale: bool
    """0.21-0.33: a draft pass leaves CPU sequence lengths short (guards/draft_seq_lens.py).
    Ends with 0.34 (``JUDGED_ENDINGS``): the V1 runner and its ``extend_all_queries_by_N``
    are gone, and the V2 draft_model speculator's first pass takes the bound plus its
    correction token (``standalone_ar/speculator.py`` 0.34:331-333; 0.33:230 passed the
    target's bound)."""
    v2_ubatches: bool
    """0.30+: the V2 runner makes its own microbatches (live.ubatch_sliced)."""
    v2_draft_prefill_kernel: bool
    """0.31+: the V2 runner has a draft_model speculator, which prepares its first pass with
    ``_prepare_prefill_inputs_kernel``, its ``BLOCK_SIZE`` following the step's longest query
    (``draft_model/speculator.py`` 0.31, ``standalone_ar/speculator.py`` 0.32-0.34;
    ``warmers.vllm_draft_prefill``). 0.30's V2 runner runs no draft_model."""
    rocm_flydsl: bool
    """0.28+: ROCm gfx950 runs the SoA/FlyDSL kernels instead (live.flydsl_layer)."""
    local_boundary_tq_backend: bool
    """0.20-0.34: a chunked local boundary layer fails to start (guards/local_boundary.py);
    ``chunked_local_attention.py`` is the same file in 0.33 and 0.34."""
    local_tq_spec_plain: bool
    """0.20-0.27: a chunked local TurboQuant layer's spec is plain (guards/local_boundary.py)."""
    prefix_fast_path_unsafe: bool
    """0.20-0.34: the first-chunk fast path drops a cache hit's prefix
    (guards/prefix_fast_path.py); 0.34's ``forward`` is 0.33's."""
    prefill_host_copies: bool
    """0.21+: ``TurboQuantMetadata`` has ``query_start_loc_cpu`` and ``seq_lens_cpu``, the
    latter the runner's ``seq_lens_cpu_upper_bound`` (``turboquant_attn.py`` 0.34:297),
    which the prefill loop takes as each request's exact length (``spec_problem``)."""
    local_prefill_real_lens: bool
    """0.21-0.29: on a chunked local attention layer (Llama 4) TurboQuant's prefill loop
    takes each *virtual* request's length from ``seq_lens_cpu_upper_bound``
    (``turboquant_attn.py`` 0.22:238, 0.29:297), which
    ``make_local_attention_virtual_batches`` copies from the real batch
    (``v1/attention/backends/utils.py`` 0.22:387, 0.29:615): every virtual row can
    reach the continuation kernels, and one past the real batch raises IndexError
    (upstream bug). 0.30+ pass the virtual lengths (``seq_lens_cpu_upper_bound=
    seq_lens_cpu``, 0.30:627, 0.33:683); 0.20 reads the virtual GPU ``seq_lens`` (:571):
    only a request's first virtual row continues a cached prefix."""
    registry_warms_slot_mapping: bool
    """0.29+: each V1 ``BlockTable`` registers its ``_compute_slot_mapping_kernel`` key
    with vLLM's JIT warmup registry (``v1/worker/block_table.py`` 0.29:147, 0.33:106), and
    the runner collects registrations (``gpu_model_runner.py`` 0.29:757). 0.20-0.28 warm
    it for block sizes 3 and 16 at most (``v1_block_table_warmup.py``, 0.26)."""
    v2_top_k_top_p_model_dtype: bool
    """0.26: the V2 sampler hands ``apply_top_k_top_p`` the logits in the model's dtype
    ("the input dtype is kept", ``v1/worker/gpu/sample/sampler.py`` 0.26:162) and the
    Triton path takes bf16/fp16 (``topk_topp_triton.py`` 0.26:881); 0.20-0.25 and
    0.27-0.33 copy them to float32 first (0.25:157, 0.27:159, 0.30:224) and assert it."""
    registry_warms_rejection_sampler: bool
    """0.30+: the rejection sampler registers its kernels, greedy and mixed batches both
    (``v1/sample/rejection_sampler.py`` 0.30, 0.33:116-121); 0.29 does not. Before, vLLM
    warms them only in the mixed batch of ``_dummy_sampler_run`` (0.26:6244)."""
    registry_warms_eagle_helpers: bool
    """0.30+: the EAGLE drafter's Triton helpers (``eagle_step_slot_mapping_metadata``,
    ``eagle_prepare_inputs_padded``, ``eagle_prepare_next_token_padded``,
    ``copy_and_expand_eagle_inputs``) register with vLLM's JIT warmup registry
    (``v1/spec_decode/utils.py`` 0.30:120-616, 0.33); 0.26-0.29 define them without
    (0.29: no ``Warmup`` in the file), and they compiled on the first draft steps (vLLM
    0.26.0, ``benchmarks/results/serve-jit``)."""
    jit_registry_collects: bool
    """0.29+: the model runner collects ``JitWarmupRegistry`` registrations (V1
    ``gpu_model_runner.py`` 0.29:757, V2 ``gpu/model_runner.py`` 0.30:202) and
    ``kernel_warmup`` compiles them first when ``kernel_config.enable_jit_warmup``
    (``kernel_warmup.py`` 0.30:170-190, 0.33:176-196), aborting startup on any exception.
    0.27-0.28 define the registry and collect nothing; 0.20-0.26 have none."""
    hybrid_turboquant: bool
    """0.21+: TurboQuant serves hybrid (attention + Mamba) models, with no boundary
    layers; 0.20 refuses them (``NotImplementedError`` in ``arg_utils.py``)."""
    tq_block_aligned: bool
    """0.25+: ``Platform._align_heterogeneous_kv_block_size`` grows TurboQuant's block
    until its page covers a boundary layer's (``plan.rules.effective_block_size``);
    0.20-0.24 keep the requested size."""
    tq_page_packed: bool
    """0.28+: that alignment sizes TurboQuant's page by its packed slot
    (``TurboQuantAttentionBackend.customize_spec``: ``slot_size_aligned`` bytes a KV head),
    read in the 0.28.0, 0.30.0, 0.33.0 and 0.34.0 wheels; 0.25-0.27 as uint8 K+V, two bytes
    a head dimension. A vLLM 0.34.0 server ran 64-token blocks for ``turboquant_4bit_nc``
    where the uint8 rule gives 32 (``benchmarks/results/serve-jit``)."""
    v1_block_table_aligned: bool
    """0.21+: the V1 block table's row (``MultiGroupBlockTable``) is rounded up to a
    multiple of ``128 // block_size`` blocks where ``block_size <= 128`` ("as required by
    some attention backends such as TRTLLM", read in the 0.21.0, 0.22.0 and 0.26.0 wheels);
    0.20.0's is not (``plan.rules.block_table_width``)."""
    block_table_rounded: bool
    """0.27+: that rounding is to a multiple of ``128 / gcd(128, block_size)`` blocks, for
    every block size (``get_block_table_width``, V1 0.30 and 0.33), and the V2 runner's row
    is rounded the same way (``gpu/model_runner.py`` 0.27:469, 0.30:614, 0.34:704), where
    0.26's V2 rounds only blocks of up to 128 tokens (0.26:439)."""
    v2_runner_default: bool
    """0.25+: the V2 model runner is what a worker runs unless told otherwise; 0.20-0.24
    run V1 (the ``--runner`` default of ``inspect`` and ``precompile``)."""
    draft_slot_in_threshold: bool
    """0.34+: vLLM's ``max_decode_query_len``, the spec-as-decode threshold, counts the
    draft model's correction token (``max_num_new_slots_for_drafting``, ``backend.py``
    0.34:579-583; ``standalone_ar/config.py`` 0.34:24): ``2 + k`` for draft_model, where
    0.33 gives ``1 + k`` (0.33:583)."""
    kv_transient_window: bool
    """0.34+: on an extensible KV cache (CUDA's default) the worker keeps free the allocator
    peak its warmup reaches, and ``kernel_warmup`` runs one-off tuning outside that window
    (``_outside_kv_cache_transient_window``, ``kernel_warmup.py`` 0.34:66-87); 0.20-0.33
    size the cache from profiling alone."""
    v1_runner: bool
    """0.20-0.33: the V1 model runner exists (``v1/worker/gpu_model_runner.py``, with its
    ``block_table``, ``v1/sample`` samplers and ``v1/spec_decode`` drafters); 0.34 removed
    it, and every worker runs V2 (``v1/worker/gpu/``)."""


def features(version: Version) -> Features:
    """The feature set of a supported release."""
    return Features(
        version=version,
        kv_view_transposed=version >= (0, 26),
        kv_head_major=(0, 26) <= version <= (0, 28),
        stage2_output_fp16=version >= (0, 21),
        continuation_seq_lens_sliced=version >= (0, 21),
        uses_workspace=version >= (0, 21),
        unrotate_fp16=version >= (0, 21),
        spec_graphs_unsafe=OLDEST <= version <= (0, 34),
        spec_verify_batched=(0, 21) <= version <= (0, 34),
        v1_tq_cache_dtype_lost=(0, 25) <= version <= (0, 26),
        prefill_buffers_cached=version >= (0, 21),
        draft_cpu_seq_lens_stale=(0, 21) <= version <= (0, 33),
        v2_ubatches=version >= (0, 30),
        rocm_flydsl=version >= (0, 28),
        local_boundary_tq_backend=OLDEST <= version <= (0, 34),
        local_tq_spec_plain=OLDEST <= version <= (0, 27),
        prefix_fast_path_unsafe=OLDEST <= version <= (0, 34),
        prefill_host_copies=version >= (0, 21),
        local_prefill_real_lens=(0, 21) <= version <= (0, 29),
        registry_warms_slot_mapping=version >= (0, 29),
        v2_top_k_top_p_model_dtype=version == (0, 26),
        registry_warms_rejection_sampler=version >= (0, 30),
        registry_warms_eagle_helpers=version >= (0, 30),
        jit_registry_collects=version >= (0, 29),
        hybrid_turboquant=version >= (0, 21),
        tq_block_aligned=version >= (0, 25),
        tq_page_packed=version >= (0, 28),
        v2_draft_prefill_kernel=version >= (0, 31),
        v1_block_table_aligned=version >= (0, 21),
        block_table_rounded=version >= (0, 27),
        v2_runner_default=version >= (0, 25),
        draft_slot_in_threshold=version >= (0, 34),
        kv_transient_window=version >= (0, 34),
        v1_runner=version <= (0, 33),
    )


JUDGED_ENDINGS: dict[str, Version] = {"draft_cpu_seq_lens_stale": (0, 34), "v1_runner": (0, 34)}
"""Gates judged to end with the release before ``NEWEST`` (their bug fixed upstream in
``NEWEST``), by the release that fixed it. A gate that ends there and is not named here
is one nobody re-judged when ``NEWEST`` moved (``gates_ending_at_newest``)."""


V2_SPEC_METHODS = frozenset({"eagle", "eagle3", "mtp", "dflash", "dspark"})
"""Speculative methods the V2 runner runs; for any other (ngram, draft_model) vLLM falls
back to V1 (0.26 ``VllmConfig._get_v2_model_runner_unsupported_features``)."""


def runs_v2(feats: Features, spec_method: str | None, moe: bool, runner: str | None) -> bool:
    """Whether a worker runs the V2 model runner: ``--runner`` where given, else the
    release's default (0.25+) unless vLLM falls back to V1 for a MoE model or a speculative
    method V2 does not run (0.26 ``VllmConfig.use_v2_model_runner``). A worker reads the
    answer from its own config; a plan that guesses wrong misses keys, which the worker then
    compiles (cost, never a wrong result)."""
    if runner is not None:
        return runner == "v2"
    if not feats.v1_runner:  # 0.34+: V2 is the only runner, MoE and every method included
        return True
    if not feats.v2_runner_default or moe:
        return False
    return spec_method is None or spec_method in V2_SPEC_METHODS


def gates_ending_at_newest(newest: Version = NEWEST) -> list[str]:
    """The gates on for the release before ``newest`` and off for ``newest`` itself
    that ``JUDGED_ENDINGS`` does not name: moving ``NEWEST`` past a gate's last release
    turns its guard off for the new one silently, unless someone judged that it should."""
    before = features((newest[0], newest[1] - 1))
    now = features(newest)
    return [
        gate
        for gate in Features._fields[1:]
        if getattr(before, gate) and not getattr(now, gate) and gate not in JUDGED_ENDINGS
    ]


def release_features(version_text: str | None) -> Features:
    """Features of the release named by a version string; raises UnsupportedRelease."""
    version = parse_version(version_text)
    problem = support_problem(version)
    if problem is not None or version is None:
        raise UnsupportedRelease(problem)
    return features(version)


def same_release(wanted: str, installed: str | None) -> bool:
    """Whether ``wanted`` (``"0.26.0"``, ``"v0.26.0"``, or ``"0.26"`` for any 0.26.x)
    names the ``installed`` version: the Triton cache is only valid for the kernel
    sources it was built from."""
    wanted = wanted.strip().removeprefix("v")
    return installed is not None and (installed == wanted or installed.startswith(wanted + "."))


def installed_vllm_version() -> str | None:
    """The installed vLLM distribution's version, without importing vLLM."""
    return distribution_version("vllm")


def distribution_version(name: str) -> str | None:
    """The installed version of distribution ``name`` (vLLM, torch, Triton), or None."""
    from importlib import metadata  # not at module level: register() must stay cheap

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def rewarm_cause(feats: Features) -> str:
    """Why ``kernel_warmup`` can run more than once in a worker process, for the report.

    0.27-0.33: elastic EP calls ``kernel_warmup(worker, process_local_only=True)``
    on a new worker (``warmup_local_kernels``, 0.33 ``warmup_new_worker``) and then
    ``warm_and_capture``, which calls it again through ``compile_or_warm_up_model``;
    existing workers re-run ``warm_and_capture`` at every scale-up/down commit.
    0.20-0.26 call it once per worker.
    """
    if feats.version >= (0, 27):
        return "elastic EP warms a worker more than once"
    return "kernel_warmup ran again in this process"
