"""``.ci/quiet-resolver.awk``: pip's complaints about vLLM's own requirements (unmet on purpose,
``--no-deps``) are left out and counted; every other line, another conflict included, stays."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

AWK = Path(__file__).resolve().parents[1] / ".ci" / "quiet-resolver.awk"
HEADER = (
    "ERROR: pip's dependency resolver does not currently take into account all the packages "
    "that are installed. This behaviour is the source of the following dependency conflicts."
)


def _filter(text: str) -> list[str]:
    if shutil.which("awk") is None:
        pytest.skip("no awk")
    out = subprocess.run(
        ["awk", "-f", str(AWK)], input=text, capture_output=True, text=True, check=True
    )
    return out.stdout.splitlines()


def test_vllms_own_requirements_are_left_out_and_counted() -> None:
    log = "\n".join(
        [
            "Installing collected packages: torch, triton",
            HEADER,
            "vllm 0.26.0 requires blake3, which is not installed.",
            "vllm 0.26.0 requires torch==2.11.0, but you have torch 2.13.0+cpu "
            "which is incompatible.",
            "Successfully installed torch-2.13.0+cpu triton-3.6.0",
            "ERROR: Could not find a version that satisfies the requirement nope",
        ]
    )
    assert _filter(log + "\n") == [
        "Installing collected packages: torch, triton",
        "Successfully installed torch-2.13.0+cpu triton-3.6.0",
        "ERROR: Could not find a version that satisfies the requirement nope",
        "vllm-env: left out 2 lines of pip's resolver listing vLLM's own requirements "
        "(unmet on purpose: vLLM is installed with --no-deps)",
    ]


def test_a_conflict_of_another_package_still_shows_under_its_header() -> None:
    other = "xgrammar 0.2.8 requires torch>=2.12, but you have torch 2.11.0 which is incompatible."
    log = [HEADER, "vllm 0.33.0 requires ninja, which is not installed.", other, "done"]
    got = _filter("\n".join(log) + "\n")
    assert got[:3] == [HEADER, other, "done"] and got[3].startswith("vllm-env: left out 1 line")


def test_output_without_the_block_passes_unchanged() -> None:
    log = "vllm-env: built /tmp/x (vllm 0.26.0, triton 3.6.0) in 75 s\nvllm 0.26.0 requires x\n"
    assert _filter(log) == log.splitlines()
