"""The synchronous, thread-safe block store: index, CAS, tiers, durability.

`SharedKvIndex` keeps everything in RAM (hot + warm); `SharedKvStoreBackend` adds the
durable cold tier under a persist directory. Both implement `SharedKvBackend`.
"""

from epistemic_kvcache.store.api import (
    BlockData,
    Buffer,
    ConsistencyReport,
    Handover,
    PutCond,
    PutOutcome,
    PutResult,
    SharedKvBackend,
    StoreHealth,
    StoreStats,
    TierStats,
)
from epistemic_kvcache.store.codec import WarmCodec
from epistemic_kvcache.store.durable import DiskIO, SharedKvStoreBackend
from epistemic_kvcache.store.engine import digest_of
from epistemic_kvcache.store.memory import SharedKvIndex

__all__ = [
    "BlockData",
    "Buffer",
    "ConsistencyReport",
    "DiskIO",
    "Handover",
    "PutCond",
    "PutOutcome",
    "PutResult",
    "SharedKvBackend",
    "SharedKvIndex",
    "SharedKvStoreBackend",
    "StoreHealth",
    "StoreStats",
    "TierStats",
    "WarmCodec",
    "digest_of",
]
