"""The report's log line and JSON form, and the Triton compile counter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tq_warmup_plugin.worker.report import CompileCounter, Report


def test_ok_line_has_every_count() -> None:
    report = Report(
        layers=32,
        keys={"decode": 2, "store": 1},
        distinct=3,
        compiled=2,
        shipped=5,
        loaded=1,
        failed=0,
        warmup_s=1.2345,
        workspace_bytes=3 * 2**20,
    )
    assert report.line() == (
        "tq-warmup: 32 TurboQuant layers, 3 distinct kernel keys (decode 2, store 1): "
        "2 compiled, 5 from the shipped cache, 1 from Triton's disk cache, 0 failed; "
        "workspace 3.0 MiB; 1234 ms"
    )
    report.launches, report.launch_s = 6, 0.1714
    assert report.line().endswith("workspace 3.0 MiB; 1234 ms; 6 first launches 171 ms")
    report.vllm.jobs, report.vllm.kernels, report.vllm.seconds = {"fused MoE": 11}, 22, 3.21
    report.vllm.compiled = 4
    assert report.line().endswith("; vLLM kernels: fused MoE 11 (22 launches, 4 compiled, 3210 ms)")
    report.vllm.compiled_names = {"_ranks_kernel": 1, "fused_moe_kernel": 3}
    assert report.line().endswith(
        "(22 launches, 4 compiled: fused_moe_kernel x3, _ranks_kernel, 3210 ms)"
    )
    report.vllm.forwards = (11, 0, 0.4049)
    assert report.line().endswith("3210 ms); 11 warmup forwards 405 ms, 0 compiles in them")
    report.vllm.family_seconds = {"fused MoE": 2.5, "slot mapping": 0.01}
    assert "3210 ms, most job time: fused MoE 2500 ms); 11 warmup" in report.line()
    report.vllm.triton_seconds = (0.1204, 0.3)
    assert (
        "most job time: fused MoE 2500 ms, in Triton: lookups 120 ms, loads 300 ms); 11 warmup"
        in report.line()
    )


def test_ok_line_with_failures_names_the_first_error() -> None:
    line = Report(failed=2, errors=["_k: RuntimeError: a", "_k: RuntimeError: b"]).line()
    assert "2 failed" in line and line.endswith("; first error: _k: RuntimeError: a")


@pytest.mark.parametrize("status", ["skipped", "failed"])
def test_other_statuses_give_the_reason(status: str) -> None:
    report = Report(status=status, reason="vLLM 0.19 is outside the supported releases")
    assert report.line() == f"tq-warmup: {status}: vLLM 0.19 is outside the supported releases"


def test_json_round_trips() -> None:
    report = Report(
        vllm_version="0.26.0",
        layers=2,
        keys={"decode": 4},
        distinct=4,
        compiled=3,
        loaded=1,
        warmup_s=0.5,
        workspace_bytes=1024,
        errors=["x"],
    )
    report.vllm.jobs, report.vllm.forwards = {"logprobs": 7}, (1, 2, 0.5)
    assert Report.from_json(report.to_json()) == report
    assert json.loads(report.to_json())["vllm"]["jobs"] == {"logprobs": 7}  # nested


def test_compile_counter_counts_and_chains_the_listener(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    from triton import knobs

    previous: list[bool] = []
    monkeypatch.setattr(
        knobs.compilation, "listener", lambda *, cache_hit, **kw: previous.append(cache_hit)
    )
    chained = knobs.compilation.listener
    with CompileCounter() as counter:
        for hit in (False, True, False):
            knobs.compilation.listener(cache_hit=hit, src=None, metadata=None, times=None)
    assert (counter.compiled, counter.loaded) == (2, 1)
    assert previous == [False, True, False]
    assert knobs.compilation.listener is chained


def test_compile_counter_tells_shipped_from_disk_cache_hits_and_names_the_key_dirs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pytest.importorskip("triton")
    from triton import knobs

    from tq_warmup_plugin.shipped import layered_cache
    from tq_warmup_plugin.shipped import trust as layer_trust

    (tmp_path / "layer").mkdir()
    monkeypatch.setenv("TRITON_CACHE_MANAGER", layered_cache.MANAGER)
    monkeypatch.setenv(layered_cache.LAYERS_ENV, str(tmp_path / "layer"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "own"))
    monkeypatch.setattr(knobs.compilation, "listener", None)

    # A layer's files are served from this process's private copies of the bytes it
    # hashed (``layer_trust``), never from the layer itself.
    served = Path(layer_trust._make_private_root())

    def group(root: Path, key: str) -> dict[str, str]:
        return {"k.json": str(root / key / "k.json")}

    with CompileCounter() as counter:
        for hit, root, key in [
            (True, served, "A"),
            (True, tmp_path / "own", "B"),
            (False, tmp_path / "own", "C"),
            (True, tmp_path / "layer", "D"),  # the layer's own path: not what it serves
        ]:
            knobs.compilation.listener(cache_hit=hit, metadata_group=group(root, key))
    assert (counter.compiled, counter.shipped, counter.loaded) == (1, 1, 2)
    assert counter.dirs == {"A", "B", "C", "D"}
