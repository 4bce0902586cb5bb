"""The plugin against the real vLLM modules: hook placement, the objects it reads,
end-to-end warmup with real Triton compilation for sm90, and the workspace lock."""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import fakes
import pytest
from realvllm import (
    MAX_NUM_SEQS,
    fake_worker,
    impl_geometry,
    layer_kv_cache,
    make_flash_impl,
    make_impl,
    recorded_keys,
    run_backend,
)

from tq_warmup_plugin import compat, install
from tq_warmup_plugin.geometry import PRESETS
from tq_warmup_plugin.settings import Settings
from tq_warmup_plugin.worker import launches, workspace
from tq_warmup_plugin.worker.warmup import run

pytestmark = pytest.mark.real_vllm


def test_hook_lands_at_the_real_call_sites(vllm_env: compat.Features) -> None:
    import vllm.model_executor.warmup.kernel_warmup as defining
    import vllm.v1.worker.gpu_worker as gpu_worker

    original = defining.kernel_warmup
    params = list(inspect.signature(original).parameters)
    assert params[0] == "worker"
    if vllm_env.version >= (0, 27):
        assert "process_local_only" in params
    assert "kernel_warmup(self)" in inspect.getsource(gpu_worker.Worker)
    install.install(Settings())
    try:
        assert gpu_worker.kernel_warmup is defining.kernel_warmup is not original
        assert gpu_worker.kernel_warmup.__wrapped__ is original  # type: ignore[attr-defined]
    finally:
        install.uninstall()
    assert gpu_worker.kernel_warmup is original and defining.kernel_warmup is original


