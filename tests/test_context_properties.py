"""Hypothesis properties: cache keys, cache hits, byte-stable rendering, resolution chain."""

from __future__ import annotations

import sys
import types
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epistemic_kvcache.context import (
    ApproxTokenCounter,
    Candidate,
    ContextBundle,
    ContextCompiler,
    InMemoryCandidateSource,
    ScoringWeights,
    Session,
    SessionPolicy,
    TTLBundleCache,
    compute_bundle_cache_key,
    reset_context_compiler_cache,
    resolve_context_compiler_cache,
    set_context_compiler_cache,
)
from epistemic_kvcache.context.model import to_epoch_us

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
COMPILE_SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

# -- keys change iff inputs change -----------------------------------------------------

small_text = st.text(alphabet="abcxyz é\n", max_size=6)
unit = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)
weight = st.floats(min_value=0.0, max_value=4.0, allow_nan=False)
datetimes = st.datetimes(
    min_value=datetime(2000, 1, 1),
    max_value=datetime(2100, 1, 1),
    timezones=st.sampled_from([UTC, timezone(timedelta(hours=5, minutes=30))]),
)
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "query": small_text,
    "tenant": st.sampled_from(["acme", "globex"]),
    "evidence_ids": st.frozensets(st.sampled_from(["a", "b", "c", "d"]), max_size=4),
    "digests": st.dictionaries(st.sampled_from(["a", "b", "c"]), st.sampled_from(["1", "2"])),
    "policy_version": st.sampled_from(["1", "2"]),
    "token_budget": st.integers(min_value=1, max_value=4),
    "top_k": st.integers(min_value=1, max_value=3),
    "diversity_lambda": st.one_of(unit, st.sampled_from([0.0, -0.0, 0.5, 1.0])),
    "weights": st.tuples(weight, weight, weight).filter(any),
    "freshness_half_life_days": st.one_of(st.none(), st.sampled_from([1.0, 30.0, 0.5])),
    "as_of": datetimes,
    "mask_redactions": st.booleans(),
    "token_counter": st.sampled_from(["approx-v1", "words"]),
}


@st.composite
def param_pairs(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, Any]]:
    a = {name: draw(s) for name, s in FIELDS.items()}
    b = dict(a)
    for name in draw(st.sets(st.sampled_from(sorted(FIELDS)))):
        b[name] = draw(FIELDS[name])
    return a, b


def key_of(p: dict[str, Any]) -> str:
    return compute_bundle_cache_key(
        query=p["query"],
        tenant=p["tenant"],
        evidence_ids=sorted(p["evidence_ids"], reverse=True),  # order must not matter
        evidence_digests=p["digests"],
        policy_version=p["policy_version"],
        token_budget=p["token_budget"],
        top_k=p["top_k"],
        diversity_lambda=p["diversity_lambda"],
        weights=ScoringWeights(*p["weights"]),
        freshness_half_life_days=p["freshness_half_life_days"],
        as_of=p["as_of"],
        mask_redactions=p["mask_redactions"],
        token_counter=p["token_counter"],
    )


def meaning(p: dict[str, Any]) -> dict[str, Any]:
    """What the result depends on (digests only matter for ids in the pool)."""
    m = dict(p)
    m["digests"] = {i: p["digests"].get(i, "") for i in p["evidence_ids"]}
    m["as_of"] = to_epoch_us(p["as_of"])
    return m


