"""Pure scoring functions: lexical relevance (BM25), freshness decay, MMR selection.

Relevance is Okapi BM25 of the query against each candidate, with document frequencies
taken over the post-policy pool and scores divided by the pool maximum (so 0..1).
Freshness halves every `half_life_days`. MMR picks, one at a time, the candidate
maximising `lambda * score - (1 - lambda) * max cosine similarity to those already
picked`; the similarity to the picked set is updated incrementally, O(k * n).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence

_TERMS = re.compile(r"\w+")
US_PER_DAY = 86_400 * 1_000_000


def terms(text: str) -> list[str]:
    """Lower-cased word terms of `text`."""
    return _TERMS.findall(text.lower())


def unit_vector(term_list: Sequence[str]) -> dict[str, float]:
    """L2-normalised term-frequency vector (empty for no terms)."""
    tf = Counter(term_list)
    norm = math.sqrt(sum(v * v for v in tf.values()))
    return {t: v / norm for t, v in tf.items()} if norm else {}


def cosine(a: dict[str, float], b: dict[str, float]) -> float:
    """Dot product of two unit vectors."""
    if len(a) > len(b):
        a, b = b, a
    return sum(v * b.get(t, 0.0) for t, v in a.items())


def bm25(
    query: str, docs: Sequence[Sequence[str]], *, k1: float = 1.2, b: float = 0.75
) -> list[float]:
    """BM25 score of every doc (a term list) for `query`, normalised to 0..1."""
    n = len(docs)
    q_terms = sorted(set(terms(query)))
    if not n or not q_terms:
        return [0.0] * n
    avg_len = sum(len(d) for d in docs) / n or 1.0
    tfs = [Counter(d) for d in docs]
    idf = {}
    for t in q_terms:
        df = sum(1 for tf in tfs if t in tf)
        idf[t] = math.log(1.0 + (n - df + 0.5) / (df + 0.5))
    raw = []
    for doc, tf in zip(docs, tfs, strict=True):
        denom_len = k1 * (1.0 - b + b * len(doc) / avg_len)
        s = 0.0
        for t in q_terms:
            f = tf.get(t, 0)
            if f:
                s += idf[t] * f * (k1 + 1.0) / (f + denom_len)
        raw.append(s)
    top = max(raw)
    return [s / top for s in raw] if top > 0 else [0.0] * n


def freshness(timestamp_us: int, as_of_us: int, half_life_days: float | None) -> float:
    """`0.5 ** (age / half_life)`; 1.0 without a half-life or for future evidence."""
    if half_life_days is None:
        return 1.0
    age_days = max(0, as_of_us - timestamp_us) / US_PER_DAY
    return math.pow(0.5, age_days / half_life_days)


def mmr_select(
    scores: Sequence[float], vectors: Sequence[dict[str, float]], k: int, lam: float
) -> list[int]:
    """Indices of up to `k` items in MMR order. Ties go to the lower index."""
    n = len(scores)
    max_sim = [0.0] * n
    remaining = list(range(n))
    picked: list[int] = []
    while remaining and len(picked) < k:
        best_pos = 0
        best_val = -math.inf
        for pos, i in enumerate(remaining):
            val = lam * scores[i] - (1.0 - lam) * max_sim[i]
            if val > best_val:
                best_val, best_pos = val, pos
        best = remaining.pop(best_pos)
        picked.append(best)
        if lam < 1.0:
            vb = vectors[best]
            for i in remaining:
                s = cosine(vectors[i], vb)
                max_sim[i] = max(max_sim[i], s)
    return picked
