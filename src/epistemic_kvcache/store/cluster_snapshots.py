"""Snapshots and branches in cluster mode (see docs/cluster.md).

How it works
------------
All in the tenant's hash slot: `{T}:snaps` (id -> JSON record), `{T}:s:<id>` (a snapshot's
entries), `{T}:branches` (id -> JSON record), `{T}:b:<id>` / `{T}:bz:<id>` / `{T}:bc:<id>`
(a branch overlay's entries, key order and counters: written with the same `ENTRY_PUT`
as live keys).

Creating a snapshot:
1. `SNAP_READ` reads the selected live entries in one script: one instant of the tenant;
2. every distinct block they name gets one held reference per entry, pinned
   (`BLOB_ADJ` with positive deltas), taken before anything names them from a snapshot;
   if a block vanished between 1 and 2 (its last key was replaced meanwhile), the holds
   are given back and the snapshot is read again (a later instant), a few times at most;
3. the record is written as `pending` (the snapshot quota is checked there, atomically),
   then the entries, then the record turns `ready`: readers see the snapshot whole or not
   at all. Creation must finish within the in-flight bound of the scrub, or it is undone.

Deleting (a snapshot, an expired one, a branch) marks the record `dropping` by
compare-and-set (one deleter wins), pops the entries in chunks (`HASH_POP`: each entry is
removed once, so each hold is released once, even if several front-ends resume the same
drop), then removes the record. A drop interrupted by a crash is resumed by
`retire_stale` on any front-end.

`ClusterSnapshots` is composed from the connection, the blocks, the entries (a branch
PUT is an ordinary PUT into the overlay's keys) and the tenants registry; it never sees
the backend that delegates to it.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any

from epistemic_kvcache.errors import (
    ClusterUnavailableError,
    NotFoundError,
    QuotaExceededError,
)
from epistemic_kvcache.store import cluster_lua as L
from epistemic_kvcache.store.api import (
    BlockData,
    BranchInfo,
    Buffer,
    PutResult,
    SnapshotInfo,
    owned_buffer,
    validate_key,
    validate_namespace,
)
from epistemic_kvcache.store.cluster_blocks import ClusterBlocks
from epistemic_kvcache.store.cluster_conn import ClusterConnection
from epistemic_kvcache.store.cluster_counters import SharedCounters
from epistemic_kvcache.store.cluster_entries import ClusterEntries

_CHUNK = 500
_TRIES = 10
PENDING_LIMIT_S = 50.0
"""A snapshot's creation must finish this long after its holds were taken (the scrub
leaves alone only blocks touched within its grace period)."""

SNAP_READ = L.Script(
    "snap_read",
    L.PARSE_LUA
    + b"""
