"""Shared fixtures: generic helpers any test module may use."""

from __future__ import annotations

import os
import random
import secrets

import pytest


@pytest.fixture
def rand(request: pytest.FixtureRequest) -> random.Random:
    """A seeded `random.Random` whose seed is printed (rerun with KVCACHE_TEST_SEED=<seed>)."""
    env = os.environ.get("KVCACHE_TEST_SEED")
    seed = int(env) if env else secrets.randbits(32)
    print(f"\n{request.node.nodeid}: seed={seed} (KVCACHE_TEST_SEED={seed} to replay)")
    return random.Random(seed)
