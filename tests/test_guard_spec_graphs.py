"""The speculative-decoding guard: on stand-in classes, then on vLLM's real builder and
vLLM's real CUDA-graph mode resolution."""

from __future__ import annotations

import enum
import importlib
import json
import logging
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import fakes
import pytest
from conftest import Log

import tq_warmup_plugin
from tq_warmup_plugin import compat, install
from tq_warmup_plugin.guards import spec_graphs as guard
from tq_warmup_plugin.settings import Settings

SPEC = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=3))
PLAIN = SimpleNamespace(speculative_config=None)


class Support(enum.Enum):
    """Stand-in for vLLM's ``AttentionCGSupport`` (same names and values)."""

    ALWAYS = 3
    UNIFORM_BATCH = 2
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    NEVER = 0


@pytest.mark.parametrize(
    ("support", "speculative", "expected"),
    [
        (Support.UNIFORM_BATCH, True, Support.UNIFORM_SINGLE_TOKEN_DECODE),
        (Support.ALWAYS, True, Support.UNIFORM_SINGLE_TOKEN_DECODE),
        (Support.UNIFORM_SINGLE_TOKEN_DECODE, True, Support.UNIFORM_SINGLE_TOKEN_DECODE),
        (Support.NEVER, True, Support.NEVER),
        (Support.UNIFORM_BATCH, False, Support.UNIFORM_BATCH),
        (Support.ALWAYS, False, Support.ALWAYS),
    ],
)
def test_capped_support(support: Support, speculative: bool, expected: Support) -> None:
    cap = Support.UNIFORM_SINGLE_TOKEN_DECODE
    assert guard.capped_support(support, speculative, cap) is expected


def fake_backend() -> types.ModuleType:
    """A module shaped like ``turboquant_attn``: the builder inherits the base's
    classmethod and sets only the class variable, as in all releases."""

    class Base:
        _cudagraph_support: ClassVar[Support] = Support.NEVER

        @classmethod
        def get_cudagraph_support(cls, vllm_config: Any, kv_cache_spec: Any) -> Support:
            return cls._cudagraph_support

    class TurboQuantMetadataBuilder(Base):
        _cudagraph_support = Support.UNIFORM_BATCH

    module = types.ModuleType("fake_turboquant_attn")
    module.TurboQuantMetadataBuilder = TurboQuantMetadataBuilder  # type: ignore[attr-defined]
    return module


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    monkeypatch.setattr(
        compat, "single_token_decode_support", lambda: Support.UNIFORM_SINGLE_TOKEN_DECODE
    )
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "0.22.0")
    module = fake_backend()
    yield module
    guard.remove(module)


def test_guard_caps_only_under_speculative_decoding(fake: types.ModuleType, log: Log) -> None:
    builder = fake.TurboQuantMetadataBuilder
    assert builder.get_cudagraph_support(SPEC, None) is Support.UNIFORM_BATCH  # the bug
    assert guard.install(fake) and guard.installed(fake)
    assert builder.get_cudagraph_support(PLAIN, None) is Support.UNIFORM_BATCH
    assert builder.get_cudagraph_support(SPEC, None) is Support.UNIFORM_SINGLE_TOKEN_DECODE
    assert builder.get_cudagraph_support(SPEC, None) is Support.UNIFORM_SINGLE_TOKEN_DECODE
    lines = [msg for level, msg in log() if level == logging.INFO]
    assert len(lines) == 1  # one line per process, however often vLLM asks
    assert lines[0].startswith(
        "tq-warmup: speculative decoding with TurboQuant: verify batches run PIECEWISE"
    )
    assert "UNIFORM_SINGLE_TOKEN_DECODE instead of UNIFORM_BATCH" in lines[0]


def test_subclasses_are_capped_and_everything_comes_back(fake: types.ModuleType) -> None:
    builder = fake.TurboQuantMetadataBuilder
    guard.install(fake)
    guard.install(fake)  # idempotent

    class Inherits(builder):  # type: ignore[misc, valid-type]
        _cudagraph_support = Support.ALWAYS

    class Overrides(builder):  # type: ignore[misc, valid-type]
        @classmethod
        def get_cudagraph_support(cls, vllm_config: Any, kv_cache_spec: Any) -> Support:
            return Support.ALWAYS

    class Never(builder):  # type: ignore[misc, valid-type]
        _cudagraph_support = Support.NEVER

    for cls in (Inherits, Overrides):
        assert cls.get_cudagraph_support(SPEC, None) is Support.UNIFORM_SINGLE_TOKEN_DECODE
        assert cls.get_cudagraph_support(PLAIN, None) is Support.ALWAYS
    assert Never.get_cudagraph_support(SPEC, None) is Support.NEVER

    guard.remove(fake)
    assert not guard.installed(fake)
    assert "get_cudagraph_support" not in builder.__dict__
    assert "__init_subclass__" not in builder.__dict__
    assert builder.get_cudagraph_support(SPEC, None) is Support.UNIFORM_BATCH
    assert Overrides.get_cudagraph_support(SPEC, None) is Support.ALWAYS


def test_unsupported_release_leaves_the_builder_alone(
    fake: types.ModuleType, monkeypatch: pytest.MonkeyPatch, log: Log
) -> None:
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: fakes.BEYOND_RELEASE)
    assert not guard.install(fake)
    assert fake.TurboQuantMetadataBuilder.get_cudagraph_support(SPEC, None) is Support.UNIFORM_BATCH
    assert log() == [
        (
            logging.WARNING,
            f"tq-warmup: speculative-decoding guard not installed: {fakes.OUTSIDE}; {guard.RISK}",
        )
    ]
    assert "wrong tokens" in guard.RISK and "PIECEWISE" in guard.RISK


