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


_STUBS = {
    "plugin": ("tq-warmup-plugin-stub", "tq_warmup = tq_warmup_plugin:register"),
    "weight_scale": (
        "tqbench-weight-scale-stub",
        "tqbench_weight_scale = benchmarks.tqbench.dummy_scale:register",
    ),
}
"""One distribution per entry point. ``importlib.metadata`` keeps only the first
distribution of a name on the path, so one shared name let a scaler-only stub hide
another stub's plugin entry point: every ``serve-jit`` row ran without the plugin
(H100, 0.34.0, 2026-12-07, ``benchmarks/results/serve-jit``)."""


def write_stub(root: Path, plugin: bool = True, weight_scale: bool = False) -> Path:
    """Dist-infos under ``root`` that declare the plugin's entry point (for a tree where
    the plugin is importable from ``src`` but not installed); put ``root`` on the path.
    ``weight_scale``: also the benchmark's dummy-weight scaler (``dummy_scale``), for
    engines in processes the benchmark does not run (``vllm serve``'s engine core).
    A distribution not asked for is removed, so a reused ``root`` declares what it says."""
    wanted = {"plugin": plugin, "weight_scale": weight_scale}
    for role, (name, line) in _STUBS.items():
        info = root / f"{name.replace('-', '_')}-0.dist-info"
        if not wanted[role]:
            for f in (info / "METADATA", info / "entry_points.txt"):
                f.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                info.rmdir()
            continue
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0\n")
        (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{line}\n")
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
