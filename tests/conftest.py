"""Shared fixtures. Real-vLLM tests need ``CUDA_VISIBLE_DEVICES=""`` before vLLM is
imported (else vLLM replaces Triton with placeholders on a GPU-less host)."""

from __future__ import annotations

import importlib.util
import os

import pytest

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAVE_VLLM:
        return
    skip = pytest.mark.skip(reason="vLLM is not installed (see README: Testing)")
    for item in items:
        if "real_vllm" in item.keywords:
            item.add_marker(skip)
