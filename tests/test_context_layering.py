"""KVCacheLayeringPolicy: store/skip decisions, priority classes, reasons, counters."""

from __future__ import annotations

import pytest

from epistemic_kvcache.context import (
    KVCacheLayeringPolicy,
    LayeringRequest,
    PriorityClass,
)

BG = PriorityClass.BACKGROUND_INGESTION
STD = PriorityClass.STANDARD
INT = PriorityClass.INTERACTIVE


def test_background_ingestion_never_stores() -> None:
    p = KVCacheLayeringPolicy()
    for _ in range(5):
        d = p.decide(LayeringRequest(100_000, BG, shared_prefix_key="b", expected_reuse=99))
        assert not d.store
        assert d.reason == "background_ingestion"
        assert d.extra_body() == {"kv_transfer_params": {"lmcache.skip_save": True}}


def test_short_prompts_skip_and_interactive_halves_the_length_threshold() -> None:
    p = KVCacheLayeringPolicy(min_prompt_tokens=256, min_expected_reuse=2)
    d = p.decide(LayeringRequest(200, STD, expected_reuse=10))
    assert (d.store, d.reason, d.min_prompt_tokens) == (False, "prompt_too_short", 256)
    d = p.decide(LayeringRequest(200, INT, expected_reuse=10))
    assert (d.store, d.reason, d.min_prompt_tokens) == (True, "reuse_hint", 128)
    d = p.decide(LayeringRequest(127, INT, expected_reuse=10))
    assert d.reason == "prompt_too_short"


def test_shared_bundle_prefix_is_stored_from_its_second_sighting() -> None:
    p = KVCacheLayeringPolicy(min_prompt_tokens=100, min_expected_reuse=2)
    first = p.decide(LayeringRequest(500, STD, shared_prefix_key="ctxbundle:1"))
    assert (first.store, first.reason, first.expected_reuse) == (False, "low_expected_reuse", 1)
    assert first.kv_transfer_params == {"lmcache.skip_save": True}
    second = p.decide(LayeringRequest(500, STD, shared_prefix_key="ctxbundle:1"))
    assert (second.store, second.reason, second.expected_reuse) == (
        True,
        "shared_bundle_prefix",
        2,
    )
    assert second.kv_transfer_params == {"lmcache.skip_save": False}
    other = p.decide(LayeringRequest(500, STD, shared_prefix_key="ctxbundle:2"))
    assert not other.store


def test_interactive_halves_the_reuse_threshold() -> None:
    p = KVCacheLayeringPolicy(min_prompt_tokens=100, min_expected_reuse=2)
    d = p.decide(LayeringRequest(500, INT, shared_prefix_key="ctxbundle:new"))
    assert (d.store, d.reason, d.min_expected_reuse) == (True, "shared_bundle_prefix", 1)


def test_recurring_system_prompt_counts_as_reuse() -> None:
    p = KVCacheLayeringPolicy(min_prompt_tokens=10, min_expected_reuse=3)
    prompt = "You are a helpful assistant." * 10
    assert not p.decide(LayeringRequest(50, STD, system_prompt=prompt)).store
    assert not p.decide(LayeringRequest(50, STD, system_prompt=prompt)).store
    d = p.decide(LayeringRequest(50, STD, system_prompt=prompt))
    assert (d.store, d.reason) == (True, "recurring_system_prompt")
    assert not p.decide(LayeringRequest(50, STD, system_prompt=prompt + "!")).store


def test_long_prompts_store_without_reuse_evidence() -> None:
    p = KVCacheLayeringPolicy(long_prompt_tokens=8192)
    assert p.decide(LayeringRequest(8192, STD)).reason == "long_prompt"
    assert p.decide(LayeringRequest(8191, STD)).reason == "low_expected_reuse"
    assert p.decide(LayeringRequest(4096, INT)).reason == "long_prompt"


def test_reuse_window_is_bounded() -> None:
    p = KVCacheLayeringPolicy(min_prompt_tokens=1, min_expected_reuse=2, window_size=2)
    p.decide(LayeringRequest(10, STD, shared_prefix_key="a"))
    p.decide(LayeringRequest(10, STD, shared_prefix_key="b"))
    p.decide(LayeringRequest(10, STD, shared_prefix_key="c"))  # evicts "a"
    assert not p.decide(LayeringRequest(10, STD, shared_prefix_key="a")).store
    assert p.decide(LayeringRequest(10, STD, shared_prefix_key="c")).store


def test_counters_by_class_and_reason() -> None:
    p = KVCacheLayeringPolicy(min_prompt_tokens=100)
    p.decide(LayeringRequest(10, BG))
    p.decide(LayeringRequest(10, STD))
    p.decide(LayeringRequest(10, STD))
    p.decide(LayeringRequest(500, INT, shared_prefix_key="k"))
    assert p.counters() == {
        ("background_ingestion", "background_ingestion"): 1,
        ("standard", "prompt_too_short"): 2,
        ("interactive", "shared_bundle_prefix"): 1,
    }
    by_class = p.counters_by_class()
    assert by_class["standard"] == {"stored": 0, "skipped": 2, "prompt_too_short": 2}
    assert by_class["interactive"]["stored"] == 1


def test_invalid_thresholds_are_refused() -> None:
    with pytest.raises(ValueError, match="min_prompt_tokens"):
        KVCacheLayeringPolicy(min_prompt_tokens=0)
    with pytest.raises(ValueError, match="prompt_tokens"):
        KVCacheLayeringPolicy().decide(LayeringRequest(-1))
