"""Fixtures for the vLLM end-to-end tests (`make e2e`, their own virtualenv)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness
import tiny_model


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model.make(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="session")
def plain(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Plain vLLM (no connector) on the same prompt: the reference output."""
    return harness.generate(tmp_path_factory.mktemp("plain"), "plain", model)


@pytest.fixture(autouse=True)
def _stop_servers() -> Iterator[None]:
    yield
    while harness.LIVE:
        harness.LIVE.pop().stop()
