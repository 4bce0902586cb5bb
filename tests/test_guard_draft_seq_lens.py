"""The draft-pass guard and the speculative-decoding warning: on stand-ins, then on
vLLM's real ``extend_all_queries_by_N``, builder and TurboQuant impl."""

from __future__ import annotations

import dataclasses
import importlib
import logging
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import fakes
import pytest
from conftest import Log

from tq_warmup_plugin import compat, guards, install
from tq_warmup_plugin.guards import draft_seq_lens as guard
from tq_warmup_plugin.guards import spec_graphs
from tq_warmup_plugin.settings import Settings
from tq_warmup_plugin.worker import keyplan, spec_problem, warmup
from tq_warmup_plugin.worker.discovery import Discovery


@dataclasses.dataclass
class Meta:
    """Stand-in for ``CommonAttentionMetadata`` (0.21-0.29 field names)."""

    seq_lens: list[int]
    seq_lens_cpu_upper_bound: Any = None
    _seq_lens_cpu: Any = None


@dataclasses.dataclass
class Meta30:
    """0.30+: no ``_seq_lens_cpu``."""

    seq_lens: list[int]
    seq_lens_cpu_upper_bound: Any = None


class Lens(tuple):  # type: ignore[type-arg]
    """A CPU length tensor stand-in: ``+ n`` makes a new one."""

    def __add__(self, n: object) -> Lens:
        assert isinstance(n, int)
        return Lens(v + n for v in self)


def vllms_extend(meta: Any, N: int, arange: Any, new_slot_mapping: Any) -> Any:
    """What vLLM's function does to the lengths: GPU ones only."""
    return dataclasses.replace(meta, seq_lens=[s + N for s in meta.seq_lens])


def test_bumped_raises_every_cpu_length_and_keeps_sharing() -> None:
    shared = Lens([10, 3])
    meta = Meta([11, 4], seq_lens_cpu_upper_bound=shared, _seq_lens_cpu=shared)
    out = guard.bumped(meta, 1)
    assert (
        out.seq_lens_cpu_upper_bound == (11, 4)
        and out._seq_lens_cpu is out.seq_lens_cpu_upper_bound
    )
    assert shared == (10, 3) and meta.seq_lens_cpu_upper_bound is shared  # nothing in place
    async_meta = Meta([5], seq_lens_cpu_upper_bound=Lens([4]))  # async: _seq_lens_cpu None
    assert guard.bumped(async_meta, 2) == Meta([5], seq_lens_cpu_upper_bound=Lens([6]))
    assert guard.bumped(Meta30([5], Lens([4])), 1) == Meta30([5], Lens([5]))
    plain = Meta([5])
    assert guard.bumped(plain, 1) is plain


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """A ``spec_decode.utils`` and a call site that imported the name (0.22.0)."""
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "0.22.0")
    utils = types.ModuleType("fake_spec_decode_utils")
    utils.extend_all_queries_by_N = vllms_extend  # type: ignore[attr-defined]
    site = types.ModuleType("fake_llm_base_proposer")
    site.extend_all_queries_by_N = vllms_extend  # type: ignore[attr-defined]
    monkeypatch.setattr(guard, "CALL_SITES", (site.__name__,))
    monkeypatch.setitem(sys.modules, site.__name__, site)
    yield utils
    guard.remove(utils)


def test_guard_bumps_after_vllm_and_rebinds_loaded_call_sites(fake: types.ModuleType) -> None:
    site = sys.modules[guard.CALL_SITES[0]]
    meta = Meta([190], seq_lens_cpu_upper_bound=Lens([190]))
    assert fake.extend_all_queries_by_N(meta, 1, None, None).seq_lens_cpu_upper_bound == (190,)
    assert guard.install(fake) and guard.install(fake) and guard.installed(fake)
    for fn in (fake.extend_all_queries_by_N, site.extend_all_queries_by_N):
        out = fn(meta, 1, arange=None, new_slot_mapping=None)
        assert out.seq_lens == [191] and out.seq_lens_cpu_upper_bound == (191,)
    guard.remove(fake)
    assert not guard.installed(fake)
    assert fake.extend_all_queries_by_N is vllms_extend is site.extend_all_queries_by_N


@pytest.mark.parametrize(
    ("version", "expected"),
    [("0.20.0", False), ("0.21.0", True), ("0.27.1", True), ("0.33.0", True)],
)
def test_gate(
    fake: types.ModuleType, monkeypatch: pytest.MonkeyPatch, version: str, expected: bool
) -> None:
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: version)
    assert guard.install(fake) is expected is guard.installed(fake)


