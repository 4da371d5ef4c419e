"""The synchronous, thread-safe block store: index, CAS, tiers, durability."""

from epistemic_kvcache.store.api import (
    Buffer,
    ConsistencyReport,
    PutOutcome,
    PutResult,
    SharedKvBackend,
    StoreStats,
    TierStats,
)
from epistemic_kvcache.store.codec import WarmCodec
from epistemic_kvcache.store.engine import SharedKvIndex, digest_of

__all__ = [
    "Buffer",
    "ConsistencyReport",
    "PutOutcome",
    "PutResult",
    "SharedKvBackend",
    "SharedKvIndex",
    "StoreStats",
    "TierStats",
    "WarmCodec",
    "digest_of",
]
