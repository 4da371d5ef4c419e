"""Where candidates come from: the `CandidateSource` protocol and two sources.

A source returns candidate evidence for a query; it is *not* trusted to enforce policy
(the compiler filters tenant, redaction and session policy itself, whatever the source
did). `InMemoryCandidateSource` holds a list; `JsonlCandidateSource` reads one JSON
object per line and re-reads the file when its size or mtime changes.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from epistemic_kvcache.context.model import Candidate, Session, to_epoch_us


@runtime_checkable
class CandidateSource(Protocol):
    """Anything that can list candidate evidence for a query and session."""

    def fetch(self, query: str, session: Session) -> Sequence[Candidate]:
        """Return candidates (unfiltered; the compiler applies policy)."""
        ...


def _unique(candidates: Iterable[Candidate]) -> tuple[Candidate, ...]:
    out = tuple(candidates)
    seen: set[str] = set()
    for c in out:
        if c.id in seen:
            raise ValueError(f"duplicate candidate id {c.id!r}")
        seen.add(c.id)
    return out


class InMemoryCandidateSource:
    """A fixed list of candidates (ids must be unique)."""

    def __init__(self, candidates: Iterable[Candidate]) -> None:
        self._candidates = _unique(candidates)

    def fetch(self, query: str, session: Session) -> Sequence[Candidate]:
        """Every candidate; policy is the compiler's job."""
        return self._candidates


def _timestamp_us(value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError("timestamp: expected ISO 8601 string or epoch seconds")
    if isinstance(value, int | float):
        return round(float(value) * 1_000_000)
    if isinstance(value, str):
        return to_epoch_us(datetime.fromisoformat(value.replace("Z", "+00:00")))
    raise TypeError("timestamp: expected ISO 8601 string or epoch seconds")


def candidate_from_mapping(doc: Mapping[str, Any]) -> Candidate:
    """Build a `Candidate` from a JSON object.

    Keys: `id`, `text`, `source`, `timestamp` (ISO 8601 with offset, or epoch seconds),
    optional `tenant`, `strength`, `labels`, `redactions` (`[[start, end], ...]`),
    `supported_by`. Unknown keys are errors.
    """
    known = {"id", "text", "source", "timestamp", "tenant", "strength", "labels"}
    known |= {"redactions", "supported_by"}
    unknown = set(doc) - known
    if unknown:
        raise ValueError(f"unknown candidate fields {sorted(unknown)}")
    for name in ("id", "text", "source"):
        if not isinstance(doc.get(name), str):
            raise ValueError(f"candidate field {name!r}: expected a string")
    tenant = doc.get("tenant")
    if tenant is not None and not isinstance(tenant, str):
        raise ValueError("candidate field 'tenant': expected a string or null")
    return Candidate(
        id=doc["id"],
        text=doc["text"],
        source=doc["source"],
        timestamp_us=_timestamp_us(doc.get("timestamp")),
        tenant=tenant,
        strength=float(doc.get("strength", 0.5)),
        labels=frozenset(str(x) for x in doc.get("labels", ())),
        redactions=tuple((int(a), int(b)) for a, b in doc.get("redactions", ())),
        supported_by=tuple(str(x) for x in doc.get("supported_by", ())),
    )


class JsonlCandidateSource:
    """Candidates from a JSON Lines file (blank lines and `#` comments are skipped)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = Path(path)
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._candidates: tuple[Candidate, ...] = ()

    def _load(self) -> tuple[Candidate, ...]:
        out = []
        with self._path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                text = line.strip()
                if not text or text.startswith("#"):
                    continue
                try:
                    doc = json.loads(text)
                    if not isinstance(doc, dict):
                        raise ValueError("expected a JSON object")
                    out.append(candidate_from_mapping(doc))
                except (ValueError, TypeError) as exc:
                    raise ValueError(f"{self._path}:{lineno}: {exc}") from exc
        return _unique(out)

    def fetch(self, query: str, session: Session) -> Sequence[Candidate]:
        """Every candidate in the file (re-read when the file changed)."""
        st = self._path.stat()
        stamp = (st.st_mtime_ns, st.st_size)
        with self._lock:
            if stamp != self._stamp:
                self._candidates = self._load()
                self._stamp = stamp
            return self._candidates
