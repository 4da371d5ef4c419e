"""ContextCompiler: policy filter, scoring, MMR, budget, proof graph, bundle cache."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from epistemic_kvcache.context import (
    ApproxTokenCounter,
    BundleFormatError,
    Candidate,
    ContextBundle,
    ContextCompiler,
    InMemoryCandidateSource,
    JsonlCandidateSource,
    NullBundleCache,
    ScoringWeights,
    Session,
    SessionPolicy,
    TTLBundleCache,
    compute_bundle_cache_key,
)
from epistemic_kvcache.context.model import REDACTION_MASK, to_epoch_us

AS_OF = datetime(2024, 6, 1, tzinfo=UTC)


def ts(days_ago: float) -> int:
    return to_epoch_us(AS_OF - timedelta(days=days_ago))


def cand(cid: str, text: str, **kw: Any) -> Candidate:
    kw.setdefault("source", f"doc://{cid}")
    kw.setdefault("timestamp_us", ts(1))
    kw.setdefault("tenant", "acme")
    return Candidate(id=cid, text=text, **kw)


SESSION = Session("s1", "acme")


def compile_(comp: ContextCompiler, query: str = "kv cache", **kw: Any) -> ContextBundle:
    kw.setdefault("as_of", AS_OF)
    kw.setdefault("kv_backend", NullBundleCache())
    session = kw.pop("session", SESSION)
    return comp.compile(query, session, **kw)


class CountingCache:
    """A real in-process cache that counts calls and can be made to fail."""

    def __init__(self) -> None:
        self.inner = TTLBundleCache()
        self.gets = 0
        self.puts = 0
        self.fail = False

    def get(self, key: str) -> bytes | None:
        self.gets += 1
        if self.fail:
            raise ConnectionError("cache down")
        return self.inner.get(key)

    def put(self, key: str, value: bytes) -> bool:
        self.puts += 1
        if self.fail:
            raise ConnectionError("cache down")
        return self.inner.put(key, value)

    def delete(self, key: str) -> bool:
        return self.inner.delete(key)


# -- policy filter ---------------------------------------------------------------------


def test_policy_filter_tenant_labels_sources_age_strength_redaction() -> None:
    cands = [
        cand("ok", "kv cache blocks"),
        cand("public", "kv cache public", tenant=None),
        cand("other", "kv cache other tenant", tenant="globex"),
        cand("secret", "kv cache secret", labels=frozenset({"secret"})),
        cand("wrongsrc", "kv cache", source="web://x"),
        cand("old", "kv cache old", timestamp_us=ts(400)),
        cand("weak", "kv cache weak", strength=0.05),
        cand("red", "kv cache token=abc", redactions=((9, 18),)),
    ]
    policy = SessionPolicy(
        version="7",
        denied_labels=frozenset({"secret"}),
        allowed_sources=frozenset({"doc://"}),
        max_age_days=365,
        min_strength=0.1,
    )
    session = Session("s", "acme", policy)
    comp = ContextCompiler(InMemoryCandidateSource(cands))

    masked = compile_(comp, session=session, mask_redactions=True)
    assert masked.evidence_ids == ("ok", "public", "red")
    assert dict(masked.policy_drops) == {
        "session_policy:label": 1,
        "session_policy:source": 1,
        "session_policy:age": 1,
        "session_policy:strength": 1,
    }
    red = next(i for i in masked.items if i.evidence_id == "red")
    assert red.text == f"kv cache {REDACTION_MASK}"
    assert "abc" not in masked.as_text()
    assert "globex" not in masked.to_bytes().decode()  # other tenants leave no trace
    assert comp.stats.tenant_drops == 1

    unmasked = compile_(comp, session=session, mask_redactions=False)
    assert unmasked.evidence_ids == ("ok", "public")
    assert dict(unmasked.policy_drops)["redaction"] == 1
    assert unmasked.cache_key != masked.cache_key
    assert masked.params.policy_version.endswith("/7")


def test_overlapping_redactions_mask_once() -> None:
    c = cand("r", "0123456789", redactions=((2, 5), (4, 7), (7, 8)))
    assert c.redactions == ((2, 8),)
    assert c.masked_text() == f"01{REDACTION_MASK}89"
    with pytest.raises(ValueError, match="redaction span"):
        cand("bad", "abc", redactions=((2, 9),))


# -- scoring, MMR, budget --------------------------------------------------------------


def test_relevance_strength_and_freshness_order_the_items() -> None:
    cands = [
        cand("rel", "prefix cache reuse for kv blocks", strength=0.5),
        cand("irrelevant", "cooking pasta recipes", strength=0.5),
    ]
    b = compile_(ContextCompiler(InMemoryCandidateSource(cands)), "prefix cache", top_k=1)
    assert [i.evidence_id for i in b.items] == ["rel"]
    assert b.items[0].relevance == 1.0

    fresh_vs_old = [
        cand("new", "kv cache note", timestamp_us=ts(0)),
        cand("old", "kv cache note", timestamp_us=ts(60)),
    ]
    comp = ContextCompiler(InMemoryCandidateSource(fresh_vs_old))
    b = compile_(comp, top_k=1, freshness_half_life_days=30)
    assert b.items[0].evidence_id == "new"
    b2 = compile_(comp, top_k=2, freshness_half_life_days=30, diversity_lambda=1.0)
    old = next(i for i in b2.items if i.evidence_id == "old")
    assert old.freshness == pytest.approx(0.25)  # two half-lives
    no_decay = compile_(comp, top_k=2, freshness_half_life_days=None, diversity_lambda=1.0)
    assert all(i.freshness == 1.0 for i in no_decay.items)

    strong = [cand("weak", "kv cache", strength=0.1), cand("strong", "kv cache", strength=0.9)]
    b = compile_(ContextCompiler(InMemoryCandidateSource(strong)), top_k=1)
    assert b.items[0].evidence_id == "strong"


def test_support_corroborates_strength_and_builds_proof_graph() -> None:
    cands = [
        cand("claim", "kv cache hit rate rose", strength=0.4, supported_by=("m1", "hidden")),
        cand("m1", "measurement log", strength=0.8, source="metrics://grafana"),
        cand("hidden", "other tenant note", tenant="globex"),
    ]
    b = compile_(ContextCompiler(InMemoryCandidateSource(cands)), top_k=1)
    (item,) = b.items
    assert item.evidence_id == "claim"
    assert item.strength == pytest.approx(1 - 0.6 * (1 - 0.5 * 0.8))
    assert item.supported_by == ("m1",)
    assert item.withheld_support == 1
    assert b.proof_graph.supporters_of("claim") == ("m1",)
    (edge,) = b.proof_graph.edges
    assert (edge.src, edge.dst, edge.relation, edge.provenance) == (
        "m1",
        "claim",
        "supports",
        "metrics://grafana",
    )
    kinds = {n.id: n.kind for n in b.proof_graph.nodes}
    assert kinds == {"claim": "item", "m1": "evidence"}
    assert "supported-by: m1" in b.as_text()


def test_mmr_prefers_diverse_items() -> None:
    dup = "vllm prefix cache blocks reuse system prompt"
    cands = [
        cand("a", dup, strength=0.9),
        cand("b", dup, strength=0.89),
        cand("c", "lmcache stores kv cache on cpu", strength=0.5),
    ]
    comp = ContextCompiler(InMemoryCandidateSource(cands))
    pure = compile_(comp, "vllm prefix cache", top_k=2, diversity_lambda=1.0)
    assert [i.evidence_id for i in pure.items] == ["a", "b"]
    diverse = compile_(comp, "vllm prefix cache", top_k=2, diversity_lambda=0.3)
    assert [i.evidence_id for i in diverse.items] == ["a", "c"]


def test_budget_is_never_exceeded_and_counts_are_exact() -> None:
    counter = ApproxTokenCounter()
    cands = [cand(f"e{i}", "kv cache " + "word " * (10 * i)) for i in range(1, 8)]
    comp = ContextCompiler(InMemoryCandidateSource(cands))
    for budget in (20, 60, 150, 400, 10_000):
        b = compile_(comp, token_budget=budget, top_k=7)
        assert b.token_count == counter.count(b.as_text()) <= budget
    assert len(compile_(comp, token_budget=10_000, top_k=7).items) == 7
    assert len(compile_(comp, token_budget=60, top_k=7).items) < 7
    with pytest.raises(ValueError, match="token_budget"):
        compile_(comp, token_budget=2)


class WordCounter:
    name = "words"

    def count(self, text: str) -> int:
        return len(text.split())


def test_pluggable_token_counter_changes_key_and_fit() -> None:
    cands = [cand("a", "kv cache " * 30)]
    a = compile_(ContextCompiler(InMemoryCandidateSource(cands)), token_budget=5000)
    b = compile_(
        ContextCompiler(InMemoryCandidateSource(cands), token_counter=WordCounter()),
        token_budget=5000,
    )
    assert a.cache_key != b.cache_key
    assert b.params.token_counter == "words"
    assert b.token_count == len(b.as_text().split())


def test_result_does_not_depend_on_source_order() -> None:
    cands = [cand(f"e{i}", f"kv cache item {i % 3}") for i in range(12)]
    a = compile_(ContextCompiler(InMemoryCandidateSource(cands)), top_k=5)
    b = compile_(ContextCompiler(InMemoryCandidateSource(reversed(cands))), top_k=5)
    assert a == b


def test_invalid_parameters_name_the_setting() -> None:
    comp = ContextCompiler(InMemoryCandidateSource([cand("a", "x")]))
    for kw, name in (
        ({"top_k": 0}, "top_k"),
        ({"diversity_lambda": 1.5}, "diversity_lambda"),
        ({"freshness_half_life_days": 0}, "freshness_half_life_days"),
        ({"token_budget": True}, "token_budget"),
    ):
        with pytest.raises(ValueError, match=name):
            compile_(comp, **kw)
    with pytest.raises(ValueError, match="timezone-aware"):
        compile_(comp, as_of=datetime(2024, 1, 1))
    with pytest.raises(ValueError, match=r"weights\.strength"):
        ScoringWeights(strength=-1)
    with pytest.raises(ValueError, match="duplicate candidate"):
        InMemoryCandidateSource([cand("a", "x"), cand("a", "y")])


def test_default_as_of_is_rounded_so_nearby_calls_share_a_key() -> None:
    now = [AS_OF.timestamp() + 10]
    comp = ContextCompiler(
        InMemoryCandidateSource([cand("a", "kv cache")]),
        as_of_granularity_s=3600,
        clock=lambda: now[0],
    )
    k1 = compile_(comp, as_of=None).cache_key
    now[0] += 1000
    assert compile_(comp, as_of=None).cache_key == k1
    now[0] += 3600
    assert compile_(comp, as_of=None).cache_key != k1


# -- bundle cache ----------------------------------------------------------------------


def instrument(comp: ContextCompiler, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    calls = dict.fromkeys(("_score", "_select_mmr", "_fit_budget", "_build_proof_graph"), 0)
    for name in calls:
        original = getattr(comp, name)

        def wrapper(*a: Any, _n: str = name, _o: Any = original, **k: Any) -> Any:
            calls[_n] += 1
            return _o(*a, **k)

        monkeypatch.setattr(comp, name, wrapper)
    return calls


def test_hit_skips_scoring_mmr_budget_and_proof_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    cands = [cand(f"e{i}", f"kv cache evidence {i}", supported_by=("e0",)) for i in range(20)]
    comp = ContextCompiler(InMemoryCandidateSource(cands))
    calls = instrument(comp, monkeypatch)
    cache = CountingCache()

    cold = compile_(comp, kv_backend=cache)
    assert not cold.kv_cache_hit
    assert calls == dict.fromkeys(calls, 1)
    assert cache.puts == 1

    warm = compile_(comp, kv_backend=cache)
    assert warm.kv_cache_hit
    assert warm == cold
    assert warm.as_text() == cold.as_text()
    assert calls == dict.fromkeys(calls, 1)  # nothing ran again
    assert cache.puts == 1
    s = comp.stats
    assert (s.cache_hits, s.cache_misses, s.cache_stores) == (1, 1, 1)

    compile_(comp, kv_backend=cache, top_k=3)  # a different parameter is a miss
    assert calls == dict.fromkeys(calls, 2)


def test_hit_across_compiler_instances_sharing_a_backend() -> None:
    cands = [cand(f"e{i}", f"kv cache {i}") for i in range(10)]
    cache = TTLBundleCache()
    a = compile_(ContextCompiler(InMemoryCandidateSource(cands)), kv_backend=cache)
    b = compile_(ContextCompiler(InMemoryCandidateSource(list(cands))), kv_backend=cache)
    assert b.kv_cache_hit
    assert a == b


def test_changed_evidence_content_is_a_miss() -> None:
    cache = TTLBundleCache()
    a = compile_(
        ContextCompiler(InMemoryCandidateSource([cand("e", "kv cache v1")])), kv_backend=cache
    )
    b = compile_(
        ContextCompiler(InMemoryCandidateSource([cand("e", "kv cache v2")])), kv_backend=cache
    )
    assert not b.kv_cache_hit
    assert a.cache_key != b.cache_key


@pytest.mark.parametrize(
    "payload",
    [
        b"\x80\x81 not json",
        b"[]",
        json.dumps({"format": "epistemic-kvcache/ctxbundle", "version": 999}).encode(),
        json.dumps({"format": "something-else", "version": 1}).encode(),
    ],
)
def test_undecodable_or_unknown_version_is_a_miss(payload: bytes) -> None:
    comp = ContextCompiler(InMemoryCandidateSource([cand("a", "kv cache")]))
    cache = CountingCache()
    key = compile_(comp, kv_backend=NullBundleCache()).cache_key
    cache.inner.put(key, payload)
    b = compile_(comp, kv_backend=cache)
    assert not b.kv_cache_hit
    assert comp.stats.cache_decode_errors == 1
    # The bad entry was deleted and replaced: the next compile hits.
    assert compile_(comp, kv_backend=cache).kv_cache_hit


def test_bundle_stored_under_another_key_is_refused() -> None:
    comp = ContextCompiler(InMemoryCandidateSource([cand("a", "kv cache")]))
    other = compile_(comp, top_k=2)
    cache = TTLBundleCache()
    key = compile_(comp).cache_key
    cache.put(key, other.to_bytes())
    assert not compile_(comp, kv_backend=cache).kv_cache_hit
    assert comp.stats.cache_decode_errors == 1


def test_failing_backend_never_fails_a_compile() -> None:
    comp = ContextCompiler(InMemoryCandidateSource([cand("a", "kv cache")]))
    cache = CountingCache()
    cache.fail = True
    b = compile_(comp, kv_backend=cache)
    assert b.items
    assert not b.kv_cache_hit
    assert comp.stats.cache_backend_errors == 2  # get and put


def test_from_bytes_rejects_wrong_types() -> None:
    comp = ContextCompiler(InMemoryCandidateSource([cand("a", "kv cache")]))
    doc = json.loads(compile_(comp).to_bytes())
    doc["token_count"] = "12"
    with pytest.raises(BundleFormatError):
        ContextBundle.from_bytes(json.dumps(doc).encode())
    doc["token_count"] = 12
    doc["items"][0][3] = 1.5  # timestamp must be an int
    with pytest.raises(BundleFormatError):
        ContextBundle.from_bytes(json.dumps(doc).encode())


def test_key_function_matches_compiler_and_prefix() -> None:
    cands = [cand("b", "kv cache"), cand("a", "kv cache two")]
    comp = ContextCompiler(InMemoryCandidateSource(cands))
    b = compile_(comp, top_k=3, token_budget=500)
    key = compute_bundle_cache_key(
        query="kv cache",
        tenant="acme",
        evidence_ids=["b", "a"],
        evidence_digests={c.id: c.digest for c in cands},
        policy_version=b.params.policy_version,
        token_budget=500,
        top_k=3,
        diversity_lambda=0.7,
        weights=ScoringWeights(),
        freshness_half_life_days=30.0,
        as_of=AS_OF,
        mask_redactions=True,
    )
    assert key == b.cache_key
    assert key.startswith("ctxbundle:")
    assert len(key) == len("ctxbundle:") + 64


# -- JSONL source ----------------------------------------------------------------------


def test_jsonl_source_reads_and_reloads(tmp_path: Path) -> None:
    path = tmp_path / "ev.jsonl"
    rows = [
        {"id": "a", "text": "kv cache", "source": "doc://a", "timestamp": "2024-05-01T00:00:00Z",
         "tenant": "acme", "strength": 0.7, "labels": ["x"], "supported_by": ["b"]},
        {"id": "b", "text": "secret=1 kv", "source": "doc://b", "timestamp": 1714521600,
         "redactions": [[0, 8]]},
    ]  # fmt: skip
    path.write_text("# evidence\n\n" + "\n".join(json.dumps(r) for r in rows) + "\n")
    src = JsonlCandidateSource(path)
    got = src.fetch("q", SESSION)
    assert [c.id for c in got] == ["a", "b"]
    assert got[0].timestamp == datetime(2024, 5, 1, tzinfo=UTC)
    assert got[1].timestamp == datetime(2024, 5, 1, tzinfo=UTC)
    assert got[1].tenant is None
    assert got[1].redactions == ((0, 8),)
    b = compile_(ContextCompiler(src))
    assert b.proof_graph.supporters_of("a") == ("b",)

    rows.append({"id": "c", "text": "new", "source": "doc://c", "timestamp": 0})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert [c.id for c in src.fetch("q", SESSION)] == ["a", "b", "c"]

    path.write_text(json.dumps({"id": "d", "text": "x", "source": "s", "timestamp": 0, "bogus": 1}))
    with pytest.raises(ValueError, match=r"ev\.jsonl:1: unknown candidate fields"):
        src.fetch("q", SESSION)
