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
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import lmdb

from epistemic_kvcache.errors import ConfigurationError, StorageIOError

FORMAT_VERSION = b"5"
"""5: every row carries a CRC-32 (format 4 had none: such an index is rebuilt from the log)."""
OLD_FORMATS = (b"4",)
"""Formats this version does not read but rebuilds from the log without asking."""
_CRC = struct.Struct(">I")
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


class IndexError_(StorageIOError):
    """The index cannot be read (missing, empty, damaged)."""


def seal_row(db: bytes, key: bytes, value: bytes) -> bytes:
    """`value` with a CRC-32 of the database name, the row key and the value appended:
    damage inside a row that LMDB's page structure does not notice is caught on read."""
    return value + _CRC.pack(zlib.crc32(value, zlib.crc32(key, zlib.crc32(db))))


def open_row(db: bytes, key: bytes, row: bytes | memoryview) -> bytes:
    """The value of a sealed row (`IndexError_` when its checksum does not match)."""
    raw = bytes(row)
    if len(raw) < _CRC.size:
        raise IndexError_(f"index row damaged ({db.decode()} {key[:40]!r}: {len(raw)} bytes)")
    value = raw[: -_CRC.size]
    if _CRC.unpack(raw[-_CRC.size :])[0] != zlib.crc32(value, zlib.crc32(key, zlib.crc32(db))):
        raise IndexError_(f"index row damaged ({db.decode()} {key[:40]!r}: checksum mismatch)")
    return value


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


# -- validating the file before LMDB maps it --------------------------------------------
_P_BRANCH, _P_LEAF, _P_OVERFLOW = 0x01, 0x02, 0x04
_F_BIGDATA, _F_SUBDATA, _F_DUPDATA = 0x01, 0x02, 0x04
_PAGEHDR = 16
_NODEHDR = 8
_P_INVALID = (1 << 64) - 1
_MAX_DEPTH = 32


class _Damaged(Exception):
    pass


