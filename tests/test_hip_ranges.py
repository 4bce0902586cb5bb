"""ROCm: Triton's HIP backend keys each pointer on whether its storage is within 2 GiB
("S"); the plugin's keys carry the real tensors' answer. Pure rule and keys here, then
Triton's own HIP specialization on the CPU, then vLLM's real backend under a
compile-only HIP target (no ROCm GPU needed)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import fakes
import pytest

from tq_warmup_plugin import compat, keys
from tq_warmup_plugin.geometry import Geometry
from tq_warmup_plugin.keys import KernelKey, Ptr

LIMIT = 2**31 - 1  # Triton's MAX_INT_32 in is_within_2gb (3.6-3.8)
SIZES = [(LIMIT - 1, True), (LIMIT, True), (LIMIT + 1, False), (2**31 + 4096, False)]


@pytest.mark.parametrize(("size", "inside"), SIZES)
def test_the_rule_at_2_gib(size: int, inside: bool) -> None:
    assert compat.pointer_in_range(size) is inside


def hip(g: Geometry, **sizes: Any) -> Geometry:
    return dataclasses.replace(g, pointer_ranges=True, **sizes)


def ptrs(ks: tuple[KernelKey, ...], name: str) -> set[Ptr]:
    return {arg for k in ks for n, arg in k.args if n == name and isinstance(arg, Ptr)}


def spans(ks: tuple[KernelKey, ...], name: str) -> set[bool | None]:
    return {p.in_range for p in ptrs(ks, name)}


def every_key(g: Geometry) -> tuple[KernelKey, ...]:
    return tuple(k for derive in keys.PATHS.values() for k in derive(g))


def test_cuda_keys_carry_no_span() -> None:
    g = fakes.geometry()
    assert {p.in_range for k in every_key(g) for _, p in k.args if isinstance(p, Ptr)} == {None}


@pytest.mark.parametrize(("size", "inside"), SIZES)
def test_the_kv_pointer_carries_the_real_storage(size: int, inside: bool) -> None:
    g = hip(fakes.geometry(), kv_storage_bytes=size, workspace_bytes=(1 << 20,))
    assert spans(every_key(g), "KV_cache_ptr") == {inside}
    # Everything else of this geometry is small.
    others = {p.in_range for k in every_key(g) for n, p in k.args if isinstance(p, Ptr)}
    assert others == {True, inside}
    assert len(every_key(g)) == len(every_key(fakes.geometry()))


@pytest.mark.parametrize(("size", "inside"), SIZES)
def test_workspace_views_carry_the_buffer_size(size: int, inside: bool) -> None:
    g = hip(fakes.geometry(), workspace_bytes=(size,))
    decode = keys.decode_keys(g)
    for name in ("Mid_o_ptr", "Mid_O", "o", "lse"):
        assert spans(decode, name) == {inside}, name
    dequant = keys.long_continuation_keys(g)
    assert spans(dequant, "K_out_ptr") == spans(dequant, "V_out_ptr") == {inside}
    # The continuation fast path allocates its own small buffers.
    assert spans(keys.short_continuation_keys(g), "Mid_o_ptr") == {True}
    # Slots of both sizes (ubatch or lane buffers grown apart): both keys.
    both = hip(fakes.geometry(), workspace_bytes=(1024, size))
    assert spans(keys.decode_keys(both), "Mid_o_ptr") == {True, inside}


def test_an_unknown_workspace_is_the_largest_planned_request() -> None:
    # 1024 sequences x 128 heads x 32 splits x 129 floats: the decode request is 2.02 GiB.
    big = hip(fakes.geometry(num_heads=128, num_kv_heads=8, max_num_seqs=1024))
    assert spans(keys.decode_keys(big), "Mid_o_ptr") == {False}
    assert spans(keys.decode_keys(hip(fakes.geometry())), "Mid_o_ptr") == {True}


def test_per_launch_tensors_over_2_gib_at_full_batch_take_both_keys() -> None:
    # 65536 tokens x 32 KV heads x 256 x 4 bytes: the MSE store's fp32 keys reach 2 GiB.
    g = hip(fakes.geometry(head_size=256, num_heads=32, num_kv_heads=32, batched=65536))
    (small_batch,) = keys.store_keys(hip(fakes.geometry(head_size=256, num_heads=32)))
    assert spans((small_batch,), "Y_ptr") == {True}
    assert spans(keys.store_keys(g), "Y_ptr") == {True, False}
    assert spans(keys.store_keys(g), "Norms_ptr") == {True}


def test_describe_shows_the_span() -> None:
    g = hip(fakes.geometry(), kv_storage_bytes=2**32)
    text = keys.decode_keys(g)[0].describe()
    assert "KV_cache_ptr=*u8:>2G" in text and "Block_table_ptr=*i32:S" in text


def test_discovery_keeps_the_real_storage_sizes_on_hip(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    from tq_warmup_plugin.worker.discovery import discover

    monkeypatch.setattr(compat, "turboquant_impl_class", lambda: fakes.TurboQuantAttentionImpl)
    feats = compat.features((0, 33))
    layer = fakes.layer(feats)  # a view of one byte less than its storage
    worker = fakes.worker({"tq": layer}, [fakes.table(64)])
    g = discover(worker, feats).geometries["tq"]
    assert (g.pointer_ranges, g.kv_storage_bytes, g.block_table_bytes) == (False, 0, 0)
    monkeypatch.setattr(compat, "triton_pointer_ranges", lambda: True)
    g = discover(worker, feats).geometries["tq"]
    kv_bytes = layer.kv_cache.untyped_storage().size()
    assert kv_bytes == layer.kv_cache.numel() + 1
    assert (g.pointer_ranges, g.kv_storage_bytes, g.block_table_bytes) == (
        True,
        kv_bytes,
        8 * 64 * 4,
    )


@pytest.mark.parametrize("on_hip", [True, False])
def test_run_reserves_then_plans_with_the_real_workspace(
    monkeypatch: pytest.MonkeyPatch, on_hip: bool
) -> None:
    from fakes import RecordingWarmer, StubCounter, manager

    from tq_warmup_plugin.settings import Settings
    from tq_warmup_plugin.warmers.turboquant import turboquant_contributions
    from tq_warmup_plugin.worker import keyplan, warmup, workspace
    from tq_warmup_plugin.worker.discovery import Discovery

    g = hip(fakes.geometry()) if on_hip else fakes.geometry()
    calls: list[str] = []

    def sizes(feats: compat.Features) -> tuple[int, ...]:
        calls.append("sizes")
        return (LIMIT + 1,)

    def reserve(groups: Any, feats: compat.Features) -> int:
        calls.append("reserve")
        return 0

    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "0.26.0")
    monkeypatch.setattr(warmup, "discover", lambda worker, feats: Discovery(geometries={"l": g}))
    monkeypatch.setattr(keyplan, "CompileCounter", StubCounter)
    monkeypatch.setattr(workspace, "reserve", reserve)
    monkeypatch.setattr(workspace, "buffer_sizes", sizes)
    warmer = RecordingWarmer(None)
    report = warmup.run(object(), Settings(launch=False), manager(warmer))
    final = dataclasses.replace(g, workspace_bytes=(LIMIT + 1,)) if on_hip else g
    assert calls == (["reserve", "sizes"] if on_hip else ["reserve"])
    assert set(warmer.seen) == set(warmup.Plan.of(turboquant_contributions({"l": final})).keys)
    assert report.geometries == [final.to_dict()]
    assert (False in spans(tuple(warmer.seen), "Mid_o_ptr")) is on_hip


# --- Triton's own HIP specialization, on the CPU --------------------------------------


@pytest.fixture
def hip_backend() -> Any:
    amd = pytest.importorskip("triton.backends.amd.compiler")
    return amd.HIPBackend


def triton_flags(backend: Any, arg: Any) -> str:
    """The specialization flags Triton's native binder computes for one argument."""
    from triton._C.libtriton import native_specialize_impl

    return str(native_specialize_impl(backend, arg, False, True, True)[1])