-- KEYS: entries, order, epochs; ARGV: mode ('all' | 'prefix' | 'keys'), prefix, keys...
-- -> {key, entry, key, entry, ...} of the live (not stale) entries selected
local out = {}
local function add(k)
  local v = redis.call('HGET', KEYS[1], k)
  if v and not is_stale(v, KEYS[3]) then
    out[#out + 1] = k
    out[#out + 1] = v
  end
end
if ARGV[1] == 'all' then
  for _, k in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do add(k) end
elseif ARGV[1] == 'prefix' then
  local lo = '[' .. ARGV[2]
  for _, k in ipairs(redis.call('ZRANGEBYLEX', KEYS[2], lo, lo .. '\\255')) do add(k) end
else
  for i = 3, #ARGV do
    if ARGV[2] == '' or string.sub(ARGV[i], 1, #ARGV[2]) == ARGV[2] then add(ARGV[i]) end
  end
end
return out
""",
)

SNAP_BEGIN = L.Script(
    "snap_begin",
    b"""
-- KEYS: snapshot records; ARGV: id, max snapshots, pending record -> 'ok' | 'quota'
if redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[2]) then return 'quota' end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 'ok'
""",
)

RECORD_CAS = L.Script(
    "record_cas",
    b"""
-- KEYS: records; ARGV: id, expected record, new record ('' deletes) -> 1 | 0
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
if ARGV[3] == '' then
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
end
return 1
""",
)

BRANCH_CREATE = L.Script(
    "branch_create",
    b"""
-- KEYS: snapshot records, branch records; ARGV: snapshot id, branch id, now, record
local s = redis.call('HGET', KEYS[1], ARGV[1])
if not s then return 'nosnap' end
local rec = cjson.decode(s)
if rec.state ~= 'ready' then return 'nosnap' end
if rec.expires_at ~= nil and rec.expires_at ~= cjson.null
   and tonumber(rec.expires_at) <= tonumber(ARGV[3]) then
  return 'nosnap'
end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[4])
return 'ok'
""",
)

HASH_POP = L.Script(
    "hash_pop",
    L.NOW_LUA
    + b"""
-- KEYS: a hash; ARGV: n -> {server time ms, {field, value, ...}} removed (about n)
local r = redis.call('HSCAN', KEYS[1], 0, 'COUNT', tonumber(ARGV[1]))
local out = r[2]
for i = 1, #out, 2 do redis.call('HDEL', KEYS[1], out[i]) end
return {now_ms(), out}
""",
)

SCRIPTS = (SNAP_READ, SNAP_BEGIN, RECORD_CAS, BRANCH_CREATE, HASH_POP)


def snaps_key(prefix: str, ns: str) -> bytes:
    return L.tenant_tag(prefix, ns) + b":snaps"


def branches_key(prefix: str, ns: str) -> bytes:
    return L.tenant_tag(prefix, ns) + b":branches"


def snap_entries_key(prefix: str, ns: str, sid: str) -> bytes:
    return L.tenant_tag(prefix, ns) + b":s:" + sid.encode()


def overlay(prefix: str, ns: str, bid: str) -> L.TenantKeys:
    """The keys of a branch overlay (epochs are the tenant's; overlays are untagged)."""
    t = L.tenant_tag(prefix, ns)
    b = bid.encode()
    return L.TenantKeys(t + b":b:" + b, t + b":bz:" + b, t + b":e", t + b":bc:" + b)


def _valid_id(rid: str) -> bool:
    return 0 < len(rid) <= 64 and all(c in "0123456789abcdef" for c in rid)


@dataclass(eq=False)
class ClusterSnapshots:
    """Snapshots and branches of every tenant (`ClusterBackend` delegates here).

    `counters`: the tenants registry; `clock`: wall-clock seconds (creation times, TTLs)."""

    conn: ClusterConnection
    blocks: ClusterBlocks
    entries: ClusterEntries
    counters: SharedCounters
    _: KW_ONLY
    prefix: str
    clock: Callable[[], float]
    max_snapshots_per_tenant: int

    def _key(self, kind: str, ns: str) -> bytes:
        """The records of `kind` ("snap" or "branch")."""
        return snaps_key(self.prefix, ns) if kind == "snap" else branches_key(self.prefix, ns)

    # -- records ---------------------------------------------------------------------
    def _records(self, key: bytes) -> dict[str, dict[str, Any]]:
        raw = self.conn.exec(key, [("HGETALL", key)])[0]
        return {bytes(k).decode(): json.loads(v) for k, v in dict(raw).items()}

    def _record(self, key: bytes, rid: str) -> tuple[bytes, dict[str, Any]] | None:
        if not _valid_id(rid):
            return None
        raw = self.conn.exec(key, [("HGET", key, rid)])[0]
        return (bytes(raw), json.loads(raw)) if raw is not None else None

    @staticmethod
    def _live(rec: dict[str, Any], now: float) -> bool:
        exp = rec.get("expires_at")
        return rec.get("state") == "ready" and (exp is None or exp > now)

    def _snapshot(self, ns: str, sid: str) -> dict[str, Any] | None:
        found = self._record(self._key("snap", ns), sid)
        return found[1] if found is not None and self._live(found[1], self.clock()) else None

    @staticmethod
    def _info(ns: str, sid: str, rec: dict[str, Any]) -> SnapshotInfo:
        return SnapshotInfo(
            id=sid,
            ns=ns,
            keys=int(rec.get("keys", 0)),
            logical_bytes=int(rec.get("logical_bytes", 0)),
            created_at=float(rec["created_at"]),
            expires_at=rec.get("expires_at"),
        )

    # -- snapshots -------------------------------------------------------------------------
    def create(
        self,
        ns: str,
        keys: Sequence[str] | None,
        prefix: str | None,
        ttl_s: float | None,
    ) -> SnapshotInfo:
        self.counters.register(ns)
        tk = self.entries.keys_of(ns)
        if keys is not None:
            args: list[Any] = ["keys", (prefix or "").encode(), *dict.fromkeys(keys)]
        elif prefix is not None:
            args = ["prefix", prefix.encode()]
        else:
            args = ["all", b""]
        for _ in range(_TRIES):
            flat = self.conn.script(SNAP_READ, [tk.entries, tk.order, tk.epochs], args)
            entries = [
                (bytes(flat[i]), L.parse_entry(bytes(flat[i + 1]))) for i in range(0, len(flat), 2)
            ]
            started = time.monotonic()
            held = self._hold(ns, [e for _k, e in entries])
            if held is not None:
                break
            time.sleep(0.01)
        else:
            raise ClusterUnavailableError(
                "the namespace changed too fast to snapshot (blocks vanished while they were "
                "being referenced); retry"
            )
        try:
            return self._commit(ns, entries, ttl_s, started)
        except BaseException:
            self._release(ns, held)
            raise

    def _hold(self, ns: str, entries: list[L.Entry]) -> dict[bytes, tuple[L.Entry, int]] | None:
        """One pinned reference per entry on each block; None (all given back) if a
        block vanished meanwhile."""
        wanted: dict[bytes, tuple[L.Entry, int]] = {}
        for e in entries:
            prev = wanted.get(e.ref)
            wanted[e.ref] = (e, (prev[1] if prev else 0) + 1)
        got: dict[bytes, tuple[L.Entry, int]] = {}
        ok = True
        # one pipeline (and one WAIT) per node: the window in which a concurrent
        # replacement can free a block we are about to hold stays a round trip or two
        groups: dict[str, list[tuple[bytes, bytes, L.Entry, int]]] = {}
        for ref, (e, n) in wanted.items():
            bkey = self.blocks.key(ns, e.digest)
            node = self.conn.node_of(bkey)
            groups.setdefault(node.name, []).append((ref, bkey, e, n))
        for items in groups.values():
            cmds = [
                ("EVALSHA", L.BLOB_ADJ.sha, 1, bkey, e.gen, n, n, self.blocks.block_ttl_ms)
                for _ref, bkey, e, n in items
            ]
            out = self.conn.exec(items[0][1], cmds, durable=True)
            for (ref, _bkey, e, n), res in zip(items, out, strict=True):
                if int(res[0]) < 0:
                    ok = False
                else:
                    got[ref] = (e, n)
        if not ok:
            self._release(ns, got)
            return None
        return got

    def _release(self, ns: str, held: dict[bytes, tuple[L.Entry, int]]) -> None:
        for e, n in held.values():
            self.blocks.unref(ns, e.digest, e.gen, refs=-n, pins=-n)

    def _commit(
        self,
        ns: str,
        entries: list[tuple[bytes, L.Entry]],
        ttl_s: float | None,
        started: float,
    ) -> SnapshotInfo:
        sid = secrets.token_hex(8)
        now = self.clock()
        rec: dict[str, Any] = {
            "created_at": now,
            "expires_at": now + ttl_s if ttl_s is not None else None,
            "state": "pending",
        }
        sk = self._key("snap", ns)
        pending = json.dumps(rec).encode()
        res = self.conn.script(
            SNAP_BEGIN, [sk], [sid, self.max_snapshots_per_tenant, pending], durable=True
        )
        if res == b"quota":
            raise QuotaExceededError(
                f"snapshot quota exceeded: {self.max_snapshots_per_tenant} snapshots; delete one "
                "(or give them a ttl_s)",
                resource="snapshots",
            )
        ek = snap_entries_key(self.prefix, ns, sid)
        for i in range(0, len(entries), _CHUNK):
            pairs: list[bytes] = []
            for k, e in entries[i : i + _CHUNK]:
                pairs += [k, _pinned(e)]
            self.conn.exec(ek, [("HSET", ek, *pairs)], durable=True)
        if time.monotonic() - started > PENDING_LIMIT_S:
            self._drop(ns, "snap", sid, pending)
            raise ClusterUnavailableError("the snapshot took too long to write; retry")
        rec.update(
            state="ready",
            keys=len(entries),
            logical_bytes=sum(e.size for _k, e in entries),
        )
        if not int(
            self.conn.script(RECORD_CAS, [sk], [sid, pending, json.dumps(rec)], durable=True)
        ):
            raise ClusterUnavailableError("the snapshot was removed while it was written")
        return self._info(ns, sid, rec)

    def info(self, ns: str, sid: str) -> SnapshotInfo | None:
        validate_namespace(ns)
        rec = self._snapshot(ns, sid)
        return self._info(ns, sid, rec) if rec is not None else None

    def listing(self, ns: str) -> list[SnapshotInfo]:
        validate_namespace(ns)
        now = self.clock()
        out = [
            self._info(ns, sid, rec)
            for sid, rec in self._records(self._key("snap", ns)).items()
            if self._live(rec, now)
        ]
        return sorted(out, key=lambda i: i.created_at)

    def get(self, ns: str, sid: str, key: str) -> Buffer | None:
        validate_namespace(ns)
        validate_key(key)
        if self._snapshot(ns, sid) is None:
            return None
        ek = snap_entries_key(self.prefix, ns, sid)
        raw = self.conn.exec(ek, [("HGET", ek, key.encode())])[0]
        return self.blocks.read(ns, L.parse_entry(bytes(raw))) if raw is not None else None

    def delete(self, ns: str, kind: str, rid: str) -> bool:
        """Delete a ready snapshot ("snap") or branch ("branch") -> False if none."""
        validate_namespace(ns)
        found = self._record(self._key(kind, ns), rid)
        if found is None or found[1].get("state") != "ready":
            return False
        return self._drop(ns, kind, rid, found[0])

    def _drop(self, ns: str, kind: str, rid: str, expected: bytes) -> bool:
        """Mark the record dropping (compare-and-set), release every entry, remove it."""
        rk = self._key(kind, ns)
        rec = json.loads(expected)
        if rec.get("state") != "dropping":
            rec["state"] = "dropping"
            marked = json.dumps(rec).encode()
            if not int(self.conn.script(RECORD_CAS, [rk], [rid, expected, marked], durable=True)):
                return False
            expected = marked
        if kind == "snap":
            for bid, brec in self._records(self._key("branch", ns)).items():
                if brec.get("snapshot_id") == rid:
                    self._drop(ns, "branch", bid, json.dumps(brec).encode())
            hashes = [snap_entries_key(self.prefix, ns, rid)]
        else:
            ov = overlay(self.prefix, ns, rid)
            hashes = [ov.entries]
        for h in hashes:
            while True:
                removed_ms, flat = self.conn.script(HASH_POP, [h], [_CHUNK], durable=True)
                for i in range(1, len(flat), 2):
                    e = L.parse_entry(bytes(flat[i]))
                    self.blocks.release(ns, e, removed_ms)
                if not flat:
                    break
        if kind == "branch":
            ov = overlay(self.prefix, ns, rid)
            self.conn.exec(ov.order, [("DEL", ov.order, ov.counters)], durable=True)
        self.conn.script(RECORD_CAS, [rk], [rid, expected, b""], durable=True)
        return True

    def retire(self, ns: str, budget: int) -> int:
        """Drop expired snapshots, finish interrupted drops, undo stuck creations."""
        now = self.clock()
        done = 0
        for kind in ("snap", "branch"):
            for rid, rec in self._records(self._key(kind, ns)).items():
                if done >= budget:
                    return done
                state = rec.get("state")
                exp = rec.get("expires_at")
                stuck = state == "pending" and now - rec["created_at"] > 2 * PENDING_LIMIT_S
                expired = kind == "snap" and state == "ready" and exp is not None and exp <= now
                if (
                    (state == "dropping" or stuck or expired)
                    and self._drop(ns, kind, rid, json.dumps(rec).encode())
                    and expired
                ):
                    done += 1
        return done

    # -- branches ----------------------------------------------------------------------------
    def branch_create(self, ns: str, sid: str) -> BranchInfo:
        validate_namespace(ns)
        if not _valid_id(sid):
            raise NotFoundError(f"no snapshot {sid!r}")
        bid = secrets.token_hex(8)
        rec = {"snapshot_id": sid, "created_at": self.clock(), "state": "ready"}
        res = self.conn.script(
            BRANCH_CREATE,
            [self._key("snap", ns), self._key("branch", ns)],
            [sid, bid, self.clock(), json.dumps(rec)],
            durable=True,
        )
        if res != b"ok":
            raise NotFoundError(f"no snapshot {sid!r}")
        info = self.branch_info(ns, bid)
        if info is None:
            raise NotFoundError(f"no snapshot {sid!r}")
        return info

    def _branch(self, ns: str, bid: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """(branch record, its snapshot's record) when both are live."""
        found = self._record(self._key("branch", ns), bid)
        if found is None or found[1].get("state") != "ready":
            return None
        snap = self._snapshot(ns, found[1]["snapshot_id"])
        return (found[1], snap) if snap is not None else None

    def branch_info(self, ns: str, bid: str) -> BranchInfo | None:
        validate_namespace(ns)
        both = self._branch(ns, bid)
        if both is None:
            return None
        rec, snap = both
        ov = overlay(self.prefix, ns, bid)
        values = self.conn.exec(ov.entries, [("HVALS", ov.entries)])[0]
        mine = [L.parse_entry(bytes(v)) for v in values]
        shared: set[bytes] = set()
        if mine:
            ek = snap_entries_key(self.prefix, ns, rec["snapshot_id"])
            shared = {
                L.parse_entry(bytes(v)).digest for v in self.conn.exec(ek, [("HVALS", ek)])[0]
            }
        return BranchInfo(
            id=bid,
            ns=ns,
            snapshot_id=rec["snapshot_id"],
            created_at=float(rec["created_at"]),
            private_keys=len(mine),
            private_bytes=sum(e.size for e in mine if e.digest not in shared),
            shared_bytes=int(snap.get("logical_bytes", 0)),
        )

    def branch_list(self, ns: str) -> list[BranchInfo]:
        validate_namespace(ns)
        out = []
        for bid in self._records(self._key("branch", ns)):
            info = self.branch_info(ns, bid)
            if info is not None:
                out.append(info)
        return sorted(out, key=lambda i: i.created_at)

    def _branch_entry(self, ns: str, bid: str, key: str) -> L.Entry | None:
        both = self._branch(ns, bid)
        if both is None:
            return None
        ov = overlay(self.prefix, ns, bid)
        raw = self.conn.exec(ov.entries, [("HGET", ov.entries, key.encode())])[0]
        if raw is None:
            ek = snap_entries_key(self.prefix, ns, both[0]["snapshot_id"])
            raw = self.conn.exec(ek, [("HGET", ek, key.encode())])[0]
        return L.parse_entry(bytes(raw)) if raw is not None else None

    def branch_get(self, ns: str, bid: str, key: str) -> Buffer | None:
        validate_namespace(ns)
        validate_key(key)
        e = self._branch_entry(ns, bid, key)
        return self.blocks.read(ns, e) if e is not None else None

    def branch_size(self, ns: str, bid: str, key: str) -> int | None:
        validate_namespace(ns)
        validate_key(key)
        e = self._branch_entry(ns, bid, key)
        return e.size if e is not None else None

    def branch_put(self, ns: str, bid: str, key: str, data: BlockData) -> PutResult:
        """`ClusterBackend.branch_put` of checked arguments."""
        if self._branch(ns, bid) is None:
            raise NotFoundError(f"no branch {bid!r}")
        ov = overlay(self.prefix, ns, bid)
        return self.entries.put_to(ns, ov, key, owned_buffer(data), None, None, 0, memo=False)

    # -- the scrub ---------------------------------------------------------------------------
    def entry_hashes(self, ns: str) -> list[bytes]:
        """Every snapshot and overlay hash of `ns` with a record (their entries hold
        references the scrub must count)."""
        p = self.prefix
        out = [snap_entries_key(p, ns, sid) for sid in self._records(self._key("snap", ns))]
        out += [overlay(p, ns, bid).entries for bid in self._records(self._key("branch", ns))]
        return out


def _pinned(e: L.Entry) -> bytes:
    """The entry as a snapshot holds it: same block, one pin, no epoch tag."""
    return e.ref + e.op + f"{e.size},1,,".encode()
