"""The epoch registry of the durable backend: (tenant, scope) -> epoch, in its own LMDB.

How it works
------------
An entry written with an epoch scope is tagged with the scope's epoch at that moment;
bumping the scope makes every older entry stale at once (reads miss), and a background
sweep reclaims them. The registry is a small LMDB environment of its own (``epochs/``
under the persist dir, or ``epoch_dir``), so that several server processes may share it:
a bump is one synced write there, and a read of a tagged entry compares the entry's epoch
with the registry's.

Per-tenant share: a tenant may register at most `max_scopes_per_tenant` scopes. When it
is at its limit, scopes of that tenant with no live tagged entry in this store are
pruned first (their rows removed: nothing is tagged with them, so forgetting their epoch
cannot make a stale entry fresh). Pruning needs to know every entry tagged with a scope,
so it only happens when the registry is private to this store (no shared `epoch_dir`); a
tenant at its limit in a shared registry gets `QuotaExceededError`.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import lmdb

from epistemic_kvcache.errors import ConfigurationError, QuotaExceededError, StorageIOError

_U16 = struct.Struct(">H")
_U64 = struct.Struct(">Q")

DEFAULT_MAX_SCOPES_PER_TENANT = 10_000
"""A tenant's epoch scopes; each is one small row, so this bounds the registry per tenant."""


def _prefix(tenant: str) -> bytes:
    raw = tenant.encode()
    return _U16.pack(len(raw)) + raw


class EpochRegistry:
    """Epochs of (tenant, scope), persisted and shareable between processes."""

    def __init__(
        self,
        directory: Path,
        *,
        shared: bool,
        max_scopes_per_tenant: int = DEFAULT_MAX_SCOPES_PER_TENANT,
    ) -> None:
        self.dir = directory
        self.shared = shared
        self.max_scopes_per_tenant = max_scopes_per_tenant
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._env = lmdb.open(
                str(directory), map_size=64 << 20, subdir=True, sync=True, max_dbs=1, mode=0o600
            )
        except (OSError, lmdb.Error) as exc:
            raise ConfigurationError(
                f"invalid epoch_dir: cannot open {str(directory)!r} ({exc})"
            ) from exc

    def current(self, tenant: str, scope: str) -> int:
        with self._env.begin() as txn:
            v = txn.get(_prefix(tenant) + scope.encode())
        return _U64.unpack(v)[0] if v is not None else 0

    def scopes(self, tenant: str) -> dict[str, int]:
        """Every registered scope of `tenant` with its epoch."""
        p = _prefix(tenant)
        out: dict[str, int] = {}
        with self._env.begin() as txn:
            cur = txn.cursor()
            if cur.set_range(p):
                for k, v in cur:
                    kb = bytes(k)
                    if not kb.startswith(p):
                        break
                    out[kb[len(p) :].decode()] = _U64.unpack(v)[0]
        return out

    def advance(self, tenant: str, scope: str, live: Callable[[str, str], int]) -> int:
        """Bump (tenant, scope); `live(tenant, scope)` counts this store's entries tagged
        with a scope (for pruning). Raises `QuotaExceededError`, `StorageIOError`."""
        k = _prefix(tenant) + scope.encode()
        try:
            with self._env.begin(write=True) as txn:
                v = txn.get(k)
                if v is None:
                    self._make_room(txn, tenant, live)
                n = (_U64.unpack(v)[0] if v is not None else 0) + 1
                txn.put(k, _U64.pack(n))
        except lmdb.Error as exc:
            raise StorageIOError(f"epoch bump failed in {self.dir}: {exc}") from exc
        return n

    def _make_room(
        self, txn: lmdb.Transaction, tenant: str, live: Callable[[str, str], int]
    ) -> None:
        p = _prefix(tenant)
        names: list[bytes] = []
        cur = txn.cursor()
        if cur.set_range(p):
            for k, _v in cur:
                kb = bytes(k)
                if not kb.startswith(p):
                    break
                names.append(kb)
        if len(names) < self.max_scopes_per_tenant:
            return
        if not self.shared:
            for k in list(names):
                if live(tenant, k[len(p) :].decode()) == 0:
                    txn.delete(k)
                    names.remove(k)
                    if len(names) < self.max_scopes_per_tenant:
                        return
        raise QuotaExceededError(
            f"epoch scope quota exceeded: this tenant has {len(names)} scopes "
            f"(limit {self.max_scopes_per_tenant}) with live entries",
            resource="epoch_scopes",
        )

    def close(self) -> None:
        self._env.close()
