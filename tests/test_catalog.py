"""`RamEpochs` (store/catalog.py), the memory backend's epoch source, on its own."""

from __future__ import annotations

import threading

import pytest

from epistemic_kvcache.errors import QuotaExceededError
from epistemic_kvcache.store.seams import RamEpochs


def test_bumps_count_per_tenant_and_scope() -> None:
    ep = RamEpochs(threading.Lock(), {}, max_scopes_per_tenant=10)
    assert ep.current("t", "s") == 0
    assert [ep.bump("t", "s") for _ in range(3)] == [1, 2, 3]
    assert ep.current("u", "s") == 0
    assert ep.current("t", "other") == 0


def test_a_tenant_at_its_limit_loses_only_scopes_nothing_is_tagged_with() -> None:
    tags: dict[tuple[str, str], tuple[str, int]] = {("t", "k"): ("used", 0)}
    ep = RamEpochs(threading.Lock(), tags, max_scopes_per_tenant=2)
    ep.bump("t", "used")
    ep.bump("t", "idle")
    ep.bump("u", "other")  # another tenant's scopes are not counted nor pruned
    assert ep.bump("t", "new") == 1
    assert ep.current("t", "used") == 1
    assert ep.current("t", "idle") == 0
    assert ep.current("u", "other") == 1
    tags[("t", "k2")] = ("new", 1)
    with pytest.raises(QuotaExceededError):
        ep.bump("t", "third")  # both scopes hold live entries
    assert ep.bump("t", "used") == 2  # bumping an existing scope is never refused
