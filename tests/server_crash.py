"""Crash harness: a real server SIGKILLed under load, restarted, checked byte for byte.

Each cycle starts `epistemic-kvcache serve` (durable backend, one persist dir for the
whole run), drives it with concurrent RESP (redis-py) and HTTP (urllib3) clients that
PUT/SET fresh keys and DELETE older ones in bursts (the pauses let the committer compact
between batches; the checkpointer runs every second), kills the server with SIGKILL at
a random moment, restarts it and verifies:

- every acknowledged PUT reads back byte for byte (unless an acknowledged DELETE of it
  followed, or a DELETE of it was in flight at the kill);
- every acknowledged DELETE stays deleted (keys are never reused);
- a PUT in flight at the kill is absent or complete, never torn;
- the server reports ready, and no block fails verification.

Run by tests/test_server_crash.py (a few cycles in CI) and by `make crash-test`
(`KVCACHE_CRASH_CYCLES`, 200 there). Content is derived from the key, so the checker
regenerates it.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import blake3
import redis
import urllib3

from epistemic_kvcache.server.process import ServerProcess

TOKEN = "crash-harness-token-0123456789abcdef"


def content(key: str) -> bytes:
    """The bytes a key holds: 1 KiB .. 1 MiB, derived from the key."""
    h = blake3.blake3(key.encode()).digest()
    size = 1024 << (h[0] % 11)
    return blake3.blake3(b"data:" + key.encode()).digest(length=size)


@dataclass
class Ledger:
    """What the clients were told, across cycles."""

    acked_put: set[str] = field(default_factory=set)
    acked_del: set[str] = field(default_factory=set)
    maybe_put: set[str] = field(default_factory=set)  # in flight at a kill
    maybe_del: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    puts: int = 0
    dels: int = 0


class Server(ServerProcess):
    """One `epistemic-kvcache serve` process (durable, TOKEN, both listeners on loopback
    port 0, small tiers), its output appended to `log`."""

    def __init__(self, persist_dir: Path, log: Path) -> None:
        super().__init__(
            persist_dir,
            *("--hot-capacity-bytes", "32MiB", "--warm-capacity-bytes", "16MiB"),
            *("--cold-capacity-bytes", "2GiB", "--log-level", "info"),
            backend="durable",
            token=TOKEN,
            log_path=log,
            start_timeout_s=120,
        )


def _resp_worker(srv: Server, ledger: Ledger, stop: threading.Event, name: str, seed: int) -> None:
    rnd = random.Random(seed)
    r = redis.Redis(port=srv.ports["resp"], password=TOKEN, socket_timeout=30)
    n = 0
    try:
        while not stop.is_set():
            for _ in range(rnd.randint(1, 20)):  # a burst, then a pause (compaction time)
                if stop.is_set():
                    break
                if rnd.random() < _delete_odds(ledger) and ledger.acked_put:
                    with ledger.lock:
                        candidates = sorted(ledger.acked_put - ledger.maybe_del)
                        if not candidates:
                            continue
                        victim = rnd.choice(candidates)
                        ledger.maybe_del.add(victim)
                    if r.delete(victim) == 1:
                        with ledger.lock:
                            ledger.acked_del.add(victim)
                            ledger.acked_put.discard(victim)
                            ledger.maybe_del.discard(victim)
                            ledger.dels += 1
                    continue
                key = f"{name}-{seed}-{n}"
                n += 1
                with ledger.lock:
                    ledger.maybe_put.add(key)
                assert r.set(key, content(key))
                with ledger.lock:
                    ledger.acked_put.add(key)
                    ledger.maybe_put.discard(key)
                    ledger.puts += 1
            time.sleep(rnd.random() * 0.3)
    except (redis.ConnectionError, redis.TimeoutError, ConnectionError):
        return  # the server was killed
    finally:
        r.close()


def _http_worker(srv: Server, ledger: Ledger, stop: threading.Event, name: str, seed: int) -> None:
    rnd = random.Random(seed)
    pool = urllib3.HTTPConnectionPool(
        "127.0.0.1", srv.ports["http"], retries=False, timeout=urllib3.Timeout(30)
    )
    auth = {"Authorization": f"Bearer {TOKEN}"}
    n = 0
    try:
        while not stop.is_set():
            for _ in range(rnd.randint(1, 20)):
                if stop.is_set():
                    break
                if rnd.random() < _delete_odds(ledger) and ledger.acked_put:
                    with ledger.lock:
                        candidates = sorted(ledger.acked_put - ledger.maybe_del)
                        if not candidates:
                            continue
                        victim = rnd.choice(candidates)
                        ledger.maybe_del.add(victim)
                    resp = pool.request(
                        "DELETE", "/kv/" + urllib.parse.quote(victim, safe=""), headers=auth
                    )
                    if resp.status == 204:
                        with ledger.lock:
                            ledger.acked_del.add(victim)
                            ledger.acked_put.discard(victim)
                            ledger.maybe_del.discard(victim)
                            ledger.dels += 1
                    continue
                key = f"{name}-{seed}-{n}"
                n += 1
                with ledger.lock:
                    ledger.maybe_put.add(key)
                resp = pool.request(
                    "PUT",
                    "/kv/" + urllib.parse.quote(key, safe=""),
                    body=content(key),
                    headers=auth,
                )
                if resp.status in (200, 201):
                    with ledger.lock:
                        ledger.acked_put.add(key)
                        ledger.maybe_put.discard(key)
                        ledger.puts += 1
            time.sleep(rnd.random() * 0.3)
    except (urllib3.exceptions.HTTPError, OSError):
        return
    finally:
        pool.close()


def _delete_odds(ledger: Ledger) -> float:
    """Delete about as often as we write once the live set is large (bounded disk)."""
    return 0.6 if len(ledger.acked_put) > 300 else 0.3


def verify(srv: Server, ledger: Ledger) -> dict[str, int]:
    """Check the restarted server against the ledger; returns counts. Raises on a loss."""
    r = redis.Redis(port=srv.ports["resp"], password=TOKEN, socket_timeout=60)
    pool = urllib3.HTTPConnectionPool("127.0.0.1", srv.ports["http"], retries=False)
    try:
        ready = pool.request("GET", "/readyz")
        if ready.status != 200:
            raise AssertionError(f"not ready after restart: {ready.status} {ready.data!r}")
        lost = []
        for key in sorted(ledger.acked_put):
            got = r.get(key)
            if key in ledger.maybe_del:
                if got is not None and got != content(key):
                    raise AssertionError(f"{key}: wrong bytes after a DELETE in flight")
                continue
            if got != content(key):
                lost.append(key)
        if lost:
            raise AssertionError(f"{len(lost)} acknowledged PUTs lost or wrong: {lost[:5]}")
        for key in sorted(ledger.acked_del):
            if r.exists(key):
                raise AssertionError(f"{key}: an acknowledged DELETE came back")
        for key in sorted(ledger.maybe_put):
            got = r.get(key)
            if got is not None and got != content(key):
                raise AssertionError(f"{key}: a PUT in flight at the kill is torn")
            if got is not None:
                ledger.acked_put.add(key)  # it made it: from now on it must stay
        ledger.maybe_put.clear()
        for key in list(ledger.maybe_del):  # settle: deleted or not, now we know
            if r.exists(key):
                ledger.maybe_del.discard(key)
            else:
                ledger.maybe_del.discard(key)
                ledger.acked_put.discard(key)
                ledger.acked_del.add(key)
        stats = json.loads(
            pool.request("GET", "/kv/stats", headers={"Authorization": f"Bearer {TOKEN}"}).data
        )
        if stats.get("integrity_failures"):
            raise AssertionError(f"integrity failures after restart: {stats}")
        return {"keys": len(ledger.acked_put)}
    finally:
        r.close()
        pool.close()


def run(persist_dir: Path, cycles: int, seed: int, log: Path) -> dict[str, int]:
    """Run `cycles` kill/restart cycles; returns totals. Raises AssertionError on a loss."""
    rnd = random.Random(seed)
    ledger = Ledger()
    for cycle in range(cycles):
        srv = Server(persist_dir, log)
        if cycle:
            verify(srv, ledger)
        stop = threading.Event()
        workers = [
            threading.Thread(
                target=_resp_worker if i % 2 == 0 else _http_worker,
                args=(srv, ledger, stop, f"c{cycle}w{i}", rnd.randrange(1 << 30)),
                daemon=True,
            )
            for i in range(4)
        ]
        for w in workers:
            w.start()
        time.sleep(0.2 + rnd.random() * 1.5)  # a delay on purpose: the random kill moment
        srv.kill()
        stop.set()
        for w in workers:
            w.join(60)
    srv = Server(persist_dir, log)
    try:
        totals = verify(srv, ledger)
    finally:
        srv.kill()
    totals.update(cycles=cycles, acked_puts=ledger.puts, acked_deletes=ledger.dels)
    return totals


def main() -> None:
    cycles = int(os.environ.get("KVCACHE_CRASH_CYCLES", "200"))
    seed = int(os.environ.get("KVCACHE_TEST_SEED", str(random.randrange(1 << 30))))
    base = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("build/crash-test")
    base.mkdir(parents=True, exist_ok=True)
    persist = base / f"store-{seed}"
    print(f"crash test: {cycles} cycles, seed {seed}, store {persist}", flush=True)
    t0 = time.monotonic()
    totals = run(persist, cycles, seed, base / f"server-{seed}.log")
    print(
        f"crash test passed: {totals['cycles']} SIGKILL cycles, {totals['acked_puts']} "
        f"acknowledged PUTs and {totals['acked_deletes']} acknowledged DELETEs, "
        f"0 lost, {totals['keys']} keys verified at the end, {time.monotonic() - t0:.0f} s",
        flush=True,
    )


if __name__ == "__main__":
    main()
