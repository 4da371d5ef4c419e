"""The Python client of epistemic-kvcache: `KvCacheConfig` and `EpistemicGraphKVBackend`."""

from epistemic_kvcache.client.backend import (
    EpistemicGraphKVBackend,
    KvCacheUnavailableError,
    PutOutcome,
)
from epistemic_kvcache.client.breaker import CircuitBreaker
from epistemic_kvcache.client.config import KvCacheConfig, is_loopback_host
from epistemic_kvcache.client.stats import ClientCounters, KvCacheStats, TierOccupancy

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
