"""A group commit torn by SIGKILL across a segment boundary stays dropped for good.

The crash is made deterministic: `store_torn_writer.py` kills itself with a real
SIGKILL at the exact moment a batch of DELETEs, having written its records into the
active segment, starts writing the rest into the segment it just opened. Those first
records sit in the log with no end-of-batch record: the batch was never acknowledged.

Before the fix, opening dropped them at replay but left them in the log (only the last
segment was cut back to the last complete batch, and this one was not the last). The
next process appended its batches after them, so the replay after its crash read the
torn records as the start of its first batch and applied them: acknowledged keys were
deleted by a DELETE that never happened, with `check()` finding nothing wrong; keys
never acknowledged came back referencing a block whose payload had been punched out
since (`check(deep=True)`: a corrupt blob).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import store_torn_writer as writer
from epistemic_kvcache.store import SharedKvStoreBackend

WRITER = Path(__file__).with_name("store_torn_writer.py")
NS = "torn"
KEYS = [f"key-{i:04d}-" + "k" * 200 for i in range(300)]  # ~80 KB of DEL records
BLOCK = writer.BLOCK  # every key holds the same block (one blob, many references)


def _run(mode: str, persist_dir: Path, keys: list[str]) -> list[str]:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parent.parent / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, str(WRITER), mode, str(persist_dir), NS, *keys],
        capture_output=True,
        env=env,
        timeout=120,
    )
    lines = proc.stdout.decode().splitlines()
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, lines, proc.stderr.decode())
    assert lines[0] == "READY", (lines, proc.stderr.decode())
    assert lines[-1] == "KILL", (lines, proc.stderr.decode())
    return lines


def _assert_all_there(persist_dir: Path, keys: list[str]) -> None:
    with SharedKvStoreBackend(persist_dir, writer.OPTIONS) as store:
        report = store.check(deep=True)
        assert report.ok, report
        have = set(store.keys(NS, limit=1 << 20))
        lost = [k for k in keys if k not in have]
        assert not lost, f"{len(lost)} acknowledged keys lost, e.g. {lost[0]}"
        assert have == set(keys)
        for key in keys:
            got = store.get(NS, key)
            assert got is not None
            assert bytes(got) == (BLOCK if key in KEYS else key.encode())


@pytest.mark.timeout(120)
def test_a_batch_torn_across_segments_is_never_applied_later(tmp_path: Path) -> None:
    persist_dir = tmp_path / "store"
    with SharedKvStoreBackend(persist_dir, writer.OPTIONS) as store:
        store.put_many(NS, [(k, BLOCK) for k in KEYS])
    # the DELETE batch is torn by SIGKILL: none of the DELETEs was acknowledged
    _run("torn-delete", persist_dir, KEYS)
    _assert_all_there(persist_dir, KEYS)
    # a later process acknowledges a write and crashes before any checkpoint
    _run("put-then-kill", persist_dir, ["after-the-crash"])
    _assert_all_there(persist_dir, [*KEYS, "after-the-crash"])
    # and once more, with the index checkpointed where that open left it
    _run("put-then-kill", persist_dir, ["later-still"])
    _assert_all_there(persist_dir, [*KEYS, "after-the-crash", "later-still"])


@pytest.mark.timeout(120)
def test_puts_torn_across_segments_never_come_back_over_a_punched_block(tmp_path: Path) -> None:
    persist_dir = tmp_path / "store"
    with SharedKvStoreBackend(persist_dir, writer.OPTIONS) as store:
        store.put(NS, "holder", writer.BLOCK)
    # PUTs of many keys with those bytes (KEY records only: deduplicated), torn
    torn = [f"torn-{i:04d}-" + "t" * 200 for i in range(300)]
    _run("torn-put", persist_dir, torn)
    with SharedKvStoreBackend(persist_dir, writer.OPTIONS) as store:
        assert store.check(deep=True).ok
        assert list(store.keys(NS)) == ["holder"]  # the batch was never acknowledged
    # a later process deletes the block's only key (its payload is punched out) and
    # crashes before any checkpoint
    _run("delete-then-kill", persist_dir, ["holder"])
    with SharedKvStoreBackend(persist_dir, writer.OPTIONS) as store:
        report = store.check(deep=True)
        assert report.ok, report
        assert list(store.keys(NS)) == []


@pytest.mark.timeout(120)
def test_a_failed_write_leaves_nothing_a_later_batch_could_apply(tmp_path: Path) -> None:
    """A write cut short by EIO leaves half a batch of DELETEs past the trusted end of
    the active segment; the caller was told nothing was stored. The next batch opens a
    new segment, and the process dies right after that batch's sync (before the old
    segment's tail is cut). Replay must not read the half-written DELETEs as the start
    of that batch."""
    persist_dir = tmp_path / "store"
    with SharedKvStoreBackend(persist_dir, writer.OPTIONS) as store:
        store.put_many(NS, [(k, BLOCK) for k in KEYS[:100]])
    lines = _run("failed-delete-then-put", persist_dir, KEYS[:100])
    assert "DELETE FAILED" in lines
    with SharedKvStoreBackend(persist_dir, writer.OPTIONS) as store:
        report = store.check(deep=True)
        assert report.ok, report
        have = set(store.keys(NS, limit=1 << 20))
        lost = [k for k in KEYS[:100] if k not in have]
        assert not lost, f"{len(lost)} keys deleted by a DELETE that failed, e.g. {lost[0]}"
        assert have == {*KEYS[:100], "big"}


@pytest.mark.timeout(120)
def test_a_complete_batch_across_segments_leaves_no_false_damage(tmp_path: Path) -> None:
    """A batch that rolled over into a new segment is durable once synced; the writer
    then cuts the zeroed space it left behind in the old segment. A crash between the
    two left zeros in the middle of the batch, which every later open reported as
    damaged log bytes (and `store check` as damage) though nothing was wrong."""
    persist_dir = tmp_path / "store"
    with SharedKvStoreBackend(persist_dir, writer.OPTIONS) as store:
        store.put(NS, "first", b"f" * 100)
    _run("spanning-put", persist_dir, KEYS)
    with SharedKvStoreBackend(persist_dir, writer.OPTIONS) as store:
        assert store.check(deep=True).ok
        assert set(store.keys(NS, limit=1 << 20)) == {"first", "small", *KEYS}
        assert store.stats(None).extra["damaged_log_regions"] == 0


@pytest.mark.timeout(120)
def test_a_segment_the_cut_emptied_is_deleted(tmp_path: Path) -> None:
    """The torn batch had opened a new segment: the cut leaves that file empty. It is
    sealed (the writer opens a fresh one after it), holds nothing live, and compaction's
    first step deletes it (a SEGDEL record, then the unlink); the next open is clean."""
    persist_dir = tmp_path / "store"
    with SharedKvStoreBackend(persist_dir, writer.OPTIONS) as store:
        store.put_many(NS, [(k, BLOCK) for k in KEYS])
    _run("torn-delete", persist_dir, KEYS)
    segments = persist_dir / "segments"
    emptied = [p.name for p in sorted(segments.iterdir()) if p.stat().st_size == 0]
    assert emptied, "the torn batch left no empty segment: this test tests nothing"
    with SharedKvStoreBackend(persist_dir, writer.OPTIONS) as store:
        deadline = time.monotonic() + 60
        while any((segments / name).exists() for name in emptied):
            assert time.monotonic() < deadline, f"{emptied} still there"
            time.sleep(0.05)  # polling, with the deadline above
        assert store.stats(None).extra["segments_deleted"] >= len(emptied)
    _assert_all_there(persist_dir, KEYS)
    assert not any((segments / name).exists() for name in emptied)
