"""Fixtures for the vLLM end-to-end tests (`make e2e`, their own virtualenv)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness
import tiny_model


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model.make(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="session")
def hybrid_model(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model.make_hybrid(tmp_path_factory.mktemp("hybrid-model"), model)


@pytest.fixture(scope="session")
def plain(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    """Plain vLLM (no connector) on each prompt: the reference outputs."""
    vllm = harness.Vllm(tmp_path_factory.mktemp("plain"), "plain", model)
    try:
        vllm.start()
        out = {}
        for name in tiny_model.PROMPTS:
            out[name] = vllm.generate(name, "plain" if name == "x" else None)["output_token_ids"]
        vllm.close()
    finally:
        vllm.stop()
    return out


@pytest.fixture(autouse=True)
def _stop_processes() -> Iterator[None]:
    yield
    while harness.LIVE:
        harness.LIVE.pop().stop()
