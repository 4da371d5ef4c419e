"""The log's record format (`store/records.py`) on its own: encode, decode, damage."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given

from epistemic_kvcache.store import records
from epistemic_kvcache.store.records import Op, RecordError

SDIG = b"ns\x00" + bytes(range(32))


@pytest.mark.parametrize(
    "fields",
    [
        {"op": Op.BLOB, "sdig": SDIG, "plen": 4096},
        {"op": Op.KEY, "ns": "t", "key": "k", "sdig": SDIG, "pins": 2, "tag": ("scope", 7)},
        {"op": Op.DEL, "ns": "t", "key": "ключ", "aux": records.DEL_EVICTED},
        {"op": Op.META, "ns": "t", "key": "s1", "aux": 1, "plen": 12, "pcrc": 99},
        {"op": Op.MDEL, "ns": "t", "key": "s1", "aux": 2},
        {"op": Op.QUAR, "sdig": SDIG, "aux": 1_700_000_000_000},
        {"op": Op.SEGH, "ns": "store-id", "epoch": 5, "aux": 4},
        {"op": Op.SEAL, "aux": 3, "epoch": 1 << 20},
        {"op": Op.SEGDEL, "aux": 3},
    ],
)
def test_every_op_round_trips(fields: dict[str, object]) -> None:
    f = dict(fields)
    op = f.pop("op")
    assert isinstance(op, Op)
    hdr = records.encode(op, **f)  # type: ignore[arg-type]
    rec = records.decode(bytes(hdr))
    assert rec.op is op
    assert rec.hlen == len(hdr) == records.header_length(hdr)
    tag = f.pop("tag", None)
    if tag is not None:
        assert (rec.scope, rec.epoch) == tag
    for name, value in f.items():
        assert getattr(rec, name) == value, name
    assert rec.flags & records.END_OF_BATCH == 0


def test_lengths_used_for_space_accounting_match_the_encoding() -> None:
    hdr = records.encode(Op.KEY, ns="tenant", key="clé", sdig=SDIG, tag=("s", 1))
    assert records.record_length(Op.KEY, "tenant", "clé", SDIG, "s") == len(hdr)
    assert records.blob_header_length(SDIG) == len(records.encode(Op.BLOB, sdig=SDIG, plen=1))


def test_end_of_batch_mark_keeps_the_header_valid() -> None:
    hdr = records.encode(Op.DEL, ns="t", key="k")
    records.set_end_of_batch(hdr)
    assert records.decode(bytes(hdr)).flags & records.END_OF_BATCH


@given(st.integers(min_value=0), st.integers(min_value=0, max_value=7))
def test_any_flipped_bit_in_a_header_is_refused(at: int, bit: int) -> None:
    hdr = records.encode(Op.KEY, ns="t", key="k", sdig=SDIG, pins=1, tag=("s", 3))
    hdr[at % len(hdr)] ^= 1 << bit
    with pytest.raises(RecordError):
        records.decode(bytes(hdr))


@pytest.mark.parametrize(
    ("buf", "match"),
    [
        (b"", "short header"),
        (b"\x00" * 60, "no record magic"),
        (
            records.MAGIC + b"\x01\x02\x00\x00" + (5).to_bytes(4, "big") + b"\x00" * 50,
            "implausible",
        ),
        (bytes(records.encode(Op.KEY, ns="t", key="k"))[:-1], "short header"),
    ],
)
def test_what_is_not_a_record_says_why(buf: bytes, match: str) -> None:
    with pytest.raises(RecordError, match=match):
        records.decode(buf)


def test_a_damaged_header_can_still_be_named_for_a_report() -> None:
    hdr = records.encode(Op.KEY, ns="tenant", key="lost", sdig=SDIG)
    hdr[records.FIXED_BYTES - 20] ^= 0xFF  # inside the epoch field: the checksum fails
    with pytest.raises(RecordError, match="checksum"):
        records.decode(bytes(hdr))
    guess = records.decode_unchecked(bytes(hdr))
    assert (guess.op, guess.ns, guess.key) == (Op.KEY, "tenant", "lost")
