"""Writer process for tests/test_store_torn_batch.py: one write, then a real SIGKILL.

Usage: python store_torn_writer.py MODE PERSIST_DIR NS KEY...

- ``torn-delete``: DELETE all KEYs in one group commit, and SIGKILL this process while
  that batch is being written, at the moment it starts writing into a segment it opened
  (its first records are in the page cache, its last ones are not): a batch torn by a
  crash across a segment boundary.
- ``put-then-kill``: PUT each KEY (its content is its name), print ``ACK <key>`` once
  acknowledged, then SIGKILL this process before any checkpoint (as a crash right
  after an acknowledged write does).

Prints ``READY`` once the store is open; ``KILL`` just before the kill.
"""

from __future__ import annotations

import os
import signal
import sys

from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.store import DiskIO, SharedKvStoreBackend
from epistemic_kvcache.store.api import Buffer

OPTIONS = StoreOptions(
    segment_bytes=64 << 10,  # a batch of a few hundred DELETEs spans two segments
    checkpoint_interval_s=3600.0,  # no checkpoint moves past the crash by chance
    hot_capacity_bytes=1 << 20,
    warm_capacity_bytes=0,
)


def emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class KillOnNewSegment(DiskIO):
    """SIGKILLs the process when an armed batch starts writing at offset 0 of a
    segment file (one it opened), after writing its part in the segment before."""

    armed = False

    def pwritev(self, fd: int, bufs: list[Buffer], offset: int) -> int:
        if self.armed and offset == 0:
            emit("KILL")
            os.kill(os.getpid(), signal.SIGKILL)
        return super().pwritev(fd, bufs, offset)


def main() -> None:
    mode, persist_dir, ns, *keys = sys.argv[1:]
    io = KillOnNewSegment()
    store = SharedKvStoreBackend(persist_dir, OPTIONS, io=io)
    emit("READY")
    if mode == "torn-delete":
        io.armed = True
        store.delete_many(ns, keys)
        emit("NOT KILLED")  # the batch did not reach a new segment: the test fails
    elif mode == "put-then-kill":
        for key in keys:
            store.put(ns, key, key.encode())
            emit(f"ACK {key}")
        emit("KILL")
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
