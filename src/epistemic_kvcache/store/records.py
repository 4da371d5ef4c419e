"""The record format of the segment log: every change to the store, self-describing.

How it works
------------
The durable store is a log of records appended to segment files; the LMDB index is only
a checkpoint of what the log says, and can always be rebuilt from it. So a record names
everything needed to replay it: the operation, the namespace and key, the scoped digest,
pins, the epoch tag, and the length of its payload. A record is

    fixed header (54 bytes, `_FIXED`) | variable fields | payload

- `magic` (4 bytes) finds record starts again after damage (resync), `version` is the
  record format version, `op` the operation, `flags` bit 0 marks the last record of a
  group commit: replay applies a batch only when its last record is present, so a batch
  torn by a crash is never half applied.
- `hcrc` is a CRC-32 of the whole header (fixed and variable parts, with `hcrc` zeroed).
  A BLOB's payload is checked against its BLAKE3 digest (the last 32 bytes of the scoped
  digest); other payloads (snapshot and branch records, JSON) against `pcrc`.
- Variable fields: namespace, key, scoped digest and epoch scope, each length-prefixed
  in the fixed part.

Operations
----------
BLOB  sdig, payload = the block (content-addressed: any valid copy of a digest will do)
KEY   ns, key -> sdig, pins, epoch tag: the key's whole state (pins change = a new KEY)
DEL   ns, key: the key is gone (a tombstone); `aux` = 1 when the cache evicted it, 2 when
      its block was quarantined (a rebuild brings the key back if the block verifies)
META  ns = tenant, key = id, aux = kind (1 snapshot, 2 branch), payload = JSON record
MDEL  a snapshot or branch record is gone (tombstone)
QUAR  sdig quarantined (its bytes failed verification); `aux` = unix time in ms
SEGH  first record of every segment: `ns` = store id, `epoch` = this segment's id,
      `aux` = the previous segment's id (0: none)
SEAL  segment `aux`'s valid bytes end at `epoch` (written after a failed sync abandoned it)
SEGDEL segment `aux` was deleted on purpose (compacted or dead): not a lost file

Replay is in log order (segment id, then offset). Compaction copies a record forward
only while it is current (see `store/compaction.py`), so a later position always wins.
"""

from __future__ import annotations

import enum
import struct
import zlib
from dataclasses import dataclass

from epistemic_kvcache.store.api import Buffer

MAGIC = b"\xd9KVr"
"""Record start marker (0xD9 never starts UTF-8 text, so text payloads rarely mimic it)."""
VERSION = 1
END_OF_BATCH = 0x01

# magic, version, op, flags, reserved, hlen, hcrc, plen, pins, epoch, aux, pcrc,
# len(ns), len(key), len(sdig), len(scope)
_FIXED = struct.Struct(">4sBBBBIIQIQQIHHBB")
FIXED_BYTES = _FIXED.size  # 54
_HCRC_AT = 12
_HCRC = struct.Struct(">I")
MAX_HEADER_BYTES = FIXED_BYTES + 0xFFFF * 2 + 0xFF * 2
MAX_PAYLOAD_BYTES = 1 << 40
"""Sanity bound on a payload length read from disk (a damaged length is not followed)."""


class Op(enum.IntEnum):
    """Record operations (see the module docstring)."""

    BLOB = 1
    KEY = 2
    DEL = 3
    META = 4
    MDEL = 5
    QUAR = 6
    SEGH = 7
    SEAL = 8
    SEGDEL = 9


TOMBSTONES = frozenset({Op.DEL, Op.MDEL})
DEL_EVICTED = 1
DEL_QUARANTINED = 2


@dataclass(slots=True)
class Record:
    """A decoded header. `plen` payload bytes follow it on disk."""

    op: Op
    flags: int = 0
    ns: str = ""
    key: str = ""
    sdig: bytes = b""
    pins: int = 0
    scope: str = ""
    epoch: int = 0
    aux: int = 0
    plen: int = 0
    pcrc: int = 0
    hlen: int = 0

    @property
    def tag(self) -> tuple[str, int] | None:
        """The epoch tag of a KEY record (None when untagged)."""
        return (self.scope, self.epoch) if self.scope else None

    @property
    def end_of_batch(self) -> bool:
        return bool(self.flags & END_OF_BATCH)


class RecordError(ValueError):
    """Bytes that are not a valid record header (damage, a torn write, or no record)."""


def encode(
    op: Op,
    *,
    ns: str = "",
    key: str = "",
    sdig: bytes = b"",
    pins: int = 0,
    tag: tuple[str, int] | None = None,
    aux: int = 0,
    epoch: int = 0,
    plen: int = 0,
    pcrc: int = 0,
    flags: int = 0,
) -> bytearray:
    """The header of a record (its payload, `plen` bytes, is written after it)."""
    raw_ns, raw_key = ns.encode(), key.encode()
    raw_scope = b""
    if tag is not None:
        raw_scope, epoch = tag[0].encode(), tag[1]
    var = raw_ns + raw_key + sdig + raw_scope
    hlen = FIXED_BYTES + len(var)
    buf = bytearray(
        _FIXED.pack(
            MAGIC,
            VERSION,
            op,
            flags,
            0,
            hlen,
            0,
            plen,
            pins,
            epoch,
            aux,
            pcrc,
            len(raw_ns),
            len(raw_key),
            len(sdig),
            len(raw_scope),
        )
    )
    buf += var
    _HCRC.pack_into(buf, _HCRC_AT, zlib.crc32(buf))
    return buf


