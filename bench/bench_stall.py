"""How long a maximum-size cold read (a page-in) stalls the other clients.

    .venv/bin/python -m bench.bench_stall [--block-mib 128] [--rounds 5] [--hot-mib 256]

One real server process (durable backend). A block of `--block-mib` MiB and a small
key are stored. Each round restarts the server (every RAM tier empty: the big block is
cold, on disk only), reads the small key once (now hot), then lets a prober read the
small key over one keep-alive connection as fast as it can: for a second alone (the
baseline), then while `curl` (another process, so the prober shares no GIL with it)
fetches the big block, whose GET reads it from disk, verifies it and promotes it to hot
(the page-in). The prober's largest latency in each window is the stall (the window runs on for
`--tail-s` after the GET, so that work it set off in the background counts).
`--scenario warm`: the page-in comes from the warm tier instead (hot holds one big block:
the big block and a second one are read in turn, which compresses the first into warm,
then the first is read again: decompressed from warm, and the second compressed).
Compare two checkouts side by side: `PYTHONPATH=<checkout>/src` picks the server's code.
Prints one markdown table; the numbers are this machine's, compare them side by side.
"""

from __future__ import annotations

import argparse
import http.client
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from epistemic_kvcache.server.process import ServerProcess

TOKEN = "bench-stall-token-0123456789abcdef"
MiB = 1 << 20


def _bf16(size: int, seed: int) -> bytes:
    """Normally distributed values truncated to bfloat16, like KV cache contents."""
    import numpy as np

    vals = np.random.default_rng(seed).standard_normal(size // 2).astype(np.float32)
    return bytes((vals.view(np.uint32) >> 16).astype(np.uint16).tobytes())


class Server:
    """Our server (durable backend, HTTP only) on its data; each start takes a port the
    kernel picks."""

    def __init__(self, data: Path, hot_mib: int, block_mib: int) -> None:
        self.data = data
        self.hot_mib = hot_mib
        self.block_mib = block_mib
        self.process: ServerProcess | None = None

    @property
    def port(self) -> int:
        assert self.process is not None
        return self.process.http_port

    def start(self) -> None:
        self.process = ServerProcess(
            self.data,
            *("--hot-capacity-bytes", f"{self.hot_mib}MiB"),
            *("--warm-capacity-bytes", f"{self.hot_mib}MiB"),
            *("--max-block-bytes", f"{max(self.block_mib, 1)}MiB"),
            backend="durable",
            token=TOKEN,
            resp=False,
            start_timeout_s=120,
        )

    def stop(self) -> None:
        assert self.process is not None
        self.process.stop(60)


def request(
    conn: http.client.HTTPConnection, method: str, path: str, body: bytes | None = None
) -> tuple[int, bytes]:
    conn.request(method, path, body=body, headers={"Authorization": f"Bearer {TOKEN}"})
    r = conn.getresponse()
    return r.status, r.read()


def probe(port: int, stop: threading.Event, out: list[float]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    while not stop.is_set():
        t0 = time.perf_counter()
        status, _ = request(conn, "GET", "/kv/small")
        out.append(time.perf_counter() - t0)
        assert status == 200
    conn.close()


def one_round(server: Server, scenario: str, tail_s: float) -> tuple[float, float, float, int]:
    """(max stall during the big GET, its duration, baseline max, probes)."""
    server.start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        assert request(conn, "GET", "/kv/small")[0] == 200  # promoted: hot from now on
        if scenario == "warm":
            assert request(conn, "GET", "/kv/big")[0] == 200  # cold -> hot
            assert request(conn, "GET", "/kv/big2")[0] == 200  # cold -> hot, big -> warm
            deadline = time.monotonic() + 30
            while b'"blocks": 1' not in _warm(conn) and time.monotonic() < deadline:
                time.sleep(0.05)
        conn.close()
        # baseline: the prober alone for a second
        stop = threading.Event()
        base: list[float] = []
        t = threading.Thread(target=probe, args=(server.port, stop, base))
        t.start()
        time.sleep(1.0)
        stop.set()
        t.join()
        # the page-in: curl GETs the cold block while the prober runs
        stop = threading.Event()
        during: list[float] = []
        t = threading.Thread(target=probe, args=(server.port, stop, during))
        t.start()
        time.sleep(0.2)
        before = len(during)
        t0 = time.perf_counter()
        subprocess.run(
            ["curl", "-sS", "-f", "-o", "/dev/null", "-H", f"Authorization: Bearer {TOKEN}",
             f"http://127.0.0.1:{server.port}/kv/big"],
            check=True,
        )  # fmt: skip
        took = time.perf_counter() - t0
        time.sleep(tail_s)  # what the page-in set off (a demotion to make room) counts too
        stop.set()
        t.join()
        window = during[before:]
        return max(window), took, max(base), len(window)
    finally:
        server.stop()


def _warm(conn: http.client.HTTPConnection) -> bytes:
    """The warm tier's stats, as JSON text."""
    import json

    status, body = request(conn, "GET", "/kv/stats")
    assert status == 200
    return json.dumps(json.loads(body)["tiers"]["warm"]).encode()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--block-mib", type=int, default=128)
    ap.add_argument("--hot-mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--scenario", choices=("cold", "warm"), default="cold")
    ap.add_argument("--tail-s", type=float, default=1.0, help="probing after the GET ends")
    args = ap.parse_args()
    if args.scenario == "warm":
        args.hot_mib = args.block_mib + args.block_mib // 4  # room for one big block
    with tempfile.TemporaryDirectory(prefix="bench-stall-") as tmp:
        server = Server(Path(tmp) / "data", args.hot_mib, args.block_mib)
        server.start()
        try:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
            for seed, name in enumerate(("big", "big2") if args.scenario == "warm" else ("big",)):
                block = _bf16(args.block_mib * MiB, seed)  # KV-like: compresses, goes to warm
                assert request(conn, "PUT", f"/kv/{name}", block)[0] == 201
            assert request(conn, "PUT", "/kv/small", b"s" * 1024)[0] == 201
            conn.close()
        finally:
            server.stop()
        rows = [one_round(server, args.scenario, args.tail_s) for _ in range(args.rounds)]
    print(f"| round | big {args.scenario} GET ({args.block_mib} MiB) s | small GET max during it ms "
          "| small GETs during it | small GET max alone ms |")  # fmt: skip
    print("|---|---|---|---|---|")
    for i, (stall, took, base, n) in enumerate(rows, 1):
        print(f"| {i} | {took:.3f} | {stall * 1000:.1f} | {n} | {base * 1000:.1f} |")
    stalls = [r[0] * 1000 for r in rows]
    print(
        f"\nsmall GET max during the page-in: median {statistics.median(stalls):.1f} ms, "
        f"max {max(stalls):.1f} ms over {len(rows)} rounds"
    )


if __name__ == "__main__":
    main()