class _Walker:
    """Walks every B-tree page reachable from the newest meta page with `pread`, checking
    what LMDB would dereference: page numbers within the file, page headers, node offsets
    and sizes within their page, overflow runs, sub-database roots, the free list."""

    def __init__(self, fd: int, psize: int, last_pg: int, size: int) -> None:
        self.fd = fd
        self.psize = psize
        self.last_pg = last_pg
        self.size = size
        self.seen: set[int] = set()

    def page(self, pgno: int, what: str) -> bytes:
        if not 2 <= pgno <= self.last_pg:
            raise _Damaged(f"{what}: page {pgno} outside the file (last page {self.last_pg})")
        if pgno in self.seen:
            raise _Damaged(f"{what}: page {pgno} is reached twice")
        self.seen.add(pgno)
        buf = os.pread(self.fd, self.psize, pgno * self.psize)
        if len(buf) != self.psize:
            raise _Damaged(f"{what}: page {pgno} is cut short")
        if struct.unpack_from("<Q", buf, 0)[0] != pgno:
            raise _Damaged(f"{what}: page {pgno} names itself {struct.unpack_from('<Q', buf)[0]}")
        return buf

    def tree(self, root: int, what: str, *, collect: bool = True) -> list[tuple[bytes, bytes, int]]:
        """Walk a B-tree; returns its leaf nodes as (key, data, node flags) if `collect`."""
        if root == _P_INVALID:
            return []
        out: list[tuple[bytes, bytes, int]] | None = [] if collect else None
        self._node_page(root, what, 0, out)
        return out or []

    def _node_page(
        self, pgno: int, what: str, depth: int, out: list[tuple[bytes, bytes, int]] | None
    ) -> None:
        if depth > _MAX_DEPTH:
            raise _Damaged(f"{what}: tree deeper than {_MAX_DEPTH}")
        buf = self.page(pgno, what)
        flags, lower, upper = struct.unpack_from("<HHH", buf, 10)
        kind = flags & (_P_BRANCH | _P_LEAF | _P_OVERFLOW | 0x20 | 0x40 | 0x08)
        if kind not in (_P_BRANCH, _P_LEAF):
            raise _Damaged(f"{what}: page {pgno} has flags {flags:#x}")
        ps = self.psize
        if lower < _PAGEHDR or lower & 1 or upper > ps or lower > upper:
            raise _Damaged(f"{what}: page {pgno} has bounds {lower}..{upper}")
        n = (lower - _PAGEHDR) >> 1
        if n == 0 and kind == _P_BRANCH:
            raise _Damaged(f"{what}: branch page {pgno} is empty")
        prev: bytes | None = None
        for i in range(n):
            ptr = struct.unpack_from("<H", buf, _PAGEHDR + 2 * i)[0]
            if ptr < upper or ptr + _NODEHDR > ps:
                raise _Damaged(f"{what}: page {pgno} node {i} at {ptr} outside its page")
            lo, hi, nflags, ksize = struct.unpack_from("<HHHH", buf, ptr)
            kend = ptr + _NODEHDR + ksize
            if kend > ps:
                raise _Damaged(f"{what}: page {pgno} node {i} key runs off its page")
            key = bytes(buf[ptr + _NODEHDR : kend])
            if kind == _P_BRANCH:
                child = lo | hi << 16 | nflags << 32
                if i > 0 and prev is not None and key <= prev:
                    raise _Damaged(f"{what}: page {pgno} keys out of order")
                prev = key if i > 0 else None
                self._node_page(child, what, depth + 1, out)
                continue
            if prev is not None and key <= prev:
                raise _Damaged(f"{what}: page {pgno} keys out of order")
            prev = key
            dsize = lo | hi << 16
            if nflags & ~(_F_BIGDATA | _F_SUBDATA) or nflags & _F_DUPDATA:
                raise _Damaged(f"{what}: page {pgno} node {i} has flags {nflags:#x}")
            if nflags & _F_BIGDATA:
                if kend + 8 > ps:
                    raise _Damaged(f"{what}: page {pgno} node {i} runs off its page")
                opg = struct.unpack_from("<Q", buf, kend)[0]
                data = self._overflow(opg, dsize, what, out is not None)
            else:
                if kend + dsize > ps:
                    raise _Damaged(f"{what}: page {pgno} node {i} data runs off its page")
                data = bytes(buf[kend : kend + dsize]) if out is not None else b""
            if out is not None:
                out.append((key, data, nflags))

    def _overflow(self, pgno: int, dsize: int, what: str, want: bool) -> bytes:
        head = self.page(pgno, what)
        flags = struct.unpack_from("<H", head, 10)[0]
        pages = struct.unpack_from("<I", head, 12)[0]
        if not flags & _P_OVERFLOW or pages < 1 or pgno + pages - 1 > self.last_pg:
            raise _Damaged(f"{what}: overflow page {pgno} is damaged")
        if pages * self.psize - _PAGEHDR < dsize:
            raise _Damaged(f"{what}: overflow run at {pgno} is shorter than its data")
        for extra in range(pgno + 1, pgno + pages):
            if extra in self.seen:
                raise _Damaged(f"{what}: page {extra} is reached twice")
            self.seen.add(extra)
        raw = os.pread(self.fd, _PAGEHDR + dsize, pgno * self.psize)
        if len(raw) != _PAGEHDR + dsize:
            raise _Damaged(f"{what}: overflow run at {pgno} is cut short")
        return raw[_PAGEHDR:]