def test_vllm_loads_the_entry_point_and_the_worker_gets_the_wrapper() -> None:
    # A fresh process: vLLM's own plugin loader calls register(), then the worker
    # module is imported and must bind our wrapper through the import hook.
    code = (
        "from vllm.plugins import load_general_plugins; load_general_plugins();"
        "import vllm.v1.worker.gpu_worker as w;"
        "print(hasattr(w.kernel_warmup, '__tq_warmup_original__'))"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "VLLM_PLUGINS": "tq_warmup"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip().splitlines()[-1] == "True", out.stderr[-2000:]
    env["VLLM_PLUGINS"] = "someone_else"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr[-2000:]


def test_objects_the_plugin_reads_exist(vllm_env: compat.Features) -> None:
    import dataclasses

    from vllm.v1.worker import workspace as ws
    from vllm.v1.worker.gpu import block_table as v2_block_table
    from vllm.v1.worker.utils import AttentionGroup

    impl = make_impl("turboquant_k3v4_nc", 128, 8, 2, 32, 1024)
    for attr in (
        "num_heads",
        "num_kv_heads",
        "head_size",
        "scale",
        "max_num_kv_splits",
        "kv_cache_dtype",
    ):
        assert hasattr(impl, attr), attr
    fields = {f.name for f in dataclasses.fields(AttentionGroup)}
    assert {"layer_names", "kv_cache_group_id"} <= fields
    for name in ("is_workspace_manager_initialized", "current_workspace_manager"):
        assert callable(getattr(ws, name))
    for method in ("get_simultaneous", "is_locked", "lock"):
        assert callable(getattr(ws.WorkspaceManager, method))
    assert "self.input_block_tables" in inspect.getsource(v2_block_table.BlockTables)
    runners = ["vllm.v1.worker.gpu.model_runner"]
    if vllm_env.v1_runner:  # 0.20-0.33
        runners.append("vllm.v1.worker.gpu_model_runner")
    for runner in runners:
        source = inspect.getsource(importlib.import_module(runner).GPUModelRunner)
        assert "self.attn_groups" in source, runner
    assert compat.turboquant_impl_class() is type(impl)
    # Which runner a worker runs: its own flag where V1 exists, V2 where it is gone (0.34),
    # taking the flag with it (``compat.worker_uses_v2``).
    worker = inspect.getsource(importlib.import_module(compat.WORKER_MODULE).Worker)
    assert ("self.use_v2_model_runner =" in worker) is vllm_env.v1_runner


def test_end_to_end_warmup_builds_sm90_cubins(
    vllm_env: compat.Features, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    for name in compat.KERNEL_MODULES:
        compat.kernel_function(name).device_caches.clear()
    impls = {
        f"layers.{i}.attn": make_impl(p, 128, 8, 2, 32, 1024)
        for i, p in enumerate(["turboquant_4bit_nc", "turboquant_4bit_nc", "turboquant_k8v4"])
    }
    # vLLM's own kernels: test_engine_warmers_build_sm90_cubins below.
    report = run(fake_worker(impls, vllm_env, 64), Settings(threads=2, vllm_kernels=False))
    assert report.status == "ok", report.line()
    assert report.layers == 3 and report.failed == 0, report.line()
    # Two identical layers share keys: distinct keys come from two presets only.
    assert report.distinct == report.compiled + report.loaded
    assert report.compiled == report.distinct  # fresh cache dir: everything compiled
    cubins = {p.stem for p in tmp_path.rglob("*.cubin")}
    assert cubins == {
        "_tq_decode_stage1",
        "_fwd_kernel_stage2",
        "_tq_full_dequant_kv",
        "_tq_fused_store_mse",
        "_tq_fused_store_fp8",
    }
    again = run(fake_worker(impls, vllm_env, 64), Settings(vllm_kernels=False))
    assert again.compiled == 0 and again.loaded == 0  # all in Triton's in-memory cache


def test_engine_warmers_build_sm90_cubins(
    vllm_env: compat.Features, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole worker warmup of a V2 worker without speculation, vLLM's own kernels
    included: its logprob and top-k/top-p kernels compile for sm90 into Triton's cache."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    try:
        import vllm.v1.sample.ops.topk_topp_triton as topk_topp
    except ImportError:
        topk_topp = None  # 0.20-0.2x without the Triton top-k/top-p path
    if topk_topp is not None:  # the CPU platform has no SM count; the H200's 132
        monkeypatch.setattr(topk_topp, "num_compute_units", lambda index=None: 132, raising=False)
    impls = {"layers.0.attn": make_impl("turboquant_4bit_nc", 128, 8, 2, 32, 1024)}
    report = run(fake_worker(impls, vllm_env, 64), Settings(threads=2, launch=False))
    assert report.errors == [] and report.failed == 0, report.line()
    assert report.vllm.jobs["logprobs"] == 7
    assert any(d.startswith("slot mapping: ") for d in report.vllm.declined)  # V2
    cubins = {p.stem for p in tmp_path.rglob("*.cubin")}
    assert {"_topk_log_softmax_kernel", "_ranks_kernel"} <= cubins
    assert topk_topp is None or "_topk_topp_kernel" in cubins


@pytest.mark.parametrize("reserve", [True, False])
def test_reservation_survives_the_workspace_lock(vllm_env: compat.Features, reserve: bool) -> None:
    """Without our reservation, the real backend grows the locked workspace and
    raises; with it, decode at max_num_seqs and the longest continuation fit."""
    import torch
    from vllm.v1.worker import workspace as ws

    if not vllm_env.uses_workspace:
        pytest.skip("0.20 does not use the workspace")
    width, bs = 64, 16
    impl = make_impl("turboquant_4bit_nc", 128, 8, 2, 32, width * bs)
    ws.reset_workspace_manager()
    ws.init_workspace_manager(torch.device("cpu"))
    try:
        g = impl_geometry(vllm_env, impl, width, bs)
        if reserve:
            assert workspace.reserve(workspace.plan_reservation([g]), vllm_env) > 0
        ws.lock_workspace()
        kv = layer_kv_cache(vllm_env, width, bs, 2, impl.tq_config.slot_size_aligned)
        longest = [(200, width * bs - 200 - 1)]
        decode_all = [(1, 40)] * MAX_NUM_SEQS
        # Launches are recorded, not run: the compile-only driver cannot launch.
        with recorded_keys():
            if reserve:
                batches = [(decode_all, MAX_NUM_SEQS), (longest, 0)]
                run_backend(impl, kv, width, torch.bfloat16, batches)
            else:
                with pytest.raises(AssertionError, match="Workspace is locked"):
                    run_backend(impl, kv, width, torch.bfloat16, [(longest, 0)])
    finally:
        ws.reset_workspace_manager()
        ws.init_workspace_manager(torch.device("cpu"))


@pytest.mark.parametrize("cache_dtype", sorted(PRESETS))
def test_planned_gemms_are_the_backends_gemms(vllm_env: compat.Features, cache_dtype: str) -> None:
    # The real backend's decode, short and long continuation on CPU tensors: every
    # GEMM it runs must have a planned launch of the same dtype and inner size (the
    # module CUDA would load for it), and no planned GEMM may be one it never runs;
    # every fp32 rotation's rows are within the planned ladder, at a planned size class.
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    gemm_ops = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
    seen: set[tuple[str, int]] = set()
    fp32_rows: set[int] = set()

    class Gemms(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            if func in gemm_ops:
                a = args[-2]
                seen.add((str(a.dtype).removeprefix("torch."), int(a.shape[-1])))
                if a.dtype == torch.float32:
                    fp32_rows.add(int(a.numel() // a.shape[-1]))
            return func(*args, **(kwargs or {}))

    width, bs, d = 64, 16, 128
    impl = make_impl(cache_dtype, d, 8, 2, 32, width * bs)
    kv = layer_kv_cache(vllm_env, width, bs, 2, impl.tq_config.slot_size_aligned)
    with recorded_keys(), Gemms():
        run_backend(impl, kv, width, torch.bfloat16)
    g = impl_geometry(vllm_env, impl, width, bs)
    planned = {(x.dtype, x.cols) for x in launches.launches(g) if x.kind == "gemm"}
    assert seen == planned
    ladder = {x.rows for x in launches.launches(g) if x.kind == "gemm" and x.dtype == "float32"}
    top = max(ladder, default=0)
    classes = {r: 1 << (r - 1).bit_length() for r in fp32_rows}  # the power of two above
    assert bool(fp32_rows) == bool(ladder)  # fp8 keys rotate nothing
    assert all(r <= top and (c in ladder or c > top) for r, c in classes.items())


def test_the_impls_flash_attention_call(vllm_env: compat.Features) -> None:
    from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionImpl

    params = list(inspect.signature(TurboQuantAttentionImpl._flash_attn_varlen).parameters)
    assert params == [
        "self",
        "q",
        "k",
        "v",
        "cu_seqlens_q",
        "cu_seqlens_k",
        "max_seqlen_q",
        "max_seqlen_k",
    ]
    impl = make_impl("turboquant_k8v4", 128, 8, 2, 32, 1024)
    assert compat.flash_attn_varlen(impl).__func__ is TurboQuantAttentionImpl._flash_attn_varlen
    from unittest import mock

    from vllm.v1.attention.backends import turboquant_attn

    # This CPU host has no CUDA platform, so the backend has no FlashAttention (its prefill
    # runs SDPA) and the plugin must plan no FlashAttention launch; the answer is the
    # backend's own flag, not a constant.
    assert turboquant_attn._HAS_FLASH_ATTN is False
    assert compat.flash_attn_available() is False
    with mock.patch.object(turboquant_attn, "_HAS_FLASH_ATTN", True):
        assert compat.flash_attn_available() is True


def _paged_call_keywords() -> set[str]:
    """Keywords of ``FlashAttentionImpl.forward``'s paged ``flash_attn_varlen_func`` call
    (0.33 makes it through ``_FA4_DENSE_ATTENTION_KERNEL``, which passes them on)."""
    import ast
    import textwrap

    from vllm.v1.attention.backends import flash_attn

    tree = ast.parse(textwrap.dedent(inspect.getsource(flash_attn.FlashAttentionImpl.forward)))
    callees = ("flash_attn_varlen_func", "_FA4_DENSE_ATTENTION_KERNEL")
    calls = [
        {k.arg for k in node.keywords if k.arg}
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") in callees
    ]
    paged = [kw for kw in calls if "block_table" in kw]
    assert len(paged) == 1, calls
    return paged[0]


def test_boundary_decode_is_the_backends_paged_call(
    vllm_env: compat.Features, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Our launch passes a subset of the keywords the backend's paged call passes, and
    # everything else that call passes is a per-layer option plain_fa2_heads refuses
    # (ALiBi, window, softcap, sinks), per-batch state, or the output buffer. A new
    # kernel-selecting keyword in a future release fails this test.
    import torch
    from vllm.v1.attention.backends import flash_attn

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(
        flash_attn, "flash_attn_varlen_func", lambda **kw: calls.append(kw), raising=False
    )
    impl = make_flash_impl(16, 8, 128)
    assert compat.plain_fa2_heads(impl) == (16, 8, 128)
    for refused in ({"sliding_window": 64}, {"logits_soft_cap": 30.0}, {"version": 3}):
        assert compat.plain_fa2_heads(make_flash_impl(16, 8, 128, **refused)) is None, refused
    todo = launches.plan({"l0": fakes.geometry(max_model_len=4096)}, {"boundary": (16, 8, 128)})
    paged = [x for x in todo if x.kind == "paged_decode"]
    done, _, errors = launches.launch_all(
        {paged[0]: "boundary"}, {"boundary": impl}, torch.device("cpu")
    )
    assert (done, errors) == (1, [])
    (kw,) = calls
    assert set(kw) <= _paged_call_keywords()
    left_to_the_runtime = {
        "out",
        "alibi_slopes",
        "window_size",
        "softcap",
        "s_aux",
        "num_splits",
        "scheduler_metadata",
        "q_descale",
        "k_descale",
        "v_descale",
        "dynamic_causal",
        "mask_mod",
        "aux_tensors",
    }
    assert _paged_call_keywords() - set(kw) <= left_to_the_runtime
    assert (kw["causal"], kw["fa_version"], kw["max_seqlen_q"], kw["max_seqlen_k"]) == (
        True,
        2,
        1,
        launches.ATTENTION_TOKENS,
    )
    assert tuple(kw["k"].shape) == (
        launches.ATTENTION_TOKENS // launches.PAGE_TOKENS,
        launches.PAGE_TOKENS,
        8,
        128,
    )
    assert kw["q"].dtype == torch.bfloat16 and kw["softmax_scale"] == impl.scale


def test_discovery_finds_the_boundary_layers(vllm_env: compat.Features) -> None:
    from tq_warmup_plugin.worker.discovery import discover

    impls = {"layers.2.attn": make_impl("turboquant_4bit_nc", 128, 8, 2, 32, 1024)}
    found = discover(fake_worker(impls, vllm_env, 64), vllm_env)
    assert list(found.geometries) == ["layers.2.attn"]
    assert found.boundary == {"boundary": (8, 2, 128)}
    assert set(found.impls) == {"layers.2.attn", "boundary"}


def test_preallocated_prefill_buffers_are_the_ones_the_backend_uses(
    vllm_env: compat.Features,
) -> None:
    """Made before capture, the loop's buffers are reused, never regrown or replaced,
    by every prefill path (first chunk, short and long continuation)."""
    import torch

    if not vllm_env.prefill_buffers_cached:
        pytest.skip("0.20 allocates them on every call")
    width, bs, max_len = 63, 16, 63 * 16
    impl = make_impl("turboquant_4bit_nc", 128, 8, 2, 32, max_len)
    kv = layer_kv_cache(vllm_env, 4, bs, 2, impl.tq_config.slot_size_aligned)
    made = compat.preallocate_prefill_buffers(impl, torch.device("cpu"), max_len)
    assert made == 3 * 8 + 4 * (max_len + 2)
    before = {n: getattr(impl, n) for n in ("_cu_2", "_cu_2_q", "_cu_2_k", "_arange_cache")}
    batches = [([(7, 7), (5, 3), (130, 20)], 0), ([(max_len - 1, 1)], 0)]
    with recorded_keys():  # no launches: the compile-only driver cannot run kernels
        run_backend(impl, kv, width, torch.bfloat16, batches)
    assert {n: getattr(impl, n) for n in before} == before  # same objects
    assert before["_arange_cache"].dtype == torch.int32
    assert compat.preallocate_prefill_buffers(impl, torch.device("cpu"), max_len) == 0
