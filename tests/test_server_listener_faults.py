"""A listener that cannot serve a new connection says so (server/loops.py `LateFactory`).

A protocol that cannot be made (a bug; before its configuration check, a RESP limit the
compiled build could not hold raised OverflowError there) used to stop the listener from
accepting while `/readyz` stayed 200. Now that connection is closed, the listener keeps
accepting, `/readyz` answers 503 naming the listener, and the error is logged once. The
fault is injected into the real server's RESP connection class (on every event loop).
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
from pathlib import Path

import pytest

from epistemic_kvcache.server.resp import connection
from servers import running_server


def _readyz(port: int) -> tuple[int, dict[str, object]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/readyz")
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _closed_unserved(s: socket.socket) -> bool:
    """The server closed the connection without an answer (EOF, or a reset: it had
    unread input)."""
    try:
        return s.recv(100) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("loops", ["1", "2"])
def test_a_failing_protocol_factory_fails_readiness_and_keeps_the_listener(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    loops: str,
) -> None:
    with running_server(tmp_path, event_loops=loops) as srv:
        assert srv.resp is not None
        assert _readyz(srv.http.port)[0] == 200

        def broken(self: object, shared: object) -> None:
            raise OverflowError("Python int too large to convert to C ssize_t")

        monkeypatch.setattr(connection.RespConnection, "__init__", broken)
        with caplog.at_level(logging.ERROR, logger="epistemic_kvcache.server"):
            for _ in range(3):  # (each loop's listener may get one)
                with socket.create_connection((srv.resp.host, srv.resp.port), timeout=10) as s:
                    s.sendall(b"PING\r\n")
                    assert _closed_unserved(s)
        status, doc = _readyz(srv.http.port)
        assert status == 503
        assert "resp listener failed: OverflowError" in str(doc["reason"])
        errors = [r for r in caplog.records if "listener cannot serve" in r.getMessage()]
        assert len(errors) == 1
        monkeypatch.undo()
        # still accepting (and serving, once connections can be made again)
        with socket.create_connection((srv.resp.host, srv.resp.port), timeout=10) as s:
            s.sendall(b"PING\r\n")
            assert s.recv(100).startswith((b"-NOAUTH", b"+PONG"))
