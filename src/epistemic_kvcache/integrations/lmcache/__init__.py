"""LMCache plugins. The only package that may import `lmcache` or `torch`.

- `l2_native_connector.EpistemicGraphL2Connector`: MP-mode `native_plugin` L2 client
  (imports neither lmcache nor torch: LMCache loads it by module path).
- `external_backend.EpistemicGraphExternalBackend`: v1 `storage_plugins` backend (Path A);
  importing it imports lmcache and torch.
"""

from epistemic_kvcache.integrations.lmcache.l2_native_connector import EpistemicGraphL2Connector

__all__ = ["EpistemicGraphL2Connector"]