@SETTINGS
@given(param_pairs())
def test_key_changes_iff_a_result_changing_input_changes(
    pair: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    a, b = pair
    assert (key_of(a) == key_of(b)) == (meaning(a) == meaning(b))


# -- compile: hit equals, budget holds, rendering is byte-stable -----------------------

AS_OF = datetime(2024, 6, 1, tzinfo=UTC)
WORDS = ["kv", "cache", "prefix", "block", "tenant", "gpu", "vllm", "lmcache", "disk"]
words = st.sampled_from([*WORDS, "redis", ",", "."])


@st.composite
def candidate_sets(draw: st.DrawFn) -> list[Candidate]:
    n = draw(st.integers(min_value=0, max_value=12))
    ids = [f"e{i}" for i in range(n)]
    out = []
    for cid in ids:
        text = " ".join(draw(st.lists(words, min_size=1, max_size=25)))
        reds = ()
        if draw(st.booleans()) and len(text) > 3:
            reds = ((0, 2),)
        out.append(
            Candidate(
                id=cid,
                text=text,
                source=draw(st.sampled_from(["doc://a", "doc://b", "web://c"])),
                timestamp_us=to_epoch_us(AS_OF) - draw(st.integers(0, 400)) * 86_400_000_000,
                tenant=draw(st.sampled_from([None, "acme", "globex"])),
                strength=draw(unit),
                labels=frozenset(draw(st.sets(st.sampled_from(["pii", "x"]), max_size=1))),
                redactions=reds,
                supported_by=tuple(draw(st.lists(st.sampled_from(ids), max_size=2))),
            )
        )
    return out


compile_params = st.fixed_dictionaries(
    {
        "token_budget": st.integers(min_value=20, max_value=600),
        "top_k": st.integers(min_value=1, max_value=8),
        "diversity_lambda": unit,
        "weights": st.tuples(weight, weight, weight).filter(any).map(lambda w: ScoringWeights(*w)),
        "freshness_half_life_days": st.one_of(st.none(), st.floats(0.5, 90)),
        "mask_redactions": st.booleans(),
    }
)
policies = st.builds(
    SessionPolicy,
    version=st.sampled_from(["1", "2"]),
    denied_labels=st.sampled_from([frozenset(), frozenset({"pii"})]),
    allowed_sources=st.sampled_from([None, frozenset({"doc://"})]),
    max_age_days=st.sampled_from([None, 100.0]),
)


@COMPILE_SETTINGS
@given(candidate_sets(), compile_params, policies, st.text(max_size=20))
def test_cache_hit_returns_an_equal_bundle_and_invariants_hold(
    cands: list[Candidate], params: dict[str, Any], policy: SessionPolicy, query: str
) -> None:
    cache = TTLBundleCache()
    session = Session("s", "acme", policy)
    comp = ContextCompiler(InMemoryCandidateSource(cands))
    cold = comp.compile("kv " + query, session, as_of=AS_OF, kv_backend=cache, **params)
    warm = comp.compile("kv " + query, session, as_of=AS_OF, kv_backend=cache, **params)
    assert not cold.kv_cache_hit
    assert warm.kv_cache_hit
    assert warm == cold
    assert ContextBundle.from_bytes(cold.to_bytes()) == cold
    assert warm.to_bytes() == cold.to_bytes()

    # Budget, top_k and policy invariants.
    assert cold.token_count == ApproxTokenCounter().count(cold.as_text())
    assert cold.token_count <= params["token_budget"]
    assert len(cold.items) <= params["top_k"]
    visible = {
        c.id
        for c in cands
        if c.tenant in (None, "acme")
        and not (c.labels & policy.denied_labels)
        and (policy.allowed_sources is None or c.source.startswith("doc://"))
    }
    assert {i.evidence_id for i in cold.items} <= visible
    assert set(cold.evidence_ids) <= visible
    for item in cold.items:
        assert set(item.supported_by) <= set(cold.evidence_ids)
    # Proof-graph edges only connect visible evidence to selected items.
    selected = {i.evidence_id for i in cold.items}
    for e in cold.proof_graph.edges:
        assert e.dst in selected
        assert e.src in visible


@COMPILE_SETTINGS
@given(candidate_sets(), compile_params, st.text(max_size=40), st.text(max_size=40))
def test_system_message_is_byte_identical_whatever_the_turn(
    cands: list[Candidate], params: dict[str, Any], turn_a: str, turn_b: str
) -> None:
    comp = ContextCompiler(InMemoryCandidateSource(cands))
    session = Session("s", "acme")
    bundle = comp.compile("kv", session, as_of=AS_OF, kv_backend=TTLBundleCache(), **params)
    copy = ContextBundle.from_bytes(bundle.to_bytes())  # e.g. another process's hit
    ma = bundle.as_prompt_messages(turn_a)
    mb = copy.as_prompt_messages(turn_b)
    assert ma[0]["content"].encode() == mb[0]["content"].encode()
    assert ma[0]["role"] == "system"
    assert (ma[1], mb[1]) == (
        {"role": "user", "content": turn_a},
        {"role": "user", "content": turn_b},
    )
    assert ma[0]["content"].endswith(bundle.as_text())


@COMPILE_SETTINGS
@given(candidate_sets(), compile_params, compile_params)
def test_different_bundle_content_renders_different_prefixes(
    cands: list[Candidate], p1: dict[str, Any], p2: dict[str, Any]
) -> None:
    comp = ContextCompiler(InMemoryCandidateSource(cands))
    session = Session("s", "acme")
    b1 = comp.compile("kv cache", session, as_of=AS_OF, kv_backend=TTLBundleCache(), **p1)
    b2 = comp.compile("kv cache", session, as_of=AS_OF, kv_backend=TTLBundleCache(), **p2)

    def content(b: ContextBundle) -> list[tuple[Any, ...]]:
        return [(i.evidence_id, i.text, i.source, i.supported_by) for i in b.items]

    same_text = b1.as_prompt_messages("t")[0] == b2.as_prompt_messages("t")[0]
    assert same_text == (content(b1) == content(b2))


# -- resolution chain ------------------------------------------------------------------


class FakeRemote:
    @classmethod
    def from_env(cls) -> FakeRemote:
        return cls()

    def get(self, key: str) -> bytes | None:
        return None

    def put(self, key: str, value: bytes) -> bool:
        return True


@settings(max_examples=80, deadline=None)
@given(
    override=st.booleans(),
    enabled=st.sampled_from(["", "true", "TRUE", "1", "yes", "on", "false", "0", "no", "off"]),
    url=st.booleans(),
    addr=st.booleans(),
)
def test_resolution_chain_picks_the_right_backend(
    override: bool, enabled: str, url: bool, addr: bool
) -> None:
    fake: Any = types.ModuleType("epistemic_kvcache.client")
    fake.EpistemicGraphKVBackend = FakeRemote
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "epistemic_kvcache.client", fake)
        for name in ("EPISTEMIC_GRAPH_KVCACHE_URL", "EPISTEMIC_GRAPH_KVCACHE_ADDR"):
            mp.delenv(name, raising=False)
        mp.setenv("MODEL_CONTEXT_COMPILER_CACHE_ENABLED", enabled)
        if url:
            mp.setenv("EPISTEMIC_GRAPH_KVCACHE_URL", "http://127.0.0.1:1")
        if addr:
            mp.setenv("EPISTEMIC_GRAPH_KVCACHE_ADDR", "127.0.0.1:1")
        reset_context_compiler_cache()
        mine = TTLBundleCache()
        if override:
            set_context_compiler_cache(mine)
        try:
            got = resolve_context_compiler_cache()
        finally:
            reset_context_compiler_cache()
    if override:
        assert got is mine
    elif enabled.lower() in ("true", "1", "yes", "on") and (url or addr):
        assert isinstance(got, FakeRemote)
    else:
        assert isinstance(got, TTLBundleCache)
        assert got is not mine
