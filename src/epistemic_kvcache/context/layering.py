"""Per-request decision whether a request's KV is worth storing in the L2 tier.

Storing KV costs bandwidth and L2 capacity; it pays only when the prefix is long enough
to be expensive to recompute and is likely to be read again. The policy decides from:

- the priority class: `BACKGROUND_INGESTION` never stores (one-off bulk work would
  flush the cache); `INTERACTIVE` halves every threshold (a user is waiting);
- the prompt length: below `min_prompt_tokens` (default one LMCache chunk, 256 tokens)
  there is nothing worth a round trip;
- expected reuse: how often the same shared prefix (a context bundle's cache key, or the
  digest of a recurring system prompt) was seen recently, in a bounded LRU window, or
  an explicit caller hint. A prefix is stored from its `min_expected_reuse`-th sighting
  on (a "doorkeeper": one-off prefixes never reach the tier);
- very long prompts (`long_prompt_tokens`) are stored even without reuse evidence:
  recomputing them costs more than storing them.

The decision travels to vLLM/LMCache as
`extra_body={"kv_transfer_params": {"lmcache.skip_save": <not store>}}`.
"""

from __future__ import annotations

import enum
import hashlib
import math
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any


class PriorityClass(enum.Enum):
    """Who is waiting for the request."""

    INTERACTIVE = "interactive"
    """A user is waiting: thresholds are halved."""
    STANDARD = "standard"
    """Default traffic: thresholds as configured."""
    BACKGROUND_INGESTION = "background_ingestion"
    """Bulk/offline ingestion: never stores."""


@dataclass(frozen=True, slots=True)
class LayeringRequest:
    """What the policy needs to know about one request.

    `shared_prefix_key` identifies a prefix shared across requests (use a context
    bundle's `cache_key`); `system_prompt` is hashed to recognise recurring system
    prompts; `expected_reuse` is an optional caller hint (expected number of reads).
    """

    prompt_tokens: int
    priority: PriorityClass = PriorityClass.STANDARD
    shared_prefix_key: str | None = None
    system_prompt: str | None = None
    expected_reuse: int | None = None


@dataclass(frozen=True, slots=True)
class LayeringDecision:
    """Store or skip, why, and the numbers that led there."""

    store: bool
    reason: str
    priority: PriorityClass
    prompt_tokens: int
    expected_reuse: int
    min_prompt_tokens: int
    min_expected_reuse: int

    @property
    def kv_transfer_params(self) -> dict[str, bool]:
        """`{"lmcache.skip_save": not store}`."""
        return {"lmcache.skip_save": not self.store}

    def extra_body(self) -> dict[str, Any]:
        """`{"kv_transfer_params": {...}}` for an OpenAI-compatible request to vLLM."""
        return {"kv_transfer_params": self.kv_transfer_params}


class KVCacheLayeringPolicy:
    """Decides per request whether its KV is stored; thread-safe; counts decisions."""

    def __init__(
        self,
        *,
        min_prompt_tokens: int = 256,
        min_expected_reuse: int = 2,
        long_prompt_tokens: int = 8192,
        window_size: int = 4096,
    ) -> None:
        for name, value in (
            ("min_prompt_tokens", min_prompt_tokens),
            ("min_expected_reuse", min_expected_reuse),
            ("long_prompt_tokens", long_prompt_tokens),
            ("window_size", window_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"invalid {name}: expected an integer >= 1 (got {value!r})")
        self.min_prompt_tokens = min_prompt_tokens
        self.min_expected_reuse = min_expected_reuse
        self.long_prompt_tokens = long_prompt_tokens
        self.window_size = window_size
        self._lock = threading.Lock()
        self._seen: OrderedDict[str, int] = OrderedDict()
        self._counters: Counter[tuple[str, str]] = Counter()

    def _sighting(self, token: str) -> int:
        """Record one more sighting of `token` (LRU-bounded) and return the count."""
        n = self._seen.pop(token, 0) + 1
        self._seen[token] = n
        while len(self._seen) > self.window_size:
            self._seen.popitem(last=False)
        return n

    def decide(self, request: LayeringRequest) -> LayeringDecision:
        """Store or skip `request`'s KV, with the reason (see the module docstring)."""
        if request.prompt_tokens < 0:
            raise ValueError(f"invalid prompt_tokens: expected >= 0 (got {request.prompt_tokens})")
        halve = request.priority is PriorityClass.INTERACTIVE
        min_tokens = (
            max(1, math.ceil(self.min_prompt_tokens / 2)) if halve else self.min_prompt_tokens
        )
        min_reuse = (
            max(1, math.ceil(self.min_expected_reuse / 2)) if halve else self.min_expected_reuse
        )
        long_tokens = (
            max(1, math.ceil(self.long_prompt_tokens / 2)) if halve else self.long_prompt_tokens
        )
        with self._lock:
            bundle_seen = prompt_seen = 0
            if request.shared_prefix_key is not None:
                bundle_seen = self._sighting("b:" + request.shared_prefix_key)
            if request.system_prompt is not None:
                digest = hashlib.sha256(request.system_prompt.encode("utf-8")).hexdigest()
                prompt_seen = self._sighting("s:" + digest)
            hint = request.expected_reuse or 0
            reuse = max(bundle_seen, prompt_seen, hint)

            if request.priority is PriorityClass.BACKGROUND_INGESTION:
                store, reason = False, "background_ingestion"
            elif request.prompt_tokens < min_tokens:
                store, reason = False, "prompt_too_short"
            elif reuse >= min_reuse:
                store = True
                if bundle_seen >= min_reuse:
                    reason = "shared_bundle_prefix"
                elif prompt_seen >= min_reuse:
                    reason = "recurring_system_prompt"
                else:
                    reason = "reuse_hint"
            elif request.prompt_tokens >= long_tokens:
                store, reason = True, "long_prompt"
            else:
                store, reason = False, "low_expected_reuse"
            self._counters[(request.priority.value, reason)] += 1
        return LayeringDecision(
            store=store,
            reason=reason,
            priority=request.priority,
            prompt_tokens=request.prompt_tokens,
            expected_reuse=reuse,
            min_prompt_tokens=min_tokens,
            min_expected_reuse=min_reuse,
        )

    def counters(self) -> dict[tuple[str, str], int]:
        """Decisions so far, by `(priority class, reason)`."""
        with self._lock:
            return dict(self._counters)

    def counters_by_class(self) -> dict[str, dict[str, int]]:
        """Decisions so far as `{class: {reason: n}}`, plus a `"stored"`/`"skipped"`
        total per class."""
        stored_reasons = {"shared_bundle_prefix", "recurring_system_prompt", "reuse_hint"}
        stored_reasons.add("long_prompt")
        out: dict[str, dict[str, int]] = {}
        for (cls, reason), n in self.counters().items():
            d = out.setdefault(cls, {"stored": 0, "skipped": 0})
            d[reason] = d.get(reason, 0) + n
            d["stored" if reason in stored_reasons else "skipped"] += n
        return out
