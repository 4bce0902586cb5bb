"""Whether vLLM can load the plugin in the benchmark's children, and a stub when not.

vLLM loads general plugins through their ``vllm.general_plugins`` entry point only, so
a checkout on ``PYTHONPATH`` (the GPU machine gets the working tree, not an install)
runs every "plugin on" configuration without the plugin, silently. Seen on the H200
(0.26.0, 2026-12-01): a matrix whose plugin-on runs compiled TurboQuant kernels after
startup and had no plugin report; again on 2026-12-02, a ``tokens --case oracle``
whose engines had no plugin line (``require`` now refuses both).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

__all__ = ["found", "require", "stub_path", "write_stub"]


def found() -> bool:
    """Whether vLLM can discover the plugin (``vllm.general_plugins`` / ``tq_warmup``)."""
    from importlib.metadata import entry_points

    with contextlib.suppress(Exception):
        return any(ep.name == "tq_warmup" for ep in entry_points(group="vllm.general_plugins"))
    return False


def write_stub(root: Path, plugin: bool = True, weight_scale: bool = False) -> Path:
    """A dist-info under ``root`` that declares the plugin's entry point (for a tree where
    the plugin is importable from ``src`` but not installed); put ``root`` on the path.
    ``weight_scale``: also the benchmark's dummy-weight scaler (``dummy_scale``), for
    engines in processes the benchmark does not run (``vllm serve``'s engine core)."""
    info = root / "tq_warmup_plugin_stub-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: tq-warmup-plugin-stub\nVersion: 0\n"
    )
    lines = ["[vllm.general_plugins]"]
    if plugin:
        lines.append("tq_warmup = tq_warmup_plugin:register")
    if weight_scale:
        lines.append("tqbench_weight_scale = benchmarks.tqbench.dummy_scale:register")
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return root


def require(command: str, stub: bool) -> None:
    """Refuse, in one line, to run plugin-on children that vLLM would start without the
    plugin: neither installed nor given a stub (``--entry-point-stub``)."""
    if not stub and not found():
        raise SystemExit(
            f"{command}: the plugin's entry point is not installed, so vLLM would run every "
            "'plugin on' configuration without it: pip install --no-deps . or pass "
            "--entry-point-stub"
        )


def stub_path(root: Path, wanted: bool) -> list[str]:
    """The children's extra path entry: a stub under ``root`` when ``wanted``
    (``--entry-point-stub``) and vLLM cannot find the installed entry point, else none."""
    return [str(write_stub(root))] if wanted and not found() else []
