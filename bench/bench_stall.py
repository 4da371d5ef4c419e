"""How long a maximum-size cold read (a page-in) stalls the other clients.

    .venv/bin/python -m bench.bench_stall [--block-mib 128] [--rounds 5] [--hot-mib 256]

One real server process (durable backend). A block of `--block-mib` MiB and a small
key are stored. Each round restarts the server (every RAM tier empty: the big block is
cold, on disk only), reads the small key once (now hot), then lets a prober read the
small key over one keep-alive connection as fast as it can: for a second alone (the
baseline), then while `curl` (another process, so the prober shares no GIL with it)
fetches the big block, whose GET reads it from disk, verifies it and promotes it to hot
(the page-in). The prober's largest latency in each window is the stall.
Compare two checkouts side by side: `PYTHONPATH=<checkout>/src` picks the server's code.
Prints one markdown table; the numbers are this machine's, compare them side by side.
"""

from __future__ import annotations

import argparse
import http.client
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TOKEN = "bench-stall-token-0123456789abcdef"
MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, data: Path, hot_mib: int, block_mib: int) -> None:
        self.data = data
        self.port = free_port()
        self.hot_mib = hot_mib
        self.block_mib = block_mib
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "epistemic_kvcache", "serve", "--backend", "durable",
               "--addr", f"127.0.0.1:{self.port}", "--resp-addr", "off",
               "--persist-dir", str(self.data), "--token", TOKEN,
               "--hot-capacity-bytes", f"{self.hot_mib}MiB",
               "--warm-capacity-bytes", f"{self.hot_mib}MiB",
               "--max-block-bytes", f"{max(self.block_mib, 1)}MiB"]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("EPISTEMIC_GRAPH_")}
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        ready = threading.Event()
        proc = self.proc

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                if re.search(r"listening http=", line):
                    ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(120) or proc.poll() is not None:
            raise RuntimeError("server did not start")

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.terminate()
        self.proc.wait(60)


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


def one_round(server: Server) -> tuple[float, float, float, int]:
    """(max stall during the big cold GET, its duration, baseline max, probes)."""
    server.start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        assert request(conn, "GET", "/kv/small")[0] == 200  # promoted: hot from now on
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
        after = len(during)
        time.sleep(0.1)  # the probe running when curl ended counts too
        stop.set()
        t.join()
        window = during[before : after + 1]
        return max(window), took, max(base), len(window)
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--block-mib", type=int, default=128)
    ap.add_argument("--hot-mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-stall-") as tmp:
        server = Server(Path(tmp) / "data", args.hot_mib, args.block_mib)
        server.start()
        try:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
            assert request(conn, "PUT", "/kv/big", os.urandom(args.block_mib * MiB))[0] == 201
            assert request(conn, "PUT", "/kv/small", b"s" * 1024)[0] == 201
            conn.close()
        finally:
            server.stop()
        rows = [one_round(server) for _ in range(args.rounds)]
    print(f"| round | big cold GET ({args.block_mib} MiB) s | small GET max during it ms "
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
