"""The LMDB index: a checkpoint of the log, so that opening reads rows, not blocks.

How it works
------------
The log (`store/records.py`) is the truth. The index holds, as of a log position
(`ckpt`), what replaying the log up to there gives:

- ``keys``:  u16 len(ns), ns, key (or 0xFF + BLAKE3(key) when too long for LMDB)
             -> u32 pins, u64 record location, u16 len(sdig), sdig, u16 len(long key),
                long key [, u64 epoch, epoch scope]
- ``blobs``: scoped digest -> u64 size, u64 payload offset, u32 segment
- ``meta``:  ``format``, ``store_id``, ``ckpt`` (u32 segment, u64 offset), ``counters``
             (JSON), ``snap:``/``branch:`` + u16 len(tenant), tenant, id
             -> u64 record location + JSON record, ``seg:%08d`` -> u64 tombstone bytes,
             u64 trusted end (of each segment, as of the checkpoint)
- ``quarantine``: scoped digest -> unix time (bytes that failed verification)

A record location packs (segment, offset) as ``segment << 40 | offset``.

The checkpointer thread (`store/durable.py`) applies the row changes of acknowledged
batches in one write transaction per checkpoint and moves ``ckpt`` forward with them;
LMDB syncs on commit. Opening loads the rows and replays the log after ``ckpt``.

An LMDB file cut short would make LMDB touch pages past the end of its memory map and
kill the process with SIGBUS, so `precheck` reads the two meta pages first and refuses a
file shorter than its newest meta page says.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import lmdb

from epistemic_kvcache.errors import ConfigurationError, StorageIOError

FORMAT_VERSION = b"4"
_U16 = struct.Struct(">H")
_U64 = struct.Struct(">Q")
_KEY_HEAD = struct.Struct(">IQ")  # pins, record location
_BLOB_ROW = struct.Struct(">QQI")  # size, payload offset, segment
_CKPT = struct.Struct(">IQ")
_SEG_ROW = struct.Struct(">QQ")  # tombstone bytes, trusted end
_MAX_ROW_KEY = 511
_HASHED = b"\xff"
LOC_SHIFT = 40


def pack_loc(seg: int, off: int) -> int:
    return (seg << LOC_SHIFT) | off


def unpack_loc(loc: int) -> tuple[int, int]:
    return loc >> LOC_SHIFT, loc & ((1 << LOC_SHIFT) - 1)


def ns_prefix(ns: str) -> bytes:
    raw = ns.encode()
    return _U16.pack(len(raw)) + raw


def key_row(ns: str, key: str) -> bytes:
    """The LMDB key of (ns, key). LMDB keys are at most 511 bytes; keys may be 1024, so
    a longer row key is `ns prefix + 0xFF + BLAKE3(key)` (0xFF never occurs in UTF-8)
    with the full key in the row's value."""
    base = ns_prefix(ns)
    raw = key.encode()
    if len(base) + len(raw) <= _MAX_ROW_KEY:
        return base + raw
    return base + _HASHED + blake3.blake3(raw).digest()


def _longkey(ns: str, key: str) -> bytes:
    raw = key.encode()
    return raw if len(ns_prefix(ns)) + len(raw) > _MAX_ROW_KEY else b""


def split_key_row(row: bytes, longkey: bytes) -> tuple[str, str]:
    n = _U16.unpack_from(row, 0)[0]
    rest = row[2 + n :]
    key = longkey if rest[:1] == _HASHED else rest
    return row[2 : 2 + n].decode(), bytes(key).decode()


@dataclass(slots=True)
class KeyState:
    """A key's state as the log says: blob, pins, epoch tag, where its record is."""

    sdig: bytes
    pins: int
    tag: tuple[str, int] | None
    loc: int


def pack_key(ns: str, key: str, st: KeyState) -> bytes:
    lk = _longkey(ns, key)
    row = _KEY_HEAD.pack(st.pins, st.loc) + _U16.pack(len(st.sdig)) + st.sdig
    row += _U16.pack(len(lk)) + lk
    if st.tag is not None:
        row += _U64.pack(st.tag[1]) + st.tag[0].encode()
    return row


def unpack_key(row: bytes) -> tuple[KeyState, bytes]:
    """(state, full key if the row key is hashed else b"")."""
    pins, loc = _KEY_HEAD.unpack_from(row, 0)
    p = _KEY_HEAD.size
    n = _U16.unpack_from(row, p)[0]
    sdig = bytes(row[p + 2 : p + 2 + n])
    p += 2 + n
    k = _U16.unpack_from(row, p)[0]
    longkey = bytes(row[p + 2 : p + 2 + k])
    rest = row[p + 2 + k :]
    tag = (bytes(rest[8:]).decode(), _U64.unpack_from(rest, 0)[0]) if rest else None
    return KeyState(sdig, pins, tag, loc), longkey


