"""The ``tq-warmup`` command's flags: their types, the geometry flags every planning
subcommand shares, the parser whose usage errors are one line, and the help format.

Parsing only: what a flag's value means is decided where it is used (``plan``,
``shipped.precompile``, ``cli.doctor``).
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from .. import compat, safe_io
from ..geometry import PRESETS
from ..plan.request import PlanRequest

__all__ = [
    "DEFAULT_GPU_NAME",
    "Help",
    "Parser",
    "arch",
    "command",
    "engine_args",
    "geometry_flags",
    "report_conflicts",
    "scale",
    "speculative_config",
    "whole",
]


DEFAULT_GPU_NAME = "NVIDIA H200"
"""``--gpu-name``'s default: the GPU this plugin's numbers were measured on (an H100 is
``NVIDIA H100 80GB HBM3``); vLLM ships tuned fused MoE configs per GPU name."""


def whole(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is less than {minimum}")
        return value

    return parse


def _json(text: str) -> object:
    """A JSON flag's value, parsed as a hostile file's (``safe_io.parse_json``): deep
    nesting or bytes that are not UTF-8 (an argument is any bytes) are a usage error,
    never a RecursionError or UnicodeEncodeError."""
    try:
        data = os.fsencode(text)  # the argument's own bytes
    except UnicodeEncodeError:  # a lone surrogate given in-process
        data = text.encode("utf-8", "surrogatepass")
    try:
        return safe_io.parse_json(data)
    except safe_io.UnsafeFile as exc:
        if str(exc).startswith("not valid JSON"):
            raise argparse.ArgumentTypeError(f"{text[:80]!r} is not JSON") from None
        raise argparse.ArgumentTypeError(f"not usable JSON: {exc}") from None


def speculative_config(text: str) -> dict[str, object]:
    """vLLM's ``--speculative-config`` JSON object, checked as vLLM's engine would need it
    for its kernels: a method and one or more draft tokens."""
    value = _json(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("it is not a JSON object")
    try:
        compat.speculative_fields(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


FIXED_ENGINE_ARGS = frozenset(
    {"model", "load_format", "skip_tokenizer_init", "kv_cache_dtype", "speculative_config",
     "gpu_memory_utilization", "seed", "dtype", "max_model_len", "max_num_seqs",
     "max_num_batched_tokens", "trust_remote_code"}
)  # fmt: skip
"""``LLM(...)`` keywords ``driver-cache`` sets itself or from its own flags."""


def engine_args(text: str) -> dict[str, object]:
    """More ``LLM(...)`` keywords for ``driver-cache``'s engine, a JSON object by
    ``EngineArgs`` field names, for the fleet's flags that change what its engine loads or
    compiles (a hybrid's ``{"gdn_prefill_backend": "triton"}``). One the build sets itself
    (``FIXED_ENGINE_ARGS``) is refused: its own flag says it."""
    value = _json(text)
    if not isinstance(value, dict) or not all(k.isidentifier() for k in value):
        raise argparse.ArgumentTypeError("it is not a JSON object of EngineArgs field names")
    fixed = sorted(FIXED_ENGINE_ARGS & set(value))
    if fixed:
        raise argparse.ArgumentTypeError(f"{', '.join(fixed)}: set by driver-cache or its flags")
    return value


def scale(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive finite number")
    return value


def arch(text: str) -> int:
    """``90``, ``sm90``, ``sm_90`` or ``9.0`` (a compute capability) -> 90."""
    bare = text.strip().removeprefix("sm_").removeprefix("sm")
    major, dot, minor = bare.partition(".")
    value = whole(0)(major + minor if dot and major.isdigit() and minor.isdigit() else bare)
    if value not in compat.SM_TARGETS:
        targets = ", ".join(map(str, compat.SM_TARGETS))
        raise argparse.ArgumentTypeError(
            f"sm{value} is not a target Triton compiles for ({targets})"
        )
    return value


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (exit code 2), like every other refusal."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"tq-warmup: {message} (see {self.prog} --help)\n")


# Flags a --geometry-json report already answers: given beside it, they would be ignored.
FROM_REPORT = ("--model", "--trust-remote-code", "--kv-cache-dtype", "--head-size",
                "--num-heads", "--num-kv-heads", "--tensor-parallel-size", "-tp",
                "--block-size", "--max-num-seqs", "--max-model-len", "--max-num-batched-tokens",
                "--kv-splits", "--attention-chunk-size", "--dtype", "--scale", "--runner",
                "--enable-dbo", "--vllm-version", "--enable-prefix-caching",
                "--no-enable-prefix-caching", "--mamba-cache-mode")  # fmt: skip


def report_conflicts(argv: Sequence[str]) -> list[str]:
    """The flags of ``argv`` that a ``--geometry-json`` beside them would ignore."""
    given = {token.split("=", 1)[0] for token in argv if token.startswith("-")}
    return [flag for flag in FROM_REPORT if flag in given] if "--geometry-json" in given else []


class Help(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written, and a flag's default after its help where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def command(sub: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand's parser: its help as its description too, defaults shown."""
    kwargs.setdefault("description", kwargs.get("help"))
    parser: argparse.ArgumentParser = sub.add_parser(name, formatter_class=Help, **kwargs)
    return parser


# (flag, least value, default, help) of the whole-number geometry flags.
_WHOLE_FLAGS: tuple[tuple[str, int, str], ...] = (
    ("--head-size", 1, "attention head size (default: model's)"),
    ("--num-heads", 1, "query heads (whole model)"),
    ("--num-kv-heads", 1, "KV heads (whole model)"),
    ("--tensor-parallel-size", 1, "vLLM's --tensor-parallel-size (-tp): heads per rank"),
    ("--block-size", 1, "vLLM's --block-size; the effective TurboQuant block is derived"),
    ("--max-num-seqs", 1, "vLLM's --max-num-seqs"),
    ("--max-model-len", 1, "vLLM's --max-model-len (default: model's)"),
    ("--max-num-batched-tokens", 1, "vLLM's --max-num-batched-tokens (the chunk budget)"),
    ("--kv-splits", 1, "attention_config.tq_max_kv_splits_for_cuda_graph"),
)
"""Flag, least value, help; the default is ``planning.PlanRequest``'s."""


def _plan_default(flag: str) -> object:
    return getattr(PlanRequest(), flag.lstrip("-").replace("-", "_"))


def geometry_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        help="directory of a model's config.json (read by vLLM's ModelConfig), or the file",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the model's own config code (models transformers does not know)",
    )
    p.add_argument(
        "--geometry-json",
        help="plan from the geometries in a plugin JSON report "
        "(TQ_WARMUP_REPORT) of a real startup instead of the flags below",
    )
    p.add_argument(
        "--kv-cache-dtype", choices=sorted(PRESETS), help="vLLM's --kv-cache-dtype (a preset)"
    )
    for flag, least, text in _WHOLE_FLAGS:
        names = (flag, "-tp") if flag == "--tensor-parallel-size" else (flag,)
        p.add_argument(*names, type=whole(least), default=_plan_default(flag), help=text)
    p.add_argument(
        "--attention-chunk-size",
        type=whole(0),
        help="chunked local attention (Llama 4): also plan layers over its virtual-batch "
        "table (default: the model's attention_chunk_size; 0: none)",
    )
    p.add_argument(
        "--dtype", choices=["bfloat16", "float16"], help="model dtype (default: model's)"
    )
    p.add_argument("--scale", type=scale, help="attention scale if not the model's own")
    p.add_argument(
        "--arch",
        type=arch,
        default=_plan_default("--arch"),
        help="target SM: 90, sm90 or 9.0 for H100/H200",
    )
    p.add_argument("--runner", choices=["v1", "v2"], help="model runner (default: release's)")
    p.add_argument(
        "--enable-dbo",
        action="store_true",
        help="vLLM's --enable-dbo (or --ubatch-size over 1): microbatches' unaligned views",
    )
    p.add_argument("--vllm-version", help="release to plan for (default: installed)")
    p.add_argument(
        "--speculative-config",
        type=speculative_config,
        help="vLLM's --speculative-config JSON: also plan vLLM's own kernels it reaches "
        "(the rejection sampler, top-k/top-p); they are planned only with a vocabulary",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=_plan_default("--enable-prefix-caching"),
        help="vLLM's --enable-prefix-caching: a hybrid model's block may follow its Mamba "
        "chunk (vLLM's default for hybrids: off)",
    )
    p.add_argument(
        "--mamba-cache-mode",
        choices=["none", "align", "all"],
        default=_plan_default("--mamba-cache-mode"),
        help="vLLM's --mamba-cache-mode (with prefix caching, none lets vLLM choose)",
    )
    p.add_argument(
        "--vocab-size",
        type=whole(1),
        help="the logits' width vLLM's sampler kernels are keyed by (default: model's)",
    )
    p.add_argument("--max-logprobs", type=whole(0), default=20, help="vLLM's --max-logprobs")
    p.add_argument(
        "--gpu-name",
        default=DEFAULT_GPU_NAME,
        help="the GPU as vLLM names it (torch.cuda.get_device_name()), whose tuned fused MoE "
        f"configs a MoE model's keys follow (default: {DEFAULT_GPU_NAME})",
    )
