"""The chunked-local boundary guard: vLLM's real ``ChunkedLocalAttention``, ``Attention``
and ``TurboQuantAttentionImpl`` build a Llama 4 boundary layer under a TurboQuant cache
config. Without the guard it raises (the bug, shown on each release); with it the layer
is vLLM's own "auto" layer, and a TurboQuant layer is unchanged.

Only backend selection is stood in for: a CPU has no CUDA platform, so
``get_attn_backend`` answers as CUDA would (TurboQuant's backend for a ``turboquant_*``
dtype, FlashAttention's for anything else).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from conftest import Log

from tq_warmup_plugin import compat
from tq_warmup_plugin.guards import local_boundary as guard

PRESET = "turboquant_4bit_nc"
SKIPPED = ["0", "1", "6", "7"]  # TurboQuant's boundary layers of an 8-layer model
SCOUT = Path(__file__).parent / "data" / "models" / "llama-4-scout"


@pytest.mark.parametrize(
    ("dtype", "skip", "index", "expected"),
    [
        (PRESET, SKIPPED, 0, True),
        (PRESET, SKIPPED, 2, False),  # a TurboQuant layer
        (PRESET, SKIPPED, None, False),  # no index in the name
        ("auto", SKIPPED, 0, False),  # not a TurboQuant engine
        ("fp8", ["0"], 0, False),
        (PRESET, [], 0, False),
    ],
)
def test_skipped_layer(dtype: str, skip: list[str], index: int | None, expected: bool) -> None:
    config = SimpleNamespace(cache_dtype=dtype, kv_cache_dtype_skip_layers=skip)
    assert guard.skipped_layer(config, index) is expected


@pytest.fixture
def local(vllm_env: compat.Features, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """vLLM's ``chunked_local_attention`` module, backend selection answered as on CUDA."""
    import vllm.model_executor.layers.attention.chunked_local_attention as module
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionBackend

    def backend(head_size: int, dtype: Any, kv_cache_dtype: Any, *a: Any, **k: Any) -> type:
        tq = str(kv_cache_dtype).startswith("turboquant_")
        return TurboQuantAttentionBackend if tq else FlashAttentionBackend

    monkeypatch.setattr(module, "get_attn_backend", backend)
    scout()  # loads vLLM's general plugins, this one among them (which installs the guard)
    guard.remove(module)
    yield module
    guard.remove(module)


def scout() -> Any:
    """vLLM's ``ModelConfig`` of Llama 4 Scout's config (dummy weights)."""
    from vllm.engine.arg_utils import EngineArgs

    engine = EngineArgs(
        model=str(SCOUT), load_format="dummy", skip_tokenizer_init=True, max_model_len=4096
    )
    return engine.create_model_config()


def build(module: ModuleType, index: int, local: bool = True) -> tuple[Any, Any]:
    """One real layer of Llama 4 Scout (vLLM's ``ModelConfig`` of its config, dummy
    weights) and its ``VllmConfig``, under a TurboQuant cache config whose skip list is
    the one vLLM's engine arguments give it (TurboQuant's boundary layers): a
    ``ChunkedLocalAttention``, or with ``local=False`` a global (NoPE) layer, a plain
    ``Attention`` on TurboQuant's backend."""
    import torch
    from vllm.config import CacheConfig, DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
    from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionBackend

    model = scout()
    cache = CacheConfig(cache_dtype=PRESET)
    cache.kv_cache_dtype_skip_layers = sorted(
        TurboQuantConfig.get_boundary_skip_layers(model), key=int
    )
    assert cache.kv_cache_dtype_skip_layers == ["0", "1", "46", "47"]
    config = VllmConfig(device_config=DeviceConfig(device="cpu"), cache_config=cache)
    # A full VllmConfig of this model needs a GPU platform; the layers read only this.
    object.__setattr__(config, "model_config", model)
    common: dict[str, Any] = {
        "num_heads": model.get_num_attention_heads(config.parallel_config),
        "head_size": model.get_head_size(),
        "scale": model.get_head_size() ** -0.5,
        "num_kv_heads": model.get_total_num_kv_heads(),
        "cache_config": cache,
        "prefix": f"language_model.model.layers.{index}.self_attn.attn",
    }
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with set_current_vllm_config(config):
            if not local:
                return Attention(**common, attn_backend=TurboQuantAttentionBackend), config
            chunk = model.attention_chunk_size
            return module.ChunkedLocalAttention(**common, attention_chunk_size=chunk), config
    finally:
        torch.set_default_dtype(default)


@pytest.mark.real_vllm
def test_a_boundary_layer_fails_without_the_guard(local: ModuleType) -> None:
    with pytest.raises(ValueError, match="Unknown TurboQuant cache dtype: 'auto'"):
        build(local, 0)


@pytest.mark.real_vllm
def test_the_guard_gives_a_boundary_layer_vllms_own_backend(
    local: ModuleType, log: Log, vllm_env: compat.Features
) -> None:
    assert guard.install(local) and guard.installed(local)
    boundary, _ = build(local, 0)
    assert boundary.kv_cache_dtype == "auto"
    assert type(boundary.impl).__name__ == "FlashAttentionImpl"
    assert boundary.attention_chunk_size == 8192
    compressed, _ = build(local, 2)  # unchanged: TurboQuant's impl, chunked local
    assert compressed.kv_cache_dtype == PRESET
    assert type(compressed.impl).__name__ == "TurboQuantAttentionImpl"
    assert compressed.attn_backend.get_builder_cls().__name__ == "ChunkedLocalAttentionBuilder"
    said = [r for r in log() if "chunked local" in r[1]]
    assert said[0] == (
        logging.INFO,
        "tq-warmup: chunked local layer language_model.model.layers.0.self_attn.attn is "
        f"a TurboQuant boundary layer; giving it vLLM's own backend, not {PRESET}'s "
        "(else: Unknown TurboQuant cache dtype: 'auto')",
    )
    # A compressed chunked local layer: where its KV-cache spec is not TurboQuant's, the
    # engine will still fail a step later, and the guard says so once.
    major, minor = vllm_env.version
    spec = (
        logging.WARNING,
        f"tq-warmup: vLLM {major}.{minor} cannot serve TurboQuant on chunked local "
        "attention layers (language_model.model.layers.2.self_attn.attn, Llama 4): their "
        "KV-cache spec is not TurboQuant's, so startup fails in KV-cache grouping "
        "(upstream; fixed in 0.28); use vLLM 0.28+ or --kv-cache-dtype auto",
    )
    assert said[1:] == ([spec] if vllm_env.local_tq_spec_plain else [])
    guard.remove(local)
    assert not guard.installed(local)
    with pytest.raises(ValueError, match="Unknown TurboQuant cache dtype: 'auto'"):
        build(local, 1)


@pytest.mark.real_vllm
def test_gate_local_tq_spec_plain_is_what_vllm_builds(
    local: ModuleType, vllm_env: compat.Features
) -> None:
    """The gate behind the guard's WARNING, on vLLM's own specs: where it is on, a
    compressed chunked local layer's KV-cache page is not that of a compressed global
    layer (the H200 failed grouping them, 0.26.0); where it is off, it is."""
    guard.install(local)
    chunked, config = build(local, 2)
    glob, _ = build(local, 3, local=False)
    assert (chunked.kv_cache_dtype, glob.kv_cache_dtype) == (PRESET, PRESET)
    pages = {layer.get_kv_cache_spec(config).page_size_bytes for layer in (chunked, glob)}
    assert (len(pages) == 2) is vllm_env.local_tq_spec_plain