def test_unsupported_release_leaves_vllm_alone(
    fake: types.ModuleType, monkeypatch: pytest.MonkeyPatch, log: Log
) -> None:
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: fakes.BEYOND_RELEASE)
    assert not guard.install(fake)
    assert fake.extend_all_queries_by_N is vllms_extend
    assert log() == [
        (
            logging.WARNING,
            f"tq-warmup: draft-pass sequence-length guard not installed: {fakes.OUTSIDE}",
        )
    ]


def test_spec_guard_setting_picks_the_verify_path_and_turns_all_off() -> None:
    from tq_warmup_plugin.guards import batched_verify

    assert guard in guards.every()
    assert {batched_verify, guard} <= set(guards.active(Settings()))
    assert spec_graphs not in guards.active(Settings())  # batched_verify installs the cap
    piecewise = set(guards.active(Settings(spec_piecewise=True)))
    assert {spec_graphs, guard} <= piecewise and batched_verify not in piecewise
    off = set(guards.active(Settings(spec_guard=False)))
    assert not {spec_graphs, batched_verify, guard} & off


@pytest.mark.parametrize("enabled", [True, False])
def test_a_call_site_imported_later_binds_the_guard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: types.ModuleType, enabled: bool
) -> None:
    package = tmp_path / "tqfake_spec_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "utils.py").write_text(
        "def extend_all_queries_by_N(cad, N, arange, new_slot_mapping):\n    return cad\n"
    )
    (package / "proposer.py").write_text("from .utils import extend_all_queries_by_N\n")
    monkeypatch.setattr(guard, "MODULE", "tqfake_spec_pkg.utils")
    monkeypatch.syspath_prepend(str(tmp_path))
    install.install(Settings(spec_guard=enabled))
    try:
        proposer = importlib.import_module("tqfake_spec_pkg.proposer")
        assert guard.installed(proposer) is enabled
    finally:
        install.uninstall()
        for name in ("tqfake_spec_pkg.proposer", "tqfake_spec_pkg.utils", "tqfake_spec_pkg"):
            sys.modules.pop(name, None)


# ------------------------------------------------------------------ the warning

F22, F33, F20 = compat.features((0, 22)), compat.features((0, 33)), compat.features((0, 20))
F34 = compat.features((0, 34))


@pytest.mark.parametrize(
    ("feats", "method", "async_", "v2", "guarded", "expected"),
    [
        (F22, None, True, False, True, None),
        (F22, "draft_model", False, False, True, None),  # the guard fixes it
        (F22, "ngram", False, False, True, None),
        (F22, "eagle", False, True, True, None),
        (F20, "eagle", True, False, True, None),  # 0.20 reads the GPU seq_lens
        (F20, "draft_model", False, True, False, None),
        (F22, "eagle", True, False, True, "optimistic"),
        (F33, "mtp", True, True, True, "optimistic"),
        (F33, "draft_model", False, True, True, "V2"),
        (F33, "draft_model", True, True, True, "V2+optimistic"),
        (F22, "draft_model", False, False, False, "unguarded"),
        (F34, "draft_model", False, True, True, None),  # its first pass takes the bound + 1
        (F34, "draft_model", True, True, True, "optimistic"),
        (F34, "eagle", True, True, True, "optimistic"),
    ],
)
def test_spec_decode_problem(
    feats: compat.Features,
    method: str | None,
    async_: bool,
    v2: bool,
    guarded: bool,
    expected: str | None,
) -> None:
    line = spec_problem.spec_decode_problem(feats, method, async_, v2, guarded)
    # With the batched verify path serving, async scheduling is no cause; the rest stay.
    batched = spec_problem.spec_decode_problem(feats, method, async_, v2, guarded, True)
    if expected not in (None, "optimistic"):
        assert batched is not None and "assumes every draft was accepted" not in batched
    else:
        assert batched is None
    if expected is None:
        assert line is None
        return
    assert line is not None and line.endswith("the plugin does not fix this")
    version = f"{feats.version[0]}.{feats.version[1]}"
    setup = " with async scheduling" if async_ else ""
    assert line.startswith(
        f"tq-warmup: speculative decoding {method!r}{setup} on the "
        f"{'V2' if v2 else 'V1'} runner with TurboQuant on vLLM {version}: "
    )
    assert ("assumes every draft was accepted" in line) is ("optimistic" in expected)
    assert ("(step=0)" in line) is ("V2" in expected)
    assert ("TQ_WARMUP_SPEC_GUARD=0" in line) is (expected == "unguarded")


