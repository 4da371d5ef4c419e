"""Crash safety with a real process: SIGKILL a concurrent writer, reopen, verify.

Each cycle starts `store_crash_writer.py` on the same persist directory, lets its
threads PUT and DELETE for a random moment, kills it with SIGKILL, and reopens the
store here. After every kill:

- every acknowledged PUT reads back bit-exact (unless its DELETE was issued since);
- every acknowledged DELETE stays deleted;
- what a crash left uncertain stays as the reopen after it found it: an unacknowledged
  DELETE that took effect stays deleted, an unacknowledged PUT found absent stays absent
  (keys are never reused: nothing may bring it back later, e.g. a torn batch's records
  replayed with a later batch);
- every key present holds exactly the bytes its name says (unacknowledged PUTs are
  absent or complete, never torn);
- `check(deep=True)` finds no orphan index entry, orphan blob, refcount mismatch or
  corrupt blob.

The seed is printed; replay a failure with KVCACHE_TEST_SEED=<seed>.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import store_crash_writer as writer
from epistemic_kvcache.store import SharedKvStoreBackend

WRITER = Path(__file__).with_name("store_crash_writer.py")
Ref = tuple[str, str]


class _Run:
    """One writer process, its output collected line by line by a reader thread."""

    def __init__(self, persist_dir: Path, seed: int, cycle: int, stderr_path: Path) -> None:
        env = dict(os.environ)
        src = str(Path(__file__).resolve().parent.parent / "src")
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
        self.stderr = stderr_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(WRITER), str(persist_dir), str(seed), str(cycle), "4"],
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env=env,
        )
        self.lines: list[str] = []
        self.ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            if not raw.endswith(b"\n"):
                break  # a line cut short by the kill was never a complete acknowledgement
            line = raw.decode().rstrip("\n")
            if line == "READY":
                self.ready.set()
            self.lines.append(line)
        self.ready.set()

    def kill(self) -> int:
        self.proc.send_signal(signal.SIGKILL)
        rc = self.proc.wait(timeout=30)
        self._reader.join(timeout=30)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        self.stderr.close()
        return rc


def _verify(
    persist_dir: Path,
    seed: int,
    present: set[Ref],
    maybe_deleted: set[Ref],
    acked_deleted: set[Ref],
    never_put: set[Ref],
) -> set[Ref]:
    """Reopen the store, check it against what was acknowledged; return the keys found."""
    with SharedKvStoreBackend(persist_dir, writer.STORE_OPTIONS) as store:
        report = store.check(deep=True)
        assert report.ok, report
        found = {(ns, k) for ns in writer.NAMESPACES for k in store.keys(ns, limit=1 << 20)}
        missing = present - maybe_deleted - found
        assert not missing, f"acknowledged keys lost: {sorted(missing)[:5]}"
        resurrected = acked_deleted & found
        assert not resurrected, f"deleted keys came back: {sorted(resurrected)[:5]}"
        undead = never_put & found
        assert not undead, f"unacknowledged PUTs found absent came back: {sorted(undead)[:5]}"
        for ns, key in found:
            got = store.get(ns, key)
            assert got is not None, f"{ns}/{key} listed but not readable"
            want = writer.content_of_key(seed, key)
            assert len(got) == len(want), f"{ns}/{key}: torn ({len(got)} of {len(want)} bytes)"
            assert bytes(got) == want, f"{ns}/{key}: wrong bytes"
        stats = store.stats(None)
        assert stats.total_refs == len(found)
        assert stats.integrity_failures == 0
        assert report.keys == len(found)
    return found


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkill_during_concurrent_puts_and_deletes(tmp_path: Path, rand) -> None:  # type: ignore[no-untyped-def]
    seed = rand.randrange(1 << 30)
    cycles = 20
    persist_dir = tmp_path / "store"
    present: set[Ref] = set()  # keys known to be in the store
    acked_deleted: set[Ref] = set()
    never_put: set[Ref] = set()  # unacknowledged PUTs found absent after their crash
    total_acks = 0
    total_del_acks = 0
    busy_cycles = 0
    for cycle in range(cycles):
        run = _Run(persist_dir, seed, cycle, tmp_path / f"writer-{cycle}.err")
        assert run.ready.wait(timeout=60), "writer did not start"
        # early kills hit the first group commits; later ones hit a busy, churning store
        time.sleep(rand.choice([0.0, 0.01, 0.05]) + rand.random() * 0.6)  # the kill moment
        rc = run.kill()
        err = (tmp_path / f"writer-{cycle}.err").read_text()
        assert "Traceback" not in err, err
        assert run.lines[:1] == ["READY"], err
        assert rc == -signal.SIGKILL, f"writer exited by itself ({rc}): {err}"
        maybe_deleted: set[Ref] = set()
        maybe_put: set[Ref] = set()
        acks = 0
        for line in run.lines[1:]:
            parts = line.split(" ")
            if parts[0] == "ACK" and parts[1] == "PUT":
                present.add((parts[2], parts[3]))
                acks += 1
            elif parts[0] == "PUT?":
                maybe_put.add((parts[1], parts[2]))
            elif parts[0] == "DEL?":
                maybe_deleted.add((parts[1], parts[2]))
            elif parts[0] == "ACK" and parts[1] == "DEL":
                ref = (parts[2], parts[3])
                acked_deleted.add(ref)
                present.discard(ref)
                total_del_acks += 1
        total_acks += acks
        if acks:
            busy_cycles += 1
        found = _verify(persist_dir, seed, present, maybe_deleted, acked_deleted, never_put)
        # what was uncertain is now known: unacked deletes that happened, unacked puts
        # that made it; from here on those must stay as they are
        acked_deleted |= maybe_deleted - found
        never_put |= maybe_put - found
        present = found
    print(f"writer seed {seed}: {total_acks} PUTs and {total_del_acks} DELETEs acknowledged")
    assert total_acks >= 100, "the writer did too little for the test to mean anything"
    assert total_del_acks >= 10
    assert busy_cycles >= cycles // 2