@pytest.mark.parametrize(("size", "inside"), SIZES)
def test_our_answer_is_tritons_for_a_tensor_of_that_storage(
    hip_backend: Any, size: int, inside: bool
) -> None:
    torch = pytest.importorskip("torch")
    tensor = torch.empty(size, dtype=torch.uint8, device="meta")  # nothing allocated
    assert tensor.untyped_storage().size() == size
    assert ("S" in triton_flags(hip_backend, tensor)) is inside
    assert hip_backend.is_within_2gb(tensor) is inside

    class PtrRange:  # Triton's own duck type: any object with ptr_range() and dtype
        dtype = torch.uint8

        def data_ptr(self) -> int:
            return 4096

        def ptr_range(self) -> int:
            return size

    assert ("S" in triton_flags(hip_backend, PtrRange())) is inside


def test_without_buffer_ops_triton_adds_nothing(
    hip_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = pytest.importorskip("torch")
    from triton import knobs

    monkeypatch.setattr(knobs.amd, "use_buffer_ops", False)
    assert triton_flags(hip_backend, torch.empty(16, dtype=torch.uint8)) == "D"


@pytest.mark.parametrize("dtype", ["u8", "i32", "i64", "fp32", "bf16", "fp16"])
@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("in_range", [True, False])
def test_the_warmer_hands_triton_what_the_key_says(
    hip_backend: Any, dtype: str, aligned: bool, in_range: bool
) -> None:
    from tq_warmup_plugin.warmers.triton_jit import warmup_arguments

    key = KernelKey("k", (("p", Ptr(dtype, aligned, in_range)),), 4)
    tensor = warmup_arguments(key)["p"]
    assert triton_flags(hip_backend, tensor) == ("D" if aligned else "") + ("S" if in_range else "")


@pytest.fixture
def hip_target(vllm_env: compat.Features) -> Iterator[compat.Features]:
    """The compile-only driver aimed at gfx942 (MI300) instead of sm90; kernels' device
    caches (which hold the backend) are rebuilt by ``recorded_keys``."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    active = driver.active
    cuda = active.target
    active.target = GPUTarget("hip", "gfx942", 64)
    try:
        yield vllm_env
    finally:
        active.target = cuda
        for name in compat.KERNEL_MODULES:
            compat.kernel_function(name).device_caches.clear()


@pytest.mark.real_vllm
def test_triton_pointer_ranges_follows_the_target_and_buffer_ops(
    hip_target: compat.Features, monkeypatch: pytest.MonkeyPatch
) -> None:
    from triton import knobs

    assert compat.triton_pointer_ranges()
    monkeypatch.setattr(knobs.amd, "use_buffer_ops", False)
    assert not compat.triton_pointer_ranges()


@pytest.mark.real_vllm
def test_cuda_target_has_no_pointer_ranges(vllm_env: compat.Features) -> None:
    assert not compat.triton_pointer_ranges()


# --- vLLM's real backend under a compile-only HIP target -----------------------------

WIDTH, BS = 63, 16


def hip_case(feats: compat.Features, preset: str, kv_storage: int, workspace: int) -> None:
    """Run the real backend's every path with a KV tensor viewing ``kv_storage`` bytes
    and a workspace buffer of ``workspace`` bytes; the plan for those sizes must be
    exactly what it launched."""
    import torch
    from realvllm import MAX_NUM_SEQS, impl_geometry, layer_kv_cache, make_impl, recorded_keys
    from realvllm import run_backend as drive
    from vllm.v1.worker import workspace as ws

    from tq_warmup_plugin.warmers.triton_jit import compile_key
    from tq_warmup_plugin.warmers.turboquant import turboquant_contributions
    from tq_warmup_plugin.worker.warmup import Plan
    from tq_warmup_plugin.worker.workspace import buffer_sizes

    ws.reset_workspace_manager()
    ws.init_workspace_manager(torch.device("cpu"))
    manager = ws.current_workspace_manager()
    manager.get_simultaneous(((workspace,), torch.uint8))  # never touched: mapped lazily
    impl = make_impl(preset, 128, 8, 2, 32, WIDTH * BS)
    kv = layer_kv_cache(feats, 4, BS, 2, impl.tq_config.slot_size_aligned, kv_storage)
    try:
        with recorded_keys() as launched:
            drive(impl, kv, WIDTH, torch.bfloat16)
        assert buffer_sizes(feats) == (workspace,)  # nothing grew it
        manager.lock()  # what vLLM does after capture; an elastic EP re-warm reads it then
        assert buffer_sizes(feats) == (workspace,)
    finally:
        ws.reset_workspace_manager()
        ws.init_workspace_manager(torch.device("cpu"))
    view = compat.kv_view(kv, feats)
    g = impl_geometry(feats, impl, WIDTH, BS, tuple(view.stride()[:3]))  # type: ignore[arg-type]
    g = hip(
        g,
        kv_storage_bytes=compat.storage_bytes(view),
        block_table_bytes=MAX_NUM_SEQS * WIDTH * 4,  # run_backend's table
        workspace_bytes=(workspace,),
    )
    with recorded_keys() as ours:
        for key in Plan.of(turboquant_contributions({"layer": g})).keys:
            compile_key(key)
    assert {name for name, _ in launched} >= {"_tq_decode_stage1", "_tq_full_dequant_kv"}
    assert ours == launched, (sorted(launched - ours), sorted(ours - launched))
    # Triton's key lists each argument's (type, flags): the cache's u8 pointer lost "S".
    kv_flags = {k.split("('*u8', ")[1].split(")")[0] for _, k in launched if "'*u8'" in k}
    assert kv_flags == ({"'D'"} if kv_storage > LIMIT else {"'DS'"})


@pytest.mark.real_vllm
@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k8v4"])
@pytest.mark.parametrize(
    ("kv_storage", "workspace"),
    [(0, 64 << 20), (LIMIT, 64 << 20), (LIMIT + 1, 64 << 20), (0, LIMIT + 1)],
    ids=["small", "kv-2GiB", "kv-over-2GiB", "workspace-over-2GiB"],
)
def test_real_backend_on_hip_launches_exactly_the_plan(
    hip_target: compat.Features, preset: str, kv_storage: int, workspace: int
) -> None:
    hip_case(hip_target, preset, kv_storage, workspace)
