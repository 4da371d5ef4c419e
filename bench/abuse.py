"""Abuse scenarios against a real server process, with a well-behaved client beside them.

Shared by `bench/bench_abuse.py` (numbers for docs/benchmarks.md and docs/security.md)
and `tests/test_abuse.py` (the same scenarios, shorter, with generous assertions).

How it works
------------
- `start_server` runs `python -m epistemic_kvcache serve` as its own process (the
  package's `ServerProcess`; from an installed package, or from a source tree given as
  `src`, e.g. an export of `main` for a before/after comparison), with three tenants in
  a token file: `tenant-a` (the attacker), `tenant-b` (the well-behaved client) and
  `default` (operator). Its output is drained by a thread for its whole life.
- `RssSampler` reads `VmRSS` of the server from `/proc/<pid>/status` every 20 ms.
- `Probe` is the well-behaved client: on one thread, it alternates a RESP `GET` and an
  HTTP `GET /kv/<key>` of a 4 KiB block (persistent connections, or a fresh connection
  per request for the slot-holding scenarios) and records each latency; failures are
  counted, never raised. Optional side checks (a 1 MiB SET, a paged SCAN, a new epoch
  scope) count failures the attack causes for the other tenant.
- Each attack runs in its own process (multiprocessing, spawn) so its CPU use does not
  share a GIL with the probe; it loops until told to stop, reconnecting whatever the
  server closes (as a persistent attacker would).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import multiprocessing
import os
import selectors
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from epistemic_kvcache.server.process import ServerProcess, write_token_file

KiB, MiB = 1024, 1024 * 1024
TOKEN_A = "abuse-token-tenant-a-0123456789abcdef"
TOKEN_B = "abuse-token-tenant-b-0123456789abcdef"
TOKEN_OPS = "abuse-token-operator-0123456789abcdef"
PROBE_KEY = "probe-4k"
PROBE_VALUE = bytes(range(256)) * 16  # 4 KiB
BIG_KEY = "big-32m"
PROBE_SOURCE = "127.0.0.2"
"""The well-behaved client connects from another loopback address than the attacker
(Linux routes all of 127/8 to lo), so per-address limits tell them apart."""


# -- the server process -----------------------------------------------------------------


@contextlib.contextmanager
def start_server(
    tmp: Path, *, src: Path | None = None, options: Sequence[str] = (), backend: str = "durable"
) -> Iterator[ServerProcess]:
    """The server on free loopback ports, in `tmp`, stopped (SIGTERM, then SIGKILL) on exit."""
    tokens = {TOKEN_A: "tenant-a", TOKEN_B: "tenant-b", TOKEN_OPS: "default"}
    with ServerProcess(
        tmp / "data",
        *("--stats-log-interval-s", "0", "--log-level", "info", *options),
        backend=backend,
        token_file=write_token_file(tmp / "tokens", tokens),
        cwd=tmp,
        pythonpath=src,
        keep_lines=2000,
    ) as server:
        yield server


def rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class RssSampler(threading.Thread):
    """Samples a process's RSS every `interval_s`; `peak_kib` is the largest seen."""

    def __init__(self, pid: int, interval_s: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.interval_s = interval_s
        self.peak_kib = rss_kib(pid)
        self.last_kib = self.peak_kib
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            self.last_kib = rss_kib(self.pid)
            self.peak_kib = max(self.peak_kib, self.last_kib)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(5)


# -- tiny blocking clients (the probe's; cheap and explicit) ---------------------------------


def resp_pack(*args: bytes | str) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a.encode() if isinstance(a, str) else a
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


class RespClient:
    """A minimal blocking RESP2 client: enough for the probe and the set-ups."""

    def __init__(
        self, port: int, token: str | None, timeout: float = 10.0, source: str | None = None
    ) -> None:
        self.sock = socket.create_connection(
            ("127.0.0.1", port), timeout=timeout, source_address=(source, 0) if source else None
        )
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""
        if token is not None:
            reply = self.call("AUTH", token)
            if reply != "OK":
                raise ConnectionError(f"AUTH failed: {reply!r}")

    def close(self) -> None:
        self.sock.close()

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed by the server")
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\r\n")
        return line

    def _exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = self.sock.recv(max(65536, n - len(self.buf)))
            if not chunk:
                raise ConnectionError("closed by the server")
            self.buf += chunk
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    def read_reply(self) -> Any:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            return RuntimeError(rest.decode())
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = self._exact(n + 2)
            return data[:-2]
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self.read_reply() for _ in range(n)]
        raise ConnectionError(f"unexpected reply line {line[:40]!r}")

    def call(self, *args: bytes | str) -> Any:
        self.sock.sendall(resp_pack(*args))
        return self.read_reply()


