"""``tq-warmup driver-cache`` without an engine, against the installed vLLM's own code:
the FA2 stand-in calls TurboQuant's ``flash_attn_varlen_func`` exactly as
``TurboQuantAttentionImpl._flash_attn_varlen`` does (FA2 forced), the paged calls bind to
the backend's function, and the FA2 library is where ``register()`` looks for it."""

from __future__ import annotations

import ast
import importlib
import inspect
from typing import Any

import pytest

from tq_warmup_plugin import compat
from tq_warmup_plugin.driver import host
from tq_warmup_plugin.worker import launches
from tq_warmup_plugin.worker.launches import Launch

pytestmark = pytest.mark.real_vllm


def fa_parameters() -> tuple[set[str], set[str]]:
    """The parameters of vLLM's ``flash_attn_varlen_func`` (``vllm_flash_attn/
    flash_attn_interface.py``, what CUDA binds both backends' name to), and the required
    ones, read from its source: on a CPU the package refuses to import."""
    found = host.fa2_library()
    assert found is not None
    tree = ast.parse((found.parent / "flash_attn_interface.py").read_text())
    (fn,) = [
        n
        for n in tree.body
        if isinstance(n, ast.FunctionDef) and n.name == "flash_attn_varlen_func"
    ]
    names = [a.arg for a in fn.args.args]
    required = set(names[: len(names) - len(fn.args.defaults)])
    return set(names) | {a.arg for a in fn.args.kwonlyargs}, required


def recorder(module: str, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Put a ``flash_attn_varlen_func`` into ``module`` (on CUDA vLLM imports it there)
    that checks each call's keywords against the real function's and records them."""
    names, required = fa_parameters()
    calls: list[dict[str, Any]] = []

    def fake(**kwargs: Any) -> None:
        assert set(kwargs) <= names and required <= set(kwargs), sorted(kwargs)
        calls.append(kwargs)

    monkeypatch.setattr(
        importlib.import_module(module), "flash_attn_varlen_func", fake, raising=False
    )
    return calls


def test_the_stand_in_calls_turboquants_function_as_its_impl_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch = pytest.importorskip("torch")
    calls = recorder(compat.BACKEND_MODULE, monkeypatch)
    monkeypatch.setattr(compat, "flash_attn_available", lambda: True)
    impl = compat.fa2_stand_in(0.125)
    backend = importlib.import_module(compat.BACKEND_MODULE)
    source = inspect.getsource(backend.TurboQuantAttentionImpl._flash_attn_varlen)
    assert "fa_version=self.fa_version" in source and "causal=True" in source
    todo = {Launch("attention", "bfloat16", 4, 8, 2, 1, 64): "x"}
    done, _, errors = launches.launch_all(todo, {"x": impl}, torch.device("cpu"))
    assert (done, errors) == (1, [])
    (call,) = calls
    assert (call["fa_version"], call["causal"], call["softmax_scale"]) == (2, True, 0.125)
    assert (call["max_seqlen_q"], call["max_seqlen_k"], tuple(call["k"].shape)) == (
        4,
        8,
        (8, 1, 64),
    )


def test_the_paged_prefill_and_decode_bind_to_the_backends_function(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch = pytest.importorskip("torch")
    calls = recorder(compat.FLASH_ATTN_MODULE, monkeypatch)
    impl = compat.fa2_stand_in(0.125)
    todo = {
        Launch("paged_decode", "bfloat16", 1, 40, 2, 1, 64): "x",
        Launch("paged_prefill", "bfloat16", 40, 40, 2, 1, 64): "x",
    }
    done, _, errors = launches.launch_all(todo, {"x": impl}, torch.device("cpu"))
    assert (done, errors) == (2, [])
    assert [(c["max_seqlen_q"], c["max_seqlen_k"], c["fa_version"]) for c in calls] == [
        (1, 40, 2),
        (40, 40, 2),
    ]
    assert all(c["block_table"].shape == (1, 3) and c["causal"] for c in calls)


def test_the_fa2_library_is_found_without_importing_vllm() -> None:
    found = host.fa2_library()
    assert found is not None and found.name == "_vllm_fa2_C.abi3.so"
    assert found.parent.name == "vllm_flash_attn" and found.stat().st_size > 1 << 20