def meta_row(kind: str, tenant: str, rid: str) -> bytes:
    return kind.encode() + b":" + ns_prefix(tenant) + rid.encode()


@dataclass(slots=True)
class Changes:
    """Row changes of acknowledged batches, coalesced (later wins); None deletes."""

    keys: dict[tuple[str, str], KeyState | None]
    blobs: dict[bytes, tuple[int, int, int] | None]
    metas: dict[tuple[str, str, str], tuple[int, dict[str, Any]] | None]
    quarantine: dict[bytes, float]
    segs: dict[int, tuple[int, int] | None]  # segment -> (tombstone bytes, trusted end)

    @classmethod
    def empty(cls) -> Changes:
        return cls({}, {}, {}, {}, {})

    def merge(self, later: Changes) -> None:
        self.keys.update(later.keys)
        self.blobs.update(later.blobs)
        self.metas.update(later.metas)
        self.quarantine.update(later.quarantine)
        self.segs.update(later.segs)

    def __len__(self) -> int:
        return (len(self.keys) + len(self.blobs) + len(self.metas) + len(self.quarantine)) + len(
            self.segs
        )


class IndexError_(StorageIOError):
    """The index cannot be read (missing, empty, damaged)."""


def precheck(index_dir: Path) -> str | None:
    """Why the LMDB file under `index_dir` cannot be opened safely (None: it can).

    Reads the meta pages and checks that the file is as long as the newest one says,
    so a truncated file is refused instead of crashing the process with SIGBUS."""
    data = index_dir / "data.mdb"
    try:
        size = data.stat().st_size
        with data.open("rb") as f:
            head = f.read(64 << 10)
    except FileNotFoundError:
        return "index file is missing"
    except OSError as exc:
        return f"index file unreadable ({exc.strerror})"
    if size == 0:
        return "index file is empty"
    best: tuple[int, int, int] | None = None  # txnid, last page, page size
    psize = 0
    for page in (0, 1):
        # the page size is in the first meta (dbs[FREE].md_pad); page 1 is one page on
        base = 0 if page == 0 else psize
        if page == 1 and not psize:
            break
        meta = base + 16
        if len(head) < meta + 136:
            break
        magic, version = struct.unpack_from("<II", head, meta)
        if magic != 0xBEEFC0DE or version != 1:
            continue
        ps = struct.unpack_from("<I", head, meta + 24)[0]
        if page == 0:
            psize = ps
        last_pg, txnid = struct.unpack_from("<QQ", head, meta + 120)
        if best is None or txnid > best[0]:
            best = (txnid, last_pg, ps)
    if best is None or not best[2]:
        return "index file is not an LMDB database (damaged meta pages)"
    need = (best[1] + 1) * best[2]
    if size < need:
        return f"index file is cut short ({size} bytes, its meta page needs {need})"
    return None


