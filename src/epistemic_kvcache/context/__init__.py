"""Context bundles: compile retrieved evidence into cacheable, prefix-stable prompts.

- `ContextCompiler.compile(...)` -> `ContextBundle` (fetch, policy filter, score, MMR,
  token budget, proof graph), cached under `ctxbundle:<sha256>` keys through any backend
  with `get`/`put` (the KV server's client, or an in-process TTL cache).
- `ContextBundle.as_prompt_messages(turn)`: a system message byte-identical for every
  turn over the same bundle, so the serving engine's prefix cache reuses it.
- `KVCacheLayeringPolicy`: per-request store/skip of the request's KV
  (`kv_transfer_params: {"lmcache.skip_save": ...}`); `bundle_chat_completion` sends
  a bundle through the `openai` client with that decision.

See docs/context-bundles.md.
"""

from epistemic_kvcache.context.cache import (
    BundleCacheBackend,
    NullBundleCache,
    TTLBundleCache,
    reset_context_compiler_cache,
    resolve_context_compiler_cache,
    set_context_compiler_cache,
)
from epistemic_kvcache.context.compiler import (
    COMPILER_VERSION,
    KEY_PREFIX,
    CompilerStats,
    ContextCompiler,
    compute_bundle_cache_key,
)
from epistemic_kvcache.context.layering import (
    KVCacheLayeringPolicy,
    LayeringDecision,
    LayeringRequest,
    PriorityClass,
)
from epistemic_kvcache.context.model import (
    DEFAULT_SYSTEM_PREAMBLE,
    BundleFormatError,
    BundleItem,
    BundleParams,
    Candidate,
    ContextBundle,
    ProofEdge,
    ProofGraph,
    ProofNode,
    ScoringWeights,
    Session,
    SessionPolicy,
)
from epistemic_kvcache.context.serving import (
    BundleCompletion,
    bundle_chat_completion,
    layering_request_for,
    make_openai_client,
)
from epistemic_kvcache.context.sources import (
    CandidateSource,
    InMemoryCandidateSource,
    JsonlCandidateSource,
    candidate_from_mapping,
)
from epistemic_kvcache.context.tokens import ApproxTokenCounter, TokenCounter

__all__ = [
    "COMPILER_VERSION",
    "DEFAULT_SYSTEM_PREAMBLE",
    "KEY_PREFIX",
    "ApproxTokenCounter",
    "BundleCacheBackend",
    "BundleCompletion",
    "BundleFormatError",
    "BundleItem",
    "BundleParams",
    "Candidate",
    "CandidateSource",
    "CompilerStats",
    "ContextBundle",
    "ContextCompiler",
    "InMemoryCandidateSource",
    "JsonlCandidateSource",
    "KVCacheLayeringPolicy",
    "LayeringDecision",
    "LayeringRequest",
    "NullBundleCache",
    "PriorityClass",
    "ProofEdge",
    "ProofGraph",
    "ProofNode",
    "ScoringWeights",
    "Session",
    "SessionPolicy",
    "TTLBundleCache",
    "TokenCounter",
    "bundle_chat_completion",
    "candidate_from_mapping",
    "compute_bundle_cache_key",
    "layering_request_for",
    "make_openai_client",
    "reset_context_compiler_cache",
    "resolve_context_compiler_cache",
    "set_context_compiler_cache",
]
