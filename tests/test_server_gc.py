"""Requests leave no reference cycles behind.

The server runs the cyclic garbage collector rarely (`server.runtime.tune_gc`), so memory a
request held in a cycle stayed allocated until the next collection: a recursive closure
in the chunked JSON encoder kept every large listing answer (~10 MB) alive, and an abuse
scenario's peak RSS went from ~200 to ~500 MiB. Reference counting must free everything
a request made; these tests make the collector find nothing.
"""

from __future__ import annotations

import gc
import http.client
import re
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

import hangup
from epistemic_kvcache.client import EpistemicGraphKVBackend, KvCacheConfig
from epistemic_kvcache.proto.http import encode_batch_put_request
from epistemic_kvcache.server.app import ServerHandle
from epistemic_kvcache.server.http.api import encode_json_chunked
from helpers import eventually
from servers import running_server

TOKEN = "gc-token-0123456789abcdef"


def _cyclic_garbage(run: object) -> list[str]:
    """Types of the objects that only the cycle collector would have freed after `run()`."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        run()  # type: ignore[operator]
        gc.collect()
        return sorted({type(o).__name__ for o in gc.garbage})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def _open_connections(server: ServerHandle) -> tuple[int, int]:
    """(RESP, HTTP) connections the server has open, as /metrics says (this request's
    own connection included)."""
    conn = http.client.HTTPConnection(server.http.host, server.http.port, timeout=10)
    try:
        conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    found = dict(re.findall(r'^kvcache_open_connections\{wire="(\w+)"\} (\S+)$', text, re.M))
    return int(float(found.get("resp", "0"))), int(float(found.get("http", "0")))


def _hang_up(server: ServerHandle, i: int) -> None:
    """Clients that go away halfway: a large SET and a batch PUT cut off mid-body."""
    assert server.resp is not None
    value = b"z" * (2 << 20)
    auth = b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(TOKEN), TOKEN.encode())
    resp = socket.create_connection(("127.0.0.1", server.resp.port), timeout=10)
    resp.sendall(auth + b"*3\r\n$3\r\nSET\r\n$3\r\ncut\r\n$%d\r\n" % len(value) + value[: i * 1000])
    body = b"".join(bytes(p) for p in encode_batch_put_request(["a", "b"], [value, value]))
    http_ = socket.create_connection((server.http.host, server.http.port), timeout=10)
    http_.sendall(
        f"POST /kv/batch/put HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body[: len(body) // 2]
    )
    for sock in (resp, http_):
        hangup.reset(sock, settle_s=0.01)


def test_the_chunked_json_encoder_makes_no_cycles() -> None:
    doc = {"keys": [f"k{i:05d}" + "x" * 1000 for i in range(2000)], "next_after": None}

    def run() -> None:
        out = encode_json_chunked(doc)
        assert b"".join(bytes(b) for b in out).startswith(b'{"keys":["k00000')

    assert _cyclic_garbage(run) == []


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerHandle]:
    with running_server(tmp_path, tokens={TOKEN: "default"}) as srv:
        yield srv.handle


def test_requests_on_both_wires_leave_no_cyclic_garbage(server: ServerHandle) -> None:
    """Answered requests, errors, and clients hanging up mid-body alike."""
    assert server.resp is not None
    r = redis.Redis(host="127.0.0.1", port=server.resp.port, password=TOKEN)
    client = EpistemicGraphKVBackend(KvCacheConfig(base_url=server.http_url, token=TOKEN))
    for i in range(300):
        r.set(f"key-{i:04d}-" + "p" * 900, b"v")

    def run() -> None:
        for i in range(5):
            r.set(f"big{i}", b"x" * (300 << 10))
            assert r.get(f"big{i}") == b"x" * (300 << 10)
            assert r.get("missing") is None
            r.mget(["big0", "big1"])
            with pytest.raises(redis.ResponseError):
                r.execute_command("GET")
            r.scan(0, count=1000)
            client.put(f"h{i}", b"y" * (300 << 10))
            assert client.get(f"h{i}") == b"y" * (300 << 10)
            assert client.get("absent") is None
            client.exists(f"h{i}")
            client.stats()
            conn = http.client.HTTPConnection(server.http.host, server.http.port)
            conn.request("GET", "/kv/keys?limit=1000", headers={"Authorization": f"Bearer {TOKEN}"})
            assert conn.getresponse().read()
            conn.close()
            _hang_up(server, i)
        eventually(lambda: _open_connections(server) == (1, 2), what="the server saw them go")

    try:
        assert _cyclic_garbage(run) == []
    finally:
        client.close()
        r.close()
