"""What a SIGTERM costs clients in flight: torn requests and time to exit.

    .venv/bin/python -m bench.bench_drain [--rounds 5] [--event-loops 1]

Each round starts a durable server (`epistemic-kvcache serve`, its own process and
store), runs three client loops in tight loops against it (redis-py SETs, http.client
PUTs, and LMCache's MP path through `EpistemicGraphL2Connector`, 4 KiB blocks), sends
SIGTERM once each loop has 200 answers, and reports per round: requests answered, how
each loop ended ("refused": it could not connect any more, the clean end; anything else
is a torn request), the time from the signal to the process's exit, and from the last
answer any client got to the exit. tests/test_server_drain.py uses the same loops.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import http.client
import logging
import os
import select
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from epistemic_kvcache.integrations.lmcache.l2_native_connector import EpistemicGraphL2Connector
from epistemic_kvcache.server.process import ServerProcess

TOKEN = "bench-drain-token-0123456789abcdef"
JOIN_TIMEOUT_S = 60
"""How long a loop may take to end once its server is gone."""


def value_of(key: str, size: int = 4096) -> bytes:
    """The bytes written under `key` (derived from it: checkable after a restart)."""
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


@dataclass
class Loop:
    """One client loop's record: acknowledged keys, the key in flight when it ended, and
    how it ended."""

    name: str
    acked: list[str] = field(default_factory=list)
    last_ack_at: float = 0.0
    unacked: str | None = None
    ended: str = ""
    """"refused" (the clean end), or what broke the loop (a failure)."""
    thread: threading.Thread | None = None
    go: threading.Event = field(default_factory=threading.Event)
    """Set once the loop has `warm` answers."""
    warm: int = 20

    def ack(self, key: str) -> None:
        self.acked.append(key)
        self.last_ack_at = time.monotonic()
        self.unacked = None


def refused(exc: BaseException) -> bool:
    """A connection that could not be opened: nothing was sent on it."""
    while exc is not None:
        if isinstance(exc, ConnectionRefusedError):
            return True
        if isinstance(exc, OSError) and exc.errno == errno.ECONNREFUSED:
            return True
        if "Connection refused" in str(exc) or "Error 111 connecting" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False


def run_loop(loop: Loop, step: Callable[[int], None], close: Callable[[], None]) -> None:
    """Call `step(0)`, `step(1)`, ... until one raises; record how it ended."""
    i = 0
    try:
        while True:
            try:
                step(i)
            except Exception as exc:
                loop.ended = "refused" if refused(exc) else f"{type(exc).__name__}: {exc}"
                return
            i += 1
            if i == loop.warm:
                loop.go.set()
    finally:
        close()


def redis_loop(port_of: Callable[[], int], prefix: str = "r", token: str = TOKEN) -> Loop:
    """redis-py SETs, no retries (every error shows), a new connection when the server
    closed the last one (redis-py's own check before it reuses a connection)."""
    loop = Loop("redis-py")
    client = redis.Redis(
        port=port_of(), password=token, socket_timeout=30, retry=Retry(NoBackoff(), 0)
    )

    def step(i: int) -> None:
        key = f"{prefix}{i}"
        loop.unacked = key
        assert client.set(key, value_of(key)) is True
        loop.ack(key)

    loop.thread = threading.Thread(target=run_loop, args=(loop, step, client.close), daemon=True)
    return loop


def http_loop(port_of: Callable[[], int], prefix: str = "h", token: str = TOKEN) -> Loop:
    """http.client PUTs on one keep-alive connection, reopened when an answer says
    `Connection: close` (http.client does that itself)."""
    loop = Loop("http.client")
    auth = {"Authorization": f"Bearer {token}"}
    conn = http.client.HTTPConnection("127.0.0.1", port_of(), timeout=30)

    def step(i: int) -> None:
        key = f"{prefix}{i}"
        loop.unacked = key
        conn.request("PUT", f"/kv/{key}", body=value_of(key), headers=auth)
        resp = conn.getresponse()
        resp.read()
        assert resp.status in (200, 201), resp.status
        loop.ack(key)

    loop.thread = threading.Thread(target=run_loop, args=(loop, step, conn.close), daemon=True)
    return loop


def connector_loop(url_of: Callable[[], str], prefix: str = "m", token: str = TOKEN) -> Loop:
    """LMCache's MP path: batches of 4 blocks through `EpistemicGraphL2Connector`, each
    completion awaited as LMCache's demux thread does (poll the eventfd, drain)."""
    loop = Loop("lmcache-mp")
    conn = EpistemicGraphL2Connector(base_url=url_of(), token=token, num_workers=2)
    poller = select.poll()
    poller.register(conn.event_fd(), select.POLLIN)
    # The connector reports a failed batch without its cause; the client logs the cause.
    causes = LogRecords()
    logging.getLogger("epistemic_kvcache.client").addHandler(causes)

    def step(i: int) -> None:
        keys = [f"org/model@00000000@0@{prefix}{i}-{j}" for j in range(4)]
        loop.unacked = keys[0]
        fid = conn.submit_batch_set(keys, [memoryview(value_of(k)) for k in keys])
        while True:
            poller.poll(200)
            done = [c for c in conn.drain_completions() if c[0] == fid]
            if done:
                break
        _fid, ok, err, _res = done[0]
        if not ok:
            why = "; ".join(causes.messages) or err
            if all("Connection refused" in m for m in causes.messages):
                raise ConnectionRefusedError(why)
            raise ConnectionError(why)
        for k in keys:
            loop.ack(k)

    def close() -> None:
        conn.close()
        logging.getLogger("epistemic_kvcache.client").removeHandler(causes)

    loop.thread = threading.Thread(target=run_loop, args=(loop, step, close), daemon=True)
    return loop


class LogRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def start_loops(loops: list[Loop], warm: int = 20) -> None:
    """Start the loops; return once each has `warm` answers."""
    for loop in loops:
        assert loop.thread is not None
        loop.warm = warm
        loop.thread.start()
    for loop in loops:
        assert loop.go.wait(60), f"{loop.name} did not get going: {loop.ended}"


def join_loops(loops: list[Loop]) -> None:
    for loop in loops:
        assert loop.thread is not None
        loop.thread.join(JOIN_TIMEOUT_S)
        assert not loop.thread.is_alive(), f"{loop.name} still running"


def one_round(tmp: Path, event_loops: int) -> dict[str, object]:
    srv = ServerProcess(
        tmp, "--shutdown-timeout-s", "60", backend="durable", token=TOKEN, event_loops=event_loops
    )
    try:
        url = srv.url()
        loops = [
            redis_loop(lambda: srv.ports["resp"]),
            http_loop(lambda: srv.ports["http"]),
            connector_loop(lambda: url),
        ]
        start_loops(loops, warm=200)
        signalled = time.monotonic()
        srv.signal(signal.SIGTERM)
        rc = srv.wait(120)
        exited = time.monotonic()
        join_loops(loops)
        return {
            "rc": rc,
            "answered": sum(len(lp.acked) for lp in loops),
            "ends": {lp.name: lp.ended for lp in loops},
            "signal_to_exit_s": exited - signalled,
            "last_answer_to_exit_s": exited - max(lp.last_ack_at for lp in loops),
            "cut_at_bound": any("shutdown_timeout_s" in line for line in srv.output),
        }
    finally:
        srv.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--event-loops", type=int, default=1)
    args = ap.parse_args(argv)
    rows = []
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    print("round  answered  torn  signal->exit  last answer->exit  cut at the bound")
    for i in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="bench-drain-") as tmp:
            r = one_round(Path(tmp), args.event_loops)
        ends = r["ends"]
        assert isinstance(ends, dict)
        torn = sum(1 for e in ends.values() if e != "refused")
        rows.append(r)
        print(
            f"{i + 1:5d}  {r['answered']:8d}  {torn:4d}  {r['signal_to_exit_s']:10.3f} s"
            f"  {r['last_answer_to_exit_s']:15.3f} s  {r['cut_at_bound']}"
        )
        for name, end in ends.items():
            if end != "refused":
                print(f"       {name}: {end}")
    med = statistics.median(float(r["last_answer_to_exit_s"]) for r in rows)  # type: ignore[arg-type]
    worst = max(float(r["last_answer_to_exit_s"]) for r in rows)  # type: ignore[arg-type]
    print(f"last answer -> exit: median {med:.3f} s, worst {worst:.3f} s")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    clean = all(
        r["rc"] == 0 and not r["cut_at_bound"] and set(r["ends"].values()) == {"refused"}  # type: ignore[attr-defined]
        for r in rows
    )
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
