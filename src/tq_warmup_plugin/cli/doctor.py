"""``tq-warmup doctor``: will this machine's vLLM processes warm, and if not, what to do.

Pure (``diagnose``) over facts read at the edge (``facts``): the installed versions, the
settings, vLLM's plugin filter, whether vLLM can find the entry point, and the GPUs the
driver lists (``/proc/driver/nvidia``, ``/dev/kfd`` for ROCm; no CUDA context, no torch
import). The plugin warms only where every check passes: a supported vLLM, the entry
point visible and not filtered out, the plugin on, and a GPU, since without one vLLM
starts no CUDA worker and the plugin says so in one WARNING. ``doctor`` exits 1 there,
so a script can gate on it, and names the next step: for a host without a GPU, the CPU
recipe CI uses (vLLM with ``--no-deps`` beside a CPU torch, enough for ``inspect``,
``precompile`` and the tests); for a GPU host, vLLM from its own index, in a fresh
virtual environment (the plugin never installs or changes vLLM or torch).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import compat
from ..settings import Settings

__all__ = ["CPU_RECIPE", "Diagnosis", "Facts", "diagnose", "facts", "install_step"]

CPU_RECIPE = ".ci/vllm-env.sh"
"""The checkout's script that builds a CPU virtual environment with vLLM (``--no-deps``),
a CPU torch and the release's Triton, as CI does."""


@dataclass(frozen=True)
class Facts:
    """What ``doctor`` reads of this machine and environment."""

    vllm: str | None
    torch: str | None
    triton: str | None
    settings: Settings
    problems: tuple[str, ...]
    vllm_plugins: str | None
    entry_point: bool
    gpus: tuple[str, ...]
    checkout: str | None = None
    """The repository root when the package runs from a checkout (the CPU recipe is there)."""


@dataclass(frozen=True)
class Diagnosis:
    """The rows ``doctor`` prints, whether the plugin will warm, and the next steps."""

    rows: list[tuple[str, str]]
    will_warm: bool
    not_warming: list[str] = field(default_factory=list)
    next_steps: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        data["rows"] = dict(self.rows)
        return data


def install_step(found: str | None, gpu: bool, checkout: str | None) -> str:
    """How to get a supported vLLM here: on a GPU host vLLM's own wheel (with its CUDA
    torch) in a fresh virtual environment; on a CPU host the recipe CI uses."""
    head = f"install vLLM {compat.SUPPORTED} ({f'found {found}' if found else 'none found'})"
    if gpu:
        return f"{head}: pip install vllm=={compat.RECOMMENDED} in a fresh virtual environment"
    where = f"from {checkout}" if checkout else "from a checkout of tq-warmup-plugin"
    venv = ".venv-vllm"
    return (
        f"{head}; on this CPU host (inspect, precompile, the tests), {where}: "
        f"bash {CPU_RECIPE} {compat.RECOMMENDED} {compat.RECOMMENDED_TRITON} {venv} && "
        f"{venv}/bin/pip install --no-deps -e . (vLLM with --no-deps beside a CPU torch, as "
        "CI does; a plain pip install vllm pulls a CUDA torch)"
    )


def _shown(value: object) -> str:
    """A setting as a person reads it: on/off, unset, or the value."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return "unset" if value is None else str(value)


def diagnose(f: Facts) -> Diagnosis:
    """The diagnosis of these facts (pure)."""
    problem = compat.support_problem(compat.parse_version(f.vllm))
    filtered = f.vllm_plugins is not None and "tq_warmup" not in f.vllm_plugins.split(",")
    rows = [
        ("vllm", f.vllm or "not installed"),
        ("torch", f.torch or "not installed"),
        ("triton", f.triton or "not installed"),
        ("supported", "yes" if problem is None else f"no: {problem}"),
        ("settings", ", ".join(f"{k}={_shown(v)}" for k, v in f.settings._asdict().items())),
        ("entry point", "visible" if f.entry_point else "missing (reinstall the package)"),
        ("VLLM_PLUGINS", f.vllm_plugins if f.vllm_plugins is not None else "unset (all load)"),
        ("GPU", ", ".join(dict.fromkeys(f.gpus)) or "none found"),
    ]
    if compat.beyond_newest(compat.parse_version(f.vllm)):  # what the guards' WARNINGs say
        from ..guards import prefix_fast_path, spec_graphs

        rows.append(("unguarded", f"{prefix_fast_path.RISK}; {spec_graphs.RISK}"))
    checks = [
        (problem is not None, problem or "", install_step(f.vllm, bool(f.gpus), f.checkout)),
        (
            not f.entry_point,
            "vLLM cannot find the entry point",
            "reinstall tq-warmup-plugin (vLLM finds plugins by entry point)",
        ),
        (
            filtered,
            "VLLM_PLUGINS leaves tq_warmup out",
            "add tq_warmup to VLLM_PLUGINS, or unset it",
        ),
        (
            not f.settings.enabled,
            "TQ_WARMUP turns the plugin off",
            "unset TQ_WARMUP (it turns the plugin off)",
        ),
        (
            not f.gpus,
            "no GPU: vLLM starts no CUDA worker to warm",
            "serve on a GPU host: the plugin warms vLLM's GPU workers",
        ),
    ]
    not_warming = [why for failed, why, _ in checks if failed]
    steps = [step for failed, _, step in checks if failed]
    rows.append(("will warm", "yes" if not not_warming else f"no: {'; '.join(not_warming)}"))
    rows += [("next step" if i == 0 else "then", step) for i, step in enumerate(steps)]
    return Diagnosis(rows, not not_warming, not_warming, steps)


def _gpus(proc: str = "/proc", dev: str = "/dev") -> tuple[str, ...]:
    from ..driver.host import read_node  # /proc/driver/nvidia only: no CUDA context

    found = read_node(proc).gpus
    if not found and os.path.exists(os.path.join(dev, "kfd")):
        return ("an AMD GPU (/dev/kfd)",)
    return found


def _checkout() -> str | None:
    root = Path(__file__).resolve().parents[2]
    return str(root) if (root / CPU_RECIPE).is_file() else None


def facts(entry_point: bool, settings: Settings, problems: list[str]) -> Facts:
    """This machine's facts (the edge: environment, package metadata, ``/proc``)."""
    return Facts(
        vllm=compat.installed_vllm_version(),
        torch=compat.distribution_version("torch"),
        triton=compat.distribution_version("triton"),
        settings=settings,
        problems=tuple(problems),
        vllm_plugins=os.environ.get("VLLM_PLUGINS"),
        entry_point=entry_point,
        gpus=_gpus(),
        checkout=_checkout(),
    )
