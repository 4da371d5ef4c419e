"""The log is the truth: what an operator can do to a persist dir, and what the store does.

Index deleted, emptied, cut short, garbage or from another store: the store refuses to
open (one line naming the command to run), never starts empty and never deletes a
segment; `--rebuild-index` (and `store rebuild-index`) bring every key back from the log.
Segments cut short, deleted or with flipped bytes: the keys whose bytes are gone are
misses from the moment the store opens, counted, listed by `store check`; nothing else
is disturbed. A store killed with SIGKILL before its index caught up replays the log
tail. Integrity counters and the quarantine survive restarts.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from epistemic_kvcache.errors import ConfigurationError
from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.store import SharedKvStoreBackend, records, tools
from epistemic_kvcache.store.records import Op
from epistemic_kvcache.store.recovery import LogState, finish, replay, valid_ends
from epistemic_kvcache.store.scan import scan
from epistemic_kvcache.store.segments import DiskIO, LogWriter, Segment

NS = "tenant"
OPTS = {"map_size_bytes": 64 << 20, "segment_bytes": 256 << 10}


def block(i: int, size: int = 20_000) -> bytes:
    return (f"block-{i}:".encode() * (size // 8 + 1))[:size]


def fill(path: Path, n: int = 60, **kw: object) -> dict[str, bytes]:
    data = {f"k{i}": block(i) for i in range(n)}
    with SharedKvStoreBackend(path, StoreOptions(**{**OPTS, **kw})) as store:  # type: ignore[arg-type]
        for key, value in data.items():
            store.put(NS, key, value)
    return data


def seg_files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((path / "segments").iterdir())}


def open_store(path: Path, **kw: object) -> SharedKvStoreBackend:
    return SharedKvStoreBackend(path, StoreOptions(**{**OPTS, **kw}))  # type: ignore[arg-type]


def assert_all(store: SharedKvStoreBackend, data: dict[str, bytes]) -> None:
    assert sorted(store.keys(NS, limit=10_000)) == sorted(data)
    for key, value in data.items():
        store.evict(NS, key)  # read from the log, verified
        assert bytes(store.get(NS, key) or b"") == value, key


def damage_index(path: Path, how: str) -> None:
    data = path / "index" / "data.mdb"
    if how == "deleted":
        shutil.rmtree(path / "index")
    elif how == "emptied":
        data.write_bytes(b"")
    elif how == "truncated":
        os.truncate(data, data.stat().st_size // 2)
    elif how == "garbage":
        data.write_bytes(os.urandom(data.stat().st_size))
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["deleted", "emptied", "truncated", "garbage"])
def test_a_lost_index_is_refused_then_rebuilt_from_the_log(tmp_path: Path, how: str) -> None:
    data = fill(tmp_path)
    before = seg_files(tmp_path)
    damage_index(tmp_path, how)
    # never SIGBUS, never an empty store: a clear refusal, in a real process
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from epistemic_kvcache.store import SharedKvStoreBackend as S; "
            "from epistemic_kvcache.options import StoreOptions as O; "
            "S(sys.argv[1], O(map_size_bytes=64 << 20))",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr  # an exception, not a signal
    last = proc.stderr.strip().splitlines()[-1]
    assert "refusing to start empty over existing data" in last
    assert "epistemic-kvcache store rebuild-index" in last
    assert seg_files(tmp_path) == before  # not a byte of the log touched
    with pytest.raises(ConfigurationError, match="rebuild-index"):
        open_store(tmp_path)
    # the explicit flag rebuilds; the old index is kept aside, not deleted
    with open_store(tmp_path, rebuild_index=True) as store:
        assert_all(store, data)
        assert store.check(deep=True).ok
    if how != "deleted":
        assert list(tmp_path.glob("index.unusable-*"))
    with open_store(tmp_path) as store:  # and the rebuilt index opens normally
        assert_all(store, data)
    summary = tools.check(tmp_path)
    assert summary.ok, summary.lines()
    assert summary.keys == len(data)


def test_store_rebuild_index_command(tmp_path: Path) -> None:
    data = fill(tmp_path, n=20)
    damage_index(tmp_path, "garbage")
    cli = Path(sys.executable).parent / "epistemic-kvcache"
    bad = subprocess.run(
        [str(cli), "store", "check", "--persist-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 1
    assert "index: unusable" in bad.stdout
    ok = subprocess.run(
        [str(cli), "store", "rebuild-index", "--persist-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert f"{len(data)} blocks, {len(data)} keys" in ok.stdout
    assert "rebuilding the index" in ok.stderr  # progress on the terminal
    good = subprocess.run(
        [str(cli), "store", "check", "--persist-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert good.returncode == 0, good.stdout
    assert good.stdout.strip().splitlines()[-1].startswith("OK")


def test_an_index_from_another_store_is_refused(tmp_path: Path) -> None:
    fill(tmp_path / "a", n=5)
    fill(tmp_path / "b", n=5)
    shutil.rmtree(tmp_path / "a" / "index")
    shutil.copytree(tmp_path / "b" / "index", tmp_path / "a" / "index")
    with pytest.raises(ConfigurationError, match="belongs to store"):
        open_store(tmp_path / "a")


def test_an_older_format_is_refused_with_the_way_out(tmp_path: Path) -> None:
    fill(tmp_path, n=3)
    import lmdb

    env = lmdb.open(str(tmp_path / "index"), max_dbs=8)
    meta = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        txn.put(b"format", b"3", db=meta)
    env.close()
    with pytest.raises(ConfigurationError, match="format 3"):
        open_store(tmp_path)


def test_sigkill_before_a_checkpoint_replays_the_log_tail(tmp_path: Path) -> None:
    """The index lags the log (no checkpoint for an hour); a killed store loses nothing."""
    script = textwrap.dedent(
        f"""
        import sys
        from epistemic_kvcache.options import StoreOptions
        from epistemic_kvcache.store import SharedKvStoreBackend
        s = SharedKvStoreBackend(sys.argv[1], StoreOptions(checkpoint_interval_s=3600, **{OPTS!r}))
        for i in range(200):
            s.put("{NS}", f"k{{i}}", (f"block-{{i}}:".encode() * 2501)[:20000])
        for i in range(0, 200, 3):
            s.delete("{NS}", f"k{{i}}")
        print("DONE", flush=True)
        import time
        time.sleep(600)
        """
    )
    with subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True
    ) as proc:
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "DONE"
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    want = {f"k{i}": block(i) for i in range(200) if i % 3}
    t0 = time.perf_counter()
    with open_store(tmp_path) as store:
        assert time.perf_counter() - t0 < 30
        assert_all(store, want)
        assert store.check(deep=True).ok
    assert tools.check(tmp_path).ok


def _segment_holding(path: Path, key: str) -> Path:
    for p in sorted((path / "segments").iterdir()):
        seg = Segment(0, p, create=False)
        for item in scan(seg, 0, payloads=False, verify=False):
            rec = getattr(item, "rec", None)
            if rec is not None and rec.op.name == "KEY" and rec.key == key:
                return p
    raise AssertionError(key)


@pytest.mark.parametrize("how", ["truncated", "deleted"])
def test_keys_whose_bytes_are_gone_are_misses_from_the_start(tmp_path: Path, how: str) -> None:
    data = fill(tmp_path)
    victim = _segment_holding(tmp_path, "k0")  # the oldest segment
    if how == "truncated":
        os.truncate(victim, victim.stat().st_size // 2)
    else:
        victim.unlink()
    with open_store(tmp_path) as store:
        lost = {key for _ns, key, _d in store.lost_keys()}
        assert lost
        assert ("k0" in lost) is (how == "deleted")  # a cut keeps the segment's first blocks
        for key in data:
            if key in lost:
                assert not store.exists(NS, key)  # EXISTS false, HEAD 404 ...
                assert store.size(NS, key) is None
                assert store.get(NS, key) is None  # ... and GET misses
            else:
                store.evict(NS, key)
                assert bytes(store.get(NS, key) or b"") == data[key]
        extra = store.stats(None).extra
        assert extra["lost_keys"] == len(lost)
        report = store.check()
        assert not report.ok
        assert sorted(report.lost_keys) == sorted(f"{NS}/{k}" for k in lost)
        # a lost key can be written again
        again = sorted(lost)[0]
        assert store.put(NS, again, b"fresh").outcome.value == "new"
        assert store.get(NS, again) == b"fresh"
        lost.discard(again)
    summary = tools.check(tmp_path, deep=True)
    assert not summary.ok
    listed = "\n".join(summary.lines())
    # listed as lost (its key record survived) or as known to the index only (it did not)
    for key in lost:
        assert f"{NS}/{key} " in listed or f"{NS}/{key}: index has it" in listed, key


def test_flipped_bytes_are_quarantined_and_remembered(tmp_path: Path) -> None:
    data = fill(tmp_path, n=10)
    seg = _segment_holding(tmp_path, "k3")
    raw = bytearray(seg.read_bytes())
    at = raw.index(block(3)[:64])  # inside the block's payload
    raw[at + 10] ^= 0xFF
    seg.write_bytes(bytes(raw))
    with open_store(tmp_path) as store:
        store.evict(NS, "k3")
        assert store.get(NS, "k3") is None
        assert not store.exists(NS, "k3")
        stats = store.stats(None)
        assert stats.integrity_failures == 1
        assert stats.extra["quarantined_blocks"] == 1
        for key in data:
            if key != "k3":
                store.evict(NS, key)
                assert bytes(store.get(NS, key) or b"") == data[key]
    with open_store(tmp_path) as store:  # counters and quarantine survive a restart
        stats = store.stats(None)
        assert stats.integrity_failures >= 1
        assert stats.extra["quarantined_blocks"] == 1
        assert not store.exists(NS, "k3")
    with open_store(tmp_path, rebuild_index=True) as store:  # and a rebuild from the log
        assert store.stats(None).extra["quarantined_blocks"] == 1
        assert store.stats(None).integrity_failures >= 1
        assert not store.exists(NS, "k3")


def test_a_damaged_record_header_is_reported_and_skipped(tmp_path: Path) -> None:
    data = fill(tmp_path, n=10)
    seg = _segment_holding(tmp_path, "k5")
    raw = bytearray(seg.read_bytes())
    at = raw.index(b"k5")  # inside the KEY record's header
    raw[at] ^= 0x01
    seg.write_bytes(bytes(raw))
    summary = tools.check(tmp_path)
    assert not summary.ok
    assert summary.damaged
    # a rebuild from the log skips the damaged record; the old index still reads, so the
    # key it hides comes back from there (its block verifies in the log)
    with open_store(tmp_path, rebuild_index=True) as store:
        assert store.salvaged is not None
        assert store.salvaged.restored == [(NS, "k5")]
        for key in data:
            assert bytes(store.get(NS, key) or b"") == data[key]
        assert store.stats(None).extra["damaged_log_regions"] >= 1
    # without an index, the log alone decides: that key is gone, the rest kept
    other = tmp_path / "other"
    fill(other, n=10)
    seg = _segment_holding(other, "k5")
    raw = bytearray(seg.read_bytes())
    raw[raw.index(b"k5")] ^= 0x01
    seg.write_bytes(bytes(raw))
    shutil.rmtree(other / "index")
    with open_store(other, rebuild_index=True) as store:
        assert not store.exists(NS, "k5")
        for key in data:
            if key != "k5":
                assert bytes(store.get(NS, key) or b"") == data[key]
        assert store.stats(None).extra["damaged_log_regions"] >= 1


def test_the_persist_dir_and_its_files_are_private(tmp_path: Path) -> None:
    path = tmp_path / "store"
    fill(path, n=2)
    for p in [path, path / "segments", path / "index"]:
        assert p.stat().st_mode & 0o077 == 0, p
    for p in [*path.glob("segments/*"), *path.glob("index/*"), path / "LOCK"]:
        assert p.stat().st_mode & 0o077 == 0, p


# -- replay on its own: a log written with the real writer, read back by `replay` --------
def _digest(data: bytes) -> bytes:
    import blake3

    return blake3.blake3(data).digest()


def _log(path: Path, batches: list[list[tuple[bytearray, bytes | None]]]) -> dict[int, Segment]:
    """Write `batches` (records) to a fresh log in `path`, one group commit each; the
    files are cut at the end of the last batch (no allocated space after it)."""
    path.mkdir(exist_ok=True)
    segs: dict[int, Segment] = {}
    w = LogWriter(path, "s-test", 1 << 20, DiskIO(), segs, next_id=1, delete_reserve=0)
    w.seal_active(prev_id=0)
    for batch in batches:
        w.begin()
        for hdr, payload in batch:
            w.alloc(hdr, payload)
        w.write(reserve_ok=True)
    assert w.active is not None
    os.truncate(w.active.path, w.pos)
    return segs


def _blob(data: bytes) -> tuple[bytearray, bytes]:
    return records.encode(Op.BLOB, sdig=_digest(data), plen=len(data)), data


def _key(key: str, data: bytes, pins: int = 0) -> tuple[bytearray, None]:
    return records.encode(Op.KEY, ns="t", key=key, sdig=_digest(data), pins=pins), None


def _replayed(segs: dict[int, Segment]) -> LogState:
    st = LogState()
    replay(segs, st, None)
    finish(st, segs, valid_ends(st, segs, (0, 0)))
    return st


def test_replay_gives_each_key_its_last_state(tmp_path: Path) -> None:
    segs = _log(
        tmp_path,
        [
            [_blob(b"one"), _key("a", b"one"), _key("b", b"one")],
            [_blob(b"two"), _key("a", b"two", pins=1)],
            [(records.encode(Op.DEL, ns="t", key="b"), None)],
        ],
    )
    st = _replayed(segs)
    assert st.store_id == "s-test"
    assert set(st.keys) == {("t", "a")}
    assert st.keys[("t", "a")].sdig == _digest(b"two")
    assert st.keys[("t", "a")].pins == 1
    assert set(st.blobs) == {_digest(b"two")}  # nothing references "one" any more
    assert st.batches == 3
    assert st.damage == []
    assert st.lost_keys == []


def test_a_torn_last_batch_is_dropped_whole(tmp_path: Path) -> None:
    segs = _log(
        tmp_path,
        [
            [_blob(b"kept"), _key("kept", b"kept")],
            [_blob(b"torn" * 100), _key("torn", b"torn" * 100)],
        ],
    )
    sid = max(segs)
    seg = segs[sid]
    os.truncate(seg.path, seg.size() - 10)  # the crash cut the last record of the batch
    st = _replayed({sid: Segment(sid, seg.path, create=False)})
    assert set(st.keys) == {("t", "kept")}
    assert st.damage == []  # a torn tail is not damage
    assert st.tail_bytes > 0


def test_damaged_bytes_are_skipped_counted_and_the_key_is_lost(tmp_path: Path) -> None:
    segs = _log(
        tmp_path,
        [
            [_blob(b"x" * 5000), _key("a", b"x" * 5000)],
            [_blob(b"y" * 5000), _key("b", b"y" * 5000)],
        ],
    )
    sid = max(segs)
    path = segs[sid].path
    raw = bytearray(path.read_bytes())
    at = raw.find(b"x" * 5000)
    raw[at + 100] ^= 0xFF  # a flipped bit in the first block's payload
    path.write_bytes(raw)
    st = _replayed({sid: Segment(sid, path, create=False)})
    assert [k for _ns, k, _d in st.lost_keys] == ["a"]  # its bytes fail their digest
    assert st.keys[("t", "b")].sdig == _digest(b"y" * 5000)
    assert st.bad_blobs
