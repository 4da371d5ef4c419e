"""A clean stop leaves a clean log; a crash in the middle of a write is still reported.

The segment writer keeps zeroed, allocated space after the active segment's end (up to
4 MiB after small batches; the delete reserve after large ones). Before, a SIGTERM left
that space in the file and the next start logged "dropping N bytes after the last
complete batch (a write torn by a crash, never acknowledged)": the line that should mean
a crash came after every clean restart. Now a clean close cuts the zeroed space, and
opening tells zeros (no record was ever there) from bytes a write left behind.

Each case runs real server processes (`python -m epistemic_kvcache serve`, durable
backend): stopped with SIGTERM, killed with SIGKILL between writes, and killed with
SIGKILL in the middle of writing a batch (`server_torn_write.py` writes half of a
marked block's batch, then kills itself).
"""

from __future__ import annotations

import http.client
import os
from pathlib import Path

import blake3
import pytest

from server_torn_write import MARKER
from servers import TOKEN, ServeProcess

TORN = "torn by a crash"
WRAPPER = str(Path(__file__).with_name("server_torn_write.py"))


def content(key: str, size: int) -> bytes:
    return blake3.blake3(key.encode()).digest(length=size)


def call(srv: ServeProcess, method: str, key: str, body: bytes | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=30)
    try:
        conn.request(method, f"/kv/{key}", body=body, headers={"Authorization": f"Bearer {TOKEN}"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def serve(data: Path, *, torn: bool = False) -> ServeProcess:
    program = (WRAPPER,) if torn else ("-m", "epistemic_kvcache")
    return ServeProcess(data, backend="durable", resp=False, program=program)


def fill(srv: ServeProcess) -> dict[str, bytes]:
    """Small PUTs (their batches zero 4 MiB ahead) and a larger one: acknowledged."""
    stored = {f"small-{i}": content(f"small-{i}", 4096) for i in range(5)}
    stored["large"] = content("large", 300_000)
    for key, body in stored.items():
        assert call(srv, "PUT", key, body)[0] == 201
    return stored


def segment_sizes(data: Path) -> int:
    return sum(p.stat().st_size for p in (data / "segments").glob("*.seg"))


def reopen_and_read(data: Path, stored: dict[str, bytes]) -> str:
    """Start the server again, read every key back, stop it: its log."""
    srv = serve(data)
    try:
        for key, body in stored.items():
            assert call(srv, "GET", key) == (200, body), key
    finally:
        srv.stop()
    assert srv.proc.returncode == 0, "".join(srv.output)
    return "".join(srv.output)


def test_sigterm_leaves_no_torn_tail(tmp_path: Path) -> None:
    data = tmp_path / "data"
    srv = serve(data)
    stored = fill(srv)
    written = sum(len(v) for v in stored.values())
    assert segment_sizes(data) > written + (1 << 20)  # zeroed space ahead of the end
    srv.stop()  # SIGTERM
    assert srv.proc.returncode == 0, "".join(srv.output)
    # the file ends where the log does: the records, no zeroed space
    assert segment_sizes(data) < written + (64 << 10)
    log = reopen_and_read(data, stored)
    assert "dropping" not in log, log  # neither the crash line nor any other
    log = reopen_and_read(data, stored)  # and again: nothing accumulates
    assert "dropping" not in log, log  # neither the crash line nor any other


def test_sigkill_between_writes_drops_only_zeros_silently(tmp_path: Path) -> None:
    """Killed while idle: no write was torn, so no crash message (the zeroed space after
    the end is cut without one); every acknowledged key reads back."""
    data = tmp_path / "data"
    srv = serve(data)
    stored = fill(srv)
    srv.kill()
    srv.stop()
    assert segment_sizes(data) > sum(len(v) for v in stored.values()) + (1 << 20)
    log = reopen_and_read(data, stored)
    assert TORN not in log, log


def test_sigkill_in_the_middle_of_a_write_is_still_reported(tmp_path: Path) -> None:
    data = tmp_path / "data"
    srv = serve(data, torn=True)
    stored = fill(srv)
    torn = MARKER + os.urandom(200_000)
    with pytest.raises((ConnectionError, http.client.HTTPException)):
        call(srv, "PUT", "torn", torn)  # the server dies half-way through writing it
    assert srv.proc.wait(30) == -9
    srv.stop()
    assert "KILL" in "".join(srv.output)
    log = reopen_and_read(data, stored)
    assert TORN in log, log
    again = serve(data)
    try:
        assert call(again, "GET", "torn")[0] == 404  # never acknowledged: never there
    finally:
        again.stop()
    assert TORN not in "".join(again.output)  # cut once, for good
