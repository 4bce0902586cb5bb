"""Contract: the prefix-cache guard's shared launch for short cache hits gives each row what
vLLM's own loop gives it, computed by vLLM's real Triton kernels.

A CPU cannot run the kernels, but Triton's interpreter (``TRITON_INTERPRET=1``) can: this
file runs itself in a fresh interpreter with it set (before Triton is imported). There
vLLM's real store kernel writes random K/V for a few requests into a real TurboQuant cache,
and vLLM's real ``_prefill_attention`` serves the hits alone (their maxima differ: its
per-request loop, one decode launch each) while ``prefix_hits.serve`` serves the same rows
in one launch. The rows must agree to float32 rounding (the query's rotation is one GEMM
over more rows); a row given the wrong sequence length or block-table row would differ by
the attention itself, which the check measures beside the difference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.real_vllm, pytest.mark.once_per_triton]

HITS = [(1, 20), (2, 33)]  # (new tokens, cached tokens): two hits, one launch
D, HQ, HK, BS, WIDTH = 64, 2, 1, 16, 5


def _run() -> dict[str, Any]:
    """In the interpreter: the loop's rows and the shared launch's, compared."""
    import torch
    from realvllm import _layer_and_buffers, activate_compile_only_driver, make_impl

    activate_compile_only_driver()  # vLLM's Triton check wants a driver; nothing compiles
    from realvllm import layer_kv_cache, metadata
    from vllm.v1.attention.backends import turboquant_attn as backend

    from tq_warmup_plugin import compat
    from tq_warmup_plugin.guards import prefix_hits

    feats = compat.release_features(compat.installed_vllm_version())
    impl = make_impl("turboquant_4bit_nc", D, HQ, HK, 32, WIDTH * BS)
    allocated = layer_kv_cache(feats, 64, BS, HK, impl.tq_config.slot_size_aligned)
    kv = compat.kv_view(allocated, feats)  # as forward hands it to the kernels
    layer, table, seq_buf, _ = _layer_and_buffers(impl, WIDTH)
    gen = torch.Generator().manual_seed(46460)
    for r in range(len(HITS)):
        table[r] = torch.arange(r * WIDTH, (r + 1) * WIDTH) + 3
    meta = metadata(HITS, 0, table, seq_buf)
    meta.slot_mapping = torch.tensor(
        [
            int(table[r, p // BS]) * BS + p % BS
            for r, (q, c) in enumerate(HITS)
            for p in range(q + c)
        ]
    )
    whole = sum(q + c for q, c in HITS)
    k, v = (torch.randn(whole, HK * D, generator=gen, dtype=torch.bfloat16) for _ in range(2))
    impl.do_kv_cache_update(
        layer, k, v, allocated, meta.slot_mapping
    )  # every position, cached or new
    n = sum(q for q, _ in HITS)
    query = torch.randn(n, HQ, D, generator=gen, dtype=torch.bfloat16)
    impl._ensure_on_device(layer, query.device)
    pi, centroids = layer._tq_Pi, layer._tq_centroids
    pit = getattr(layer, "_tq_PiT", None)
    meta = metadata(HITS, 0, table, seq_buf)
    loop = impl._prefill_attention(
        query, query[:, :HK], query[:, :HK], kv, meta, pi, centroids, pit, layer=layer
    )
    qsl = [0, *[sum(q for q, _ in HITS[: i + 1]) for i in range(len(HITS))]]
    hits, _ = prefix_hits.short_hits(qsl, [q + c for q, c in HITS], list(range(len(HITS))))
    (group,) = prefix_hits.groups(hits)
    shared = torch.zeros_like(loop)
    named = prefix_hits.prefill_args((pi, centroids, pit), {})
    prefix_hits.serve(
        backend.triton_turboquant_decode_attention,
        impl,
        (query, kv, meta.block_table),
        group,
        named,
        shared,
    )
    # The size a real error has: the same rows served with each row's length one short.
    short = [(q, c - 1) for q, c in HITS]
    wrong = impl._prefill_attention(
        query,
        query[:, :HK],
        query[:, :HK],
        kv,
        metadata(short, 0, table, seq_buf),
        pi,
        centroids,
        pit,
        layer=layer,
    )
    return {
        "rows": n,
        "max_diff": float((shared.float() - loop.float()).abs().max()),
        "scale": float(loop.float().abs().max()),
        "wrong_diff": float((wrong.float() - loop.float()).abs().max()),
    }


def test_the_shared_launch_gives_each_row_the_loops_result_with_the_real_kernels() -> None:
    import triton

    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 8):
        # 3.6's interpreter cannot run the kernel (a loop bound it loads); 3.7's can, but
        # the kernel is every release's (compat.KERNEL_MODULES): the newest Triton's is enough
        pytest.skip("runs with Triton 3.8+, the newest release's")
    here = Path(__file__).resolve()
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = os.pathsep.join([str(here.parents[1]), str(here.parents[2] / "src")])
    done = subprocess.run(
        [sys.executable, str(here)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["rows"] == 3 and got["scale"] > 0.05
    # the shared launch within float32 rounding of the loop; a wrong length far outside it
    assert got["max_diff"] <= 1e-2 * got["scale"] < got["wrong_diff"], got


if __name__ == "__main__":
    print(json.dumps(_run()))
