"""The server runner end to end: the real `python -m epistemic_kvcache serve` as a subprocess.

Covers the parseable `listening` lines, /healthz and auth over HTTP, RESP through
redis-py, busy ports, first-run token generation, the non-loopback refusal, TLS and mTLS
on both listeners (trustme certificates), the stats log line, SIGTERM -> exit 0, and the
graceful drain of a request in flight (in-process `ServerThread`).
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import ssl
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import jwt
import pytest
import redis
import trustme
from redis.backoff import NoBackoff
from redis.retry import Retry

from epistemic_kvcache.config import Address
from epistemic_kvcache.errors import ConfigurationError
from epistemic_kvcache.server.app import ServerHandle, ServerThread
from epistemic_kvcache.server.background import format_stats
from epistemic_kvcache.server.process import ServerProcess, child_env
from epistemic_kvcache.store.api import StoreStats, TierStats
from helpers import eventually
from servers import server_config

TOKEN = "test-token-0123456789"
NO_RETRY = Retry(NoBackoff(), 0)
"""redis-py retries failed connections (and AUTH) with backoff by default; not here."""


BASE_ARGS = ("--addr", "127.0.0.1:0", "--resp-addr", "127.0.0.1:0", "--persist-dir", "data")


@pytest.fixture
def servers() -> Iterator[list[ServerProcess]]:
    started: list[ServerProcess] = []
    yield started
    for server in started:
        server.kill()


def start(servers: list[ServerProcess], cwd: Path, *args: str) -> ServerProcess:
    """`serve` in `cwd` with `args` (persist dir `data`, both listeners on loopback port
    0, no credentials unless `args` give some), once it has started."""
    server = ServerProcess("data", *args, cwd=cwd)
    servers.append(server)
    return server


def fail_to_start(cwd: Path, *args: str, base: tuple[str, ...] = BASE_ARGS) -> tuple[int, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "epistemic_kvcache", "serve", *base, *args],
        cwd=cwd,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc.returncode, proc.stdout + proc.stderr


def _get(
    addr: Address,
    path: str,
    token: str | None = TOKEN,
    tls: ssl.SSLContext | None = None,
    method: str = "GET",
    body: bytes | None = None,
) -> tuple[int, bytes]:
    conn: http.client.HTTPConnection
    if tls is None:
        conn = http.client.HTTPConnection(addr.host, addr.port, timeout=10)
    else:
        conn = http.client.HTTPSConnection(addr.host, addr.port, timeout=10, context=tls)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


# -- plain ------------------------------------------------------------------------------


def test_serve_healthz_auth_resp_stats_and_sigterm(
    tmp_path: Path, servers: list[ServerProcess]
) -> None:
    server = start(servers, tmp_path, "--token", TOKEN, "--stats-log-interval-s", "0.2")
    assert server.http is not None
    assert server.resp is not None
    assert server.http.port != 0
    assert server.resp.port != 0

    status, body = _get(server.http, "/healthz", token=None)
    assert status == 200
    assert json.loads(body)["status"] == "ok"
    assert _get(server.http, "/kv/stats", token=None)[0] == 401
    assert _get(server.http, "/kv/stats", token="wrong-token-012345")[0] == 401
    assert _get(server.http, "/kv/k1", method="PUT", body=b"block-bytes")[0] == 201

    # The same store and namespace over RESP.
    r = redis.Redis(host=server.resp.host, port=server.resp.port, password=TOKEN)
    try:
        assert r.ping() is True
        assert r.get("k1") == b"block-bytes"
    finally:
        r.close()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(
            host=server.resp.host, port=server.resp.port, password="nope-0123", retry=NO_RETRY
        ).ping()

    server.wait_for(r"stats hit_rate=\S+ gets=\d+ .*dedup_rate=\S+ .*hot=\S+")
    assert server.stop() == 0
    assert "stopped" in server.text
    assert TOKEN not in server.text


def test_tenants_from_token_file_and_jwt_are_isolated(
    tmp_path: Path, servers: list[ServerProcess]
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("token-team-a-0123456789 team-a\ntoken-team-b-0123456789 team-b\n")
    tokens.chmod(0o600)
    secret = tmp_path / "jwt.secret"
    secret.write_text("k" * 40 + "\n")
    server = start(servers, tmp_path, "--token-file", str(tokens), "--jwt-secret-file", str(secret))
    assert server.http is not None
    assert server.resp is not None
    a, b = "token-team-a-0123456789", "token-team-b-0123456789"
    assert _get(server.http, "/kv/shared-name", a, method="PUT", body=b"A")[0] == 201
    assert _get(server.http, "/kv/shared-name", b)[0] == 404
    assert _get(server.http, "/kv/shared-name", a) == (200, b"A")
    claims = {"tenant": "team-a", "sub": "svc", "exp": int(time.time()) + 60}
    token = jwt.encode(claims, "k" * 40, algorithm="HS256")
    assert _get(server.http, "/kv/shared-name", token) == (200, b"A")
    expired = jwt.encode(dict(claims, exp=int(time.time()) - 60), "k" * 40, algorithm="HS256")
    assert _get(server.http, "/kv/shared-name", expired)[0] == 401
    r = redis.Redis(host=server.resp.host, port=server.resp.port, password=b, retry=NO_RETRY)
    try:
        assert r.get("shared-name") is None
    finally:
        r.close()
    assert server.stop() == 0
    assert "token-team" not in server.text


def test_busy_port_names_the_flag(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc, out = fail_to_start(
            tmp_path,
            "--token",
            TOKEN,
            base=(
                "--addr",
                "127.0.0.1:0",
                "--resp-addr",
                f"127.0.0.1:{port}",
                "--persist-dir",
                "data",
            ),
        )
        assert rc == 1, out
        assert f"--resp-addr 127.0.0.1:{port}: address already in use" in out
        assert "listening" not in out
        rc, out = fail_to_start(
            tmp_path,
            "--token",
            TOKEN,
            base=("--addr", f"127.0.0.1:{port}", "--resp-addr", "off", "--persist-dir", "data"),
        )
        assert rc == 1, out
        assert f"--addr 127.0.0.1:{port}: address already in use" in out
        assert "listening" not in out


def test_first_run_token_generated_and_reused(tmp_path: Path, servers: list[ServerProcess]) -> None:
    server = start(servers, tmp_path)
    token_path = tmp_path / "data" / "token"
    assert stat.S_IMODE(token_path.stat().st_mode) == 0o600
    token = token_path.read_text().strip()
    assert str(token_path) in server.text
    assert token not in server.text
    assert server.http is not None
    assert _get(server.http, "/kv/stats", token=token)[0] == 200
    assert server.stop() == 0

    again = start(servers, tmp_path)
    assert token_path.read_text().strip() == token
    assert again.http is not None
    assert _get(again.http, "/kv/stats", token=token)[0] == 200
    assert again.stop() == 0


def test_no_credentials_and_no_generation_fails_closed(tmp_path: Path) -> None:
    rc, out = fail_to_start(tmp_path, "--no-generate-token")
    assert rc == 2, out
    assert "refusing to serve" in out
    assert "listening" not in out


def test_non_loopback_without_tls_refused(tmp_path: Path) -> None:
    rc, out = fail_to_start(
        tmp_path,
        "--token",
        TOKEN,
        base=("--addr", "0.0.0.0:0", "--resp-addr", "off", "--persist-dir", "data"),
    )
    assert rc == 2, out
    assert "refusing to listen on 0.0.0.0:0 (--addr) without TLS" in out
    assert "listening" not in out


def test_bad_flag_value_exits_2(tmp_path: Path) -> None:
    rc, out = fail_to_start(tmp_path, "--hot-capacity-bytes", "-1")
    assert rc == 2
    assert (
        "invalid hot_capacity_bytes: expected a size like 4GiB, "
        "or 0 to turn the tier off (got '-1')" in out
    )


def test_help_lists_flags(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "epistemic_kvcache", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
        check=True,
    )
    for flag in ("--addr", "--resp-addr", "--token-file", "--jwt-jwks", "--tls-client-ca"):
        assert flag in proc.stdout


# -- TLS ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def tls_files(tmp_path: Path, ca: trustme.CA) -> dict[str, Path]:
    server_cert = ca.issue_cert("127.0.0.1", "localhost")
    client_cert = ca.issue_cert("client@example")
    files = {
        "ca": tmp_path / "ca.pem",
        "cert": tmp_path / "server.pem",
        "key": tmp_path / "server.key",
        "client": tmp_path / "client.pem",
    }
    ca.cert_pem.write_to_path(str(files["ca"]))
    server_cert.cert_chain_pems[0].write_to_path(str(files["cert"]))
    for pem in server_cert.cert_chain_pems[1:]:
        pem.write_to_path(str(files["cert"]), append=True)
    server_cert.private_key_pem.write_to_path(str(files["key"]))
    client_cert.private_key_and_cert_chain_pem.write_to_path(str(files["client"]))
    return files


def _client_ctx(files: dict[str, Path], *, with_cert: bool) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(files["ca"]))
    if with_cert:
        ctx.load_cert_chain(str(files["client"]))
    return ctx


def test_tls_on_both_listeners(
    tmp_path: Path, servers: list[ServerProcess], tls_files: dict[str, Path]
) -> None:
    server = start(
        servers,
        tmp_path,
        "--token",
        TOKEN,
        "--tls-cert",
        str(tls_files["cert"]),
        "--tls-key",
        str(tls_files["key"]),
    )
    assert server.http is not None
    assert server.resp is not None
    assert "tls=on" in server.text
    ctx = _client_ctx(tls_files, with_cert=False)
    assert _get(server.http, "/healthz", token=None, tls=ctx)[0] == 200
    assert _get(server.http, "/kv/stats", tls=ctx)[0] == 200
    # Plaintext against the TLS listener does not get an HTTP answer.
    with pytest.raises((http.client.HTTPException, ConnectionError, OSError)):
        _get(server.http, "/healthz", token=None)

    r = redis.Redis(
        host=server.resp.host,
        port=server.resp.port,
        password=TOKEN,
        ssl=True,
        ssl_ca_certs=str(tls_files["ca"]),
    )
    try:
        assert r.ping() is True
        assert r.set("tls-key", b"v") is True
        assert r.get("tls-key") == b"v"
    finally:
        r.close()
    assert server.stop() == 0


def test_mtls_on_both_listeners(
    tmp_path: Path, servers: list[ServerProcess], tls_files: dict[str, Path]
) -> None:
    server = start(
        servers,
        tmp_path,
        "--token",
        TOKEN,
        "--tls-cert",
        str(tls_files["cert"]),
        "--tls-key",
        str(tls_files["key"]),
        "--tls-client-ca",
        str(tls_files["ca"]),
    )
    assert server.http is not None
    assert server.resp is not None
    assert "tls=mtls" in server.text
    good = _client_ctx(tls_files, with_cert=True)
    assert _get(server.http, "/kv/stats", tls=good)[0] == 200
    with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException)):
        _get(server.http, "/healthz", token=None, tls=_client_ctx(tls_files, with_cert=False))

    r = redis.Redis(
        host=server.resp.host,
        port=server.resp.port,
        password=TOKEN,
        ssl=True,
        ssl_ca_certs=str(tls_files["ca"]),
        ssl_certfile=str(tls_files["client"]),
    )
    try:
        assert r.ping() is True
    finally:
        r.close()
    anonymous = redis.Redis(
        host=server.resp.host,
        port=server.resp.port,
        password=TOKEN,
        ssl=True,
        ssl_ca_certs=str(tls_files["ca"]),
        retry=NO_RETRY,
    )
    with pytest.raises(redis.ConnectionError):
        anonymous.ping()
    anonymous.close()
    assert server.stop() == 0


def test_bad_tls_key_is_a_configuration_error(tmp_path: Path, tls_files: dict[str, Path]) -> None:
    rc, out = fail_to_start(
        tmp_path,
        "--token",
        TOKEN,
        "--tls-cert",
        str(tls_files["cert"]),
        "--tls-key",
        str(tls_files["ca"]),
    )
    assert rc == 2, out
    assert "invalid tls_key" in out


# -- in-process: graceful drain -----------------------------------------------------------


def _thread_config(tmp_path: Path, **extra: str) -> ServerThread:
    return ServerThread(server_config(tmp_path, tokens={TOKEN: "default"}, **extra))


def _open_http_connections(handle: ServerHandle) -> int:
    """The HTTP connections the server has open, as /metrics says (this one included)."""
    url = f"http://{handle.http.host}:{handle.http.port}/metrics"
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    m = re.search(r'^kvcache_open_connections\{wire="http"\} (\S+)$', text, re.M)
    return int(float(m.group(1))) if m else 0


def test_stop_lets_an_upload_in_flight_finish(tmp_path: Path) -> None:
    thread = _thread_config(tmp_path, shutdown_timeout_s="20")
    handle = thread.start()
    size = 512 * 1024
    idle = socket.create_connection((handle.http.host, handle.http.port))
    sock = socket.create_connection((handle.http.host, handle.http.port))
    try:
        sock.sendall(
            f"PUT /kv/inflight HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Length: {size}\r\n\r\n".encode()
        )
        sock.sendall(b"x" * (size // 2))
        # both connections accepted (and this poll's own): the upload is in flight
        eventually(lambda: _open_http_connections(handle) == 3, what="3 open connections")
        started = time.monotonic()
        stopper = threading.Thread(target=thread.stop)
        stopper.start()
        chunk = b"x" * 4096
        for _ in range(size // 2 // len(chunk)):
            sock.sendall(chunk)
            time.sleep(0.002)  # a delay on purpose: a slow uploader, still going at the stop
        sock.settimeout(10)
        response = sock.recv(65536)
        assert response.startswith(b"HTTP/1.1 201"), response
        stopper.join(20)
        assert not stopper.is_alive()
        # The idle keep-alive connection did not hold the stop up until the timeout.
        assert time.monotonic() - started < 10
        with pytest.raises(OSError):
            socket.create_connection((handle.http.host, handle.http.port), timeout=2).close()
    finally:
        sock.close()
        idle.close()


def test_server_thread_start_failure_raises(tmp_path: Path) -> None:
    thread = _thread_config(tmp_path, addr="0.0.0.0:0")
    with pytest.raises(ConfigurationError, match="refusing to listen"):
        thread.start()


def test_server_thread_idle_stop_is_quick(tmp_path: Path) -> None:
    # Nothing to drain: the stop must not wait out the shutdown timeout (30 s here).
    with _thread_config(tmp_path, resp_addr="off", shutdown_timeout_s="30") as handle:
        assert handle.resp is None
        assert handle.http_url.startswith("http://127.0.0.1:")
        status, _ = _get(handle.http, "/healthz", token=None)
        assert status == 200
        started = time.monotonic()
    assert time.monotonic() - started < 10


def test_format_stats() -> None:
    stats = StoreStats(
        get_hits=3,
        get_misses=1,
        logical_bytes=1000,
        dedup_savings_bytes=250,
        unique_blocks=2,
        tiers={"hot": TierStats(blocks=2, bytes=1 << 20, capacity_bytes=1 << 30)},
    )
    line = format_stats(stats)
    assert "hit_rate=0.750" in line
    assert "dedup_rate=0.250" in line
    assert "hot=1.0MiB/1GiB(0%,2blk)" in line
