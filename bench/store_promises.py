"""What our server, redis-server and Mooncake Store promise, checked rather than quoted.

    .venv/bin/python -m bench.store_promises

Each store runs as bench.bench_lmcache runs it (ours: durable backend, a token; redis-server:
no persistence, no password; Mooncake Store: a `mooncake_master` and one storage process
holding the memory, TCP on loopback), and each check goes through the store's own client
(ours over RESP with redis-py, redis-server with redis-py, Mooncake with its
`MooncakeDistributedStore`):

- restart: a 4 MiB chunk is written, every process of the store is SIGKILLed and started
  again the same way, and the chunk is read back (byte for byte, or not there);
- dedup: the same 4 MiB chunk is written under 8 keys, and the store's own memory figure
  (ours: `/kv/stats` resident_bytes; redis-server: `INFO memory` used_memory; Mooncake:
  the master's "Mem Storage" in `/metrics/summary`) is read before and after;
- no credentials: a client given none reads the chunk written with them.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.bench_server import free_port, spawn_redis, wait_port
from epistemic_kvcache.server.process import ServerProcess

MiB = 1024 * 1024
TOKEN = "bench-promises-token-0123456789abcdef"
PROMISES = ("survives SIGKILL and restart", "same bytes under 8 keys", "client without credentials")
CHUNK = 4 * MiB
COPIES = 8

NODE = """
import sys, signal
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
rc = s.setup({"local_hostname": "127.0.0.1", "metadata_server": sys.argv[1],
              "global_segment_size": sys.argv[3], "local_buffer_size": str(64 << 20),
              "protocol": "tcp", "device_name": "", "master_server_addr": sys.argv[2]})
