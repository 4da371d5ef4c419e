"""The context compiler: candidates in, a cached, budget-fitted `ContextBundle` out.

Pipeline: fetch (a `CandidateSource`) -> policy filter (tenant, redaction, session
policy) -> cache key -> [cache hit: done] -> score (BM25 relevance, evidence strength
corroborated by supporters, freshness decay) -> MMR diversity -> token-budget fit ->
proof graph -> store.

The cache key is computed right after the policy filter because the post-policy pool
plus the parameters determine the result completely: a hit skips every expensive step.
The pool is sorted by id before scoring, so the result never depends on the order the
source returned candidates in.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime

from epistemic_kvcache.context.cache import BundleCacheBackend, resolve_context_compiler_cache
from epistemic_kvcache.context.model import (
    BundleFormatError,
    BundleItem,
    BundleParams,
    Candidate,
    ContextBundle,
    ProofEdge,
    ProofGraph,
    ProofNode,
    ScoringWeights,
    Session,
    canonical_json,
    from_epoch_us,
    to_epoch_us,
)
from epistemic_kvcache.context.scoring import US_PER_DAY, bm25, freshness, mmr_select, terms
from epistemic_kvcache.context.scoring import unit_vector as _unit_vector
from epistemic_kvcache.context.sources import CandidateSource
from epistemic_kvcache.context.tokens import ApproxTokenCounter, TokenCounter

log = logging.getLogger(__name__)

KEY_PREFIX = "ctxbundle:"
COMPILER_VERSION = "ctxcompiler-1"
"""Goes into every key: bump it whenever scoring, selection or rendering changes."""
SUPPORT_WEIGHT = 0.5
"""How much a supporter's strength corroborates the evidence it supports (noisy-OR)."""


@dataclass(slots=True)
class CompilerStats:
    """Counters of one compiler (read them, do not write them)."""

    compiles: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    cache_stores: int = 0
    cache_store_failures: int = 0
    cache_decode_errors: int = 0
    cache_backend_errors: int = 0
    tenant_drops: int = 0


def _check_params(
    token_budget: int,
    top_k: int,
    diversity_lambda: float,
    freshness_half_life_days: float | None,
) -> tuple[float, float | None]:
    if isinstance(token_budget, bool) or not isinstance(token_budget, int) or token_budget < 1:
        raise ValueError(f"invalid token_budget: expected an integer >= 1 (got {token_budget!r})")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"invalid top_k: expected an integer >= 1 (got {top_k!r})")
    lam = float(diversity_lambda) + 0.0
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"invalid diversity_lambda: expected 0..1 (got {diversity_lambda!r})")
    half_life = None
    if freshness_half_life_days is not None:
        half_life = float(freshness_half_life_days) + 0.0
        if not (math.isfinite(half_life) and half_life > 0):
            raise ValueError(
                f"invalid freshness_half_life_days: expected > 0 or None "
                f"(got {freshness_half_life_days!r})"
            )
    return lam, half_life


def compute_bundle_cache_key(
    *,
    query: str,
    tenant: str,
    evidence_ids: Collection[str],
    policy_version: str,
    token_budget: int,
    top_k: int,
    diversity_lambda: float,
    weights: ScoringWeights,
    freshness_half_life_days: float | None,
    as_of: datetime,
    mask_redactions: bool,
    token_counter: str = "approx-v1",  # noqa: S107 (a tokenizer name)
    evidence_digests: Mapping[str, str] | None = None,
) -> str:
    """`ctxbundle:<sha256>` over canonical JSON of every result-changing input.

    `evidence_ids` are the post-policy ids (order does not matter: they are sorted);
    `evidence_digests` (id -> content digest) make the key notice evidence whose content
    changed under the same id. Equal inputs give equal keys; any change, a different key.
    """
    lam, half_life = _check_params(token_budget, top_k, diversity_lambda, freshness_half_life_days)
    ids = sorted(evidence_ids)
    if len(set(ids)) != len(ids):
        raise ValueError("invalid evidence_ids: duplicates")
    digests = evidence_digests or {}
    # The pool can hold thousands of ids: hash it as length-prefixed strings (unambiguous,
    # and several times faster than JSON-encoding a list of pairs), then hash that digest.
    pool = hashlib.sha256()
    for i in ids:
        d = digests.get(i, "")
        pool.update(f"{len(i)}:{i}{len(d)}:{d}".encode())
    doc = {
        "v": COMPILER_VERSION,
        "query": query,
        "tenant": tenant,
        "evidence": [len(ids), pool.hexdigest()],
        "policy_version": policy_version,
        "token_budget": token_budget,
        "top_k": top_k,
        "diversity_lambda": lam,
        "weights": weights.as_list(),
        "half_life_days": half_life,
        "as_of_us": to_epoch_us(as_of),
        "mask_redactions": bool(mask_redactions),
        "token_counter": token_counter,
    }
    return KEY_PREFIX + hashlib.sha256(canonical_json(doc)).hexdigest()


