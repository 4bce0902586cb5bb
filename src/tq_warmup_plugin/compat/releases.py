"""The release table: which vLLM releases the plugin supports and what each one does.

``features()`` is the one place a release's behaviour is decided, one line per gate:
gates are ranges of releases, so the table is not split per release. Everything here
is pure except ``installed_vllm_version``, which reads the installed distribution's
metadata without importing vLLM. Source: the released wheels of 0.20.0-0.33.0, read
file by file; the ``real_vllm`` contract tests pin each gate down against the real code
of the releases CI installs.
"""

from __future__ import annotations

import re
from typing import NamedTuple

__all__ = [
    "NEWEST",
    "OLDEST",
    "Features",
    "UnsupportedRelease",
    "Version",
    "features",
    "installed_vllm_version",
    "parse_version",
    "release_features",
    "rewarm_cause",
    "same_release",
    "support_problem",
]

Version = tuple[int, int]

OLDEST: Version = (0, 20)
NEWEST: Version = (0, 33)


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
        lo, hi = (".".join(map(str, v)) for v in (OLDEST, NEWEST))
        return f"vLLM {version[0]}.{version[1]} is outside the supported releases {lo}-{hi}"
    return None


class Features(NamedTuple):
    """What a release does, as far as TurboQuant warmup is concerned."""

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
    """0.20-0.33: ``TurboQuantMetadataBuilder`` reports ``UNIFORM_BATCH`` while verify
    batches are not decodes (``supports_spec_as_decode=False``), so under speculative
    decoding vLLM captures FULL graphs of 1+k-token verify batches. Capture runs
    ``_prefill_attention``'s per-request loop on dummy metadata (``seq_len == q_len``)
    and bakes in "attention over the new tokens only": 0.21-0.33 replay it with the
    cached context ignored (upstream #40831, #52475, #53180), 0.20 calls ``.tolist()``
    on GPU tensors during capture and fails at startup (#40807). The fixes (#43747,
    #53406) are unmerged in every release up to 0.33."""
    spec_verify_batched: bool
    """0.21-0.33: verify batches can be served as decode rows inside FULL graphs
    (``guards/batched_verify.py``); 0.20 keeps decode scratch on the layer."""
    v1_tq_cache_dtype_lost: bool
    """0.25-0.26: ``TQFullAttentionSpec`` is built without ``kv_quant_mode``
    (``attention.py`` 0.25:672-679, 0.26:677-684), so the V1 runner passes
    ``cache_dtype_str="auto"`` to TurboQuant's ``get_kv_cache_shape``
    (``gpu_model_runner.py`` 0.25:7192-7208, 0.26:7349-7365), which raises "Unknown
    TurboQuant cache dtype: 'auto'" (upstream #50709). 0.20-0.24 pass the cache
    config's dtype; 0.27.1+ have ``KVQuantMode.TURBOQUANT``; V2 special-cases it."""
    prefill_buffers_cached: bool
    """0.21+: ``_prefill_attention`` caches ``_cu_2`` and ``_arange_cache`` on the impl
    the first time it runs (``_continuation_prefill`` ``_cu_2_q``/``_cu_2_k``), growing
    the arange when a longer sequence comes; 0.20 allocates them on every call."""
    draft_cpu_seq_lens_stale: bool
    """0.21-0.33: TurboQuant's prefill loop takes each request's length from
    ``seq_lens_cpu_upper_bound`` (``turboquant_attn.py`` 0.22:238, 0.33:297; 0.20 reads
    the GPU ``seq_lens``, :571), and ``extend_all_queries_by_N``, which lengthens every
    query of a V1 draft pass by N (draft_model: N=1, ``llm_base_proposer.py`` 0.22:98-101,
    823), raises the GPU ``seq_lens`` but not that bound nor ``_seq_lens_cpu``
    (``spec_decode/utils.py`` 0.22:293-303, 0.33:413-423): a fresh prompt gets
    ``cached_len = -1``, a crash over 128 tokens ("expanded size ... (0)"). draft_model
    runs on V1 up to 0.30 (V2 refuses it, ``config/vllm.py`` 0.23:2011, 0.30:2844), on
    request (``VLLM_USE_V2_MODEL_RUNNER=0``) in 0.31-0.33; async by default from 0.28, where
    the bound's prefill rows are still exact (``backend.py`` 0.22:405-409): all need it."""
    v2_ubatches: bool
    """0.30+: the V2 runner splits batches into microbatches itself
    (``v1/worker/gpu/ubatch_utils.py``) and copies each one's ``seq_lens`` into a buffer
    of its own (``_slice_seq_lens``, 0.30:229, 0.33:235). 0.20-0.29 list dual-batch
    overlap as unsupported by V2 (``config/vllm.py`` 0.20:1803, 0.25:2096, 0.29:2591),
    so it runs on V1."""
    rocm_flydsl: bool
    """0.28+: on ROCm gfx950 with FlyDSL importable, ``TurboQuantAttentionImpl`` sets
    ``_soa_store = _use_flydsl = is_flydsl_available()`` (``turboquant_attn.py``
    0.28:398-399, 0.29-0.33:369-370) and then stores, decodes and dequantizes with the
    SoA Triton and FlyDSL kernels (0.33: ``_store_kv`` :686, continuation :839,
    ``_continuation_prefill`` :952, ``_decode_attention`` :1129; 0.28: :715, :868, :981,
    :1158), never the ones warmed here. 0.20-0.27 have no such path."""
    local_boundary_tq_backend: bool
    """0.20-0.33: ``ChunkedLocalAttention`` picks its backend from the cache config's
    dtype (``chunked_local_attention.py`` 0.20-0.26:102, 0.27.1-0.33:101) before
    ``Attention.__init__`` gives a layer in ``kv_cache_dtype_skip_layers`` the dtype
    ``"auto"`` (``attention.py`` 0.22:264, 0.26:312, 0.33:312): a TurboQuant boundary
    layer that is chunked local (Llama 4's layer 0) gets TurboQuant's impl with
    ``"auto"``, which raises "Unknown TurboQuant cache dtype: 'auto'" at startup."""
    local_tq_spec_plain: bool
    """0.20-0.27: a TurboQuant layer's KV-cache spec is ``TQFullAttentionSpec``
    (``attention.py`` 0.26:677, 0.27.1:677) but a chunked local TurboQuant layer's is
    ``ChunkedLocalAttentionSpec`` of uint8 at the full head size
    (``chunked_local_attention.py`` 0.20-0.26:122, 0.27.1:121): 32768 bytes a page
    beside 17152 at 128x8 heads, so a Llama 4 fails in KV-cache grouping ("page size is
    not divisible by the maximum page size", H200, 0.26.0). 0.28+ give both the same
    spec with ``kv_quant_mode``."""
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
        spec_graphs_unsafe=OLDEST <= version <= (0, 33),
        spec_verify_batched=(0, 21) <= version <= (0, 33),
        v1_tq_cache_dtype_lost=(0, 25) <= version <= (0, 26),
        prefill_buffers_cached=version >= (0, 21),
        draft_cpu_seq_lens_stale=(0, 21) <= version <= (0, 33),
        v2_ubatches=version >= (0, 30),
        rocm_flydsl=version >= (0, 28),
        local_boundary_tq_backend=OLDEST <= version <= (0, 33),
        local_tq_spec_plain=OLDEST <= version <= (0, 27),
        local_prefill_real_lens=(0, 21) <= version <= (0, 29),
    )


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
    from importlib import metadata  # not at module level: register() must stay cheap

    try:
        return metadata.version("vllm")
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
