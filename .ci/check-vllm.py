"""Smoke check of a CI venv: the vLLM TurboQuant modules import on CPU and Triton
compiles one real vLLM kernel for sm90 (a compile-only driver: nothing launches).
The driver is the package's own (``tq_warmup_plugin.shipped.precompile``, installed in the venv
before this runs), so the check also covers the one ``tq-warmup precompile`` uses.
Run: CUDA_VISIBLE_DEVICES= TRITON_CACHE_DIR=$(mktemp -d) VENV/bin/python .ci/check-vllm.py
"""
import os

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before any vllm import, else HAS_TRITON=False
import importlib
import math
import time

import torch
import triton
from triton.runtime.jit import JITFunction

from tq_warmup_plugin.shipped.precompile import use_compile_only_target

MODULES = [
    "vllm.v1.attention.backends.turboquant_attn",
    "vllm.v1.attention.ops.triton_turboquant_decode",
    "vllm.v1.attention.ops.triton_turboquant_store",
    "vllm.model_executor.layers.quantization.turboquant.config",
    "vllm.model_executor.warmup.kernel_warmup",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.workspace",
    "vllm.plugins",
]
t0 = time.perf_counter()
mods = {m: importlib.import_module(m) for m in MODULES}
import vllm  # noqa: E402

print(f"vllm {vllm.__version__} triton {triton.__version__} torch {torch.__version__}: "
      f"{len(MODULES)} modules imported in {time.perf_counter() - t0:.1f} s")
dec = mods["vllm.v1.attention.ops.triton_turboquant_decode"]
assert isinstance(dec._tq_decode_stage1, JITFunction), type(dec._tq_decode_stage1)


use_compile_only_target(90)
_orig_run = JITFunction.run
compiled = []


def _run(self, *a, grid, warmup, **kw):  # kernel[grid](...) -> compile only
    k = _orig_run(self, *a, grid=grid, warmup=True, **kw)
    compiled.append((self.fn.__name__, k))
    return k


JITFunction.run = _run

from vllm.model_executor.layers.quantization.turboquant.config import (  # noqa: E402
    TurboQuantConfig,
)

store = mods["vllm.v1.attention.ops.triton_turboquant_store"].triton_turboquant_store
decode = dec.triton_turboquant_decode_attention
tq = TurboQuantConfig.from_cache_dtype("turboquant_4bit_nc", 128)
D, Hq, Hk, BS, NB, N, B = 128, 16, 8, 16, 4, 4, 2
kv = torch.zeros(NB, BS, Hk, tq.slot_size_aligned, dtype=torch.uint8).permute(0, 2, 1, 3).transpose(1, 2)
nc = 2 ** tq.centroid_bits
Pi = torch.eye(D)
centroids = torch.linspace(-1, 1, nc)
midpoints = (centroids[1:] + centroids[:-1]) / 2
k = torch.zeros(N, Hk, D, dtype=torch.bfloat16)
t1 = time.perf_counter()
store(k, k.clone(), kv, torch.full((N,), -1, dtype=torch.int64), Pi.T.contiguous(), midpoints,
      tq.key_mse_bits, tq.key_packed_size, tq.effective_value_quant_bits, key_fp8=tq.key_fp8)
decode(torch.zeros(B, Hq, D, dtype=torch.bfloat16), kv, torch.zeros(B, 256, dtype=torch.int32),
       torch.full((B,), 16, dtype=torch.int32), Pi, centroids, 1 / math.sqrt(D),
       tq.key_mse_bits, tq.key_packed_size, tq.effective_value_quant_bits,
       key_fp8=tq.key_fp8, norm_correction=tq.norm_correction, max_num_kv_splits=32)
for name, ck in compiled:
    assert ck.metadata.target.arch == 90 and ck.asm.get("cubin"), name
    print(f"compiled {name} for sm{ck.metadata.target.arch} hash {ck.hash[:12]}")
assert len(compiled) >= 3, [n for n, _ in compiled]
print(f"OK: {len(compiled)} kernels compiled in {time.perf_counter() - t1:.1f} s")
