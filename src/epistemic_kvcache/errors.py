"""Exceptions, one root, split by who is at fault.

- `KvCacheError` is the root; catch it to catch everything this package raises.
- `ConfigurationError` (also `ValueError`): a setting is wrong; fix the configuration.
- `ProtocolError`: bytes on a wire broke the protocol. `RemoteProtocolError` means the
  peer sent them; `LocalProtocolError` means we were asked to send something invalid.
- `StoreError`: the store could not do what was asked. Subclasses say why and whether
  retrying can help.
- `AuthError`: credentials missing or invalid (401) / `ForbiddenError` (403).
"""

from __future__ import annotations


class KvCacheError(Exception):
    """Root of every exception raised by epistemic_kvcache."""


class ConfigurationError(KvCacheError, ValueError):
    """A setting is invalid. The message names the setting and the offending value."""


class ProtocolError(KvCacheError):
    """A wire protocol was violated. `status_hint` is the HTTP status to answer with."""

    def __init__(self, message: str, *, status_hint: int = 400) -> None:
        super().__init__(message)
        self.status_hint = status_hint


class RemoteProtocolError(ProtocolError):
    """The peer sent bytes that break the protocol."""


class LocalProtocolError(ProtocolError):
    """We were asked to send something the protocol does not allow."""


class StoreError(KvCacheError):
    """The store could not complete an operation. Catch it around store calls."""


class InvalidKeyError(StoreError, ValueError):
    """The key (or namespace) is empty, too long, or not valid UTF-8."""


class BlockTooLargeError(StoreError, ValueError):
    """The block exceeds `max_block_bytes`."""


class NotFoundError(StoreError, LookupError):
    """A named snapshot or branch does not exist (HTTP 404)."""


class CapacityError(StoreError):
    """The block cannot fit: every block that could make room is pinned (HTTP 507)."""


class QuotaExceededError(CapacityError):
    """A tenant reached one of its own limits (`resource`: "keys", "pins", "snapshots",
    "epoch_scopes"). Other tenants are unaffected; free some of that resource and retry."""

    def __init__(self, message: str, *, resource: str) -> None:
        super().__init__(message)
        self.resource = resource


class DiskFullError(StoreError):
    """The disk has no space (ENOSPC). Nothing was acknowledged; retry once space returns."""


class StorageIOError(StoreError):
    """A write or sync to disk failed (EIO, ...). Nothing was acknowledged."""


class OutcomeUnknownError(StoreError):
    """The operation may or may not have been applied: the answer was lost after the
    request reached the store (or the server). Do not assume either; read back (or
    retry a write that is safe to repeat) once the server answers again."""


class ClusterUnavailableError(StorageIOError, OutcomeUnknownError):
    """Cluster mode: the shared Redis/Valkey Cluster cannot be reached, or did not accept
    (or replicate) the write within the retry window. Retry later (HTTP 503
    `outcome_unknown`, RESP -ERR); a write that failed this way may or may not have been
    applied."""


class StoreFaultError(StoreError):
    """The store hit an unexpected internal fault and turned read-only until restarted.

    Reads keep working; every write fails at once with this error (HTTP 503, RESP -ERR).
    The log says why, once."""


class StoreClosedError(StoreError):
    """The store was closed by its owner; no more operations are accepted."""


class AuthError(KvCacheError):
    """Credentials are missing or invalid (HTTP 401, RESP -NOAUTH/-WRONGPASS)."""


class ForbiddenError(AuthError):
    """Credentials are valid but do not allow this operation (HTTP 403)."""
