"""Where vLLM keeps its fused MoE launcher and what it reads from a layer's experts (all
releases): the experts of a live runner or of a model's config, the GPU name its tuned
configs are looked up by, and one step of each size through ``TritonExperts.apply``, for
``compile_only_launches`` to turn into ``fused_moe_kernel`` keys.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from ..patching import swapped
from . import vllm_paths as paths
from .vllm_kernels import CompatError

__all__ = [
    "MoeExperts",
    "device_name",
    "moe_config_function",
    "moe_experts",
    "moe_experts_of_config",
    "moe_runs_triton_experts",
    "moe_steps",
    "named_gpu",
]


@dataclasses.dataclass(frozen=True)
class MoeExperts:
    """What vLLM's fused MoE launcher reads from one layer's experts: its weights'
    shapes and dtype, the global expert count and the experts per token."""

    w13: tuple[int, ...]
    w2: tuple[int, ...]
    experts: int
    top_k: int
    dtype: str


def moe_experts(runner: Any) -> list[MoeExperts]:
    """Each module of the runner's model (``get_model()``: without its CUDA graph
    wrapper, all releases) that holds MoE expert weights: ``w13_weight`` and
    ``w2_weight`` beside a ``moe_config`` (``FusedMoEConfig``: ``num_experts``,
    ``experts_per_token``). Where that module is differs: ``FusedMoE`` itself up to
    0.25, its ``RoutedExperts`` from 0.26 (``fused_moe/layer.py``)."""
    found = []
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    for module in model.modules():
        w13 = getattr(module, "w13_weight", None)
        w2 = getattr(module, "w2_weight", None)
        moe = getattr(module, "moe_config", None)
        if w13 is None or w2 is None or moe is None:
            continue
        found.append(
            MoeExperts(
                w13=tuple(w13.shape),
                w2=tuple(w2.shape),
                experts=int(moe.num_experts),
                top_k=int(moe.experts_per_token),
                dtype=str(w13.dtype).removeprefix("torch."),
            )
        )
    return found


def moe_runs_triton_experts(runner: Any) -> bool:
    """Whether every module of the runner's model that holds MoE experts runs them through
    vLLM's own ``TritonExperts``, the class :func:`moe_steps` drives: its
    ``quant_method.moe_kernel.fused_experts`` (``FusedMoEKernel``, 0.22-0.34), which
    ``make_unquantized_moe_kernel`` picks for bf16 experts on Hopper. Another backend
    (FlashInfer's, a quantized method) launches other kernels, which only a forward reaches."""
    triton = importlib.import_module(paths.TRITON_EXPERTS_MODULE).TritonExperts
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    kinds = set()
    for module in model.modules():
        if (
            getattr(module, "w13_weight", None) is None
            or getattr(module, "moe_config", None) is None
        ):
            continue
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        kinds.add(type(getattr(kernel, "fused_experts", None)))
    return kinds == {triton}


def moe_config_function() -> Any:
    """vLLM's ``try_get_optimal_moe_config(w1_shape, w2_shape, top_k, dtype, M)``: the
    Triton config a step of ``M`` tokens launches ``fused_moe_kernel`` with (a tuned JSON
    of this GPU, else vLLM's defaults; inside :func:`named_gpu`, of that GPU). This module
    and signature in 0.22, 0.26, 0.30 and 0.33, the releases its contract test runs."""
    return importlib.import_module(paths.FUSED_MOE_MODULE).try_get_optimal_moe_config


GATED_ACTIVATIONS = frozenset({"silu", "swiglu"})
"""``hidden_act`` of experts whose ``w13_weight`` stacks the gate and the up projection
(``2 x intermediate`` rows): Mixtral, Qwen2/3-MoE, Qwen3-Next, DeepSeek."""


def moe_experts_of_config(
    model_config: Any, tensor_parallel: int = 1, expert_parallel: bool = False
) -> tuple[MoeExperts, ...]:
    """The experts a worker of this ``ModelConfig`` will hold (:func:`moe_experts` reads
    them from the built model), read from the config before any model exists: for an
    offline plan and the compile-ahead child. The expert count is vLLM's own lookup of
    the config's names (``get_num_experts``, 0.22+), the experts per token its own
    where it has one (``get_num_experts_per_tok``, 0.30+) and ``num_experts_per_tok``
    before; the width ``moe_intermediate_size`` (Qwen, DeepSeek) or
    ``intermediate_size`` (Mixtral), split over the tensor-parallel ranks as
    ``FusedMoE`` splits it. Empty for a dense model; CompatError (one line) where the
    experts are not derived here: quantized, expert parallel, not gated, or a field
    missing. A wrong guess costs the worker compiles, never a wrong result."""
    experts = int(model_config.get_num_experts() or 0)
    if experts <= 0:
        return ()
    text = model_config.hf_text_config
    quantized = getattr(model_config, "quantization", None)
    if quantized:
        raise CompatError(f"{quantized} experts: their configs are not derived offline")
    if expert_parallel:
        raise CompatError("expert parallel: a rank's share of the experts is not derived")
    per_token = getattr(model_config, "get_num_experts_per_tok", None)
    top_k = int(per_token() if callable(per_token) else getattr(text, "num_experts_per_tok", 0))
    width = getattr(text, "moe_intermediate_size", None) or getattr(text, "intermediate_size", 0)
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    act = str(getattr(text, "hidden_act", "silu"))
    if not (top_k and width and hidden) or int(width) % tensor_parallel:
        raise CompatError(
            f"the config's experts (top-k {top_k}, width {width}, hidden {hidden}, "
            f"tensor parallel {tensor_parallel}) are not a shape derived here"
        )
    if act not in GATED_ACTIVATIONS:
        raise CompatError(f"experts of activation {act}: their weights are not derived here")
    rank = int(width) // tensor_parallel
    dtype = str(model_config.dtype).removeprefix("torch.")
    return (
        MoeExperts((experts, 2 * rank, hidden), (experts, hidden, rank), experts, top_k, dtype),
    )


def device_name() -> str:
    """The GPU's name as vLLM's fused MoE config lookup reads it
    (``current_platform.get_device_name()``, all releases)."""
    platform = importlib.import_module(paths.PLATFORMS_MODULE).current_platform
    return str(platform.get_device_name())


@contextlib.contextmanager
def named_gpu(gpu_name: str) -> Iterator[None]:
    """vLLM's MoE config lookup reads ``gpu_name``'s tuned JSONs inside, as an offline plan
    must (``current_platform.get_device_name()``, which a host without the GPU cannot
    answer); enter it once around many lookups, not per lookup. Its caches of the
    name and of the configs read (``get_device_name_as_file_name``, 0.26+;
    ``get_moe_configs``, all releases: ``functools`` caches not keyed by the GPU) are
    emptied on the way in and out, so no other name's answer is reused, nor this one's
    left behind."""
    platform = importlib.import_module(paths.PLATFORMS_MODULE).current_platform
    clear = []
    cached_by = (
        (paths.FUSED_MOE_MODULE, "get_moe_configs"),
        (paths.PLATFORM_UTILS_MODULE, "get_device_name_as_file_name"),
    )
    for module, name in cached_by:
        try:
            cached = getattr(importlib.import_module(module), name, None)
        except ImportError:  # before 0.26
            continue
        if cached is not None and hasattr(cached, "cache_clear"):
            clear.append(cached.cache_clear)
    for each in clear:
        each()
    try:
        with swapped(platform, {"get_device_name": lambda *a, **k: gpu_name}):
            yield
    finally:
        for each in clear:
            each()


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


_MOE_STEPS = threading.Lock()
"""Held by :func:`moe_steps`: its patch of vLLM's ops module is one at a time, so two
warmer threads never save each other's stand-in as the original."""


def moe_steps(layer: MoeExperts, sizes: Iterable[int], gpu_name: str) -> None:
    """One step of each size through vLLM's own ``TritonExperts.apply`` (the experts a
    bf16 MoE layer runs on Hopper: its config lookup for ``gpu_name``, workspaces,
    expert assignment and both ``fused_moe_kernel`` GEMMs) on meta tensors, for
    ``compile_only_launches`` to turn into keys, with or without a GPU. The CUDA ops that
    only fill buffers no key reads are skipped: ``moe_align_block_size``, ``moe_sum``, the
    activation. It patches vLLM's ops module while it runs (under a lock), so a worker
    calls it only where no forward runs: inside ``kernel_warmup``, whose model forwards
    (``Job.real``) finish before the compile-only jobs start. The same classes and
    arguments in 0.22 (whose config names the width ``intermediate_size_per_partition``),
    0.26, 0.30, 0.33 and 0.34."""
    import torch

    moe = importlib.import_module(paths.FUSED_MOE_CONFIG_MODULE)
    silu = importlib.import_module(paths.MOE_ACTIVATION_MODULE).MoEActivation.SILU
    experts_class = importlib.import_module(paths.TRITON_EXPERTS_MODULE).TritonExperts
    e, top_k, hidden, width = layer.experts, layer.top_k, layer.w13[2], layer.w2[2]
    dtype = getattr(torch, layer.dtype)
    required = {f.name for f in dataclasses.fields(moe.FusedMoEConfig)
                if f.default is dataclasses.MISSING}  # fmt: skip
    named = "intermediate_size" if "intermediate_size" in required else (
        "intermediate_size_per_partition")  # 0.22  # fmt: skip
    config = moe.FusedMoEConfig(
        num_experts=e, experts_per_token=top_k, hidden_dim=hidden, num_local_experts=e,
        num_logical_experts=e, activation=silu, device="meta",
        routing_method=moe.RoutingMethodType.Renormalize, in_dtype=dtype,
        moe_parallel_config=moe.FusedMoEParallelConfig.make_no_parallel(), **{named: width},
    )  # fmt: skip
    experts = experts_class(config, moe.FUSED_MOE_UNQUANTIZED_CONFIG)
    experts.activation = _no_op

    def meta(*shape: int, of: Any = dtype) -> Any:
        return torch.empty(*shape, dtype=of, device="meta")

    weights = (meta(*layer.w13), meta(*layer.w2))
    ops = importlib.import_module(paths.CUSTOM_OPS_MODULE)
    skipped = {"moe_align_block_size": _no_op, "moe_sum": _no_op}
    with _MOE_STEPS, swapped(ops, skipped), named_gpu(gpu_name):
        for n in sizes:
            ws13, ws2, out = experts.workspace_shapes(n, 2 * width, hidden, top_k, e, e, None, silu)
            experts.apply(
                meta(*out), meta(n, hidden), *weights, meta(n, top_k, of=torch.float32),
                meta(n, top_k, of=torch.int32), silu, e, None, None, None, meta(*ws13),
                meta(*ws2), None, False,
            )  # fmt: skip