class HttpClient:
    def __init__(
        self, port: int, token: str, timeout: float = 10.0, source: str | None = None
    ) -> None:
        self.conn = http.client.HTTPConnection(
            "127.0.0.1", port, timeout=timeout, source_address=(source, 0) if source else None
        )
        self.headers = {"Authorization": f"Bearer {token}"}

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        self.conn.request(method, path, body=body, headers=self.headers)
        r = self.conn.getresponse()
        return r.status, r.read()

    def close(self) -> None:
        self.conn.close()


# -- the well-behaved client ---------------------------------------------------------------


def pct(values: Sequence[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


@dataclass
class ProbeResult:
    resp_ms: list[float] = field(default_factory=list)
    http_ms: list[float] = field(default_factory=list)
    failures: int = 0
    side_failures: int = 0
    side_ok: int = 0
    errors: list[str] = field(default_factory=list)

    def p99(self) -> float:
        return pct(self.resp_ms, 99)

    def http_p99(self) -> float:
        return pct(self.http_ms, 99)

    def note(self, what: str) -> None:
        if len(self.errors) < 20:
            self.errors.append(what)


SideCheck = Callable[["Probe"], bool]


class Probe(threading.Thread):
    """Tenant B: 4 KiB GETs over RESP and HTTP, timing each (see the module docstring)."""

    def __init__(
        self,
        server: ServerProcess,
        *,
        fresh: bool = False,
        side: SideCheck | None = None,
        pause_s: float = 0.004,
    ) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.fresh = fresh
        self.side = side
        self.pause_s = pause_s
        self.result = ProbeResult()
        self._stop_event = threading.Event()
        self._resp: RespClient | None = None
        self._http: HttpClient | None = None
        self.counter = 0

    def stop(self) -> ProbeResult:
        self._stop_event.set()
        self.join(60)
        for c in (self._resp, self._http):
            if c is not None:
                with contextlib.suppress(OSError):
                    c.close()
        return self.result

    def _resp_get(self) -> None:
        if self._resp is None or self.fresh:
            if self._resp is not None:
                self._resp.close()
            self._resp = None
            self._resp = RespClient(self.server.resp_port, TOKEN_B, source=PROBE_SOURCE)
        value = self._resp.call("GET", PROBE_KEY)
        if value != PROBE_VALUE:
            raise ConnectionError(f"GET answered {str(value)[:80]}")

    def _http_get(self) -> None:
        if self._http is None or self.fresh:
            if self._http is not None:
                self._http.close()
            self._http = HttpClient(self.server.http_port, TOKEN_B, source=PROBE_SOURCE)
        status, body = self._http.request("GET", "/kv/" + PROBE_KEY)
        if status != 200 or body != PROBE_VALUE:
            raise ConnectionError(f"HTTP GET answered {status}")

    def _timed(self, fn: Callable[[], None], into: list[float], wire: str) -> None:
        t0 = time.perf_counter()
        try:
            fn()
        except (OSError, ConnectionError, http.client.HTTPException) as exc:
            # a failed request counts with the time it took to fail (a timeout: 10 s)
            into.append((time.perf_counter() - t0) * 1000)
            self.result.failures += 1
            self.result.note(f"{wire}: {exc}")
            if wire == "resp" and self._resp is not None:
                with contextlib.suppress(OSError):
                    self._resp.close()
                self._resp = None
            if wire == "http" and self._http is not None:
                with contextlib.suppress(OSError):
                    self._http.close()
                self._http = None
            self._stop_event.wait(0.05)
            return
        into.append((time.perf_counter() - t0) * 1000)

    def run(self) -> None:
        side = None
        if self.side is not None:
            side = threading.Thread(target=self._side_loop, daemon=True)
            side.start()
        while not self._stop_event.is_set():
            self._timed(self._resp_get, self.result.resp_ms, "resp")
            self._timed(self._http_get, self.result.http_ms, "http")
            self._stop_event.wait(self.pause_s)
        if side is not None:
            side.join(30)

    def _side_loop(self) -> None:
        """The side check, at its own pace (beside the GETs, never delaying them)."""
        assert self.side is not None
        while not self._stop_event.is_set():
            self.counter += 1
            try:
                ok = self.side(self)
            except (OSError, ConnectionError, http.client.HTTPException) as exc:
                self.result.note(f"side: {exc}")
                ok = False
            if ok:
                self.result.side_ok += 1
            else:
                self.result.side_failures += 1
            self._stop_event.wait(0.01)


def side_set_1mib(probe: Probe) -> bool:
    """Tenant B stores a 1 MiB block over RESP (needs the in-flight body budget)."""
    c = RespClient(probe.server.resp_port, TOKEN_B, source=PROBE_SOURCE)
    try:
        reply = c.call("SET", f"side-{probe.counter % 8}", os.urandom(MiB))
    finally:
        c.close()
    if reply != "OK":
        probe.result.note(f"side SET: {reply}")
    return reply == "OK"


def side_scan(probe: Probe) -> bool:
    """Tenant B pages through its 50 keys with SCAN COUNT 20, pausing 1 s between pages
    (time enough for a flood of other cursors to push B's out of a shared table)."""
    c = RespClient(probe.server.resp_port, TOKEN_B, source=PROBE_SOURCE)
    try:
        cursor, seen = b"0", 0
        while True:
            reply = c.call("SCAN", cursor, "COUNT", "20")
            if isinstance(reply, Exception):
                probe.result.note(f"side SCAN: {reply}")
                return False
            cursor, keys = reply
            seen += len(keys)
            if cursor == b"0":
                return seen >= 40
            time.sleep(1.0)
    finally:
        c.close()


def side_fresh_connection(probe: Probe) -> bool:
    """Tenant B opens a new connection on each listener, authenticates and GETs."""
    c = RespClient(probe.server.resp_port, TOKEN_B, source=PROBE_SOURCE)
    try:
        ok = c.call("GET", PROBE_KEY) == PROBE_VALUE
    finally:
        c.close()
    h = HttpClient(probe.server.http_port, TOKEN_B, source=PROBE_SOURCE)
    try:
        status, body = h.request("GET", "/kv/" + PROBE_KEY)
    finally:
        h.close()
    return ok and status == 200 and body == PROBE_VALUE


def side_new_scope(probe: Probe) -> bool:
    """Tenant B bumps a new epoch scope (the registry must have room for it)."""
    c = HttpClient(probe.server.http_port, TOKEN_B, source=PROBE_SOURCE)
    try:
        status, body = c.request("POST", f"/kv/epoch/b-scope-{os.getpid()}-{probe.counter}/bump")
    finally:
        c.close()
    if status != 200:
        probe.result.note(f"side bump: {status} {body[:120]!r}")
    return status == 200


# -- attacks (each runs in its own process) --------------------------------------------------


class _Pump:
    """Non-blocking sockets that send a payload over and over and drop what comes back."""

    def __init__(self) -> None:
        self.sel = selectors.DefaultSelector()
        self.out: dict[socket.socket, memoryview] = {}

    def add(self, s: socket.socket, first: bytes, *, read: bool = True) -> None:
        s.setblocking(False)
        self.out[s] = memoryview(first)
        events = selectors.EVENT_WRITE | (selectors.EVENT_READ if read else 0)
        self.sel.register(s, events)

    def drop(self, s: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(s)
        self.out.pop(s, None)
        s.close()

    def step(self, refill: Callable[[socket.socket], bytes | None], timeout: float = 0.05) -> int:
        """One select round; returns how many sockets the server closed."""
        closed = 0
        for key, mask in self.sel.select(timeout):
            s: socket.socket = key.fileobj  # type: ignore[assignment]
            try:
                if mask & selectors.EVENT_READ and s.recv(1 << 20) == b"":
                    raise ConnectionResetError
                if mask & selectors.EVENT_WRITE:
                    view = self.out.get(s)
                    if view is None:
                        continue
                    if not view:
                        more = refill(s)
                        if more is None:
                            self.sel.modify(s, key.events & ~selectors.EVENT_WRITE)
                            continue
                        view = memoryview(more)
                    sent = s.send(view)
                    self.out[s] = view[sent:]
            except BlockingIOError:
                continue
            except OSError:
                self.drop(s)
                closed += 1
        return closed

    def close(self) -> None:
        for s in list(self.out):
            self.drop(s)


def _connect(port: int) -> socket.socket | None:
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=2)
    except OSError:
        return None
    return s


def _auth_prefix(token: str) -> bytes:
    return resp_pack("AUTH", token)


def attack_unauth_ping_flood(ports: dict[str, int], stop: Any, conns: int = 4) -> None:
    """Unauthenticated connections pipelining PINGs as fast as they can."""
    payload = b"PING\r\n" * (MiB // 6)
    pump = _Pump()
    while not stop.is_set():
        while len(pump.out) < conns and not stop.is_set():
            s = _connect(ports["resp"])
            if s is not None:
                pump.add(s, payload)
        pump.step(lambda s: payload)
    pump.close()


def attack_auth_pipeline_flood(ports: dict[str, int], stop: Any, conns: int = 4) -> None:
    """Authenticated connections pipelining PING and GET of a missing key."""
    payload = (resp_pack("PING") + resp_pack("GET", "missing")) * 8192
    pump = _Pump()
    while not stop.is_set():
        while len(pump.out) < conns and not stop.is_set():
            s = _connect(ports["resp"])
            if s is not None:
                pump.add(s, _auth_prefix(TOKEN_A) + payload)
        pump.step(lambda s: payload)
    pump.close()


def attack_http_pipeline_flood(ports: dict[str, int], stop: Any, conns: int = 4) -> None:
    """Unauthenticated HTTP connections pipelining `GET /healthz` as fast as they can."""
    payload = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" * (MiB // 38)
    pump = _Pump()
    while not stop.is_set():
        while len(pump.out) < conns and not stop.is_set():
            s = _connect(ports["http"])
            if s is not None:
                pump.add(s, payload)
        pump.step(lambda s: payload)
    pump.close()


def attack_partial_multibulk(ports: dict[str, int], stop: Any) -> None:
    """`*1000000` and then small arguments forever: a command that never completes."""
    chunk = (b"$100\r\n" + b"x" * 100 + b"\r\n") * 1000
    pump = _Pump()
    while not stop.is_set():
        if not pump.out:
            s = _connect(ports["resp"])
            if s is not None:
                pump.add(s, _auth_prefix(TOKEN_A) + b"*1000000\r\n")
        pump.step(lambda s: chunk)
    pump.close()


def attack_unread_replies(ports: dict[str, int], stop: Any, conns: int = 40) -> None:
    """Connections that ask for a 32 MiB block four times and never read a reply."""
    gets = resp_pack("GET", BIG_KEY) * 4
    pump = _Pump()
    while not stop.is_set():
        while len(pump.out) < conns and not stop.is_set():
            s = _connect(ports["resp"])
            if s is not None:
                pump.add(s, _auth_prefix(TOKEN_A) + gets, read=False)
        pump.step(lambda s: None)
    pump.close()


def attack_batch_get_unread(ports: dict[str, int], stop: Any, conns: int = 4) -> None:
    """HTTP batch GETs of 8 x 32 MiB whose answers are never read."""
    body = json.dumps({"keys": [BIG_KEY] * 8}).encode()
    head = (
        f"POST /kv/batch/get HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN_A}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    pump = _Pump()
    while not stop.is_set():
        while len(pump.out) < conns and not stop.is_set():
            s = _connect(ports["http"])
            if s is not None:
                pump.add(s, head + body, read=False)
        pump.step(lambda s: None)
    pump.close()


def attack_header_only_puts(
    ports: dict[str, int], stop: Any, conns: int = 20, length: int = 128 * MiB
) -> None:
    """HTTP PUT heads announcing `length`-byte bodies that never come."""
    pump = _Pump()
    n = 0
    while not stop.is_set():
        while len(pump.out) < conns and not stop.is_set():
            s = _connect(ports["http"])
            if s is not None:
                n += 1
                head = (
                    f"PUT /kv/hold-{n} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN_A}\r\n"
                    f"Content-Length: {length}\r\n\r\n"
                ).encode()
                pump.add(s, head)
        pump.step(lambda s: None)
    pump.close()


def attack_unauth_slots(ports: dict[str, int], stop: Any, conns: int = 1100) -> None:
    """Unauthenticated connections held open on both listeners, reopened when closed."""
    pump = _Pump()
    count = {"http": 0, "resp": 0}
    owner: dict[socket.socket, str] = {}

    def refill(s: socket.socket) -> bytes | None:
        return None

    while not stop.is_set():
        for wire in ("resp", "http"):
            opened = 0
            while count[wire] < conns and opened < 200 and not stop.is_set():
                s = _connect(ports[wire])
                if s is None:
                    break
                owner[s] = wire
                count[wire] += 1
                opened += 1
                pump.add(s, b"")
        before = set(pump.out)
        pump.step(refill)
        for s in before - set(pump.out):
            count[owner.pop(s)] -= 1
    pump.close()


def attack_subscriber_slots(ports: dict[str, int], stop: Any, conns: int = 1100) -> None:
    """Tenant A: subscribed connections (never idle) up to and past the connection limit."""
    pump = _Pump()
    hello = _auth_prefix(TOKEN_A) + resp_pack("SUBSCRIBE", "kvcache:epochs")
    while not stop.is_set():
        opened = 0
        while len(pump.out) < conns and opened < 200 and not stop.is_set():
            s = _connect(ports["resp"])
            if s is None:
                break
            opened += 1
            pump.add(s, hello)
        pump.step(lambda s: None)
    pump.close()


def attack_scan_cursors(ports: dict[str, int], stop: Any) -> None:
    """Tenant A creates SCAN cursors as fast as it can (each `SCAN 0 COUNT 1` makes one)."""
    payload = resp_pack("SCAN", "0", "COUNT", "1") * 2000
    pump = _Pump()
    while not stop.is_set():
        if not pump.out:
            s = _connect(ports["resp"])
            if s is not None:
                pump.add(s, _auth_prefix(TOKEN_A) + payload)
        pump.step(lambda s: payload)
    pump.close()


def attack_epoch_scopes(ports: dict[str, int], stop: Any) -> None:
    """Tenant A reads (watches) and bumps ever new epoch scopes."""
    n = 0
    c = HttpClient(ports["http"], TOKEN_A, timeout=30)
    while not stop.is_set():
        n += 1
        try:
            c.request("GET", f"/kv/epoch/a-watch-{os.getpid()}-{n}")
            c.request("POST", f"/kv/epoch/a-bump-{os.getpid()}-{n}/bump")
        except (OSError, http.client.HTTPException):
            c.close()
            c = HttpClient(ports["http"], TOKEN_A, timeout=30)


def attack_list_keys(ports: dict[str, int], stop: Any, limit: int = 10) -> None:
    """Tenant A lists its (large) namespace, page after page, over HTTP and RESP SCAN."""
    c = HttpClient(ports["http"], TOKEN_A, timeout=60)
    r = RespClient(ports["resp"], TOKEN_A, timeout=60)
    n = 0
    while not stop.is_set():
        n += 1
        try:
            c.request("GET", f"/kv/keys?limit={limit}&after=k{n % 9973:06d}")
            r.call("SCAN", "0", "COUNT", str(limit))
        except (OSError, ConnectionError, http.client.HTTPException):
            c.close()
            r.close()
            c = HttpClient(ports["http"], TOKEN_A, timeout=60)
            r = RespClient(ports["resp"], TOKEN_A, timeout=60)


def attack_large_json(ports: dict[str, int], stop: Any) -> None:
    """Tenant A asks for 10,000 keys of ~1000 bytes in one JSON answer, again and again."""
    attack_list_keys(ports, stop, limit=10_000)


def _attack_main(name: str, ports: dict[str, int], stop: Any, params: dict[str, Any]) -> None:
    with contextlib.suppress(KeyboardInterrupt):
        ATTACKS[name](ports, stop, **params)


ATTACKS: dict[str, Callable[..., None]] = {
    "unauth_ping_flood": attack_unauth_ping_flood,
    "auth_pipeline_flood": attack_auth_pipeline_flood,
    "http_pipeline_flood": attack_http_pipeline_flood,
    "partial_multibulk": attack_partial_multibulk,
    "unread_replies": attack_unread_replies,
    "batch_get_unread": attack_batch_get_unread,
    "header_only_puts": attack_header_only_puts,
    "unauth_slots": attack_unauth_slots,
    "subscriber_slots": attack_subscriber_slots,
    "scan_cursors": attack_scan_cursors,
    "epoch_scopes": attack_epoch_scopes,
    "big_namespace_listing": attack_list_keys,
    "large_json": attack_large_json,
}


# -- set-ups -----------------------------------------------------------------------------------


def setup_probe(server: ServerProcess) -> None:
    c = RespClient(server.resp_port, TOKEN_B)
    try:
        assert c.call("SET", PROBE_KEY, PROBE_VALUE) == "OK"
        for i in range(50):
            c.call("SET", f"b-key-{i:03d}", b"v")
    finally:
        c.close()


def setup_big(server: ServerProcess) -> None:
    c = RespClient(server.resp_port, TOKEN_A, timeout=60)
    try:
        reply = c.call("SET", BIG_KEY, os.urandom(32 * MiB))
        assert reply == "OK", reply
    finally:
        c.close()


def setup_keys(server: ServerProcess, count: int, key_bytes: int = 7) -> None:
    c = RespClient(server.resp_port, TOKEN_A, timeout=120)
    try:
        pad = "p" * max(0, key_bytes - 7)
        for start in range(0, count, 1000):
            args: list[bytes | str] = ["MSET"]
            for i in range(start, min(count, start + 1000)):
                args += [f"k{i:06d}{pad}", b"v"]
            reply = c.call(*args)
            assert reply == "OK", reply
    finally:
        c.close()


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    setup: Callable[[ServerProcess], None] | None = None
    fresh: bool = False
    side: SideCheck | None = None
    options: tuple[str, ...] = ()
    """Extra server flags (flags that exist on older versions too)."""
    warmup_s: float = 0.5
    """How long the attack runs before the probe starts (the slot-holding attacks need
    a moment to open their 1100 connections per listener; measured is the steady state)."""


COLD = ("--hot-capacity-bytes", "16MiB", "--warm-capacity-bytes", "0")
"""The 32 MiB block lives on disk only: every GET reads it into a new buffer."""

SCENARIOS: tuple[Scenario, ...] = (
    Scenario("unauth_ping_flood", "4 unauthenticated connections pipelining PINGs"),
    Scenario("auth_pipeline_flood", "4 authenticated connections pipelining PING + GET"),
    Scenario(
        "http_pipeline_flood",
        "4 unauthenticated HTTP connections pipelining GET /healthz",
    ),
    Scenario("partial_multibulk", "`*1000000` then 100-byte arguments, never completed"),
    Scenario(
        "unread_replies",
        "40 connections x 4 GETs of a cold 32 MiB block, never read",
        setup_big,
        options=COLD,
    ),
    Scenario(
        "batch_get_unread",
        "4 HTTP batch GETs of 8 x a cold 32 MiB block, never read",
        setup_big,
        options=COLD,
    ),
    Scenario(
        "header_only_puts",
        "20 HTTP PUT heads of 128 MiB, no body (side: tenant B 1 MiB SETs)",
        side=side_set_1mib,
    ),
    Scenario(
        "unauth_slots",
        "1100 unauthenticated connections per listener, reopened as closed "
        "(side: tenant B opens new connections)",
        side=side_fresh_connection,
        warmup_s=3.0,
    ),
    Scenario(
        "subscriber_slots",
        "1100 subscribed connections of tenant A, reopened as closed "
        "(side: tenant B opens new connections)",
        side=side_fresh_connection,
        warmup_s=3.0,
    ),
    Scenario(
        "scan_cursors",
        "tenant A creates SCAN cursors non-stop (side: tenant B pages a SCAN)",
        lambda s: setup_keys(s, 200),
        side=side_scan,
    ),
    Scenario(
        "epoch_scopes",
        "tenant A watches and bumps new epoch scopes (side: tenant B bumps new scopes)",
        side=side_new_scope,
    ),
    Scenario(
        "big_namespace_listing",
        "tenant A (200,000 keys) lists 10 keys at a time over HTTP and SCAN",
        lambda s: setup_keys(s, 200_000),
    ),
    Scenario(
        "large_json",
        "tenant A lists 10,000 keys of 1000 bytes in one JSON answer, repeatedly",
        lambda s: setup_keys(s, 10_000, key_bytes=1000),
    ),
)
SCENARIOS_BY_NAME = {s.name: s for s in SCENARIOS}


@dataclass
class Outcome:
    scenario: str
    unloaded_p99_ms: float
    loaded_p99_ms: float
    unloaded_http_p99_ms: float
    loaded_http_p99_ms: float
    samples: int
    probe_failures: int
    side_failures: int
    side_ok: int
    baseline_rss_mib: float
    peak_rss_mib: float
    server_alive: bool
    errors: list[str]

    def row(self) -> str:
        return (
            f"| {self.scenario} | {self.unloaded_p99_ms:.1f} | {self.loaded_p99_ms:.1f} | "
            f"{self.unloaded_http_p99_ms:.1f} | {self.loaded_http_p99_ms:.1f} | "
            f"{self.probe_failures} | {self.side_failures}/{self.side_failures + self.side_ok} | "
            f"{self.baseline_rss_mib:.0f} | {self.peak_rss_mib:.0f} |"
        )


def run_scenario(
    server: ServerProcess,
    scenario: Scenario,
    *,
    unloaded_s: float = 2.0,
    loaded_s: float = 6.0,
    warmup_s: float | None = None,
    attack_params: dict[str, Any] | None = None,
) -> Outcome:
    """Set up, probe unloaded, start the attack, probe under it, stop the attack."""
    setup_probe(server)
    if scenario.setup is not None:
        scenario.setup(server)
    probe = Probe(server, fresh=scenario.fresh)
    probe.start()
    time.sleep(unloaded_s)
    unloaded = probe.stop()
    baseline = rss_kib(server.pid)
    sampler = RssSampler(server.pid)
    sampler.start()
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    ports = {"http": server.http_port, "resp": server.resp_port}
    attacker = ctx.Process(
        target=_attack_main, args=(scenario.name, ports, stop, attack_params or {})
    )
    attacker.start()
    try:
        time.sleep(scenario.warmup_s if warmup_s is None else warmup_s)
        probe = Probe(server, fresh=scenario.fresh, side=scenario.side)
        probe.start()
        time.sleep(loaded_s)
        loaded = probe.stop()
    finally:
        stop.set()
        attacker.join(20)
        if attacker.is_alive():
            attacker.kill()
            attacker.join(5)
        sampler.stop()
    return Outcome(
        scenario=scenario.name,
        unloaded_p99_ms=unloaded.p99(),
        loaded_p99_ms=loaded.p99(),
        unloaded_http_p99_ms=unloaded.http_p99(),
        loaded_http_p99_ms=loaded.http_p99(),
        samples=len(loaded.resp_ms),
        probe_failures=loaded.failures,
        side_failures=loaded.side_failures,
        side_ok=loaded.side_ok,
        baseline_rss_mib=baseline / 1024,
        peak_rss_mib=sampler.peak_kib / 1024,
        server_alive=server.returncode is None,
        errors=loaded.errors,
    )


def run_isolated(
    scenario: Scenario,
    *,
    src: Path | None = None,
    options: Sequence[str] = (),
    backend: str = "durable",
    **timing: float,
) -> Outcome:
    """`run_scenario` on a fresh server of its own (so RSS peaks do not carry over)."""
    with tempfile.TemporaryDirectory(prefix=f"abuse-{scenario.name}-") as tmp:
        all_options = [*scenario.options, *options]
        with start_server(Path(tmp), src=src, options=all_options, backend=backend) as server:
            return run_scenario(server, scenario, **timing)


HEADER = (
    "| scenario | RESP GET p99 unloaded (ms) | under abuse (ms) | HTTP GET p99 unloaded (ms) "
    "| under abuse (ms) | probe failures | side-check failures | RSS before (MiB) | peak RSS (MiB) |\n"
    "|---|---|---|---|---|---|---|---|---|"
)
