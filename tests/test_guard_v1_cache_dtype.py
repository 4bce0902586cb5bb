"""The V1 cache-dtype guard (upstream #50709): on stand-in classes, then on vLLM's real
backend, spec and V1 runner source."""

from __future__ import annotations

import ast
import importlib.util
import logging
import types
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import fakes
import pytest
from conftest import Log

from tq_warmup_plugin import compat, guards
from tq_warmup_plugin.guards import v1_cache_dtype as guard
from tq_warmup_plugin.settings import Settings

PRESETS = {"turboquant_k8v4": 196, "turboquant_4bit_nc": 132}  # stand-in slot sizes


@pytest.mark.parametrize(
    ("given", "presets", "expected"),
    [
        ("auto", {"turboquant_4bit_nc"}, "turboquant_4bit_nc"),
        ("bfloat16", {"turboquant_k8v4"}, "turboquant_k8v4"),
        ("turboquant_k8v4", {"turboquant_4bit_nc"}, None),  # a TurboQuant dtype stays
        ("auto", set(), None),  # no layer seen: vLLM's own error
        ("auto", {"turboquant_k8v4", "turboquant_4bit_nc"}, None),  # ambiguous
    ],
)
def test_substitute(given: str, presets: set[str], expected: str | None) -> None:
    assert guard.substitute(given, presets) == expected


def fake_backend() -> types.ModuleType:
    """A module shaped like ``turboquant_attn`` in 0.25-0.26: a staticmethod shape
    function whose dtype defaults to a preset and raises for anything else, and an impl
    whose ``__init__`` validates its ``kv_cache_dtype``."""

    def check(dtype: str) -> int:
        if dtype not in PRESETS:
            raise ValueError(f"Unknown TurboQuant cache dtype: {dtype!r}")
        return PRESETS[dtype]

    class TurboQuantAttentionBackend:
        @staticmethod
        def get_kv_cache_shape(
            num_blocks: int,
            block_size: int,
            num_kv_heads: int,
            head_size: int,
            cache_dtype_str: str = "turboquant_4bit_nc",
        ) -> tuple[int, ...]:
            return (num_blocks, num_kv_heads, block_size, check(cache_dtype_str))

    class TurboQuantAttentionImpl:
        def __init__(self, num_heads: int, head_size: int, kv_cache_dtype: str = "auto") -> None:
            self.kv_cache_dtype = kv_cache_dtype
            self.slot = check(kv_cache_dtype)

    module = types.ModuleType("fake_turboquant_attn")
    module.TurboQuantAttentionBackend = TurboQuantAttentionBackend  # type: ignore[attr-defined]
    module.TurboQuantAttentionImpl = TurboQuantAttentionImpl  # type: ignore[attr-defined]
    return module


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "0.26.0")
    module = fake_backend()
    yield module
    guard.remove(module)


def shape(module: types.ModuleType, *args: Any, **kwargs: Any) -> tuple[int, ...]:
    result: tuple[int, ...] = module.TurboQuantAttentionBackend.get_kv_cache_shape(
        10, 16, 2, 128, *args, **kwargs
    )
    return result


def test_guard_substitutes_the_preset_the_layers_use(fake: types.ModuleType, log: Log) -> None:
    with pytest.raises(ValueError, match="Unknown TurboQuant cache dtype: 'auto'"):
        shape(fake, cache_dtype_str="auto")  # the bug
    assert guard.install(fake) and guard.installed(fake)
    fake.TurboQuantAttentionImpl(8, 128, kv_cache_dtype="turboquant_k8v4")
    fake.TurboQuantAttentionImpl(8, 128, kv_cache_dtype="turboquant_k8v4")
    assert shape(fake, cache_dtype_str="auto") == (10, 2, 16, 196)
    assert shape(fake, "auto") == (10, 2, 16, 196)  # positional, too
    assert shape(fake, cache_dtype_str="turboquant_4bit_nc") == (10, 2, 16, 132)  # unchanged
    assert shape(fake) == (10, 2, 16, 132)  # omitted: vLLM's own default
    assert log() == [
        (
            logging.INFO,
            "tq-warmup: vLLM 0.26 V1 runner passed cache dtype 'auto' "
            "for TurboQuant layers (upstream #50709); using turboquant_k8v4",
        )
    ]