def test_speculative_setup_reads_the_config() -> None:
    config = SimpleNamespace(
        speculative_config=SimpleNamespace(method="draft_model"),
        scheduler_config=SimpleNamespace(async_scheduling=True),
    )
    assert compat.speculative_setup(config) == ("draft_model", True)
    assert compat.speculative_setup(SimpleNamespace(speculative_config=None)) == (None, False)
    assert compat.speculative_setup(None) == (None, False)


@pytest.mark.parametrize("spec", [None, "eagle"])
def test_warmup_warns_once_on_turboquant_workers(
    monkeypatch: pytest.MonkeyPatch, log: Log, spec: str | None
) -> None:
    import fakes

    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "0.26.0")
    monkeypatch.setattr(compat, "workspace_manager", lambda feats: None)
    monkeypatch.setattr(warmup, "discover", lambda worker, feats: found)
    monkeypatch.setattr(keyplan, "compile_all", lambda pm, todo, threads, progress: [])
    monkeypatch.setattr(keyplan, "CompileCounter", fakes.StubCounter)  # no Triton here
    found = Discovery(geometries={"layers.0.attn": fakes.geometry()})
    worker = SimpleNamespace(
        use_v2_model_runner=False,
        vllm_config=SimpleNamespace(
            speculative_config=spec and SimpleNamespace(method=spec),
            scheduler_config=SimpleNamespace(async_scheduling=True),
        ),
    )
    report = warmup.run(worker, Settings(vllm_kernels=False, launch=False, strict=True))
    assert not report.errors
    warnings = [msg for level, msg in log() if level == logging.WARNING]
    assert warnings == (
        []
        if spec is None
        else [
            spec_problem.spec_decode_problem(
                compat.features((0, 26)), "eagle", True, False, guard.in_place()
            )
        ]
    )
    found.geometries.clear()  # no TurboQuant layers: no warning
    warmup.run(worker, Settings(vllm_kernels=False, launch=False))
    assert [msg for level, msg in log() if level == logging.WARNING] == warnings
    # The batched path serves the layers (their rows' verify length): no async cause.
    found.geometries["layers.0.attn"] = dataclasses.replace(fakes.geometry(), verify_len=3)
    warmup.run(worker, Settings(vllm_kernels=False, launch=False))
    assert [msg for level, msg in log() if level == logging.WARNING] == warnings


# ------------------------------------------------------------------ real vLLM

PROMPT = 190  # one fresh prompt: over the 128-token continuation threshold


@pytest.fixture
def real_utils(vllm_env: compat.Features) -> Iterator[types.ModuleType]:
    if not vllm_env.v1_runner:
        assert not vllm_env.draft_cpu_seq_lens_stale
        pytest.skip("0.34 removed the V1 drafters and extend_all_queries_by_N with them")
    from vllm.v1.spec_decode import utils

    assert not guard.installed(utils)
    yield utils
    guard.remove(utils)


def target_metadata(prompt: int, width: int) -> Any:
    """The target pass of one fresh prompt as the V1 runner builds it without async
    scheduling: ``_seq_lens_cpu`` and the bound are one tensor (gpu_model_runner.py
    0.22:2264-2286), on CPU tensors."""
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata

    seq_lens_cpu = torch.tensor([prompt], dtype=torch.int32)
    fields = {
        "query_start_loc": torch.tensor([0, prompt], dtype=torch.int32),
        "query_start_loc_cpu": torch.tensor([0, prompt], dtype=torch.int32),
        "seq_lens": seq_lens_cpu.clone(),
        "num_reqs": 1,
        "num_actual_tokens": prompt,
        "max_query_len": prompt,
        "max_seq_len": prompt,
        "block_table_tensor": torch.zeros(1, width, dtype=torch.int32),
        "slot_mapping": torch.full((prompt,), -1, dtype=torch.int64),
        "seq_lens_cpu_upper_bound": seq_lens_cpu,
        "_seq_lens_cpu": seq_lens_cpu,  # absent from 0.30
    }
    names = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    return CommonAttentionMetadata(**{k: v for k, v in fields.items() if k in names})


