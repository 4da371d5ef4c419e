"""Memory a real server keeps per HTTP miss (GET, HEAD, DELETE of absent keys).

    .venv/bin/python -m bench.bench_miss_memory [--misses 30000] [--mode keepalive|conn]

Starts `python -m epistemic_kvcache serve` (HTTP only, durable backend in a temporary
dir), answers 2,000 misses to warm it up, then `--misses` more, one request at a time,
GET/HEAD/DELETE in turn: on one keep-alive connection (`keepalive`) or a connection
each (`conn`). Prints the server's anonymous RSS (`RssAnon` of /proc/<pid>/status)
before and after, and the growth per miss. Issue 22 measured ~1.9 KB (keep-alive) and
~5.6 KB (a connection each) kept for good per miss; a server that keeps nothing shows a
few bytes (allocator noise).
"""

from __future__ import annotations

import argparse
import http.client
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOKEN = "bench-miss-memory-token-0123456789"


def rss_anon(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/<pid>/status")


def misses(port: int, n: int, mode: str) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        for i in range(n):
            if mode == "conn":
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request(("GET", "HEAD", "DELETE")[i % 3], f"/kv/absent-{i}", headers=headers)
            r = conn.getresponse()
            r.read()
            if r.status != 404:
                raise RuntimeError(f"expected 404, got {r.status}")
    finally:
        conn.close()


def settled_rss(pid: int) -> int:
    """RSS once it stops moving (the server finishes its last answers), 5 s at most."""
    deadline = time.monotonic() + 5
    last = rss_anon(pid)
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = rss_anon(pid)
        if now == last:
            return now
        last = now
    return last


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--misses", type=int, default=30000)
    ap.add_argument("--mode", choices=("keepalive", "conn"), default="keepalive")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "epistemic_kvcache", "serve", "--addr", "127.0.0.1:0"]
        cmd += ["--resp-addr", "off", "--token", TOKEN, "--persist-dir", tmp]
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ
        )
        try:
            port = None
            assert proc.stdout is not None
            for line in proc.stdout:
                m = re.search(r"listening http=127\.0\.0\.1:(\d+)", line)
                if m:
                    port = int(m.group(1))
                    break
            if port is None:
                raise RuntimeError("the server did not start")
            misses(port, 2000, args.mode)
            before = settled_rss(proc.pid)
            misses(port, args.misses, args.mode)
            after = settled_rss(proc.pid)
        finally:
            proc.terminate()
            proc.wait(30)
    print(
        f"{args.mode}: {args.misses} misses: RssAnon {before / 2**20:.1f} -> "
        f"{after / 2**20:.1f} MiB, {(after - before) / args.misses:.0f} B a miss"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
