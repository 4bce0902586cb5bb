"""Discovery of boundary layers: one odd layer is refused, the others still warm."""

from __future__ import annotations

from typing import Any

import fakes
import pytest

from tq_warmup_plugin import compat
from tq_warmup_plugin.discovery import discover

torch = pytest.importorskip("torch")

FEATS = compat.features((0, 26))


class OddFlash(fakes.FlashAttentionImpl):
    """A boundary impl whose attributes plain_fa2_heads cannot read."""


def heads_or_raise(impl: Any) -> tuple[int, int, int] | None:
    if isinstance(impl, OddFlash):
        raise TypeError("'int' object is not iterable")
    if isinstance(impl, fakes.FlashAttentionImpl):
        return (impl.num_heads, impl.num_kv_heads, impl.head_size)
    return None


def test_an_odd_boundary_layer_is_refused_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "turboquant_impl_class", lambda: fakes.TurboQuantAttentionImpl)
    monkeypatch.setattr(compat, "plain_fa2_heads", heads_or_raise)
    layers = {
        "first": fakes.layer(FEATS, fakes.FlashAttentionImpl()),
        "odd": fakes.layer(FEATS, OddFlash()),
        "tq": fakes.layer(FEATS),
    }
    found = discover(fakes.worker(layers, [fakes.table(64)]), FEATS)
    assert list(found.geometries) == ["tq"]
    assert found.boundary == {"first": (8, 2, 128)}
    assert found.refused == {"odd": "boundary layer: TypeError: 'int' object is not iterable"}


def test_without_vllms_flash_attention_module_nothing_is_boundary(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(compat, "FLASH_ATTN_MODULE", "tq_warmup_plugin._no_such_module")
    assert compat.plain_fa2_heads(fakes.FlashAttentionImpl()) is None


def test_chunked_local_attention_is_declined_in_one_note(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "turboquant_impl_class", lambda: fakes.TurboQuantAttentionImpl)
    local = [fakes.layer(FEATS), fakes.layer(FEATS)]
    for layer in local:
        layer.attention_chunk_size = 8192  # Llama 4's ChunkedLocalAttention
    layers = {"global": fakes.layer(FEATS), "local.0": local[0], "local.1": local[1]}
    found = discover(fakes.worker(layers, [fakes.table(64)]), FEATS)
    assert list(found.geometries) == ["global", "local.0", "local.1"]  # store keys, reservation
    assert found.note.count("attention_chunk_size=8192") == 1 and found.refused == {}
    assert compat.local_attention_chunk(layers["global"]) is None