def validate_file(index_dir: Path) -> str | None:
    """Why LMDB must not map the file under `index_dir` (None: it is safe to open).

    LMDB trusts its file: a page number past the end makes it touch unmapped memory
    (SIGBUS, the process dies with nothing logged), a bad node offset reads garbage. So
    before LMDB maps it, every page reachable from the newest meta page (each database's
    B-tree, overflow pages, the free list) is read with `pread` and checked."""
    why = precheck(index_dir)
    if why is not None:
        return why
    data = index_dir / "data.mdb"
    try:
        fd = os.open(data, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        return f"index file unreadable ({exc.strerror})"
    try:
        size = os.fstat(fd).st_size
        psize = struct.unpack_from("<I", os.pread(fd, 64, 16 + 24), 0)[0]
        best: tuple[int, bytes] | None = None
        for page in (0, 1):
            raw = os.pread(fd, 16 + 136, page * psize)
            if len(raw) < 16 + 136:
                return "index file is not an LMDB database (damaged meta pages)"
            flags = struct.unpack_from("<H", raw, 10)[0]
            magic, version = struct.unpack_from("<II", raw, 16)
            if not flags & 0x08 or magic != 0xBEEFC0DE or version != 1:
                return f"index meta page {page} is damaged"
            txnid = struct.unpack_from("<Q", raw, 16 + 128)[0]
            if best is None or txnid > best[0]:
                best = (txnid, raw)
        assert best is not None
        meta = best[1]
        free_root = struct.unpack_from("<Q", meta, 16 + 24 + 40)[0]
        main_root = struct.unpack_from("<Q", meta, 16 + 72 + 40)[0]
        last_pg = struct.unpack_from("<Q", meta, 16 + 120)[0]
        if psize < 512 or psize & (psize - 1) or psize > 1 << 16:
            return f"index meta page names page size {psize}"
        w = _Walker(fd, psize, last_pg, size)
        try:
            for name, data_, nflags in w.tree(main_root, "main database"):
                if not nflags & _F_SUBDATA:
                    continue
                if len(data_) != 48:
                    raise _Damaged(f"database {name!r}: its record is {len(data_)} bytes")
                root = struct.unpack_from("<Q", data_, 40)[0]
                w.tree(root, f"database {name.decode(errors='replace')!r}", collect=False)
            free: list[int] = []
            for _k, ids, _f in w.tree(free_root, "free list"):
                if len(ids) < 8 or len(ids) % 8:
                    raise _Damaged("free list: a record of odd length")
                n = struct.unpack_from("<Q", ids, 0)[0]
                if n != len(ids) // 8 - 1:
                    raise _Damaged("free list: a record's count does not match its length")
                free.extend(struct.unpack_from(f"<{n}Q", ids, 8))
            for pg in free:
                if not 2 <= pg <= last_pg:
                    raise _Damaged(f"free list: page {pg} outside the file")
                if pg in w.seen:
                    raise _Damaged(f"free list: page {pg} is free and in use")
        except _Damaged as exc:
            return f"index file is damaged ({exc})"
        except (OSError, struct.error) as exc:
            return f"index file is damaged ({exc})"
        return None
    finally:
        os.close(fd)


class Index:
    """The LMDB environment and its rows."""

    def __init__(self, index_dir: Path, *, map_size: int, create: bool) -> None:
        self.dir = index_dir
        self.tolerant = False
        """Skip damaged rows instead of refusing (salvage during a rebuild)."""
        self.damaged_rows = 0
        if not create:
            why = validate_file(index_dir)
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

    # -- reading ---------------------------------------------------------------------------
    # Every row is checked (`open_row`); a row that fails, or a value that does not parse,
    # is `IndexError_`: the store refuses the index and names the rebuild, as for a
    # missing one.
    def meta(self, name: bytes) -> bytes | None:
        try:
            with self.env.begin() as txn:
                v = txn.get(name, db=self.db_meta)
                if v is None:
                    return None
                return bytes(v) if name == b"format" else open_row(b"meta", name, v)
        except lmdb.Error as exc:
            raise IndexError_(f"index unreadable: {exc}") from exc

    def checkpoint(self) -> tuple[int, int] | None:
        v = self.meta(b"ckpt")
        if v is None:
            return None
        try:
            seg, off = _CKPT.unpack(v)
        except struct.error as exc:
            raise IndexError_(f"index row damaged (ckpt: {exc})") from exc
        return int(seg), int(off)

    def counters(self) -> dict[str, int]:
        v = self.meta(b"counters")
        try:
            out = json.loads(v) if v else {}
        except ValueError as exc:
            raise IndexError_(f"index row damaged (counters: {exc})") from exc
        if not isinstance(out, dict):
            raise IndexError_("index row damaged (counters)")
        return out

    def is_empty(self) -> bool:
        try:
            with self.env.begin() as txn:
                return txn.get(b"format", db=self.db_meta) is None
        except lmdb.Error as exc:
            raise IndexError_(f"index unreadable: {exc}") from exc

    def _rows(self, db: Any, name: bytes) -> Iterator[tuple[bytes, bytes]]:
        seed = zlib.crc32(name)
        crc32 = zlib.crc32
        n = _CRC.size
        try:
            with self.env.begin() as txn:
                for k, v in txn.cursor(db=db):
                    kb = bytes(k)
                    raw = bytes(v)
                    value = raw[:-n]
                    # (`open_row`, inlined: this runs once per row at every open)
                    if len(raw) >= n and int.from_bytes(raw[-n:]) == crc32(value, crc32(kb, seed)):
                        yield kb, value
                        continue
                    if name == b"meta" and kb == b"format":
                        continue  # the one row read before its format is known
                    try:
                        open_row(name, kb, raw)  # raises with the reason
                    except IndexError_:
                        if not self.tolerant:
                            raise
                        self.damaged_rows += 1
        except lmdb.Error as exc:
            raise IndexError_(f"index unreadable: {exc}") from exc

    def iter_keys(self) -> Iterator[tuple[str, str, KeyState]]:
        for krow, v in self._rows(self.db_keys, b"keys"):
            try:
                st, longkey = unpack_key(v)
                ns, key = split_key_row(krow, longkey)
            except (struct.error, UnicodeDecodeError, ValueError) as exc:
                if self.tolerant:
                    self.damaged_rows += 1
                    continue
                raise IndexError_(f"index row damaged (keys {krow[:40]!r}: {exc})") from exc
            yield ns, key, st

    def iter_blobs(self) -> Iterator[tuple[bytes, tuple[int, int, int]]]:
        for sdig, row in self._rows(self.db_blobs, b"blobs"):
            try:
                yield sdig, _BLOB_ROW.unpack(row)
            except struct.error as exc:
                raise IndexError_(f"index row damaged (blobs: {exc})") from exc

    def iter_metas(self) -> Iterator[tuple[str, str, str, int, dict[str, Any]]]:
        for k, v in self._rows(self.db_meta, b"meta"):
            for kind in ("snap", "branch"):
                prefix = kind.encode() + b":"
                if not k.startswith(prefix):
                    continue
                try:
                    n = _U16.unpack_from(k, len(prefix))[0]
                    tenant = k[len(prefix) + 2 : len(prefix) + 2 + n].decode()
                    rid = k[len(prefix) + 2 + n :].decode()
                    loc = _U64.unpack_from(v, 0)[0]
                    rec = json.loads(v[8:])
                except (struct.error, ValueError) as exc:
                    raise IndexError_(f"index row damaged ({kind} {k[:40]!r}: {exc})") from exc
                if not isinstance(rec, dict):
                    raise IndexError_(f"index row damaged ({kind} {k[:40]!r})")
                yield kind, tenant, rid, loc, rec

    def iter_segs(self) -> Iterator[tuple[int, tuple[int, int]]]:
        for k, v in self._rows(self.db_meta, b"meta"):
            if not k.startswith(b"seg:"):
                continue
            try:
                yield int(k[4:]), _SEG_ROW.unpack(v)
            except (struct.error, ValueError) as exc:
                raise IndexError_(f"index row damaged ({k[:40]!r}: {exc})") from exc

    def quarantined(self) -> dict[bytes, float]:
        out = {}
        for k, v in self._rows(self.db_quarantine, b"quarantine"):
            try:
                out[k] = float(v.decode() or 0)
            except ValueError as exc:
                raise IndexError_(f"index row damaged (quarantine: {exc})") from exc
        return out

    # -- writing -------------------------------------------------------------------------
    def init(self, store_id: str) -> None:
        with self.env.begin(write=True) as txn:
            txn.put(b"format", FORMAT_VERSION, db=self.db_meta)
            txn.put(b"store_id", seal_row(b"meta", b"store_id", store_id.encode()), db=self.db_meta)

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
                        txn.put(row, seal_row(b"keys", row, pack_key(ns, key, st)), db=self.db_keys)
                for sdig, b in ch.blobs.items():
                    if b is None:
                        txn.delete(sdig, db=self.db_blobs)
                    else:
                        txn.put(
                            sdig, seal_row(b"blobs", sdig, _BLOB_ROW.pack(*b)), db=self.db_blobs
                        )
                for (kind, tenant, rid), m in ch.metas.items():
                    row = meta_row(kind, tenant, rid)
                    if m is None:
                        txn.delete(row, db=self.db_meta)
                    else:
                        body = _U64.pack(m[0]) + json.dumps(m[1]).encode()
                        txn.put(row, seal_row(b"meta", row, body), db=self.db_meta)
                for sdig, when in ch.quarantine.items():
                    q = seal_row(b"quarantine", sdig, str(when).encode())
                    txn.put(sdig, q, db=self.db_quarantine)
                for seg, srow in ch.segs.items():
                    row = b"seg:%08d" % seg
                    if srow is not None:
                        txn.put(row, seal_row(b"meta", row, _SEG_ROW.pack(*srow)), db=self.db_meta)
                    else:
                        txn.delete(row, db=self.db_meta)
                if counters is not None:
                    cnt = seal_row(b"meta", b"counters", json.dumps(counters).encode())
                    txn.put(b"counters", cnt, db=self.db_meta)
                txn.put(b"ckpt", seal_row(b"meta", b"ckpt", _CKPT.pack(*ckpt)), db=self.db_meta)
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
