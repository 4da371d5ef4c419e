"""Damage to the index never costs an intact block, and damage to the log is reported.

The log is the truth and the LMDB index only a checkpoint of it, so:
- a read that fails verification first distrusts the index: if the block's record is
  not where the index row says, the log is searched for a copy that verifies, RAM and
  the row are repaired, and the block is served; only bytes that really fail are
  quarantined, and a rebuild lifts a quarantine whose block verifies in the log;
- damage inside the index file (page structure or rows) is found before LMDB maps the
  file (never SIGBUS) and answered like a missing index: refuse, name the rebuild;
- `store rebuild-index` names every key it could not restore, and takes what damaged
  log records hide from the old index where that still reads.
"""

from __future__ import annotations

import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest

from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.store import SharedKvStoreBackend, tools
from epistemic_kvcache.store.index import _BLOB_ROW, seal_row
from epistemic_kvcache.store.records import Op
from epistemic_kvcache.store.scan import Scanned, scan
from epistemic_kvcache.store.segments import Segment

NS = "tenant"
OPTS = {"map_size_bytes": 64 << 20, "segment_bytes": 256 << 10}
CLI = Path(sys.executable).parent / "epistemic-kvcache"


def block(i: int, size: int = 20_000) -> bytes:
    return (f"block-{i}:".encode() * (size // 8 + 1))[:size]


def open_store(path: Path, **kw: object) -> SharedKvStoreBackend:
    return SharedKvStoreBackend(path, StoreOptions(**{**OPTS, **kw}))  # type: ignore[arg-type]


def fill(path: Path, n: int = 40) -> dict[str, bytes]:
    data = {f"k{i}": block(i) for i in range(n)}
    with open_store(path) as store:
        for key, value in data.items():
            store.put(NS, key, value)
    return data


def assert_all(store: SharedKvStoreBackend, data: dict[str, bytes]) -> None:
    assert sorted(store.keys(NS, limit=10_000)) == sorted(data)
    for key, value in data.items():
        store.evict(NS, key)  # read from the log, verified
        assert bytes(store.get(NS, key) or b"") == value, key


def blob_rows(path: Path) -> dict[bytes, tuple[int, int, int]]:
    env = lmdb.open(str(path / "index"), max_dbs=8, readonly=True, lock=False)
    try:
        db = env.open_db(b"blobs", create=False)
        with env.begin() as txn:
            return {
                bytes(k): _BLOB_ROW.unpack(bytes(v)[: _BLOB_ROW.size]) for k, v in txn.cursor(db=db)
            }
    finally:
        env.close()


def write_blob_row(path: Path, sdig: bytes, row: tuple[int, int, int]) -> None:
    """A row that is well-formed (its checksum matches) but wrong: what a bug, or damage
    that passes the row checksum, would leave."""
    env = lmdb.open(str(path / "index"), max_dbs=8)
    try:
        db = env.open_db(b"blobs", create=False)
        with env.begin(write=True) as txn:
            txn.put(sdig, seal_row(b"blobs", sdig, _BLOB_ROW.pack(*row)), db=db)
    finally:
        env.close()


def digest_of_key(store: SharedKvStoreBackend, key: str) -> bytes:
    with store.ram.lock:
        b = store.ram.lookup_locked(NS, key)
        assert b is not None
        return b.sdig


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(CLI), "store", *args], capture_output=True, text=True, timeout=120, check=False
    )


# -- item 2: a wrong location never destroys an intact block ----------------------------
def test_a_wrong_index_row_is_repaired_from_the_log_not_quarantined(tmp_path: Path) -> None:
    data = fill(tmp_path)
    with open_store(tmp_path) as store:
        victim, other = digest_of_key(store, "k7"), digest_of_key(store, "k8")
    rows = blob_rows(tmp_path)
    write_blob_row(tmp_path, victim, rows[other])  # k7's row now names k8's bytes
    with open_store(tmp_path) as store:
        store.evict(NS, "k7")
        assert bytes(store.get(NS, "k7") or b"") == data["k7"]  # served, from the log
        extra = store.stats(None).extra
        assert extra["quarantined_blocks"] == 0
        assert extra["index_repairs"] == 1
        assert store.stats(None).integrity_failures == 0
        assert_all(store, data)
    assert blob_rows(tmp_path)[victim] == rows[victim]  # the row itself is repaired
    summary = tools.check(tmp_path)
    assert summary.ok, summary.lines()