class Index:
    """The LMDB environment and its rows."""

    def __init__(self, index_dir: Path, *, map_size: int, create: bool) -> None:
        self.dir = index_dir
        if not create:
            why = precheck(index_dir)
            if why is not None:
                raise IndexError_(why)
        try:
            index_dir.mkdir(mode=0o700, exist_ok=True)
            self.env = lmdb.open(
                str(index_dir),
                map_size=map_size,
                max_dbs=8,
                subdir=True,
                sync=True,
                metasync=True,
                readahead=False,
                lock=True,
                create=create,
                mode=0o600,
            )
            self.db_keys = self.env.open_db(b"keys")
            self.db_blobs = self.env.open_db(b"blobs")
            self.db_meta = self.env.open_db(b"meta")
            self.db_quarantine = self.env.open_db(b"quarantine")
        except lmdb.Error as exc:
            raise IndexError_(f"index unreadable: {exc}") from exc

    # -- reading -------------------------------------------------------------------------
    def meta(self, name: bytes) -> bytes | None:
        with self.env.begin() as txn:
            v = txn.get(name, db=self.db_meta)
        return bytes(v) if v is not None else None

    def checkpoint(self) -> tuple[int, int] | None:
        v = self.meta(b"ckpt")
        if v is None:
            return None
        seg, off = _CKPT.unpack(v)
        return int(seg), int(off)

    def counters(self) -> dict[str, int]:
        v = self.meta(b"counters")
        return json.loads(v) if v else {}

    def is_empty(self) -> bool:
        with self.env.begin() as txn:
            return txn.get(b"format", db=self.db_meta) is None

    def iter_keys(self) -> Iterator[tuple[str, str, KeyState]]:
        with self.env.begin() as txn:
            for krow, v in txn.cursor(db=self.db_keys):
                st, longkey = unpack_key(v)
                ns, key = split_key_row(bytes(krow), longkey)
                yield ns, key, st

    def iter_blobs(self) -> Iterator[tuple[bytes, tuple[int, int, int]]]:
        with self.env.begin() as txn:
            for sdig, row in txn.cursor(db=self.db_blobs):
                yield bytes(sdig), _BLOB_ROW.unpack(row)

    def iter_metas(self) -> Iterator[tuple[str, str, str, int, dict[str, Any]]]:
        with self.env.begin() as txn:
            for kind in ("snap", "branch"):
                prefix = kind.encode() + b":"
                cur = txn.cursor(db=self.db_meta)
                if not cur.set_range(prefix):
                    continue
                for k, v in cur:
                    if not k.startswith(prefix):
                        break
                    n = _U16.unpack_from(k, len(prefix))[0]
                    tenant = bytes(k[len(prefix) + 2 : len(prefix) + 2 + n]).decode()
                    rid = bytes(k[len(prefix) + 2 + n :]).decode()
                    loc = _U64.unpack_from(v, 0)[0]
                    yield kind, tenant, rid, loc, json.loads(bytes(v[8:]))

    def iter_segs(self) -> Iterator[tuple[int, tuple[int, int]]]:
        with self.env.begin() as txn:
            cur = txn.cursor(db=self.db_meta)
            if cur.set_range(b"seg:"):
                for k, v in cur:
                    if not k.startswith(b"seg:"):
                        break
                    yield int(k[4:]), _SEG_ROW.unpack(v)

    def quarantined(self) -> dict[bytes, float]:
        with self.env.begin() as txn:
            return {
                bytes(k): float(bytes(v).decode() or 0)
                for k, v in txn.cursor(db=self.db_quarantine)
            }

    # -- writing -------------------------------------------------------------------------
    def init(self, store_id: str) -> None:
        with self.env.begin(write=True) as txn:
            txn.put(b"format", FORMAT_VERSION, db=self.db_meta)
            txn.put(b"store_id", store_id.encode(), db=self.db_meta)

    def apply(
        self,
        ch: Changes,
        ckpt: tuple[int, int],
        counters: dict[str, int] | None = None,
    ) -> None:
        """Write `ch` and move the checkpoint to `ckpt`, in one synced transaction."""
        try:
            with self.env.begin(write=True) as txn:
                for (ns, key), st in ch.keys.items():
                    row = key_row(ns, key)
                    if st is None:
                        txn.delete(row, db=self.db_keys)
                    else:
                        txn.put(row, pack_key(ns, key, st), db=self.db_keys)
                for sdig, b in ch.blobs.items():
                    if b is None:
                        txn.delete(sdig, db=self.db_blobs)
                    else:
                        txn.put(sdig, _BLOB_ROW.pack(*b), db=self.db_blobs)
                for (kind, tenant, rid), m in ch.metas.items():
                    row = meta_row(kind, tenant, rid)
                    if m is None:
                        txn.delete(row, db=self.db_meta)
                    else:
                        txn.put(row, _U64.pack(m[0]) + json.dumps(m[1]).encode(), db=self.db_meta)
                for sdig, when in ch.quarantine.items():
                    txn.put(sdig, str(when).encode(), db=self.db_quarantine)
                for seg, srow in ch.segs.items():
                    row = b"seg:%08d" % seg
                    if srow is not None:
                        txn.put(row, _SEG_ROW.pack(*srow), db=self.db_meta)
                    else:
                        txn.delete(row, db=self.db_meta)
                if counters is not None:
                    txn.put(b"counters", json.dumps(counters).encode(), db=self.db_meta)
                txn.put(b"ckpt", _CKPT.pack(*ckpt), db=self.db_meta)
        except lmdb.Error as exc:
            raise StorageIOError(f"index checkpoint failed in {self.dir}: {exc}") from exc

    def close(self) -> None:
        self.env.close()


def open_index(index_dir: Path, map_size: int) -> Index:
    """Open an existing index (`IndexError_` when it is missing, empty or damaged)."""
    return Index(index_dir, map_size=map_size, create=False)


def create_index(index_dir: Path, map_size: int, store_id: str) -> Index:
    """Create a fresh, empty index (the directory must not hold one)."""
    if (index_dir / "data.mdb").exists():
        raise ConfigurationError(f"an index already exists in {index_dir}")
    ix = Index(index_dir, map_size=map_size, create=True)
    ix.init(store_id)
    return ix


def remove_index(index_dir: Path) -> None:
    """Delete the index files (before a rebuild writes new ones)."""
    for name in ("data.mdb", "lock.mdb"):
        p = index_dir / name
        if p.exists():
            os.unlink(p)
