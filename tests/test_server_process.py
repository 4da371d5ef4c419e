"""The child-process server harness (`epistemic_kvcache.server.process`), against the real
`serve`: ports read back, environment cleared, start failures with their output, the
three ways to stop, the output kept, a token file of several tenants."""

from __future__ import annotations

import os
import signal
import socket
import stat
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from epistemic_kvcache.server.process import (
    ServerProcess,
    ServerStartError,
    child_env,
    write_token_file,
)

TOKEN = "process-harness-token-0123456789"
BAD_ENV = {"EPISTEMIC_GRAPH_KVCACHE_HOT_CAPACITY_BYTES": "-1"}
"""A setting `serve` refuses at start (exit 2): inherited, it would stop every start."""


def status(url: str, token: str | None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return exc.code


def test_child_env_drops_the_server_variables_and_applies_what_it_is_told(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("EPISTEMIC_GRAPH_KVCACHE_BACKEND", "durable")
    monkeypatch.setenv("GRAPH_SERVICE_PERSIST_DIR", "/elsewhere")
    monkeypatch.setenv("PYTHONPATH", "/after")
    monkeypatch.setenv("KEEP_ME", "1")
    env = child_env({"ADDED": "x", "KEEP_ME": None}, pythonpath="/first")
    assert "EPISTEMIC_GRAPH_KVCACHE_BACKEND" not in env
    assert "GRAPH_SERVICE_PERSIST_DIR" not in env
    assert env["ADDED"] == "x"
    assert "KEEP_ME" not in env
    assert env["PYTHONPATH"] == "/first" + os.pathsep + "/after"
    kept = child_env(keep_env=True)
    assert kept["EPISTEMIC_GRAPH_KVCACHE_BACKEND"] == "durable"


def test_ports_output_graceful_stop_and_a_cleared_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in BAD_ENV.items():
        monkeypatch.setenv(name, value)
    log = tmp_path / "server.log"
    with ServerProcess(
        tmp_path / "data", backend="memory", token=TOKEN, log_path=log, keep_lines=1000
    ) as srv:
        assert srv.http.port != 0
        assert srv.resp_port != 0
        assert srv.ports == {"http": srv.http_port, "resp": srv.resp_port}
        assert status(srv.url() + "/kv/stats", TOKEN) == 200
        with socket.create_connection(("127.0.0.1", srv.resp_port), timeout=10) as sock:
            sock.sendall(b"PING\r\n")
            assert sock.recv(100).startswith(b"-NOAUTH")
        since = srv.lines_seen
        srv.signal(signal.SIGTERM)
        assert srv.wait_for(r" stopped$", since=since)
        assert srv.wait(30) == 0
    assert srv.returncode == 0
    assert srv.proc.stdout is not None
    assert srv.proc.stdout.closed
    assert "started epistemic-kvcache" in srv.text
    assert log.read_text() == srv.text
    with pytest.raises(TimeoutError, match="exited"):
        srv.wait_for("never printed")


def test_a_start_that_fails_raises_with_the_exit_status_and_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in BAD_ENV.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ServerStartError) as failed:
        ServerProcess(tmp_path, backend="memory", token=TOKEN, keep_env=True)
    assert failed.value.returncode == 2
    assert "invalid hot_capacity_bytes" in failed.value.output
    with pytest.raises(ServerStartError, match=r"not started in 0\.01 s") as silent:
        ServerProcess(tmp_path, program=("-c", "import time; time.sleep(60)"), start_timeout_s=0.01)
    assert silent.value.returncode == -signal.SIGKILL


def test_kill_a_stopped_server_and_several_tenants_in_a_token_file(tmp_path: Path) -> None:
    tokens = write_token_file(tmp_path / "tokens", {TOKEN: "tenant-a", "b" * 32: "tenant-b"})
    assert stat.S_IMODE(tokens.stat().st_mode) == 0o600
    (tmp_path / "run").mkdir()
    srv = ServerProcess(
        "data", backend="memory", token_file="../tokens", resp=False, cwd=tmp_path / "run"
    )
    try:
        assert srv.resp is None
        with pytest.raises(LookupError, match="RESP listener is off"):
            _ = srv.resp_port
        assert status(srv.url() + "/kv/stats", "b" * 32) == 200
        assert status(srv.url() + "/kv/stats", "c" * 32) == 401
        srv.signal(signal.SIGSTOP)
    finally:
        assert srv.kill() == -signal.SIGKILL
    assert srv.stop() == -signal.SIGKILL  # already gone: its status again
