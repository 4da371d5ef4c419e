"""The Python client of epistemic-kvcache: `KvCacheConfig` and `EpistemicGraphKVBackend`."""

from epistemic_kvcache.client.backend import (
    RETRY_ON_RESET,
    EpistemicGraphKVBackend,
    KvCacheOutcomeUnknownError,
    KvCacheUnavailableError,
    PutOutcome,
)
from epistemic_kvcache.client.breaker import CircuitBreaker
from epistemic_kvcache.client.config import KvCacheConfig
from epistemic_kvcache.client.stats import ClientCounters, KvCacheStats, TierOccupancy
from epistemic_kvcache.shared import is_loopback_host

__all__ = [
    "RETRY_ON_RESET",
    "CircuitBreaker",
    "ClientCounters",
    "EpistemicGraphKVBackend",
    "KvCacheConfig",
    "KvCacheOutcomeUnknownError",
    "KvCacheStats",
    "KvCacheUnavailableError",
    "PutOutcome",
    "TierOccupancy",
    "is_loopback_host",
]
