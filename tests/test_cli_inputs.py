"""The CLI's file inputs read as hostile files, and vLLM's own refusals in one whole
line (issue 20): ``inspect --model`` / ``--geometry-json`` / ``verify`` on a FIFO, a
device or deeply nested JSON end in one ``tq-warmup:`` line, within a time limit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
FLAGS = ["--kv-cache-dtype", "turboquant_4bit_nc"]


def cli(*argv: str, timeout: float = 120) -> tuple[int, str]:
    """``tq-warmup ...`` in a child process (a FIFO must not block it): exit code, stderr."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "tq_warmup_plugin.cli", *argv]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stderr


def _hostile(path: Path, kind: str) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    else:
        path.write_text("[" * 100_000 + "]" * 100_000)


@pytest.mark.parametrize(
    ("flag", "kind"),
    [
        ("--model", "nested"),
        ("--geometry-json", "fifo"),
        ("--geometry-json", "dev-zero"),
        ("--geometry-json", "nested"),
    ],
)
def test_a_hostile_json_input_is_one_line_and_exit_2(flag: str, kind: str, tmp_path: Path) -> None:
    """Before: a FIFO blocked forever, ``/dev/zero`` raised MemoryError, deep nesting
    RecursionError (a traceback). A huge file, and a FIFO or device as ``--model``'s
    config.json, were one line already (a JSON error; "no config.json"): the hypothesis
    test (``test_cli_property``) keeps generating them."""
    if flag == "--model":
        (tmp_path / "model").mkdir()
        path = tmp_path / "model" / "config.json"
    else:
        path = tmp_path / "report.json"
    _hostile(path, kind)
    rc, err = cli("inspect", flag, str(path), *FLAGS, timeout=60)
    assert rc == 2 and err.count("\n") == 1 and err.startswith("tq-warmup: "), err[-2000:]
    assert "Traceback" not in err


@pytest.mark.real_vllm
def test_vllms_cut_off_validation_error_is_printed_with_its_reason(tmp_path: Path) -> None:
    """vLLM 0.33.0 (huggingface_hub's strict config dataclasses): the message was cut
    after "Validation error for field 'num_attention_heads':", before its reason."""
    config = json.loads((DATA / "models" / "llama-3-8b" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_attention_heads": "abc"}))
    rc, err = cli("inspect", "--model", str(tmp_path), *FLAGS)
    assert rc == 2 and err.count("\n") == 1 and err.startswith("tq-warmup: "), err[-2000:]
    assert not err.rstrip().endswith(":"), err
    assert "num_attention_heads" in err and ("abc" in err or "int" in err), err


def test_a_hybrids_attention_kv_tensors_follow_vllms_grouping() -> None:
    """vLLM's uniform-page grouping, by hand (the contract test runs vLLM's own for every
    mix): groups of the smaller count, or the larger under 1.5 times it, dealt
    round-robin; layer i of every group shares tensor i."""
    from tq_warmup_plugin.plan.rules import attention_kv_tensors

    assert attention_kv_tensors(7, 18) == 7  # serve-jit's Qwen3-Next: 6 + its MTP layer
    assert attention_kv_tensors(6, 4) == 3  # groups of 4: 2 attention groups of 3
    assert attention_kv_tensors(13, 12) == 13  # a drafter's extra layer: groups of 13
    assert attention_kv_tensors(4, 28) == 4 and attention_kv_tensors(5, 0) == 5


def test_a_hybrids_zeroing_counts_only_the_drafters_it_knows() -> None:
    from tq_warmup_plugin import compat
    from tq_warmup_plugin.plan.model import ModelShape
    from tq_warmup_plugin.plan.request import kv_zeroing

    layers = tuple(range(3, 24, 4))
    shape = ModelShape("Qwen3NextForCausalLM", 256, 16, 2, 16, 2, 24, layers, True,
                       "bfloat16", None, 4096, None, state_layers=18, mtp_layers=1)  # fmt: skip
    for method, segments in ((None, 6), ("ngram", 6), ("mtp", 7), ("qwen3_next_mtp", 7)):
        assert kv_zeroing(shape, method, 1088, 135) == compat.KvZeroing(segments, 146880, 1088)
    assert kv_zeroing(shape, "eagle", 1088, 135) is None  # its head's layers: its config
    assert kv_zeroing(shape, "draft_model", 1088, 135) is None
    assert kv_zeroing(shape._replace(mtp_layers=0), "mtp", 1088, 135) is None
