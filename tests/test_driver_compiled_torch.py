"""The round trip through torch itself: a graph ``torch.compile`` built in the build's
engine process (``compiled.save``) is a cache hit in a worker that loaded the entry's
artifacts (``compiled.load``), and a compile there without them. On the CPU (inductor's
C++ backend; the GPU proof is ``serve-jit``'s driver-cache rows): the same torch code
path, the mega-cache, whatever the device."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_driver_cache import make_entry

from tq_warmup_plugin.driver import entry as dc
from tq_warmup_plugin.driver.build import _hashed

pytestmark = pytest.mark.real_vllm  # torch: the vLLM environments have it

# vLLM's own V1 rank count (``batched_count_greater_than``, 0.20-0.33: the graph the
# artifacts are for; inductor is its backend on the CPU platform too), else the same body.
GRAPH = """
import torch
from torch._dynamo.utils import counters
try:
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than as ranks
except ImportError:  # 0.34: no V1 sampler
    @torch.compile
    def ranks(x, v):
        return (x >= v).sum(-1)

x = torch.arange(64.0).reshape(4, 16)
with torch.inference_mode():  # as the sampler runs it
    ranks(x, x[:, :1])
"""


def python(code: str, cache: Path) -> dict[str, int]:
    """``code`` then ``GRAPH`` in a fresh interpreter over an empty inductor cache;
    inductor's counters."""
    done = subprocess.run(
        [sys.executable, "-c", code + GRAPH + "print(json.dumps(dict(counters['inductor'])))"],
        env={
            "TORCHINDUCTOR_CACHE_DIR": str(cache),
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": ":".join(sys.path),
        },
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    counts: dict[str, int] = json.loads(done.stdout.splitlines()[-1])
    return counts


@pytest.mark.once_per_triton
def test_an_entrys_artifacts_make_the_workers_compile_a_cache_hit(tmp_path: Path) -> None:
    out = tmp_path / "stage" / dc.COMPILED_DIR / dc.COMPILED_FILE
    built = python(
        "import atexit, json\nfrom pathlib import Path\n"
        "from tq_warmup_plugin.driver import compiled\n"
        f"atexit.register(lambda: compiled.save(Path({str(out)!r})))\n",
        tmp_path / "build-cache",
    )
    assert built.get("fxgraph_cache_miss") == 1 and out.stat().st_size > 0
    entry = make_entry(tmp_path / "layer", compiled=_hashed(out.parent))
    (entry / dc.COMPILED_DIR).mkdir()
    (entry / dc.COMPILED_DIR / dc.COMPILED_FILE).write_bytes(out.read_bytes())
    load = (
        "import json\nfrom pathlib import Path\n"
        "from tq_warmup_plugin.driver import compiled, entry\n"
        f"e = Path({str(entry)!r})\n"
        "line, ok = compiled.load(compiled.Chosen(e, entry.read(e)))\n"
        "assert ok, line\n"
    )
    loaded = python(load, tmp_path / "worker-cache")
    assert loaded.get("fxgraph_cache_hit") == 1 and "fxgraph_cache_miss" not in loaded
    # The check can fail: the same worker without the entry's artifacts compiles.
    assert python("import json\n", tmp_path / "cold-cache").get("fxgraph_cache_miss") == 1