@dataclass(frozen=True, slots=True)
class _Scored:
    cand: Candidate
    text: str
    relevance: float
    strength: float
    fresh: float
    score: float
    vector: dict[str, float]
    supporters: tuple[str, ...]
    withheld: int


class ContextCompiler:
    """Compiles candidate evidence into `ContextBundle`s, through a bundle cache.

    `as_of_granularity_s`: when `compile` gets no `as_of`, "now" is rounded down to this
    granularity so that calls within the same window share a cache key (freshness with a
    half-life of days barely moves within an hour).
    """

    def __init__(
        self,
        source: CandidateSource,
        *,
        token_counter: TokenCounter | None = None,
        as_of_granularity_s: float = 3600.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not as_of_granularity_s > 0:
            raise ValueError(
                f"invalid as_of_granularity_s: expected > 0 (got {as_of_granularity_s})"
            )
        self.source = source
        self.token_counter: TokenCounter = token_counter or ApproxTokenCounter()
        self.as_of_granularity_s = as_of_granularity_s
        self._clock = clock
        self._stats_lock = threading.Lock()
        self._stats = CompilerStats()

    @property
    def stats(self) -> CompilerStats:
        """A snapshot of the counters."""
        with self._stats_lock:
            s = self._stats
            return CompilerStats(**{f: getattr(s, f) for f in CompilerStats.__slots__})

    def _count(self, name: str, n: int = 1) -> None:
        with self._stats_lock:
            setattr(self._stats, name, getattr(self._stats, name) + n)

    def _default_as_of(self) -> datetime:
        g_us = round(self.as_of_granularity_s * 1_000_000)
        now_us = round(self._clock() * 1_000_000)
        return from_epoch_us(now_us - now_us % g_us)

    # -- entry point -------------------------------------------------------------------

    def compile(
        self,
        query: str,
        session: Session,
        *,
        token_budget: int = 2048,
        top_k: int = 8,
        diversity_lambda: float = 0.7,
        weights: ScoringWeights | None = None,
        freshness_half_life_days: float | None = 30.0,
        as_of: datetime | None = None,
        mask_redactions: bool = True,
        kv_backend: BundleCacheBackend | None = None,
    ) -> ContextBundle:
        """Compile (or fetch from the cache) the bundle for `query` in `session`.

        `kv_backend=None` uses `resolve_context_compiler_cache()`; pass
        `NullBundleCache()` to compile without caching. Cache failures never fail a
        compile: they count in `stats` and the bundle is compiled.
        """
        weights = weights or ScoringWeights()
        lam, half_life = _check_params(
            token_budget, top_k, diversity_lambda, freshness_half_life_days
        )
        when = as_of if as_of is not None else self._default_as_of()
        as_of_us = to_epoch_us(when)
        backend = kv_backend if kv_backend is not None else resolve_context_compiler_cache()
        self._count("compiles")

        pool, drops = self._policy_filter(
            self.source.fetch(query, session), session, as_of_us, mask_redactions
        )
        policy_version = f"{COMPILER_VERSION}/{session.policy.version}"
        key = compute_bundle_cache_key(
            query=query,
            tenant=session.tenant,
            evidence_ids=[c.id for c in pool],
            evidence_digests={c.id: c.digest for c in pool},
            policy_version=policy_version,
            token_budget=token_budget,
            top_k=top_k,
            diversity_lambda=lam,
            weights=weights,
            freshness_half_life_days=half_life,
            as_of=when,
            mask_redactions=mask_redactions,
            token_counter=self.token_counter.name,
        )
        cached = self._cache_get(backend, key)
        if cached is not None:
            return cached

        params = BundleParams(
            token_budget=token_budget,
            top_k=top_k,
            diversity_lambda=lam,
            weights=weights,
            freshness_half_life_days=half_life,
            as_of_us=as_of_us,
            mask_redactions=mask_redactions,
            policy_version=policy_version,
            token_counter=self.token_counter.name,
        )
        scored = self._score(
            query,
            pool,
            weights=weights,
            as_of_us=as_of_us,
            half_life=half_life,
            mask_redactions=mask_redactions,
        )
        picked = self._select_mmr(scored, top_k, lam)
        items = self._fit_budget(
            picked, token_budget, query=query, tenant=session.tenant, params=params, key=key
        )
        graph = self._build_proof_graph(items, pool, session)
        bundle = ContextBundle(
            cache_key=key,
            query=query,
            tenant=session.tenant,
            items=items,
            proof_graph=graph,
            token_count=0,
            evidence_ids=tuple(c.id for c in pool),
            policy_drops=tuple(sorted(drops.items())),
            params=params,
        )
        bundle = replace(bundle, token_count=self.token_counter.count(bundle.as_text()))
        self._cache_put(backend, key, bundle)
        return bundle

    # -- cache -------------------------------------------------------------------------

    def _cache_get(self, backend: BundleCacheBackend, key: str) -> ContextBundle | None:
        try:
            raw = backend.get(key)
        except Exception:  # an unreachable cache must never fail a compile
            log.warning("bundle cache get failed; compiling", exc_info=True)
            self._count("cache_backend_errors")
            raw = None
        if raw is None:
            self._count("cache_misses")
            return None
        try:
            bundle = ContextBundle.from_bytes(raw)
            if bundle.cache_key != key:
                raise BundleFormatError("stored bundle was compiled for another key")
        except BundleFormatError as exc:
            log.warning("ignoring undecodable cached bundle %s: %s", key, exc)
            self._count("cache_decode_errors")
            self._count("cache_misses")
            self._discard(backend, key)
            return None
        self._count("cache_hits")
        return replace(bundle, kv_cache_hit=True)

    def _discard(self, backend: BundleCacheBackend, key: str) -> None:
        delete = getattr(backend, "delete", None)
        if callable(delete):
            try:
                delete(key)
            except Exception:
                log.warning("bundle cache delete failed", exc_info=True)
                self._count("cache_backend_errors")

    def _cache_put(self, backend: BundleCacheBackend, key: str, bundle: ContextBundle) -> None:
        try:
            ok = backend.put(key, bundle.to_bytes())
        except Exception:
            log.warning("bundle cache put failed", exc_info=True)
            self._count("cache_backend_errors")
            ok = False
        self._count("cache_stores" if ok else "cache_store_failures")

    # -- stages (methods, so tests can observe which ran) -------------------------------

    def _policy_filter(
        self,
        candidates: Sequence[Candidate],
        session: Session,
        as_of_us: int,
        mask_redactions: bool,
    ) -> tuple[list[Candidate], dict[str, int]]:
        """Keep what the session may see; sorted by id. Drops by reason (tenant drops
        are only counted in `stats`: the bundle must not reveal other tenants' volume)."""
        policy = session.policy
        drops: Counter[str] = Counter()
        tenant_drops = 0
        pool: dict[str, Candidate] = {}
        max_age_us = None if policy.max_age_days is None else policy.max_age_days * US_PER_DAY
        tenant = session.tenant
        denied = policy.denied_labels
        prefixes = None if policy.allowed_sources is None else tuple(policy.allowed_sources)
        for c in candidates:
            if c.tenant is not None and c.tenant != tenant:
                tenant_drops += 1
            elif denied and c.labels and not denied.isdisjoint(c.labels):
                drops["session_policy:label"] += 1
            elif prefixes is not None and not c.source.startswith(prefixes):
                drops["session_policy:source"] += 1
            elif max_age_us is not None and as_of_us - c.timestamp_us > max_age_us:
                drops["session_policy:age"] += 1
            elif c.strength < policy.min_strength:
                drops["session_policy:strength"] += 1
            elif c.redactions and not mask_redactions:
                drops["redaction"] += 1
            elif c.id in pool:
                raise ValueError(f"candidate source returned id {c.id!r} twice")
            else:
                pool[c.id] = c
        if tenant_drops:
            self._count("tenant_drops", tenant_drops)
        return [pool[i] for i in sorted(pool)], dict(drops)

    def _score(
        self,
        query: str,
        pool: Sequence[Candidate],
        *,
        weights: ScoringWeights,
        as_of_us: int,
        half_life: float | None,
        mask_redactions: bool,
    ) -> list[_Scored]:
        """Relevance (BM25, 0..1), corroborated strength, freshness; weighted mean."""
        texts = [c.masked_text() if mask_redactions else c.text for c in pool]
        term_lists = [terms(t) for t in texts]
        relevance = bm25(query, term_lists)
        by_id = {c.id: c for c in pool}
        total_w = weights.relevance + weights.strength + weights.freshness
        out = []
        for c, text, tl, rel in zip(pool, texts, term_lists, relevance, strict=True):
            doubt = 1.0 - c.strength
            supporters: list[str] = []
            withheld = 0
            for sid in dict.fromkeys(c.supported_by):
                sup = by_id.get(sid)
                if sup is None:
                    withheld += 1
                elif sid != c.id:
                    supporters.append(sid)
                    doubt *= 1.0 - SUPPORT_WEIGHT * sup.strength
            strength = 1.0 - doubt
            fresh = freshness(c.timestamp_us, as_of_us, half_life)
            score = (
                weights.relevance * rel + weights.strength * strength + weights.freshness * fresh
            ) / total_w
            out.append(
                _Scored(
                    c,
                    text,
                    rel,
                    strength,
                    fresh,
                    score,
                    _unit_vector(tl),
                    tuple(supporters),
                    withheld,
                )
            )
        return out

    def _select_mmr(self, scored: Sequence[_Scored], top_k: int, lam: float) -> list[_Scored]:
        """Up to `top_k` candidates, in MMR order."""
        order = mmr_select([s.score for s in scored], [s.vector for s in scored], top_k, lam)
        return [scored[i] for i in order]

    def _fit_budget(
        self,
        picked: Sequence[_Scored],
        token_budget: int,
        *,
        query: str,
        tenant: str,
        params: BundleParams,
        key: str,
    ) -> tuple[BundleItem, ...]:
        """Greedily keep picked items (in MMR order) whose rendering fits the budget;
        the whole rendered bundle, wrapper included, never exceeds `token_budget`."""
        count = self.token_counter.count

        def render(items: tuple[BundleItem, ...]) -> str:
            probe = ContextBundle(key, query, tenant, items, ProofGraph(), 0, (), (), params)
            return probe.as_text()

        kept: tuple[BundleItem, ...] = ()
        base = count(render(kept))
        if base > token_budget:
            raise ValueError(
                f"invalid token_budget: {token_budget} cannot hold even an empty bundle "
                f"({base} tokens)"
            )
        used = base
        for s in picked:
            item = BundleItem(
                evidence_id=s.cand.id,
                text=s.text,
                source=s.cand.source,
                timestamp_us=s.cand.timestamp_us,
                relevance=s.relevance,
                strength=s.strength,
                freshness=s.fresh,
                score=s.score,
                tokens=0,
                supported_by=s.supporters,
                withheld_support=s.withheld,
            )
            solo = count(render((item,))) - base
            if used + solo > token_budget:
                continue
            kept = (*kept, replace(item, tokens=solo))
            used += solo
        # Counters need not be additive over concatenation: check the real total.
        while kept and count(render(kept)) > token_budget:
            kept = kept[:-1]
        return kept

    def _build_proof_graph(
        self, items: Sequence[BundleItem], pool: Sequence[Candidate], session: Session
    ) -> ProofGraph:
        """Nodes for selected items and their visible supporters; `supports` edges with
        the supporter's source as provenance."""
        by_id = {c.id: c for c in pool}
        selected = {i.evidence_id for i in items}
        nodes: dict[str, ProofNode] = {}
        edges: list[ProofEdge] = []
        for item in items:
            c = by_id[item.evidence_id]
            nodes[c.id] = ProofNode(c.id, "item", c.source, c.timestamp_us, item.strength)
        for item in items:
            for sid in item.supported_by:
                sup = by_id[sid]
                if sid not in selected and sid not in nodes:
                    nodes[sid] = ProofNode(
                        sid, "evidence", sup.source, sup.timestamp_us, sup.strength
                    )
                edges.append(ProofEdge(sid, item.evidence_id, "supports", sup.source))
        return ProofGraph(tuple(nodes.values()), tuple(edges))
