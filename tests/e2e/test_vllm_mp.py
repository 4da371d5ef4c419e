"""vLLM -> LMCache (MP mode, `lmcache server`) -> our server, end to end.

Both MP L2 adapters (our native plugin, LMCache's RESP adapter) go through every scenario
of tests/e2e/scenarios.py: two fresh processes (each with its own fresh `lmcache server`,
so an L1 hit is impossible and every hit comes from our server) with a server restart
between them, a corrupted load, our server down, a second tenant.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from scenarios import PATHS, run_path

# Each vLLM process takes 20-90 s to import and build its `LLM()` on a shared 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


@pytest.mark.parametrize("path", ["native", "resp"])
def test_mp_path(tmp_path: Path, model: Path, plain: dict[str, list[int]], path: str) -> None:
    run_path(tmp_path, PATHS[path], model, plain)
