"""vLLM -> LMCache v1 (in-process `LMCacheConnectorV1`) -> our server, end to end.

Each path runs the shipped deploy/lmcache/ YAML (only the server's address changed and
LMCache's local RAM tier shrunk for this machine) through every scenario of
tests/e2e/scenarios.py: two fresh processes with a server restart between them, a
corrupted load, our server down, a second tenant.

The copy between vLLM's CPU KV cache and LMCache's buffers is the test-only
tests/e2e/cpu_connector.py (LMCache has no CPU connector; see its docstring).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from scenarios import PATHS, run_path

# Each vLLM process takes 20-90 s to import and build its `LLM()` on a shared 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


@pytest.mark.parametrize("path", ["path-a", "redis-url", "resp-url"])
def test_v1_path(tmp_path: Path, model: Path, plain: dict[str, list[int]], path: str) -> None:
    run_path(tmp_path, PATHS[path], model, plain)
