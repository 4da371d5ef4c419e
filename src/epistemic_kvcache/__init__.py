"""epistemic-kvcache: a shared, durable, deduplicating L2 tier for LLM KV caches.

Importing the package imports nothing else: the client (`epistemic_kvcache.client`)
needs only `urllib3`; the server (`epistemic-kvcache serve`) needs the `[server]` extra.
"""

from epistemic_kvcache._version import __version__

__all__ = ["__version__"]
