"""Value types of the context compiler and the bundle's versioned wire format.

A `ContextBundle` is plain data (frozen dataclasses, tuples, str/int/float/bool), so it
serializes to canonical JSON and back to an *equal* object: that is what lets a bundle
compiled in one process be a cache hit in another. Decoding is strict (every field is
type-checked, unknown format versions are refused) because the bytes come from the
network: no pickle, nothing executable.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from epistemic_kvcache.errors import KvCacheError

BUNDLE_FORMAT = "epistemic-kvcache/ctxbundle"
BUNDLE_FORMAT_VERSION = 1
REDACTION_MASK = "[REDACTED]"

DEFAULT_SYSTEM_PREAMBLE = (
    "You are a careful assistant. Answer from the evidence in the context bundle below; "
    "cite evidence by its [n] number and say when the evidence does not settle a question."
)


class BundleFormatError(KvCacheError):
    """Stored bundle bytes are not a bundle this version understands (treated as a miss)."""


def canonical_json(obj: Any) -> bytes:
    """Deterministic JSON: sorted keys, no spaces, UTF-8, no NaN/Infinity."""
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def _finite(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"invalid {name}: expected a finite number (got {value!r})")
    return value + 0.0  # folds -0.0 into 0.0 so equal values serialize equally


def to_epoch_us(when: datetime) -> int:
    """Integer microseconds since the Unix epoch of a timezone-aware datetime."""
    if when.tzinfo is None or when.utcoffset() is None:
        raise ValueError(f"invalid datetime {when!r}: expected a timezone-aware value")
    delta = when - datetime(1970, 1, 1, tzinfo=UTC)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def from_epoch_us(us: int) -> datetime:
    """Inverse of `to_epoch_us` (UTC)."""
    return datetime.fromtimestamp(us // 1_000_000, tz=UTC).replace(microsecond=us % 1_000_000)


@dataclass(frozen=True, slots=True)
class Candidate:
    """One piece of retrievable evidence.

    `tenant=None` marks public evidence visible to every tenant. `redactions` are
    `(start, end)` character spans of `text` that must never be shown unmasked.
    `supported_by` names other evidence that corroborates this one (proof-graph edges).
    `digest` is a SHA-256 over every field, computed once at construction, so cache keys
    notice evidence whose content changed under the same id.
    """

    id: str
    text: str
    source: str
    timestamp_us: int
    tenant: str | None = None
    strength: float = 0.5
    labels: frozenset[str] = frozenset()
    redactions: tuple[tuple[int, int], ...] = ()
    supported_by: tuple[str, ...] = ()
    digest: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.id:
            raise ValueError("invalid candidate id: empty")
        strength = _finite("strength", self.strength)
        if not 0.0 <= strength <= 1.0:
            raise ValueError(f"invalid strength for {self.id!r}: expected 0..1 (got {strength})")
        object.__setattr__(self, "strength", strength)
        merged: list[tuple[int, int]] = []
        for start, end in sorted((int(a), int(b)) for a, b in self.redactions):
            if not 0 <= start < end <= len(self.text):
                raise ValueError(f"invalid redaction span ({start}, {end}) for {self.id!r}")
            if merged and start <= merged[-1][1]:  # overlapping or touching: one mask
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        spans = tuple(merged)
        object.__setattr__(self, "redactions", spans)
        object.__setattr__(self, "labels", frozenset(self.labels))
        object.__setattr__(self, "supported_by", tuple(self.supported_by))
        body = canonical_json(
            [
                self.id,
                self.text,
                self.source,
                self.timestamp_us,
                self.tenant,
                strength,
                sorted(self.labels),
                [list(s) for s in spans],
                list(self.supported_by),
            ]
        )
        object.__setattr__(self, "digest", hashlib.sha256(body).hexdigest())

    @property
    def timestamp(self) -> datetime:
        """When the evidence was produced (UTC)."""
        return from_epoch_us(self.timestamp_us)

    def masked_text(self) -> str:
        """`text` with every redacted span replaced by `REDACTION_MASK`."""
        if not self.redactions:
            return self.text
        out: list[str] = []
        pos = 0
        for start, end in self.redactions:  # sorted, disjoint (see __post_init__)
            out.append(self.text[pos:start])
            out.append(REDACTION_MASK)
            pos = end
        out.append(self.text[pos:])
        return "".join(out)


@dataclass(frozen=True, slots=True)
class SessionPolicy:
    """What a session may see. `version` goes into bundle cache keys: bump it on change."""

    version: str = "1"
    denied_labels: frozenset[str] = frozenset()
    allowed_sources: frozenset[str] | None = None
    """Source prefixes the session may read; `None` allows every source."""
    max_age_days: float | None = None
    min_strength: float = 0.0


@dataclass(frozen=True, slots=True)
class Session:
    """The caller: a session id, the tenant it acts for, and its policy."""

    session_id: str
    tenant: str
    policy: SessionPolicy = SessionPolicy()


@dataclass(frozen=True, slots=True)
class ScoringWeights:
    """Linear weights of the three score components (non-negative, not all zero)."""

    relevance: float = 0.6
    strength: float = 0.25
    freshness: float = 0.15

    def __post_init__(self) -> None:
        values = []
        for name in ("relevance", "strength", "freshness"):
            v = _finite(f"weights.{name}", getattr(self, name))
            if v < 0:
                raise ValueError(f"invalid weights.{name}: expected >= 0 (got {v})")
            object.__setattr__(self, name, v)
            values.append(v)
        if not any(values):
            raise ValueError("invalid weights: at least one weight must be positive")

    def as_list(self) -> list[float]:
        """`[relevance, strength, freshness]`."""
        return [self.relevance, self.strength, self.freshness]


@dataclass(frozen=True, slots=True)
class BundleParams:
    """Every result-changing compile parameter, as stored with the bundle."""

    token_budget: int
    top_k: int
    diversity_lambda: float
    weights: ScoringWeights
    freshness_half_life_days: float | None
    as_of_us: int
    mask_redactions: bool
    policy_version: str
    token_counter: str


@dataclass(frozen=True, slots=True)
class BundleItem:
    """One selected piece of evidence, with its score breakdown and rendered text."""

    evidence_id: str
    text: str
    source: str
    timestamp_us: int
    relevance: float
    strength: float
    freshness: float
    score: float
    tokens: int
    supported_by: tuple[str, ...] = ()
    withheld_support: int = 0
    """Named supporters the session cannot see (filtered by policy or absent): a count,
    never their ids."""


@dataclass(frozen=True, slots=True)
class ProofNode:
    """A node of the proof graph: a selected item or the evidence supporting one."""

    id: str
    kind: str  # "item" | "evidence"
    source: str
    timestamp_us: int
    strength: float


@dataclass(frozen=True, slots=True)
class ProofEdge:
    """`src` supports `dst`; `provenance` is where the supporting claim came from."""

    src: str
    dst: str
    relation: str
    provenance: str


@dataclass(frozen=True, slots=True)
class ProofGraph:
    """Which evidence supports which selected item, with provenance."""

    nodes: tuple[ProofNode, ...] = ()
    edges: tuple[ProofEdge, ...] = ()

    def supporters_of(self, item_id: str) -> tuple[str, ...]:
        """Ids of evidence with a `supports` edge into `item_id`."""
        return tuple(e.src for e in self.edges if e.dst == item_id and e.relation == "supports")


@dataclass(frozen=True, slots=True)
class ContextBundle:
    """A compiled, budget-fitted, explainable selection of evidence for one query.

    Equality ignores `kv_cache_hit`: a bundle read back from the cache equals the one that
    was stored.
    """

    cache_key: str
    query: str
    tenant: str
    items: tuple[BundleItem, ...]
    proof_graph: ProofGraph
    token_count: int
    evidence_ids: tuple[str, ...]
    """Sorted ids of the evidence that passed the policy filter (the candidate pool)."""
    policy_drops: tuple[tuple[str, int], ...]
    """`(reason, count)` of candidates the policy filter removed, sorted by reason."""
    params: BundleParams
    kv_cache_hit: bool = field(default=False, compare=False)

    # -- rendering ---------------------------------------------------------------------

    def as_text(self) -> str:
        """The bundle as prompt text. Depends only on the selected content, never on
        scores or the time of compilation, so equal content renders byte-identically."""
        lines = [f"<context-bundle items={len(self.items)}>"]
        for n, item in enumerate(self.items, start=1):
            day = from_epoch_us(item.timestamp_us).date().isoformat()
            lines.append(f"[{n}] id={item.evidence_id} source={item.source} date={day}")
            if item.supported_by:
                lines.append("supported-by: " + ", ".join(item.supported_by))
            lines.append(item.text)
            lines.append("")
        lines.append("</context-bundle>")
        return "\n".join(lines)

    def as_prompt_messages(
        self, turn_text: str, *, system_preamble: str = DEFAULT_SYSTEM_PREAMBLE
    ) -> list[dict[str, str]]:
        """OpenAI-style messages: a system message (preamble + `as_text()`, identical for
        every turn over this bundle, so the engine's prefix cache reuses it) and the turn."""
        return [
            {"role": "system", "content": f"{system_preamble}\n\n{self.as_text()}"},
            {"role": "user", "content": turn_text},
        ]

    # -- serialization -----------------------------------------------------------------

    def to_bytes(self) -> bytes:
        """Versioned canonical JSON."""
        p = self.params
        doc = {
            "format": BUNDLE_FORMAT,
            "version": BUNDLE_FORMAT_VERSION,
            "cache_key": self.cache_key,
            "query": self.query,
            "tenant": self.tenant,
            "token_count": self.token_count,
            "evidence_ids": list(self.evidence_ids),
            "policy_drops": [[r, c] for r, c in self.policy_drops],
            "params": {
                "token_budget": p.token_budget,
                "top_k": p.top_k,
                "diversity_lambda": p.diversity_lambda,
                "weights": p.weights.as_list(),
                "freshness_half_life_days": p.freshness_half_life_days,
                "as_of_us": p.as_of_us,
                "mask_redactions": p.mask_redactions,
                "policy_version": p.policy_version,
                "token_counter": p.token_counter,
            },
            "items": [
                [
                    i.evidence_id,
                    i.text,
                    i.source,
                    i.timestamp_us,
                    i.relevance,
                    i.strength,
                    i.freshness,
                    i.score,
                    i.tokens,
                    list(i.supported_by),
                    i.withheld_support,
                ]
                for i in self.items
            ],
            "proof_graph": {
                "nodes": [
                    [n.id, n.kind, n.source, n.timestamp_us, n.strength]
                    for n in self.proof_graph.nodes
                ],
                "edges": [[e.src, e.dst, e.relation, e.provenance] for e in self.proof_graph.edges],
            },
        }
        return canonical_json(doc)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> ContextBundle:
        """Decode `to_bytes` output; raise `BundleFormatError` on anything else."""
        try:
            doc = json.loads(bytes(data).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise BundleFormatError(f"bundle is not JSON: {exc}") from exc
        try:
            return _decode(doc)
        except BundleFormatError:
            raise
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise BundleFormatError(f"malformed bundle: {exc!r}") from exc


# -- strict decoding -------------------------------------------------------------------


def _s(v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError(f"expected str, got {type(v).__name__}")
    return v


def _i(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"expected int, got {type(v).__name__}")
    return v


def _f(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise TypeError(f"expected number, got {type(v).__name__}")
    return _finite("number", v)


def _b(v: Any) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"expected bool, got {type(v).__name__}")
    return v


def _str_tuple(v: Any) -> tuple[str, ...]:
    items = _seq(v)
    if not all(type(x) is str for x in items):
        raise TypeError("expected a list of strings")
    return tuple(items)


def _seq(v: Any, n: int | None = None) -> Sequence[Any]:
    if not isinstance(v, list) or (n is not None and len(v) != n):
        raise TypeError(f"expected list of {n if n is not None else 'any'} items")
    return v


def _map(v: Any) -> Mapping[str, Any]:
    if not isinstance(v, dict):
        raise TypeError(f"expected object, got {type(v).__name__}")
    return v


def _decode(raw: Any) -> ContextBundle:
    doc = _map(raw)
    if doc.get("format") != BUNDLE_FORMAT:
        raise BundleFormatError(f"unknown bundle format {doc.get('format')!r}")
    if doc.get("version") != BUNDLE_FORMAT_VERSION:
        raise BundleFormatError(f"unsupported bundle version {doc.get('version')!r}")
    p = _map(doc["params"])
    w = _seq(p["weights"], 3)
    half_life = p["freshness_half_life_days"]
    params = BundleParams(
        token_budget=_i(p["token_budget"]),
        top_k=_i(p["top_k"]),
        diversity_lambda=_f(p["diversity_lambda"]),
        weights=ScoringWeights(_f(w[0]), _f(w[1]), _f(w[2])),
        freshness_half_life_days=None if half_life is None else _f(half_life),
        as_of_us=_i(p["as_of_us"]),
        mask_redactions=_b(p["mask_redactions"]),
        policy_version=_s(p["policy_version"]),
        token_counter=_s(p["token_counter"]),
    )
    items = []
    for raw_item in _seq(doc["items"]):
        it = _seq(raw_item, 11)
        items.append(
            BundleItem(
                evidence_id=_s(it[0]),
                text=_s(it[1]),
                source=_s(it[2]),
                timestamp_us=_i(it[3]),
                relevance=_f(it[4]),
                strength=_f(it[5]),
                freshness=_f(it[6]),
                score=_f(it[7]),
                tokens=_i(it[8]),
                supported_by=_str_tuple(it[9]),
                withheld_support=_i(it[10]),
            )
        )
    graph = _map(doc["proof_graph"])
    nodes = tuple(
        ProofNode(_s(n[0]), _s(n[1]), _s(n[2]), _i(n[3]), _f(n[4]))
        for n in (_seq(x, 5) for x in _seq(graph["nodes"]))
    )
    edges = tuple(
        ProofEdge(_s(e[0]), _s(e[1]), _s(e[2]), _s(e[3]))
        for e in (_seq(x, 4) for x in _seq(graph["edges"]))
    )
    return ContextBundle(
        cache_key=_s(doc["cache_key"]),
        query=_s(doc["query"]),
        tenant=_s(doc["tenant"]),
        items=tuple(items),
        proof_graph=ProofGraph(nodes, edges),
        token_count=_i(doc["token_count"]),
        evidence_ids=_str_tuple(doc["evidence_ids"]),
        policy_drops=tuple(
            (_s(d[0]), _i(d[1])) for d in (_seq(x, 2) for x in _seq(doc["policy_drops"]))
        ),
        params=params,
    )