@pytest.mark.parametrize("built", [[], ["turboquant_k8v4", "turboquant_4bit_nc"]])
def test_no_single_preset_leaves_vllms_error(
    fake: types.ModuleType, log: Log, built: list[str]
) -> None:
    guard.install(fake)
    for dtype in built:
        fake.TurboQuantAttentionImpl(8, 128, kv_cache_dtype=dtype)
    with pytest.raises(ValueError, match="Unknown TurboQuant cache dtype: 'auto'"):
        shape(fake, cache_dtype_str="auto")
    with pytest.raises(ValueError, match="Unknown TurboQuant cache dtype: 'auto'"):
        shape(fake, cache_dtype_str="auto")
    why = (
        (
            "this process built TurboQuant layers with 2 presets "
            "(turboquant_4bit_nc, turboquant_k8v4)"
        )
        if built
        else "no TurboQuant layer was built"
    )
    assert log() == [
        (
            logging.WARNING,
            "tq-warmup: cannot replace cache dtype 'auto' for "
            f"TurboQuant layers (upstream #50709): {why}; vLLM's own error follows",
        )
    ]


def test_failed_impl_records_nothing(fake: types.ModuleType) -> None:
    guard.install(fake)
    with pytest.raises(ValueError):
        fake.TurboQuantAttentionImpl(8, 128, kv_cache_dtype="turboquant_bogus")
    fake.TurboQuantAttentionImpl(8, 128, kv_cache_dtype="turboquant_4bit_nc")
    assert shape(fake, cache_dtype_str="auto") == (10, 2, 16, 132)


def test_remove_restores_vllms_own_attributes(fake: types.ModuleType) -> None:
    backend, impl = fake.TurboQuantAttentionBackend, fake.TurboQuantAttentionImpl
    own_shape, own_init = backend.__dict__["get_kv_cache_shape"], impl.__dict__["__init__"]
    assert guard.install(fake) and guard.install(fake)  # idempotent
    assert isinstance(backend.__dict__["get_kv_cache_shape"], staticmethod)
    assert backend().get_kv_cache_shape(1, 16, 2, 128, "turboquant_k8v4") == (1, 2, 16, 196)
    impl(8, 128, kv_cache_dtype="turboquant_k8v4")
    guard.remove(fake)
    guard.remove(fake)  # idempotent
    assert not guard.installed(fake)
    assert backend.__dict__["get_kv_cache_shape"] is own_shape
    assert impl.__dict__["__init__"] is own_init
    with pytest.raises(ValueError, match="'auto'"):
        shape(fake, cache_dtype_str="auto")
    assert not guard._presets


@pytest.mark.parametrize("version", ["0.22.0", "0.24.0", "0.27.1", "0.33.0"])
def test_releases_without_the_bug_are_left_alone(
    fake: types.ModuleType, monkeypatch: pytest.MonkeyPatch, log: Log, version: str
) -> None:
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: version)
    own = fake.TurboQuantAttentionBackend.__dict__["get_kv_cache_shape"]
    assert not guard.install(fake) and not guard.installed(fake)
    assert fake.TurboQuantAttentionBackend.__dict__["get_kv_cache_shape"] is own
    assert log() == []


def test_unsupported_release_warns_once(
    fake: types.ModuleType, monkeypatch: pytest.MonkeyPatch, log: Log
) -> None:
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: fakes.BEYOND_RELEASE)
    assert not guard.install(fake)
    assert log() == [
        (
            logging.WARNING,
            "tq-warmup: V1 cache-dtype guard not installed: " + fakes.OUTSIDE,
        )
    ]


@pytest.mark.parametrize("spec_guard", [True, False])
def test_always_active_when_the_plugin_is_on(spec_guard: bool) -> None:
    assert guard in guards.every()
    assert guard in guards.active(Settings(spec_guard=spec_guard))


# ------------------------------------------------------------------ real vLLM


