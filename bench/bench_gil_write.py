"""Does a reply's copy into the socket hold the GIL? uvloop's `transport.write` against
`os.write` first (issue 26: what limits GET across loops).

    PYTHONPATH=src python -m bench.bench_gil_write [--size 4MiB] [--seconds 3] [--repeat 2]

How it works
------------
A minimal uvloop server (a child process) answers each 1-byte request with one reply of
`--size` bytes, written either with `transport.write` (uvloop first calls write(2) from
`UVStream._try_write` while holding the GIL, and queues only what the socket did not
take) or, when the transport has nothing queued, with `os.write` on the socket first
(CPython releases the GIL around the system call) and `transport.write` for the rest.
Two client threads in another process read the replies. The server's event-loop thread
is measured as in bench_scaling_inputs (root and perf): its on-CPU seconds while holding
the GIL over its on-CPU seconds, from uprobes on `take_gil` and `drop_gil` and
`sched:sched_switch`. Printed per mode and repeat: the client's GB/s, the loop thread's
CPU (kernel part) and s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.bench_cpu import parse_size, thread_cpu
from bench.bench_scaling_inputs import cpu_since, gil_by_perf, gil_probes

EVENTS = ["-e", "probe_libpython3:take_gil__return", "-e", "probe_libpython3:drop_gil"]


def serve(mode: str, size: int) -> None:
    import uvloop

    reply = memoryview(os.urandom(size))

    class Reply(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.t: asyncio.Transport = transport  # type: ignore[assignment]
            self.fd = transport.get_extra_info("socket").fileno()

        def data_received(self, data: bytes) -> None:
            for _ in range(len(data)):
                n = 0
                if mode == "os" and self.t.get_write_buffer_size() == 0:
                    try:
                        n = os.write(self.fd, reply)  # the copy runs without the GIL
                    except BlockingIOError:
                        n = 0
                if n < len(reply):
                    self.t.write(reply[n:])

    async def main() -> None:
        srv = await asyncio.get_running_loop().create_server(Reply, "127.0.0.1", 0)
        print(srv.sockets[0].getsockname()[1], flush=True)
        await srv.serve_forever()

    uvloop.run(main())


def client(port: int, size: int, seconds: float) -> None:
    total = [0, 0]

    def one(i: int) -> None:
        s = socket.create_connection(("127.0.0.1", port))
        buf = bytearray(1 << 20)
        t = time.time()
        while time.time() - t < seconds:
            s.sendall(b"x")
            got = 0
            while got < size:
                got += s.recv_into(buf)
            total[i] += size

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    print(f"{sum(total) / seconds / 1e9:.2f}", flush=True)


def measure(mode: str, size: int, seconds: float, tmp: Path) -> str:
    me = [sys.executable, "-m", "bench.bench_gil_write", "--size", str(size)]
    srv = subprocess.Popen([*me, "--serve", mode], stdout=subprocess.PIPE, text=True)
    try:
        assert srv.stdout is not None
        port = int(srv.stdout.readline())
        with gil_probes(srv.pid):
            cli = subprocess.Popen(
                [*me, "--client", str(port), "--seconds", str(seconds + 1.0)],
                stdout=subprocess.PIPE,
                text=True,
            )
            time.sleep(0.5)  # connected and streaming before the record starts
            t0 = thread_cpu(srv.pid)
            data = tmp / f"gil-write-{mode}.data"
            subprocess.run(
                ["perf", "record", "-q", "-a", "-o", str(data), *EVENTS,
                 "-e", "sched:sched_switch", "--", "sleep", str(seconds)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True,
            )  # fmt: skip
            used = cpu_since(srv.pid, t0)
            gbps = cli.communicate()[0].strip()
            by_tid = gil_by_perf(data, {int(t) for t in used})
    finally:
        srv.kill()
        srv.wait()
    on, held = by_tid[srv.pid]
    u, k = used[str(srv.pid)]
    return (
        f"| {mode} | {gbps} | {u + k:.2f} ({k:.2f}) | {on:.2f} | {held:.2f} "
        f"| {held / on if on else 0:.2f} |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="4MiB")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--serve", choices=("transport", "os"), help=argparse.SUPPRESS)
    p.add_argument("--client", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    size = parse_size(a.size)
    if a.serve:
        serve(a.serve, size)
        return
    if a.client:
        client(a.client, size, a.seconds)
        return
    print(f"load: {os.getloadavg()[0]:.2f} (1-min); {a.size} replies, 2 client connections\n")
    print("| write | client GB/s | loop thread CPU s (kernel) | on-CPU s (perf) "
          "| on-CPU holding the GIL s | s |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    tmp = Path(f"/tmp/bench-gil-write-{os.getpid()}")
    tmp.mkdir(exist_ok=True)
    try:
        for _ in range(a.repeat):
            for mode in ("transport", "os"):
                print(measure(mode, size, a.seconds, tmp), flush=True)
    finally:
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()


if __name__ == "__main__":
    main()
