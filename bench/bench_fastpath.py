"""The Python cost of one read on the RESP inline fast path, in this process (issue 29).

    PYTHONPATH=src .venv/bin/python -m bench.bench_fastpath [--n 40000]
    PYTHONPATH=/path/to/old/src .venv/bin/python -m bench.bench_fastpath   # a before

One connection (`make_resp_factory`) over the recording transport of the tests
(tests/helpers.py `FakeTransport`), a real `SharedKvIndex` behind it (tests/servers.py
`run_in_context`); each read is one command (EXISTS of a present key, a 4 KiB GET, a
4 KiB SET) copied into `get_buffer` and handed over by `buffer_updated`, as uvloop does.
Prints the thread CPU time per read, best of 5: the read callback, the framer, the
dispatcher, the store and the metrics, without the socket and the event loop (those
are the rest of a server's CPU per request: `bench_twins`). The machine's load hardly
moves it, so two source trees compare well one after the other.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from epistemic_kvcache.proto.resp import serialize
from epistemic_kvcache.server.context import ServerContext
from epistemic_kvcache.server.resp import make_resp_factory
from helpers import FakeTransport
from servers import run_in_context

TOKEN = "bench-fastpath-token-0123"


def cmd(*args: str | bytes) -> bytes:
    """One command as a RESP array of bulk strings."""
    parts = [a.encode() if isinstance(a, str) else a for a in args]
    return b"".join(bytes(b) for b in serialize(parts, 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=40_000, help="reads per timing")
    n = ap.parse_args().n
    results: dict[str, float] = {}

    async def scenario(ctx: ServerContext) -> None:
        proto = make_resp_factory(ctx)()
        tr = FakeTransport().connect(proto)
        for setup in (cmd("AUTH", TOKEN), cmd("SET", "key:1", b"x" * 4096)):
            tr.receive(setup)
            await asyncio.sleep(0.05)
        tr.take()
        reads = {
            "EXISTS": cmd("EXISTS", "key:1"),
            "4 KiB GET": cmd("GET", "key:1"),
            "4 KiB SET": cmd("SET", "key:1", b"x" * 4096),
        }
        for label, data in reads.items():
            best = float("inf")
            for _ in range(5):
                t0 = time.thread_time()
                for _ in range(n):
                    buf = proto.get_buffer(len(data))
                    buf[: len(data)] = data
                    proto.buffer_updated(len(data))
                    tr.written.clear()
                best = min(best, (time.thread_time() - t0) / n * 1e6)
                await asyncio.sleep(0)
            results[label] = best

    run_in_context(scenario, tokens={TOKEN: "alpha"})
    print(" | ".join(f"{k} {v:.2f} us/read" for k, v in results.items()))


if __name__ == "__main__":
    main()