def set_end_of_batch(header: bytearray) -> None:
    """Mark an encoded header as the last of its batch (and re-seal its checksum)."""
    header[6] |= END_OF_BATCH
    _HCRC.pack_into(header, _HCRC_AT, 0)
    _HCRC.pack_into(header, _HCRC_AT, zlib.crc32(header))


def header_length(buf: bytes | bytearray | memoryview) -> int:
    """The full header length announced by the fixed part at the start of `buf`.

    Raises `RecordError` when the fixed part is not a record's."""
    if len(buf) < FIXED_BYTES:
        raise RecordError("short header")
    if bytes(buf[:4]) != MAGIC:
        raise RecordError("no record magic")
    hlen = int.from_bytes(buf[8:12], "big")
    if hlen < FIXED_BYTES or hlen > MAX_HEADER_BYTES:
        raise RecordError(f"implausible header length {hlen}")
    return hlen


def decode(buf: bytes | bytearray | memoryview) -> Record:
    """Decode one header from the start of `buf` (which holds at least the whole header).

    Raises `RecordError` on anything but a valid header of a known version and op."""
    hlen = header_length(buf)
    if len(buf) < hlen:
        raise RecordError("short header")
    (
        _magic,
        version,
        op,
        flags,
        _reserved,
        _hlen,
        hcrc,
        plen,
        pins,
        epoch,
        aux,
        pcrc,
        n_ns,
        n_key,
        n_sdig,
        n_scope,
    ) = _FIXED.unpack_from(buf, 0)
    if FIXED_BYTES + n_ns + n_key + n_sdig + n_scope != hlen:
        raise RecordError("header fields do not add up")
    head = bytearray(buf[:hlen])
    struct.pack_into(">I", head, _HCRC_AT, 0)
    if zlib.crc32(head) != hcrc:
        raise RecordError("header checksum mismatch")
    if version != VERSION:
        raise RecordError(f"record version {version}, this code reads {VERSION}")
    try:
        kind = Op(op)
    except ValueError:
        raise RecordError(f"unknown record op {op}") from None
    if plen > MAX_PAYLOAD_BYTES:
        raise RecordError(f"implausible payload length {plen}")
    try:
        ns, key, sdig, scope = _names(head, n_ns, n_key, n_sdig)
    except UnicodeDecodeError:
        raise RecordError("header text is not UTF-8") from None
    return Record(kind, flags, ns, key, sdig, pins, scope, epoch, aux, plen, pcrc, hlen)


def _names(
    buf: bytes | bytearray | memoryview, n_ns: int, n_key: int, n_sdig: int
) -> tuple[str, str, bytes, str]:
    """The variable fields after the fixed ones: (ns, key, sdig, scope), the scope
    running to the header's end. UnicodeDecodeError if a text field is not UTF-8."""
    pos = FIXED_BYTES
    ns = bytes(buf[pos : pos + n_ns]).decode()
    pos += n_ns
    key = bytes(buf[pos : pos + n_key]).decode()
    pos += n_key
    sdig = bytes(buf[pos : pos + n_sdig])
    return ns, key, sdig, bytes(buf[pos + n_sdig :]).decode()


def decode_unchecked(buf: bytes | bytearray | memoryview) -> Record:
    """Decode a header whose checksum fails, to name what a damaged record was (the
    result is a guess: never applied, only reported). `RecordError` if it cannot be."""
    if len(buf) < FIXED_BYTES or bytes(buf[:4]) != MAGIC:
        raise RecordError("no record magic")
    fields = _FIXED.unpack_from(buf, 0)
    op, flags, plen, pins, epoch, aux = (
        fields[2],
        fields[3],
        fields[7],
        fields[8],
        fields[9],
        fields[10],
    )
    n_ns, n_key, n_sdig, n_scope = fields[12:16]
    hlen = FIXED_BYTES + n_ns + n_key + n_sdig + n_scope
    if hlen > len(buf):
        raise RecordError("header fields run past the bytes read")
    try:
        kind = Op(op)
        ns, key, sdig, scope = _names(buf[:hlen], n_ns, n_key, n_sdig)
    except ValueError:  # an unknown op, or text that is not UTF-8
        raise RecordError("not a readable header") from None
    return Record(kind, flags, ns, key, sdig, pins, scope, epoch, aux, plen, fields[11], hlen)


def record_length(op: Op, ns: str = "", key: str = "", sdig: bytes = b"", scope: str = "") -> int:
    """Header length of a record with these variable fields (for space accounting)."""
    return FIXED_BYTES + len(ns.encode()) + len(key.encode()) + len(sdig) + len(scope.encode())


def blob_header_length(sdig: bytes) -> int:
    """Header length of a BLOB record: its payload starts this far after the record."""
    return FIXED_BYTES + len(sdig)


def payload_crc(payload: Buffer) -> int:
    """The `pcrc` of a non-BLOB payload."""
    return zlib.crc32(payload)