def test_a_release_before_the_oldest_gets_no_risk_line(
    fake: types.ModuleType, monkeypatch: pytest.MonkeyPatch, log: Log
) -> None:
    """TurboQuant came with 0.20: before it there is no TurboQuant to get wrong."""
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "0.19.1")
    assert not guard.install(fake)
    assert log() == [
        (
            logging.WARNING,
            "tq-warmup: speculative-decoding guard not installed: vLLM 0.19 is outside the "
            f"supported releases {compat.SUPPORTED}",
        )
    ]


@pytest.mark.parametrize("enabled", [True, False])
def test_import_hook_guards_the_backend_when_it_is_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: types.ModuleType, enabled: bool
) -> None:
    name = "tqfake_backend_pkg.turboquant_attn"
    source = (
        "class TurboQuantMetadataBuilder:\n"
        "    _cudagraph_support = 'UNIFORM_BATCH'\n"
        "    @classmethod\n"
        "    def get_cudagraph_support(cls, vllm_config, kv_cache_spec):\n"
        "        return cls._cudagraph_support\n"
    )
    monkeypatch.setattr(guard, "MODULE", name)
    with fakes.package_on_path(tmp_path, monkeypatch, name, source):
        install.install(Settings(spec_guard=enabled, spec_piecewise=True))
        try:
            module = importlib.import_module(name)
            assert guard.installed(module) is enabled
        finally:
            install.uninstall()
    assert not guard.installed(module)


# ------------------------------------------------------------------ real vLLM


@pytest.fixture
def real_backend(vllm_env: compat.Features) -> Iterator[Any]:
    from vllm.v1.attention.backends import turboquant_attn

    assert not guard.installed(turboquant_attn)
    yield turboquant_attn
    guard.remove(turboquant_attn)


def resolve(support: Any, query_len: int) -> str:
    """vLLM's own resolution of FULL_AND_PIECEWISE for a minimum support level."""
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CompilationMode

    config = CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE, cudagraph_mode="FULL_AND_PIECEWISE"
    )
    config.set_splitting_ops_for_v1(all2all_backend="naive")  # as VllmConfig does (all releases)
    mode = config.resolve_cudagraph_mode_and_sizes(
        min_cg_support=support,
        min_cg_attn_backend="TURBOQUANT",
        uniform_decode_query_len=query_len,
    )
    return str(mode.name)


@pytest.mark.real_vllm
@pytest.mark.parametrize("k", [1, 2, 4])
def test_real_builder_and_vllms_mode_resolution(real_backend: Any, k: int) -> None:
    from vllm.v1.attention.backend import AttentionCGSupport

    builder = real_backend.TurboQuantMetadataBuilder
    spec = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k))
    own = builder.get_cudagraph_support(spec, None)
    assert own is AttentionCGSupport.UNIFORM_BATCH
    assert resolve(own, 1 + k) == "FULL_AND_PIECEWISE"  # verify batches get FULL graphs

    assert guard.install(real_backend)
    guarded = builder.get_cudagraph_support(spec, None)
    assert guarded is AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    assert resolve(guarded, 1 + k) == "PIECEWISE"
    # Without speculative decoding: vLLM's own value, and its FULL decode graphs.
    assert builder.get_cudagraph_support(PLAIN, None) is own
    assert resolve(builder.get_cudagraph_support(PLAIN, None), 1) == "FULL_AND_PIECEWISE"


@pytest.mark.real_vllm
@pytest.mark.parametrize(
    ("env", "spec_guards", "batched", "plugin"),
    [
        ({}, True, True, True),
        ({"TQ_WARMUP_SPEC_GUARD": "piecewise"}, True, False, True),
        ({"TQ_WARMUP_SPEC_GUARD": "0"}, False, False, True),
        ({"TQ_WARMUP": "0"}, False, False, False),
    ],
)
def test_vllms_plugin_loader_installs_each_guard_where_its_gate_is_on(
    vllm_env: compat.Features,
    env: dict[str, str],
    spec_guards: bool,
    batched: bool,
    plugin: bool,
) -> None:
    """Through vLLM's own plugin loader, then vLLM importing each guarded module: the
    speculative-decoding guards follow TQ_WARMUP_SPEC_GUARD, the V1 cache-dtype, the
    chunked-local boundary and the prefix-cache fixes only the plugin switch (and their
    own variables), each only in the releases its gate names."""
    code = (
        "import importlib, json\n"
        "from vllm.plugins import load_general_plugins; load_general_plugins()\n"
        "from tq_warmup_plugin import guards\n"
        "from importlib.util import find_spec\n"
        "print(json.dumps({g.__name__.rsplit('.', 1)[1]: find_spec(g.MODULE) is not None "
        "and g.installed(importlib.import_module(g.MODULE)) for g in guards.every()}))\n"
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith("TQ_WARMUP")}
    src = str(Path(tq_warmup_plugin.__file__).parents[1])
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [src, base.get("PYTHONPATH")]))
    env = {**base, **env, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "batched_verify": batched and vllm_env.spec_verify_batched,
        # The cap: alone on request or where the rows are unproven, else for what they
        # do not serve.
        "spec_graphs": spec_guards and vllm_env.spec_graphs_unsafe,
        "v1_cache_dtype": plugin and vllm_env.v1_tq_cache_dtype_lost,
        "draft_seq_lens": spec_guards and vllm_env.draft_cpu_seq_lens_stale,
        "local_boundary": plugin and vllm_env.local_boundary_tq_backend,
        "prefix_fast_path": plugin and vllm_env.prefix_fast_path_unsafe,
    }
