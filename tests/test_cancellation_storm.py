"""Clients that hang up mid-write cannot disturb the committer.

Thousands of RESP and HTTP clients each send a write (small and large blocks, pipelined
and not, whole or cut off in the middle of the body) and close the socket without reading
the answer. Afterwards writes on both wires still succeed within a bound, the server is
ready, its log shows no store fault, and SIGTERM stops it within its shutdown timeout.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import redis
import urllib3

import server_crash

TOKEN = server_crash.TOKEN


def _resp_cmd(*parts: bytes) -> bytes:
    out = [b"*%d\r\n" % len(parts)]
    for p in parts:
        out.append(b"$%d\r\n%s\r\n" % (len(p), p))
    return b"".join(out)


def _hang_up(port_resp: int, port_http: int, rnd: random.Random, n: int, errors: list[str]) -> None:
    for i in range(n):
        kind = rnd.choice(["resp", "resp-pipe", "resp-cut", "http", "http-cut"])
        big = rnd.random() < 0.1
        value = os.urandom(rnd.choice([100, 4096, 65536] if not big else [1 << 20, 3 << 20]))
        key = f"storm-{threading.get_ident()}-{i}".encode()
        try:
            if kind.startswith("resp"):
                s = socket.create_connection(("127.0.0.1", port_resp), timeout=10)
                wire = _resp_cmd(b"AUTH", TOKEN.encode())
                if kind == "resp-pipe":
                    wire += b"".join(_resp_cmd(b"SET", key + b"-%d" % j, value) for j in range(8))
                else:
                    wire += _resp_cmd(b"SET", key, value)
                if kind == "resp-cut":
                    wire = wire[: rnd.randrange(len(wire) // 2, len(wire))]
            else:
                s = socket.create_connection(("127.0.0.1", port_http), timeout=10)
                head = (
                    b"PUT /kv/" + key + b" HTTP/1.1\r\nHost: x\r\n"
                    b"Authorization: Bearer " + TOKEN.encode() + b"\r\n"
                    b"Content-Length: %d\r\n\r\n" % len(value)
                )
                wire = head + value
                if kind == "http-cut":
                    wire = wire[: rnd.randrange(len(head), len(wire))]
            s.sendall(wire)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            s.close()  # RST: gone before any answer
        except OSError as exc:
            errors.append(f"{kind}: {exc}")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_thousands_of_clients_hanging_up_mid_write(tmp_path: Path, rand) -> None:  # type: ignore[no-untyped-def]
    srv = server_crash.Server(tmp_path / "store", tmp_path / "server.log")
    try:
        errors: list[str] = []
        threads = [
            threading.Thread(
                target=_hang_up,
                args=(
                    srv.ports["resp"],
                    srv.ports["http"],
                    random.Random(rand.random()),
                    150,
                    errors,
                ),
            )
            for _ in range(16)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(errors) < 50, errors[:5]  # a refused connect under load is fine
        # writes still work, on both wires, within a bound
        r = redis.Redis(port=srv.ports["resp"], password=TOKEN, socket_timeout=10)
        pool = urllib3.HTTPConnectionPool("127.0.0.1", srv.ports["http"], retries=False, timeout=10)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        try:
            for i in range(20):
                t0 = time.monotonic()
                assert r.set(f"after-{i}", b"v" * 4096)
                resp = pool.request("PUT", f"/kv/after-http-{i}", body=b"w" * 65536, headers=auth)
                assert resp.status == 201, resp.data
                assert time.monotonic() - t0 < 5
            assert r.get("after-19") == b"v" * 4096
            ready = pool.request("GET", "/readyz")
            assert ready.status == 200, ready.data
        finally:
            r.close()
            pool.close()
        # SIGTERM under load exits within the shutdown timeout
        stop = threading.Event()

        def load() -> None:
            c = redis.Redis(port=srv.ports["resp"], password=TOKEN, socket_timeout=5)
            try:
                while not stop.is_set():
                    c.set(f"load-{time.monotonic_ns()}", os.urandom(65536))
            except (redis.ConnectionError, redis.TimeoutError):
                pass
            finally:
                c.close()

        loaders = [threading.Thread(target=load) for _ in range(4)]
        for t in loaders:
            t.start()
        time.sleep(0.5)  # a delay on purpose: the loaders are busy when SIGTERM comes
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        rc = srv.proc.wait(timeout=30)
        took = time.monotonic() - t0
        stop.set()
        for t in loaders:
            t.join()
        assert rc == 0, rc
        assert took < 15, took  # the default --shutdown-timeout-s is 10
    finally:
        srv.kill()  # (a no-op signal if it exited; closes its log)
    log = (tmp_path / "server.log").read_text()
    assert "store fault" not in log
    assert "InvalidStateError" not in log
    assert "Traceback" not in log, log[-3000:]
