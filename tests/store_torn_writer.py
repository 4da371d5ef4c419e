"""Writer process for tests/test_store_torn_batch.py: one write, then a real SIGKILL.

Usage: python store_torn_writer.py MODE PERSIST_DIR NS KEY...

- ``torn-delete`` / ``torn-put``: DELETE all KEYs, or PUT them all with `BLOCK`, in one
  group commit, and SIGKILL this process while that batch is being written, at the
  moment it starts writing into a segment it opened (its first records are in the page
  cache, its last ones are not): a batch torn by a crash across a segment boundary.
- ``failed-delete-then-put``: DELETE all KEYs in one group commit whose write fails
  half-way (EIO: half its bytes land past the trusted end), then PUT a block that opens
  a new segment, and SIGKILL this process right after that batch's sync.
- ``spanning-put``: PUT a small block (its batch zeroes space past the segment's end),
  then PUT all KEYs (content: their names) in one group commit that rolls over into a
  new segment, and SIGKILL this process right after that batch's syncs.
- ``put-then-kill`` / ``delete-then-kill``: PUT each KEY (its content is its name), or
  DELETE it, print ``ACK <key>`` once acknowledged (a DELETE: and once the dead payload
  is punched out), then SIGKILL this process before any checkpoint (as a crash right
  after an acknowledged write does).

Prints ``READY`` once the store is open; ``KILL`` just before the kill.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time

from epistemic_kvcache.errors import StorageIOError
from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.store import DiskIO, SharedKvStoreBackend
from epistemic_kvcache.store.api import Buffer

OPTIONS = StoreOptions(
    segment_bytes=64 << 10,  # a batch of a few hundred DELETEs spans two segments
    checkpoint_interval_s=3600.0,  # no checkpoint moves past the crash by chance
    hot_capacity_bytes=1 << 20,
    warm_capacity_bytes=0,
)
BLOCK = b"b" * (16 << 10)
"""The block `torn-put` writes: whole pages of payload, so a dead copy is punched out."""


def emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class HookedIO(DiskIO):
    """The real system calls, with three hooks a mode arms:

    - `kill_on_new_segment`: SIGKILL when a batch starts writing at offset 0 of a
      segment file (one it opened), after writing its part in the segment before;
    - `fail_next_write`: the next write puts half its bytes on disk, then fails with
      EIO (a write cut short by a failing disk: garbage lands past the trusted end);
    - `kill_after_new_segment_sync`: SIGKILL right after the sync of a segment the
      batch started (the batch is durable; what the writer does after it is not done).
    """

    kill_on_new_segment = False
    fail_next_write = False
    kill_after_new_segment_sync = False
    _new_fd = -1

    def pwritev(self, fd: int, bufs: list[Buffer], offset: int) -> int:
        if self.kill_on_new_segment and offset == 0:
            emit("KILL")
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fail_next_write:
            self.fail_next_write = False
            joined = b"".join(bytes(b) for b in bufs)
            os.pwrite(fd, joined[: len(joined) // 2], offset)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        if offset == 0:
            self._new_fd = fd
        return super().pwritev(fd, bufs, offset)

    def fdatasync(self, fd: int) -> None:
        super().fdatasync(fd)
        if self.kill_after_new_segment_sync and fd == self._new_fd:
            emit("KILL")
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    mode, persist_dir, ns, *keys = sys.argv[1:]
    io = HookedIO()
    store = SharedKvStoreBackend(persist_dir, OPTIONS, io=io)
    emit("READY")
    if mode == "torn-delete":
        io.kill_on_new_segment = True
        store.delete_many(ns, keys)
        emit("NOT KILLED")  # the batch did not reach a new segment: the test fails
    elif mode == "torn-put":
        io.kill_on_new_segment = True
        store.put_many(ns, [(key, BLOCK) for key in keys])
        emit("NOT KILLED")
    elif mode == "failed-delete-then-put":
        io.fail_next_write = True
        try:
            store.delete_many(ns, keys)
        except StorageIOError:
            emit("DELETE FAILED")
        else:
            emit("DELETE DID NOT FAIL")
        io.kill_after_new_segment_sync = True
        store.put(ns, "big", bytes(OPTIONS.segment_bytes or 0))  # opens a new segment
        emit("NOT KILLED")
    elif mode == "spanning-put":
        store.put(ns, "small", b"s" * 100)  # a small batch: zeroes space past the end
        io.kill_after_new_segment_sync = True
        store.put_many(ns, [(key, key.encode()) for key in keys])  # rolls over
        emit("NOT KILLED")
    elif mode in ("put-then-kill", "delete-then-kill"):
        punched = store.stats(None).extra["punched_bytes"]
        for key in keys:
            if mode == "put-then-kill":
                store.put(ns, key, key.encode())
            else:
                assert store.delete(ns, key)
            emit(f"ACK {key}")
        if mode == "delete-then-kill":
            # the committer punches a dead payload out just after it answers: wait for it
            deadline = time.monotonic() + 30
            while store.stats(None).extra["punched_bytes"] == punched:
                assert time.monotonic() < deadline, "no payload was punched out"
                time.sleep(0.01)  # polling, with the deadline above
            emit("PUNCHED")
        emit("KILL")
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