@pytest.fixture
def real_backend(vllm_env: compat.Features, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from vllm.v1.attention.backends import turboquant_attn

    assert not guard.installed(turboquant_attn)
    monkeypatch.setattr(guard, "_presets", set())
    yield turboquant_attn
    guard.remove(turboquant_attn)


def runner_cache_dtype(spec: Any, config_dtype: str) -> Any:
    """The V1 runner's own ``layer_cache_dtype_str`` for ``spec``: the expression read
    from the installed ``gpu_model_runner.py`` (0.25-0.26) and evaluated as written;
    also checks that it is what the runner hands ``get_kv_cache_shape``."""
    from vllm.v1.kv_cache_interface import KVQuantMode

    origin = importlib.util.find_spec("vllm.v1.worker.gpu_model_runner").origin  # type: ignore[union-attr]
    tree = ast.parse(Path(str(origin)).read_text(encoding="utf-8"))
    [value] = [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and [ast.unparse(t) for t in node.targets] == ["layer_cache_dtype_str"]
    ]
    passed = [
        ast.unparse(kw.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(".get_kv_cache_shape")
        for kw in node.keywords
        if kw.arg == "cache_dtype_str"
    ]
    assert "layer_cache_dtype_str" in passed
    runner = SimpleNamespace(cache_config=SimpleNamespace(cache_dtype=config_dtype))
    code = compile(ast.Expression(value), str(origin), "eval")
    return eval(code, {"KVQuantMode": KVQuantMode}, {"kv_cache_spec": spec, "self": runner})


@pytest.mark.real_vllm
def test_real_gate_decides_installation(real_backend: Any, vllm_env: compat.Features) -> None:
    assert guard.install(real_backend) is vllm_env.v1_tq_cache_dtype_lost
    assert guard.installed(real_backend) is vllm_env.v1_tq_cache_dtype_lost


@pytest.mark.real_vllm
@pytest.mark.parametrize(
    "preset", ["turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"]
)
def test_real_v1_runner_bug_and_fix(
    real_backend: Any, vllm_env: compat.Features, log: Log, preset: str
) -> None:
    if not vllm_env.v1_tq_cache_dtype_lost:
        pytest.skip("the V1 runner passes a TurboQuant dtype in this release")
    import torch
    from realvllm import make_impl
    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
    from vllm.v1.kv_cache_interface import KVQuantMode, TQFullAttentionSpec

    d, hk = 128, 2
    # As attention.py builds it (0.25:672-679, 0.26:677-684): no kv_quant_mode.
    slot = TurboQuantConfig.from_cache_dtype(preset, d).slot_size_aligned
    spec = TQFullAttentionSpec(
        block_size=16,
        num_kv_heads=hk,
        head_size=d,
        head_size_v=d,
        dtype=torch.uint8,
        tq_slot_size=slot,
    )
    assert spec.kv_quant_mode == KVQuantMode.NONE
    given = runner_cache_dtype(spec, preset)
    assert given == "auto"
    backend = real_backend.TurboQuantAttentionBackend
    own, own_init = (
        backend.__dict__["get_kv_cache_shape"],
        real_backend.TurboQuantAttentionImpl.__init__,
    )
    expected = backend.get_kv_cache_shape(64, 16, hk, d, cache_dtype_str=preset)
    assert expected[-1] == slot
    with pytest.raises(ValueError, match="Unknown TurboQuant cache dtype: 'auto'"):
        backend.get_kv_cache_shape(64, 16, hk, d, cache_dtype_str=given)  # the bug

    assert guard.install(real_backend)
    make_impl(preset, d, 8, hk, 32, 4096)  # the worker builds the model first
    assert backend.get_kv_cache_shape(64, 16, hk, d, cache_dtype_str=given) == expected
    major, minor = vllm_env.version
    assert log() == [
        (
            logging.INFO,
            f"tq-warmup: vLLM {major}.{minor} V1 runner passed cache "
            f"dtype 'auto' for TurboQuant layers (upstream #50709); using {preset}",
        )
    ]

    guard.remove(real_backend)
    assert backend.__dict__["get_kv_cache_shape"] is own
    assert real_backend.TurboQuantAttentionImpl.__init__ is own_init
    with pytest.raises(ValueError, match="Unknown TurboQuant cache dtype: 'auto'"):
        backend.get_kv_cache_shape(64, 16, hk, d, cache_dtype_str=given)