print("ready" if rc == 0 else f"setup failed: {rc}", flush=True)
signal.pause()
"""


def _mooncake_env() -> dict[str, str]:
    return {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1", "GLOG_minloglevel": "2"}


class MooncakeStack:
    """A `mooncake_master` (with its HTTP metadata server) and one storage process."""

    def __init__(self, tmp: Path, segment_bytes: int) -> None:
        self.tmp = tmp
        self.segment_bytes = segment_bytes
        self.procs: list[subprocess.Popen[str]] = []
        self.rpc_port = self.meta_port = self.admin_port = 0

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.meta_port}/metadata"

    def start(self) -> None:
        import mooncake

        os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"  # this process's transfers too
        master = Path(mooncake.__file__).parent / "mooncake_master"
        self.rpc_port, self.meta_port, self.admin_port = free_port(), free_port(), free_port()
        log = (self.tmp / "mooncake-master.log").open("a")
        self.procs.append(subprocess.Popen(
            [str(master), f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={self.meta_port}", f"--metrics_port={self.admin_port}"],
            stdout=log, stderr=subprocess.STDOUT, env=_mooncake_env(), text=True))  # fmt: skip
        for port in (self.rpc_port, self.meta_port, self.admin_port):
            wait_port(port)
        node = subprocess.Popen(
            [sys.executable, "-c", NODE, self.metadata_url, f"127.0.0.1:{self.rpc_port}", str(self.segment_bytes)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=_mooncake_env(), text=True,
        )  # fmt: skip
        self.procs.append(node)
        assert node.stdout is not None
        line = node.stdout.readline().strip()
        if line != "ready":
            self.stop()
            raise RuntimeError(f"Mooncake storage process did not start: {line!r}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(sig)
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self.procs = []

    def used_bytes(self) -> float:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.admin_port}/metrics/summary", timeout=5
        ) as r:
            text = r.read().decode()
        m = re.search(r"Mem Storage: ([\d.]+) (\w*B) /", text)
        if not m:
            raise RuntimeError(f"no 'Mem Storage' in the master's summary: {text[:200]!r}")
        scale = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40}[m.group(2)]
        return float(m.group(1)) * scale

    def client(self) -> Any:
        from mooncake.store import MooncakeDistributedStore

        s = MooncakeDistributedStore()
        rc = s.setup({"local_hostname": "127.0.0.1", "metadata_server": self.metadata_url,
                      "global_segment_size": "0", "local_buffer_size": str(64 * MiB),
                      "protocol": "tcp", "device_name": "", "master_server_addr": f"127.0.0.1:{self.rpc_port}"})  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"Mooncake client setup failed: {rc}")
        return s


class OurServer:
    """`epistemic-kvcache serve` (durable backend, a token) as a child we can SIGKILL;
    each start takes the ports the kernel picks."""

    def __init__(self, data: Path) -> None:
        self.data = data
        self.process: ServerProcess | None = None

    @property
    def ports(self) -> dict[str, int]:
        assert self.process is not None
        return self.process.ports

    def start(self) -> None:
        self.process = ServerProcess(
            self.data, "--max-block-bytes", "64MiB", backend="durable", token=TOKEN
        )

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process is not None:
            self.process.signal(sig)
            self.process.wait(30)

    def redis(self, password: str | None = TOKEN) -> Any:
        import redis

        return redis.Redis(port=self.ports["resp"], password=password)

    def used_bytes(self) -> float:
        from epistemic_kvcache.client.backend import EpistemicGraphKVBackend

        with EpistemicGraphKVBackend(base_url=f"http://127.0.0.1:{self.ports['http']}", token=TOKEN) as c:  # fmt: skip
            stats = c.stats()
        assert stats is not None
        return float(stats.resident_bytes)


def _anonymous_get(port: int, size: int) -> str:
    """`GET promise/restart` on a fresh connection that never authenticated: the reply."""
    with socket.create_connection(("127.0.0.1", port), 5) as sock:
        sock.sendall(b"*2\r\n$3\r\nGET\r\n$15\r\npromise/restart\r\n")
        line = sock.makefile("rb").readline().strip().decode(errors="replace")
    if line == f"${size}":
        return "accepted: read the chunk"
    return f"refused: `{line[1:] if line.startswith('-') else line}`"


def _mib(n: float) -> str:
    return f"{n / MiB:.1f} MiB"


def _dedup_cell(used: float) -> str:
    held = "held once" if used < 2 * CHUNK else f"held {used / CHUNK:.1f} times"
    return f"{COPIES} x {_mib(CHUNK)} took {_mib(used)}: {held}"


def check_ours(tmp: Path) -> dict[str, str]:
    chunk = os.urandom(CHUNK)
    srv = OurServer(tmp / "ours")
    srv.start()
    try:
        r = srv.redis()
        r.set("promise/restart", chunk)
        anon = _anonymous_get(srv.ports["resp"], len(chunk))
        before = srv.used_bytes()
        other = os.urandom(CHUNK)
        for i in range(COPIES):
            r.set(f"promise/dedup/{i}", other)
        dedup = _dedup_cell(srv.used_bytes() - before)
        srv.stop(signal.SIGKILL)
        srv.start()
        got = srv.redis().get("promise/restart")
        restart = "yes: read back byte for byte" if got == chunk else "no: gone after the restart"
        return {PROMISES[0]: restart + " (durable backend)", PROMISES[1]: dedup, PROMISES[2]: anon}
    finally:
        srv.stop()


def check_redis(tmp: Path) -> dict[str, str]:
    import redis

    args = ["--save", "", "--appendonly", "no"]
    chunk = os.urandom(CHUNK)
    p, port = spawn_redis(tmp, args)
    try:
        r = redis.Redis(port=port)
        r.set("promise/restart", chunk)
        anon = _anonymous_get(port, len(chunk)) + " (no password set, as benchmarked)"
        before = int(r.info("memory")["used_memory"])
        other = os.urandom(CHUNK)
        for i in range(COPIES):
            r.set(f"promise/dedup/{i}", other)
        dedup = _dedup_cell(int(r.info("memory")["used_memory"]) - before)
        p.kill()
        p.wait(10)
        # the same command on the same port and folder
        p = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir",
                              str(tmp / f"redis-{port}"), "--protected-mode", "no", *args],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        wait_port(port)
        got = redis.Redis(port=port).get("promise/restart")
        restart = "yes: read back byte for byte" if got == chunk else "no: gone after the restart"
        return {PROMISES[0]: restart + " (no persistence, as benchmarked)", PROMISES[1]: dedup, PROMISES[2]: anon}  # fmt: skip
    finally:
        p.kill()
        p.wait(10)


def check_mooncake(tmp: Path) -> dict[str, str]:
    chunk = os.urandom(CHUNK)
    stack = MooncakeStack(tmp, segment_bytes=512 * MiB)
    stack.start()
    try:
        c = stack.client()
        if c.put("promise/restart", chunk) != 0:
            raise RuntimeError("Mooncake put failed")
        anon_client = stack.client()  # setup takes no credential of any kind
        anon = "accepted: read the chunk" if bytes(anon_client.get("promise/restart")) == chunk else "refused"  # fmt: skip
        before = stack.used_bytes()
        other = os.urandom(CHUNK)
        for i in range(COPIES):
            c.put(f"promise/dedup/{i}", other)
        time.sleep(1.5)  # the summary is refreshed about once a second
        dedup = _dedup_cell(stack.used_bytes() - before)
        stack.stop(signal.SIGKILL)
        stack.start()
        got = bytes(stack.client().get("promise/restart") or b"")
        restart = "yes: read back byte for byte" if got == chunk else "no: gone after the restart"
        return {PROMISES[0]: restart + " (memory segments, no SSD tier configured)", PROMISES[1]: dedup, PROMISES[2]: anon}  # fmt: skip
    finally:
        stack.stop()


def check_all(tmp: Path) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for name, check in (("this server", check_ours), ("redis-server", check_redis),
                        ("Mooncake Store", check_mooncake)):  # fmt: skip
        d = tmp / name.replace(" ", "-")
        d.mkdir()
        try:
            out[name] = check(d)
        except Exception as exc:  # a failed check is reported, not hidden
            out[name] = dict.fromkeys(PROMISES, f"check failed: {type(exc).__name__}: {exc}")
    return out


def main() -> None:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="store-promises-") as d:
        got = check_all(Path(d))
    print("| store | " + " | ".join(PROMISES) + " |")
    print("|---|" + "---|" * len(PROMISES))
    for name, cells in got.items():
        print(f"| {name} | " + " | ".join(cells[k] for k in PROMISES) + " |")


if __name__ == "__main__":
    main()
