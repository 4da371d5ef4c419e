"""`epistemic-kvcache` with one hook: SIGKILL in the middle of writing a marked block.

Usage: python server_torn_write.py serve ARGS... (the arguments of `epistemic-kvcache`)

The real server (`cli.main`), except that the segment writer's `pwritev` (the one call
that writes a group commit into the log) watches for a block starting with `MARKER`:
it writes the first half of that batch's bytes, prints ``KILL`` and SIGKILLs this
process, before the batch is synced or acknowledged. What is left in the log is a write
torn by a crash, as a real crash in the middle of a large write leaves it.
"""

from __future__ import annotations

import os
import signal
import sys

from epistemic_kvcache import cli
from epistemic_kvcache.store.api import Buffer
from epistemic_kvcache.store.segments import DiskIO

MARKER = b"TEAR-THIS-WRITE:"


def _torn_pwritev(self: DiskIO, fd: int, bufs: list[Buffer], offset: int) -> int:
    if any(bytes(memoryview(b)[: len(MARKER)]) == MARKER for b in bufs):
        joined = b"".join(bytes(b) for b in bufs)
        os.pwrite(fd, joined[: len(joined) // 2], offset)
        print("KILL", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return os.pwritev(fd, bufs, offset)


DiskIO.pwritev = _torn_pwritev  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:]))
