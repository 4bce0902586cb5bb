"""Discovery of boundary layers: one odd layer is refused, the others still warm."""

from __future__ import annotations

from typing import Any

import fakes
import pytest

from tq_warmup_plugin import compat
from tq_warmup_plugin.keys import Int
from tq_warmup_plugin.worker.discovery import discover

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
    monkeypatch.setattr(compat.vllm_paths, "FLASH_ATTN_MODULE", "tq_warmup_plugin._no_such_module")
    assert compat.plain_fa2_heads(fakes.FlashAttentionImpl()) is None


def test_chunked_local_attention_plans_its_virtual_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama 4's ``ChunkedLocalAttention`` layers keep the runner's geometry plus their
    chunk: their decode and continuation keys follow a table of chunk/block_size
    columns (8192 / 16 = 512: stride class %16 where the runner's 63 is not)."""
    from tq_warmup_plugin.keys import decode_keys, long_continuation_keys

    monkeypatch.setattr(compat, "turboquant_impl_class", lambda: fakes.TurboQuantAttentionImpl)
    local = [fakes.layer(FEATS), fakes.layer(FEATS)]
    for layer in local:
        layer.attention_chunk_size = 8192
    layers = {"global": fakes.layer(FEATS), "local.0": local[0], "local.1": local[1]}
    found = discover(fakes.worker(layers, [fakes.table(63)]), FEATS)
    assert list(found.geometries) == ["global", "local.0", "local.1"]
    assert found.note == "" and found.refused == {}
    g, loc = found.geometries["global"], found.geometries["local.0"]
    assert (g.attention_chunk, g.local_width, g.block_table_width) == (0, 0, 63)
    assert (loc.attention_chunk, loc.local_width, loc.block_table_width) == (8192, 512, 63)
    assert found.geometries["local.1"] == loc
    assert compat.local_attention_chunk(layers["global"]) is None

    def strides(keys: Any) -> set[object]:
        return {dict(k.args)["stride_bt_b"] for k in keys if k.kernel != "_fwd_kernel_stage2"}

    assert strides(decode_keys(g)) == {Int(17)} and strides(decode_keys(loc)) == {Int(16)}
    assert strides(long_continuation_keys(loc)) == {Int(16)}
