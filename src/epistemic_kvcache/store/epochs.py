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

The map is shared too, and the count limit alone does not protect it: ~14 tenants at
10,000 scopes of long names filled the 64 MiB map, and from then on every tenant's new
scope failed (`MDB_MAP_FULL`, a storage error). So each tenant also has a bounded share
of the map (sizes below in bytes of rows, and of the registry's pages):

- below `map / PRESSURE_DIVISOR` of pages, only the count limit applies;
- past it, a tenant's rows may grow to its share: `max(map / FLOOR_DIVISOR,
  map / SHARE_DIVISOR / T)`, T the tenants holding scopes (the caller included): a
  tenant that took more earlier (alone, or while fewer tenants shared the registry)
  adds nothing more;
- past `map / RESERVE_DIVISOR` of pages, only tenants below `map / FLOOR_DIVISOR` add
  (the rest of the map is kept for newcomers' first scopes);
- past `map * 3 / 4` of pages nobody adds: LMDB's pages are at least half full, so the
  map itself never fills.

A refused tenant first loses its unused scopes (private registry, as above), else gets
`QuotaExceededError` saying why; bumping an existing scope rewrites its row and is never
refused. With the 64 MiB map: a floor of 256 KiB of rows per tenant (~550 scopes of the
longest names, thousands of short ones), kept for ~40 tenants arriving after the map is
half full.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import lmdb

from epistemic_kvcache.errors import ConfigurationError, QuotaExceededError, StorageIOError
from epistemic_kvcache.options import DEFAULT_STORE_OPTIONS

_U16 = struct.Struct(">H")
_U64 = struct.Struct(">Q")

DEFAULT_MAX_SCOPES_PER_TENANT = DEFAULT_STORE_OPTIONS.max_epoch_scopes_per_tenant
"""A tenant's epoch scopes; each is one small row, so this bounds the registry per tenant."""
DEFAULT_MAP_BYTES = 64 << 20
"""The registry's LMDB map (address space; the file grows with its rows)."""
PRESSURE_DIVISOR = 8
"""Tenants' shares are enforced once the registry's pages exceed map / this."""
SHARE_DIVISOR = 8
"""Under pressure each tenant may hold map / this / tenants (in row bytes) ..."""
FLOOR_DIVISOR = 256
"""... and at least map / this (in row bytes)."""
RESERVE_DIVISOR = 2
"""Past map / this of pages only tenants below their floor add scopes."""
_ROW_OVERHEAD = 12
"""An LMDB leaf node's header (8 bytes) and page pointer (2), rounded up."""


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
        map_size_bytes: int = DEFAULT_MAP_BYTES,
    ) -> None:
        self.dir = directory
        self.shared = shared
        self.max_scopes_per_tenant = max_scopes_per_tenant
        self.map_size_bytes = map_size_bytes
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._env = lmdb.open(
                str(directory),
                map_size=map_size_bytes,
                subdir=True,
                sync=True,
                max_dbs=1,
                mode=0o600,
            )
            self._db = self._env.open_db()
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
                    self._make_room(txn, tenant, k, live)
                n = (_U64.unpack(v)[0] if v is not None else 0) + 1
                txn.put(k, _U64.pack(n))
        except lmdb.Error as exc:
            raise StorageIOError(f"epoch bump failed in {self.dir}: {exc}") from exc
        return n

    def _make_room(
        self, txn: lmdb.Transaction, tenant: str, new: bytes, live: Callable[[str, str], int]
    ) -> None:
        """Room for `tenant`'s new row `new`: within its scope count and, under pressure,
        its share of the map; its unused scopes are pruned (private registry) to make it."""
        p = _prefix(tenant)
        names: list[bytes] = []
        cur = txn.cursor()
        if cur.set_range(p):
            for k, _v in cur:
                kb = bytes(k)
                if not kb.startswith(p):
                    break
                names.append(kb)
        share, floor, level = self._room(txn, p)
        mine = sum(_row_bytes(k) for k in names)
        need = _row_bytes(new)
        freed = 0

        def fits() -> bool:
            if len(names) >= self.max_scopes_per_tenant or mine + need > share:
                return False
            if level == "full" or (level == "reserve" and mine + need > floor):
                return freed >= need  # room only where this tenant's pruned rows were
            return True

        if fits():
            return
        if not self.shared:
            for k in list(names):
                if live(tenant, k[len(p) :].decode()) == 0:
                    txn.delete(k)
                    names.remove(k)
                    mine -= _row_bytes(k)
                    freed += _row_bytes(k)
                    if fits():
                        return
        if len(names) >= self.max_scopes_per_tenant:
            raise QuotaExceededError(
                f"epoch scope quota exceeded: this tenant has {len(names)} scopes "
                f"(limit {self.max_scopes_per_tenant}) with live entries",
                resource="epoch_scopes",
            )
        if mine + need > share:
            raise QuotaExceededError(
                f"epoch scope quota exceeded: the epoch registry is shared by every tenant "
                f"and this tenant holds its share of it ({len(names)} scopes, {mine} of "
                f"{share} bytes); bump or reuse existing scopes",
                resource="epoch_scopes",
            )
        raise QuotaExceededError(
            "epoch scope quota exceeded: the epoch registry is "
            + ("full" if level == "full" else "nearly full (the rest is kept for tenants "
               "with few scopes)")
            + f"; this tenant has {len(names)} scopes: bump or reuse them",
            resource="epoch_scopes",
        )  # fmt: skip

    def _room(self, txn: lmdb.Transaction, prefix: bytes) -> tuple[int, int, str]:
        """(the row bytes the tenant of `prefix` may hold now, its floor, the registry's
        level: "ok", "reserve" (only tenants below their floor add) or "full")."""
        st = txn.stat(self._db)
        used = (st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]) * st["psize"]
        size = self.map_size_bytes
        floor = size // FLOOR_DIVISOR
        if used * 4 >= size * 3:
            level = "full"
        elif used * RESERVE_DIVISOR >= size:
            level = "reserve"
        else:
            level = "ok"
        if used * PRESSURE_DIVISOR < size:
            return size, floor, level  # no pressure: only the count limit applies
        tenants = 0
        mine_counted = False
        cur = txn.cursor()
        found = cur.first()
        while found:
            key = bytes(cur.key())
            plen = _U16.unpack_from(key)[0] + _U16.size
            tenants += 1
            mine_counted = mine_counted or key[:plen] == prefix
            # past this tenant's rows: a scope is UTF-8, which has no 0xff byte
            found = cur.set_range(key[:plen] + b"\xff")
        tenants += 0 if mine_counted else 1
        return max(floor, size // SHARE_DIVISOR // tenants), floor, level

    def close(self) -> None:
        self._env.close()


def _row_bytes(key: bytes) -> int:
    """What one scope's row takes in an LMDB leaf page."""
    return len(key) + _U64.size + _ROW_OVERHEAD
