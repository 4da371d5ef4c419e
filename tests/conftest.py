"""Shared fixtures: generic helpers any test module may use."""

from __future__ import annotations

import importlib.util
import os
import random
import secrets

import pytest

# tests/e2e/ drives vLLM itself and runs in its own virtualenv (`make e2e`); where vLLM is
# not installed (the main virtualenv) it is not collected at all.
collect_ignore = [] if importlib.util.find_spec("vllm") else ["e2e"]


@pytest.fixture
def rand(request: pytest.FixtureRequest) -> random.Random:
    """A seeded `random.Random` whose seed is printed (rerun with KVCACHE_TEST_SEED=<seed>)."""
    env = os.environ.get("KVCACHE_TEST_SEED")
    seed = int(env) if env else secrets.randbits(32)
    print(f"\n{request.node.nodeid}: seed={seed} (KVCACHE_TEST_SEED={seed} to replay)")
    return random.Random(seed)
