"""A second store process for tests/test_store_epochs.py, driven line by line on stdin.

Usage: python epoch_bumper.py PERSIST_DIR EPOCH_DIR

Opens a `SharedKvStoreBackend` on its own persist directory but the given (shared)
epoch registry, prints ``READY``, then answers one line per command:

- ``put <ns> <key> <scope or -> <hex bytes>`` -> the PUT outcome (``new``, ...);
- ``get <ns> <key>``                        -> the block as hex, or ``-`` for a miss;
- ``bump <ns> <scope>``                     -> the new epoch;
- ``epoch <ns> <scope>``                    -> the current epoch;
- ``stale_missed <ns>``                     -> the namespace's counter.

EOF on stdin closes the store and exits.
"""

from __future__ import annotations

import sys

from epistemic_kvcache.options import StoreOptions


def main() -> None:
    from epistemic_kvcache.store import SharedKvStoreBackend

    persist_dir, epoch_dir = sys.argv[1], sys.argv[2]
    store = SharedKvStoreBackend(
        persist_dir, StoreOptions(map_size_bytes=64 << 20), epoch_dir=epoch_dir
    )

    def answer(text: str) -> None:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()

    answer("READY")
    try:
        for line in sys.stdin:
            cmd, *args = line.split()
            if cmd == "put":
                ns, key, scope, data = args
                res = store.put(
                    ns, key, bytes.fromhex(data), epoch_scope=None if scope == "-" else scope
                )
                answer(res.outcome.value)
            elif cmd == "get":
                got = store.get(args[0], args[1])
                answer(bytes(got).hex() if got is not None else "-")
            elif cmd == "bump":
                answer(str(store.epoch_bump(args[0], args[1])))
            elif cmd == "epoch":
                answer(str(store.epoch_get(args[0], args[1])))
            elif cmd == "stale_missed":
                answer(str(store.stats(args[0]).stale_missed))
            else:
                answer(f"ERR unknown command {cmd!r}")
    finally:
        store.close()


if __name__ == "__main__":
    main()
