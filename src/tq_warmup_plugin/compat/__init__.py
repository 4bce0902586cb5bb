"""Every difference between the supported vLLM releases (``SUPPORTED``) that the plugin depends on.

One package, split by concern; callers use ``compat.X`` for any of these names:

* ``releases``: the release table (``Features``, ``features()``) and versions;
* ``vllm_paths``: every vLLM module, class and function name the plugin touches;
* ``live``: accessors on live vLLM objects, each naming the releases it serves;
* ``triton``: the Triton facts a kernel's key or cache files depend on;
* ``vllm_kernels``: the launchers of vLLM's own kernels and their inputs;
* ``vllm_moe``: vLLM's fused MoE launcher and what it reads from a layer's experts.

A test patches a name where its caller reads it: code outside ``compat`` reads
``compat.X``, so ``monkeypatch.setattr(compat, "X", ...)`` reaches it; inside the
package ``live`` reads module names as ``vllm_paths.X`` at call time. Offline
planning from a model's config is ``plan``, the Ray variables ``multinode``, and
the speculative-decoding warning ``worker.spec_problem``.
"""

from __future__ import annotations

from . import live, releases, triton, vllm_kernels, vllm_moe, vllm_paths
from .live import *  # noqa: F403 (each module's __all__ is the list of its names)
from .releases import *  # noqa: F403
from .triton import *  # noqa: F403
from .vllm_kernels import *  # noqa: F403
from .vllm_moe import *  # noqa: F403
from .vllm_paths import *  # noqa: F403

__all__ = list(live.__all__)
__all__ += releases.__all__
__all__ += triton.__all__
__all__ += vllm_kernels.__all__
__all__ += vllm_moe.__all__
__all__ += vllm_paths.__all__