def test_store_check_reports_a_wrong_block_location(tmp_path: Path) -> None:
    fill(tmp_path, n=10)
    with open_store(tmp_path) as store:
        victim, other = digest_of_key(store, "k3"), digest_of_key(store, "k4")
    rows = blob_rows(tmp_path)
    write_blob_row(tmp_path, victim, rows[other])
    out = run_cli("check", "--persist-dir", str(tmp_path))
    assert out.returncode == 1, out.stdout
    assert f"block {victim[-32:].hex()}: the index places it where it is not" in out.stdout


def test_compaction_keeps_a_block_whose_row_points_elsewhere(tmp_path: Path) -> None:
    data = fill(tmp_path, n=40)
    with open_store(tmp_path) as store:
        victim, other = digest_of_key(store, "k2"), digest_of_key(store, "k30")
    rows = blob_rows(tmp_path)
    write_blob_row(tmp_path, victim, rows[other])
    with open_store(tmp_path) as store:
        # make k2's segment worth compacting, then let compaction run to the end
        for i in range(3, 12):
            store.delete(NS, f"k{i}")
            del data[f"k{i}"]
        assert store._compact is not None
        for _ in range(200):
            with store.space.maint_lock:
                pass
            if not store._compact.step():
                break
        assert_all(store, data)
        assert store.stats(None).extra["quarantined_blocks"] == 0


