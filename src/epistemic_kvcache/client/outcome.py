"""What a client PUT did (`PutOutcome`) and the errors of calls that cannot degrade.

The outcome words are the API's own (`proto.http.OUTCOME_*`, what the server writes in
`X-Kv-Outcome` and in batch results): defined once, read here.
"""

from __future__ import annotations

import enum

from epistemic_kvcache.errors import KvCacheError, OutcomeUnknownError
from epistemic_kvcache.proto.errors import client_rule
from epistemic_kvcache.proto.http import (
    OUTCOME_CONFLICT,
    OUTCOME_CREATED,
    OUTCOME_DUPLICATE,
    OUTCOME_ERROR_PREFIX,
    OUTCOME_MISSING,
    OUTCOME_REPLACED,
)


class PutOutcome(enum.Enum):
    """What one `put` did (the server's `X-Kv-Outcome` / batch result words).

    Truthy exactly when the server holds the given bytes under the key afterwards
    (`NEW`, `DUPLICATE`, `REPLACED`), so `if kv.put(k, b):` reads naturally.
    """

    NEW = OUTCOME_CREATED
    """The key did not exist; it was created."""
    DUPLICATE = OUTCOME_DUPLICATE
    """The key already held exactly these bytes; nothing was written."""
    REPLACED = OUTCOME_REPLACED
    """The key held other bytes; they were replaced."""
    CONFLICT = OUTCOME_CONFLICT
    """Refused: the key exists with other bytes and the server keeps the first write
    (a first-write-wins tenant, or an `nx` condition)."""
    MISSING = OUTCOME_MISSING
    """Refused: an `xx` condition and the key does not exist."""
    FAILED = "failed"
    """Not stored: unreachable or failing server, block refused (too large, quota)."""
    UNKNOWN = "unknown"
    """The server could not say whether the write was applied (cluster mode: the shared
    cluster did not confirm it, HTTP 503 `outcome_unknown`); read the key back."""

    @property
    def stored(self) -> bool:
        """True when the server holds these bytes under the key."""
        return self in _STORED

    def __bool__(self) -> bool:
        return self in _STORED

    @classmethod
    def from_word(cls, word: object) -> PutOutcome:
        """The outcome named by a server result word; `error:<code>` is UNKNOWN when the
        error table says such a write may have been applied, else (and for words it
        does not know) FAILED."""
        for member in cls:
            if member.value == word:
                return member
        if (
            isinstance(word, str)
            and word.startswith(OUTCOME_ERROR_PREFIX)
            and client_rule(500, word[len(OUTCOME_ERROR_PREFIX) :]).action == "unknown"
        ):
            return cls.UNKNOWN
        return cls.FAILED


_STORED = frozenset({PutOutcome.NEW, PutOutcome.DUPLICATE, PutOutcome.REPLACED})


class KvCacheUnavailableError(KvCacheError):
    """The server could not be reached (or answered 5xx/429/408).

    Raised only by calls whose silent failure would mislead the caller (`epoch_bump`,
    `epoch_get`, `list_keys`, `list_snapshots`, `list_branches`); the data-path calls
    degrade to a miss / False instead. Retrying later may help.
    """


class KvCacheOutcomeUnknownError(KvCacheUnavailableError, OutcomeUnknownError):
    """A request that is not safe to repeat (`snapshot`, `fork`, `epoch_bump`) may or may
    not have been applied: the connection broke after it was sent, or the server said
    it cannot tell (cluster mode, `outcome_unknown`). It was not retried; look before
    repeating it (`list_snapshots`, `list_branches`, `epoch_get`)."""
