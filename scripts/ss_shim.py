#!/usr/bin/env python3
"""A stand-in for `ss -Htlnp 'sport = :PORT'` where iproute2 is not installed.

bench/bench_cpu.py's `pid_listening` asks `ss` which process listens on a loopback port.
scripts/gpu_does_it_pay.sh puts this script first on PATH, named `ss`, only when the
machine has no `ss`. It answers that one question from /proc/net/tcp{,6} (listening
sockets, state 0A) and /proc/<pid>/fd (socket inodes), in `ss -p`'s format:
`LISTEN 0 0 127.0.0.1:PORT 0.0.0.0:* users:(("name",pid=N,fd=M))`.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path


def listening_inodes(port: int) -> set[str]:
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                found.add(f[9])
    return found


def main() -> int:
    m = re.search(r"sport = :(\d+)", " ".join(sys.argv[1:]))
    if not m or "p" not in "".join(a for a in sys.argv[1:] if a.startswith("-")):
        print("ss_shim: only `ss -Htlnp 'sport = :PORT'` is supported", file=sys.stderr)
        return 2
    port = int(m.group(1))
    inodes = listening_inodes(port)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                name = Path(f"/proc/{pid}/comm").read_text().strip()
                print(f'LISTEN 0 0 127.0.0.1:{port} 0.0.0.0:* users:(("{name}",pid={pid},fd={fd}))')
                return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
