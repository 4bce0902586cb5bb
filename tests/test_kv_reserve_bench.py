"""The ``kv-reserve`` benchmark's pure parts: its log reader, modes and ratios."""

from __future__ import annotations

from benchmarks.tqbench import kv_reserve

# vLLM 0.34.0's sizing line and the child's facts, as an H100 engine logged them.
LOG = """\
INFO [extensible_kv_cache.py:693] Memory after warmup: 68.06 GiB free, 0.03 GiB committed \
to the KV cache, 2.35 GiB kept for transient activations (1.69 GiB allocated at peak, 2.35 \
GiB of torch reservation growth); 36984 KV cache blocks (64.47 GiB) fit within the \
requested 79.18 GiB. Torch may reserve up to 13.05 GiB.
INFO [kv_cache_utils.py:1168] GPU KV cache size: 2,366,976 tokens
{"workspace_mib": 524.125}
{"torch_allocated_mib": 66540.5, "torch_reserved_mib": 66600.0, "free_mib": 1024.0}
{"phase": "warmup.compile_into", "delta_mib": {"torch_reserved_mib": 0.0, "free_mib": -42.0, \
"modules_loaded": 21}}
"""


def test_the_log_gives_blocks_reserve_and_memory() -> None:
    row = kv_reserve.parse_log(LOG)
    assert row["kv_blocks"] == 36984 and row["kept_gib"] == 2.35 and row["peak_gib"] == 1.69
    assert row["kv_tokens"] == 2366976 and row["workspace_mib"] == 524.125
    assert row["torch_reserved_mib"] == 66600.0 and row["free_mib"] == 1024.0
    held = row["phases_mib"]["warmup.compile_into"]
    assert held["free_mib"] == -42.0 and held["modules_loaded"] == 21


def test_each_part_mode_runs_the_plugin_less_that_part_only() -> None:
    assert kv_reserve.mode_env("off") == {"TQ_WARMUP": "0"}
    assert kv_reserve.mode_env("on") == {"TQ_WARMUP": "1"}
    for mode, off in kv_reserve.PARTS_OFF.items():
        env = kv_reserve.mode_env(mode)
        assert env["TQ_WARMUP"] == "1" and set(env) == {"TQ_WARMUP", *off}
        assert all(value == "0" for value in off.values())


def test_ratios_are_over_the_off_engine_of_the_same_length() -> None:
    rows = [
        {"max_model_len": 4096, "mode": "off", "kv_blocks": 37200},
        {"max_model_len": 4096, "mode": "on", "kv_blocks": 36984, "plugin_line": "x"},
        {"max_model_len": 65536, "mode": "on", "kv_blocks": 36984, "plugin_line": "x"},
    ]
    assert kv_reserve.ratios(rows) == {"4096": {"on": 36984 / 37200}}
    assert "36984" in kv_reserve.table(rows)


def test_a_plugin_mode_without_the_plugins_line_has_no_ratio() -> None:
    """vLLM started an ``on`` engine without the plugin (not installed, no stub): its
    blocks equal the baseline's, which would read as no cost; the table says so instead."""
    rows = [
        {"max_model_len": 4096, "mode": "off", "kv_blocks": 37200},
        {"max_model_len": 4096, "mode": "on", "kv_blocks": 37200},
        {"max_model_len": 4096, "mode": "no-launch", "kv_blocks": 37000, "plugin_line": "x"},
    ]
    assert kv_reserve.without_plugin(rows[1]) and not kv_reserve.without_plugin(rows[0])
    assert kv_reserve.ratios(rows) == {"4096": {"no-launch": 37000 / 37200}}
    assert "on (no plugin)" in kv_reserve.table(rows)
    assert kv_reserve.parse_log(LOG + "tq-warmup: 12 TurboQuant layers, 6 keys\n")["plugin_line"]
