"""New connections per second: connect, one command, close; trees side by side.

    .venv/bin/python -m bench.bench_accept [--src TREE]... [--event-loops 2] [--n 3000]
        [--rounds 3]

Our server (memory backend) from each `--src` tree (its `src/` first on PYTHONPATH; none:
this tree), all running at once; each round times `--n` RESP connections in a row on each
server in turn: connect, send an inline `PING` (answered `NOAUTH` before AUTH: any reply
means the server accepted and served it), read the reply, close. Prints connections per
second per round. With several event loops each loop accepts and hands the connection
to the lightest loop (server/balance.py); this measures what that costs a client that
does not keep its connections.
"""

from __future__ import annotations

import argparse
import socket
import tempfile
import time
from pathlib import Path

from epistemic_kvcache.server.process import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "bench-accept-token-0123456789ab"


def start(tree: Path, persist: Path, loops: int) -> ServerProcess:
    """Our server from `tree` (its `src/` first on PYTHONPATH), started."""
    return ServerProcess(
        persist, backend="memory", token=TOKEN, event_loops=loops, pythonpath=tree / "src"
    )


def rate(port: int, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(b"PING\r\n")
            if not s.recv(100):
                raise SystemExit("closed without a reply")
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", action="append", default=[], help="tree to run our server from")
    ap.add_argument("--event-loops", type=int, default=2)
    ap.add_argument("--n", type=int, default=3000, help="connections per timing")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    trees = [Path(t).resolve() for t in args.src] or [ROOT]
    with tempfile.TemporaryDirectory(prefix="bench-accept-") as d:
        servers = [start(t, Path(d) / str(i), args.event_loops) for i, t in enumerate(trees)]
        results: dict[Path, list[float]] = {t: [] for t in trees}
        try:
            for _ in range(args.rounds):
                for tree, server in zip(trees, servers, strict=True):
                    results[tree].append(rate(server.resp_port, args.n))
        finally:
            for server in servers:
                server.stop()
    print(f"connect + PING + close, {args.n} in a row, --event-loops {args.event_loops}")
    for tree in trees:
        print(f"{tree}: " + " / ".join(f"{r:,.0f}" for r in results[tree]) + " connections/s")


if __name__ == "__main__":
    main()
