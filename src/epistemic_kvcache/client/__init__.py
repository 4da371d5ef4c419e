"""The Python client of epistemic-kvcache: `KvCacheConfig` and `EpistemicGraphKVBackend`."""

from epistemic_kvcache.client.backend import (
    EpistemicGraphKVBackend,
    KvCacheUnavailableError,
    PutOutcome,
)
from epistemic_kvcache.client.breaker import CircuitBreaker
from epistemic_kvcache.client.config import KvCacheConfig
from epistemic_kvcache.client.stats import ClientCounters, KvCacheStats, TierOccupancy
from epistemic_kvcache.shared import is_loopback_host

__all__ = [
    "CircuitBreaker",
    "ClientCounters",
    "EpistemicGraphKVBackend",
    "KvCacheConfig",
    "KvCacheStats",
    "KvCacheUnavailableError",
    "PutOutcome",
    "TierOccupancy",
    "is_loopback_host",
]