def test_a_rebuild_lifts_a_quarantine_whose_block_verifies(tmp_path: Path) -> None:
    data = fill(tmp_path, n=10)
    with open_store(tmp_path) as store:
        sdig = digest_of_key(store, "k5")
        with store.ram.lock:
            b = store.ram.lookup_locked(NS, "k5")
            assert b is not None
            seg_file, off = store.space.segs[b.seg].path, b.off
    # a transient read fault: the bytes read back wrong once (then the medium is fine)
    raw = bytearray(seg_file.read_bytes())
    good = bytes(raw[off + 100 : off + 101])
    raw[off + 100] ^= 0xFF
    seg_file.write_bytes(raw)
    with open_store(tmp_path) as store:
        store.evict(NS, "k5")
        assert store.get(NS, "k5") is None  # damaged where the log says: quarantined
        assert store.stats(None).extra["quarantined_blocks"] == 1
        assert store.get(NS, "k5") is None
    with seg_file.open("r+b") as f:  # the medium is fine again (the log grew meanwhile)
        f.seek(off + 100)
        f.write(good)
    # check (deep) sees what a rebuild would bring back
    assert "k5: index lacks it" in "\n".join(tools.check(tmp_path).lines())
    out = run_cli("rebuild-index", "--persist-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert f"{NS}/k5 is back" in out.stderr
    with open_store(tmp_path) as store:
        assert_all(store, data)
        assert store.stats(None).extra["quarantined_blocks"] == 0
        assert digest_of_key(store, "k5") == sdig
    assert tools.check(tmp_path).ok


# -- item 3: index damage LMDB would accept is found before it is used --------------------
def _start(path: Path) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys; from epistemic_kvcache.store import SharedKvStoreBackend as S\n"
        "from epistemic_kvcache.options import StoreOptions\n"
        "s = S(sys.argv[1], StoreOptions(map_size_bytes=64 << 20))\n"
        "print(len(s.keys('tenant', limit=100000)), s.stats(None).extra['lost_keys'])\n"
        "s.close()"
    )
    return subprocess.run(
        [sys.executable, "-c", code, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_flipped_byte_in_a_blob_row_is_refused_not_blamed_on_the_log(tmp_path: Path) -> None:
    data = fill(tmp_path, n=30)
    with open_store(tmp_path) as store:
        sdig = digest_of_key(store, "k9")
    row = _BLOB_ROW.pack(*blob_rows(tmp_path)[sdig])
    f = tmp_path / "index" / "data.mdb"
    raw = bytearray(f.read_bytes())
    at = raw.find(row)
    assert at > 0
    raw[at + 12] ^= 0x10  # the payload offset of k9's block
    f.write_bytes(raw)
    proc = _start(tmp_path)
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    last = proc.stderr.strip().splitlines()[-1]
    assert "index row damaged" in last, last
    assert "store rebuild-index" in last, last
    assert "lost their bytes" not in proc.stderr
    out = run_cli("check", "--persist-dir", str(tmp_path))
    assert out.returncode == 1, out.stdout
    assert "index: unusable" in out.stdout, out.stdout
    assert run_cli("rebuild-index", "--persist-dir", str(tmp_path)).returncode == 0
    with open_store(tmp_path) as store:
        assert_all(store, data)


@pytest.mark.parametrize("seed", range(12))
def test_random_index_damage_never_kills_the_process(tmp_path: Path, seed: int) -> None:
    base = tmp_path / "base"
    data = fill(base, n=200)
    rng = random.Random(seed)
    raw = bytearray((base / "index" / "data.mdb").read_bytes())
    used = [i for i, c in enumerate(raw) if c]
    for _ in range(rng.choice([1, 3, 10, 40])):
        i = rng.choice(used)
        raw[i] ^= 1 << rng.randrange(8)
    (base / "index" / "data.mdb").write_bytes(raw)
    for _ in range(2):  # a second start after the first must not die either
        proc = _start(base)
        assert proc.returncode in (0, 1), (proc.returncode, proc.stderr[-2000:])
        if proc.returncode == 0:  # the flips hit nothing in use: every key is there
            assert proc.stdout.split() == [str(len(data)), "0"], proc.stderr[-2000:]
        else:
            assert "store rebuild-index" in proc.stderr.strip().splitlines()[-1]
    check = run_cli("check", "--persist-dir", str(base))
    assert check.returncode in (0, 1), check.stderr
    if check.returncode == 0:
        assert proc.returncode == 0
    assert run_cli("rebuild-index", "--persist-dir", str(base)).returncode == 0
    with open_store(base) as store:
        assert_all(store, data)


def test_an_index_without_row_checksums_is_rebuilt_from_the_log(tmp_path: Path) -> None:
    data = fill(tmp_path, n=10)
    env = lmdb.open(str(tmp_path / "index"), max_dbs=8)
    meta = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        txn.put(b"format", b"4", db=meta)
    env.close()
    with open_store(tmp_path) as store:
        assert_all(store, data)
    assert list(tmp_path.glob("index.unusable-*"))
    assert tools.check(tmp_path).ok


# -- item 4: a rebuild names every key it could not restore -------------------------------
def _key_records(path: Path) -> list[tuple[Path, int, str]]:
    out = []
    for p in sorted((path / "segments").iterdir()):
        seg = Segment(int(p.stem), p, create=False)
        for item in scan(seg, 0, payloads=False, verify=False):
            if isinstance(item, Scanned) and item.rec.op is Op.KEY:
                out.append((p, item.off, item.rec.key))
    return out


def _flip_key_headers(path: Path, keys: list[str]) -> None:
    for p, off, key in _key_records(path):
        if key in keys:
            raw = bytearray(p.read_bytes())
            raw[off + 30] ^= 0x01  # inside the fixed header: the record fails its CRC
            p.write_bytes(raw)


def test_rebuild_restores_keys_hidden_by_damaged_headers_from_the_old_index(
    tmp_path: Path,
) -> None:
    data = fill(tmp_path, n=30)
    _flip_key_headers(tmp_path, ["k3", "k11", "k20"])
    out = run_cli("rebuild-index", "--persist-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "keys whose bytes are gone: 0" in out.stdout
    assert "restored from the old index: 3" in out.stdout, out.stdout
    with open_store(tmp_path) as store:
        assert_all(store, data)
    # the restored keys are in the log again: a second rebuild without that index keeps them
    shutil.rmtree(tmp_path / "index")
    for p in tmp_path.glob("index.unusable-*"):
        shutil.rmtree(p)
    out = run_cli("rebuild-index", "--persist-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "keys whose bytes are gone: 0" in out.stdout, out.stdout
    with open_store(tmp_path) as store:
        assert_all(store, data)


def test_rebuild_without_an_old_index_names_the_keys_it_lost(tmp_path: Path) -> None:
    data = fill(tmp_path, n=30)
    _flip_key_headers(tmp_path, ["k3", "k11", "k20"])
    shutil.rmtree(tmp_path / "index")
    out = run_cli("rebuild-index", "--persist-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "keys whose bytes are gone: 0" not in out.stdout, out.stdout
    for key in ("k3", "k11", "k20"):
        assert f"{NS}/{key}" in out.stdout, out.stdout
    with open_store(tmp_path) as store:
        assert sorted(store.keys(NS, limit=1000)) == sorted(set(data) - {"k3", "k11", "k20"})


def test_a_page_pointer_past_the_end_is_refused_with_the_way_out(tmp_path: Path) -> None:
    """A branch page naming a page past the end of the file (or anything else LMDB's
    page checks stop at, or do not: then it touches unmapped memory, SIGBUS): the file is
    validated with `pread` before LMDB maps it, so starts and `store check` refuse and
    name the way out instead of dying on an uncaught LMDB error."""
    data = fill(tmp_path, n=400)
    f = tmp_path / "index" / "data.mdb"
    raw = bytearray(f.read_bytes())
    psize = struct.unpack_from("<I", raw, 16 + 24)[0]
    branches = [
        pg
        for pg in range(2, len(raw) // psize)
        if struct.unpack_from("<Q", raw, pg * psize)[0] == pg
        and struct.unpack_from("<H", raw, pg * psize + 10)[0] & 0x01
    ]
    assert branches, "400 keys make a tree with a branch page"
    base = branches[-1] * psize
    ptr = struct.unpack_from("<H", raw, base + 16)[0]  # the first node of the page
    far = len(raw) // psize + 1000  # inside LMDB's map, past the end of the file
    struct.pack_into("<HH", raw, base + ptr, far & 0xFFFF, far >> 16)
    f.write_bytes(raw)
    for _ in range(2):
        proc = _start(tmp_path)
        assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
        last = proc.stderr.strip().splitlines()[-1]
        assert "index file is damaged" in last, last
        assert "store rebuild-index" in last, last
    out = run_cli("check", "--persist-dir", str(tmp_path))
    assert out.returncode == 1, (out.returncode, out.stderr)
    assert "index: unusable" in out.stdout, (out.returncode, out.stderr)
    assert run_cli("rebuild-index", "--persist-dir", str(tmp_path)).returncode == 0
    with open_store(tmp_path) as store:
        assert_all(store, data)


def test_rebuild_never_reports_fewer_lost_keys_than_it_lost(tmp_path: Path) -> None:
    """A segment deleted by hand takes keys and their KEY records with it: the log alone
    no longer knows those keys, but the old index does, so the rebuild names each one."""
    data = fill(tmp_path, n=40)
    segs = sorted((tmp_path / "segments").glob("*.seg"))
    assert len(segs) >= 3
    segs[1].unlink()
    out = run_cli("rebuild-index", "--persist-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    with open_store(tmp_path) as store:
        served = set(store.keys(NS, limit=1000))
        assert_all(store, {k: v for k, v in data.items() if k in served})
    gone = sorted(set(data) - served)
    assert gone
    assert f"keys whose bytes are gone: {len(gone)}," in out.stdout, out.stdout
    for key in gone:
        assert f"lost: {NS}/{key} (" in out.stdout, (key, out.stdout)


def test_rebuild_and_check_name_keys_lost_to_a_quarantine(tmp_path: Path) -> None:
    fill(tmp_path, n=10)
    with open_store(tmp_path) as store, store.ram.lock:
        b = store.ram.lookup_locked(NS, "k4")
        assert b is not None
        seg_file, off = store.space.segs[b.seg].path, b.off
    with seg_file.open("r+b") as f:  # damaged for good
        f.seek(off + 10)
        f.write(b"\x00" * 64)
    with open_store(tmp_path) as store:
        store.evict(NS, "k4")
        assert store.get(NS, "k4") is None  # quarantined, its key deleted
    summary = tools.check(tmp_path)
    assert not summary.ok, summary.lines()  # never OK while a key is missing
    out = run_cli("rebuild-index", "--persist-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "keys whose bytes are gone: 1," in out.stdout, out.stdout
    assert f"lost: {NS}/k4 (its block" in out.stdout, out.stdout
