"""Writer process for tests/test_store_crash.py: concurrent PUTs and DELETEs until killed.

Usage: python store_crash_writer.py PERSIST_DIR SEED CYCLE [THREADS]

Opens a `SharedKvStoreBackend`, prints ``READY``, then runs THREADS threads that PUT
fresh keys (1 KiB..2 MiB, content derived from the key's content id and SEED, so the
parent can regenerate it) and DELETE existing ones. Every line is flushed as it is
written; the parent kills this process with SIGKILL at a random moment:

- ``PUT? <ns> <key>``: a PUT is about to be issued (it may or may not happen);
- ``ACK PUT <ns> <key>``: the PUT returned (the block is acknowledged);
- ``DEL? <ns> <key>``: a DELETE is about to be issued (it may or may not happen);
- ``ACK DEL <ns> <key>``: the DELETE returned True (the key is gone for good).

Keys are never reused, so an acknowledged DELETE must stay deleted, and a PUT that was
not acknowledged and found absent after the crash must stay absent.
"""

from __future__ import annotations

import random
import sys
import threading
import time

import blake3

from epistemic_kvcache.options import StoreOptions

NAMESPACES = ("crash-a", "crash-b")
CONTENT_IDS = 48  # keys draw content from a small pool, so dedup happens
MIN_BLOCK, MAX_BLOCK = 1 << 10, 2 << 20
MAX_KEYS = 160  # delete more eagerly above this many keys, to bound the disk used
STORE_OPTIONS = StoreOptions(
    hot_capacity_bytes=8 << 20,
    warm_capacity_bytes=4 << 20,
    segment_bytes=4 << 20,  # small segments: batches roll over, dead ones get deleted
    map_size_bytes=256 << 20,
)


def block_size(seed: int, cid: int) -> int:
    """Log-uniform size in [MIN_BLOCK, MAX_BLOCK] for content id `cid`."""
    u = int.from_bytes(blake3.blake3(f"size:{seed}:{cid}".encode()).digest(8), "big") / 2**64
    return int(MIN_BLOCK * (MAX_BLOCK / MIN_BLOCK) ** u)


def content(seed: int, cid: int) -> bytes:
    """The bytes every key with content id `cid` holds."""
    return blake3.blake3(f"data:{seed}:{cid}".encode()).digest(length=block_size(seed, cid))


def content_of_key(seed: int, key: str) -> bytes:
    """Keys look like ``k<cycle>.<thread>.<n>.c<cid>``."""
    return content(seed, int(key.rsplit(".c", 1)[1]))


def main() -> None:
    from epistemic_kvcache.store import SharedKvStoreBackend

    persist_dir, seed, cycle = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    threads = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    store = SharedKvStoreBackend(persist_dir, STORE_OPTIONS)
    out_lock = threading.Lock()
    live: list[tuple[str, str]] = [(ns, k) for ns in NAMESPACES for k in store.keys(ns)]
    live_lock = threading.Lock()

    def emit(line: str) -> None:
        with out_lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    def worker(tid: int) -> None:
        rng = random.Random(f"{seed}:{cycle}:{tid}")
        n = 0
        deadline = time.monotonic() + 120  # never outlive a parent that died
        while time.monotonic() < deadline:
            with live_lock:
                nlive = len(live)
            p_delete = 0.6 if nlive > MAX_KEYS else 0.25
            if nlive and rng.random() < p_delete:
                with live_lock:
                    if not live:
                        continue
                    ns, key = live.pop(rng.randrange(len(live)))
                emit(f"DEL? {ns} {key}")
                if store.delete(ns, key):
                    emit(f"ACK DEL {ns} {key}")
                continue
            ns = NAMESPACES[rng.randrange(len(NAMESPACES))]
            batch = 3 if rng.random() < 0.15 else 1
            items = []
            for _ in range(batch):
                cid = rng.randrange(CONTENT_IDS)
                items.append((f"k{cycle}.{tid}.{n}.c{cid}", content(seed, cid)))
                n += 1
            for key, _ in items:
                emit(f"PUT? {ns} {key}")
            if batch == 1:
                store.put(ns, items[0][0], items[0][1])
            else:
                store.put_many(ns, items)
            for key, _ in items:
                emit(f"ACK PUT {ns} {key}")
            with live_lock:
                live.extend((ns, key) for key, _ in items)

    pool = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(threads)]
    emit("READY")
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    store.close()


if __name__ == "__main__":
    main()