def draft_pass(utils: types.ModuleType, target: Any, n: int = 1) -> Any:
    """The draft_model first pass's call (llm_base_proposer.py 0.22:823-828)."""
    import torch

    slots = torch.full((target.num_actual_tokens + n,), -1, dtype=torch.int64)
    return utils.extend_all_queries_by_N(
        target, N=n, arange=torch.arange(8, dtype=torch.int32), new_slot_mapping=slots
    )


def cpu_lengths(meta: Any) -> list[list[int]]:
    return [
        getattr(meta, name).tolist()
        for name in guard.CPU_FIELDS
        if getattr(meta, name, None) is not None
    ]


@pytest.mark.real_vllm
def test_real_extend_leaves_cpu_lengths_stale_and_the_guard_fixes_them(
    real_utils: types.ModuleType, vllm_env: compat.Features
) -> None:
    target = target_metadata(PROMPT, 16)
    stale = draft_pass(real_utils, target)
    assert stale.seq_lens.tolist() == [PROMPT + 1] and stale.max_query_len == PROMPT + 1
    assert cpu_lengths(stale) and set(map(tuple, cpu_lengths(stale))) == {(PROMPT,)}  # the bug
    assert guard.install(real_utils) is vllm_env.draft_cpu_seq_lens_stale
    if not vllm_env.draft_cpu_seq_lens_stale:
        assert not guard.installed(real_utils)
        return
    fixed = draft_pass(real_utils, target)
    assert set(map(tuple, cpu_lengths(fixed))) == {(PROMPT + 1,)}
    assert cpu_lengths(target) == cpu_lengths(stale)  # vLLM's tensors untouched
    proposer = sys.modules.get("vllm.v1.spec_decode.llm_base_proposer")
    if proposer is None:
        proposer = importlib.import_module("vllm.v1.spec_decode.llm_base_proposer")
    assert proposer.extend_all_queries_by_N is real_utils.extend_all_queries_by_N
    guard.remove(real_utils)
    assert not guard.installed(real_utils) and not guard.installed(proposer)
    assert proposer.extend_all_queries_by_N is real_utils.extend_all_queries_by_N


def turboquant_forward(meta_in: Any, feats: compat.Features) -> None:
    """Build TurboQuant metadata with the real builder and run the real impl's forward
    on it, compiling and launching no Triton kernel."""
    import torch
    from realvllm import layer_kv_cache, make_impl, recorded_keys
    from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
    from vllm.v1.attention.backends.turboquant_attn import TurboQuantMetadataBuilder
    from vllm.v1.worker import workspace as ws

    # A served engine's workspace holds earlier requests' scratch (a zero-byte request
    # of a never-grown one fails on its own, before the bug shows).
    ws.reset_workspace_manager()
    ws.init_workspace_manager(torch.device("cpu"))
    ws.current_workspace_manager().get_simultaneous(((1, 2, 256, 128), torch.float16))
    builder = TurboQuantMetadataBuilder.__new__(TurboQuantMetadataBuilder)
    builder.reorder_batch_threshold = 1  # what __init__ sets (_init_reorder_batch_threshold(1))
    meta = builder.build(0, meta_in)
    impl = make_impl("turboquant_4bit_nc", 128, 8, 2, 32, 1024)
    kv = layer_kv_cache(feats, 16, 16, 2, impl.tq_config.slot_size_aligned)
    layer = torch.nn.Module()
    layer._tq_centroids = get_centroids(128, impl.tq_config.centroid_bits)
    n = meta_in.num_actual_tokens
    q, k, v = (torch.randn(n, h * 128, dtype=torch.bfloat16) for h in (8, 2, 2))
    with recorded_keys():
        impl.forward(layer, q, k, v, kv, meta, output=torch.zeros(n, 8 * 128, dtype=torch.bfloat16))


@pytest.mark.real_vllm
def test_real_turboquant_crashes_on_the_draft_pass_without_the_guard(
    real_utils: types.ModuleType, vllm_env: compat.Features
) -> None:
    if not vllm_env.draft_cpu_seq_lens_stale:
        pytest.skip("0.20 reads the GPU seq_lens")
    stale = draft_pass(real_utils, target_metadata(PROMPT, 16))
    with pytest.raises(
        RuntimeError,
        match=r"expanded size of the tensor \(189\) must match "
        r"the existing size \(0\)",
    ):
        turboquant_forward(stale, vllm_env)
    assert guard.install(real_utils)
    turboquant_forward(draft_pass(real_utils, target_metadata(PROMPT, 16)), vllm_env)
