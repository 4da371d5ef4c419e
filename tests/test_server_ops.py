"""What an operator sees and does: the start-up line, JSON logs, failed logins and the
access log in the log, SIGHUP reloading tokens, JWT keys and TLS certificates without
dropping connections, file modes, and a failed start-up that leaves nothing behind.

The real `python -m epistemic_kvcache serve` runs as a subprocess (signals reach it);
the helpers are test_server_app.py's.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import signal
import socket
import ssl
import stat
import time
from pathlib import Path

import jwt
import pytest
import redis
import trustme
from cryptography.hazmat.primitives.asymmetric import ec
from jwt.algorithms import ECAlgorithm

from epistemic_kvcache.server.oplog import (
    AccessLog,
    AuthFailureLog,
    JsonFormatter,
    TextFormatter,
    escape_text,
)
from epistemic_kvcache.server.process import ServerProcess
from test_server_app import (  # the subprocess harness of the runner's own tests
    NO_RETRY,
    TOKEN,
    _get,
    fail_to_start,
    servers,
    start,
)

__all__ = ["servers"]  # the fixture, imported for this module's tests


def _replace(path: Path, text: str) -> None:
    """Rewrite a file the way an operator's tooling should: write aside, rename."""
    tmp = path.with_suffix(".new")
    tmp.write_text(text)
    tmp.chmod(0o600)
    tmp.replace(path)


def _hup(server: ServerProcess, marker: str) -> None:
    since = server.lines_seen
    server.signal(signal.SIGHUP)
    server.wait_for(re.escape(marker), 10, since=since)


# -- start-up and logs ---------------------------------------------------------------------


def test_startup_line_and_json_log_format(tmp_path: Path, servers: list[ServerProcess]) -> None:
    server = start(servers, tmp_path, "--token", TOKEN, "--log-format", "json")
    assert server.http is not None
    assert server.resp is not None
    # start() returns once the started line is logged
    server.wait_for(r'"event":\s*"started"')
    docs = [json.loads(line) for line in server.output if line.strip()]
    assert all({"ts", "level", "logger", "msg"} <= set(d) for d in docs)
    started = [d for d in docs if d.get("event") == "started"]
    assert len(started) == 1
    assert started[0]["http"] == str(server.http)
    assert started[0]["resp"] == str(server.resp)
    assert started[0]["version"]
    assert started[0]["msg"].startswith(f"started epistemic-kvcache {started[0]['version']} ")
    assert server.stop() == 0


def test_failed_logins_are_logged_with_peer_and_reason(
    tmp_path: Path, servers: list[ServerProcess]
) -> None:
    secret = tmp_path / "jwt.secret"
    secret.write_text("s" * 40)
    server = start(servers, tmp_path, "--token", TOKEN, "--jwt-secret-file", str(secret))
    assert server.http is not None
    assert server.resp is not None
    expired = jwt.encode({"tenant": "t", "exp": int(time.time()) - 60}, "s" * 40, algorithm="HS256")
    status, body = _get(server.http, "/kv/stats", token=expired)
    assert status == 401
    assert json.loads(body)["message"] == "invalid credentials"  # generic for the client
    assert _get(server.http, "/kv/stats", token=None)[0] == 401
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(
            host=server.resp.host, port=server.resp.port, password="wrong-0123", retry=NO_RETRY
        ).ping()
    # the peer with its port: one connection among many from the same host
    server.wait_for(
        r"authentication failed wire=http peer=127\.0\.0\.1:\d+ reason=invalid token: expired"
    )
    server.wait_for(r"authentication failed wire=http peer=127\.0\.0\.1:\d+ reason=no credentials")
    server.wait_for(
        r"authentication failed wire=resp peer=127\.0\.0\.1:\d+ reason=invalid credentials"
    )
    assert expired not in server.text
    assert "wrong-0123" not in server.text
    assert server.stop() == 0


def test_failed_login_log_is_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    from helpers import FakeClock  # here: keeps clear of the module's import block

    clock = FakeClock()
    log = AuthFailureLog(burst=3, window_s=0.2, clock=clock)
    with caplog.at_level(logging.WARNING, logger="epistemic_kvcache.auth"):
        for _ in range(50):
            log.failed("resp", "10.0.0.1", "invalid credentials")
            clock.advance(0.001)
        clock.advance(0.2)  # past the window: the summary line, then a logged one
        log.failed("resp", "10.0.0.1", "invalid credentials")
    messages = [r.getMessage() for r in caplog.records]
    assert messages[:3] == ["authentication failed wire=resp peer=10.0.0.1 "
                            "reason=invalid credentials"] * 3  # fmt: skip
    assert "47 more failed authentications not logged in the last" in messages[3]
    assert len(messages) == 5
    assert log.total == 51


def test_json_formatter_keeps_extra_fields() -> None:
    record = logging.makeLogRecord(
        {"name": "x", "levelno": 30, "levelname": "WARNING", "msg": "m %s", "args": ("a",)}
    )
    record.peer = "10.0.0.1"
    doc = json.loads(JsonFormatter().format(record))
    assert (doc["level"], doc["logger"], doc["msg"], doc["peer"]) == (
        "warning",
        "x",
        "m a",
        "10.0.0.1",
    )


def _resp(*args: bytes) -> bytes:
    """A command as a RESP array, the way client libraries send it."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


def _exchange(sock: socket.socket, request: bytes, answer_bytes: int) -> bytes:
    sock.sendall(request)
    got = b""
    while len(got) < answer_bytes:
        chunk = sock.recv(1 << 20)
        assert chunk, got
        got += chunk
    return got


def test_access_log(tmp_path: Path, servers: list[ServerProcess]) -> None:
    """One line per request or command with the bytes it took: HTTP bodies in and out;
    RESP the command and its reply as sent (issue 23: RESP logged in=0 out=0)."""
    server = start(servers, tmp_path, "--token", TOKEN, "--access-log")
    assert server.http is not None
    assert server.resp is not None
    assert _get(server.http, "/kv/a1", method="PUT", body=b"12345")[0] == 201
    assert _get(server.http, "/kv/a1", method="HEAD")[0] == 200
    r = redis.Redis(host=server.resp.host, port=server.resp.port, password=TOKEN)
    try:
        assert r.get("a1") == b"12345"
    finally:
        r.close()
    big = bytes(range(256)) * 400  # 100 KiB: the reply goes out as separate buffers
    exchanges = [
        (_resp(b"AUTH", TOKEN.encode()), b"+OK\r\n", "auth"),
        (_resp(b"SET", b"r1", b"12345"), b"+OK\r\n", "set"),
        (_resp(b"GET", b"r1"), b"$5\r\n12345\r\n", "get"),
        (_resp(b"GET", b"r0"), b"$-1\r\n", "get"),
        (_resp(b"SET", b"r2", big), b"+OK\r\n", "set"),
        (_resp(b"GET", b"r2"), b"$%d\r\n%s\r\n" % (len(big), big), "get"),
        (_resp(b"EXISTS", b"r1", b"r2", b"r0"), b":2\r\n", "exists"),
    ]
    with socket.create_connection((server.resp.host, server.resp.port), timeout=10) as sock:
        for request, answer, _ in exchanges:
            assert _exchange(sock, request, len(answer)) == answer
    server.wait_for(
        r"epistemic_kvcache\.access: http 127\.0\.0\.1 default 'PUT /kv/a1' 201 in=5 out="
    )
    server.wait_for(
        r"epistemic_kvcache\.access: http 127\.0\.0\.1 default 'HEAD /kv/a1' 200 in=0 out=0 "
    )
    server.wait_for(r"epistemic_kvcache\.access: resp 127\.0\.0\.1 default 'get' ok in=21 out=11 ")
    for request, answer, route in exchanges:
        server.wait_for(
            rf"epistemic_kvcache\.access: resp 127\.0\.0\.1 \S+ '{route}' ok "
            rf"in={len(request)} out={len(answer)} "
        )
    assert server.stop() == 0


FORGED = "2026-01-01 00:00:00,000 INFO epistemic_kvcache.access: http 10.9.9.9 root 'DELETE /'"


def test_a_tenant_claim_with_line_breaks_forges_no_log_line(
    tmp_path: Path, servers: list[ServerProcess]
) -> None:
    """Issue 23: a JWT whose tenant claim held CR/LF wrote forged records into the text
    access log. Now the token is refused at verification, the reason says why, and no
    line of the log is the forged one."""
    secret = tmp_path / "jwt.secret"
    secret.write_text("s" * 40)
    server = start(
        servers, tmp_path, "--token", TOKEN, "--jwt-secret-file", str(secret), "--access-log"
    )
    assert server.http is not None
    claims = {"tenant": "t\r\n" + FORGED, "exp": int(time.time()) + 600}
    token = jwt.encode(claims, "s" * 40, algorithm="HS256")
    assert _get(server.http, "/kv/stats", token=token)[0] == 401
    server.wait_for(
        r"authentication failed wire=http peer=127\.0\.0\.1:\d+ reason=invalid token: claim "
        r"'tenant' is not a valid tenant name: control character U\+000D at index 1"
    )
    server.wait_for(r"epistemic_kvcache\.access: http 127\.0\.0\.1 - 'GET /kv/stats' 401")
    assert not [line for line in server.output if line.startswith(FORGED[:24])], server.text
    assert server.stop() == 0


def _record(msg: str, *args: object, exc: BaseException | None = None) -> logging.LogRecord:
    return logging.makeLogRecord(
        {
            "name": "epistemic_kvcache.test",
            "levelno": 30,
            "levelname": "WARNING",
            "msg": msg,
            "args": args,
            "exc_info": (type(exc), exc, exc.__traceback__) if exc is not None else None,
        }
    )


def test_text_log_lines_escape_control_characters() -> None:
    """Whatever a value holds, a text record is one line, and a traceback's lines are
    indented: a line at column 0 is always the start of a real record."""
    fmt = TextFormatter("%(levelname)s %(name)s: %(message)s")
    evil = "a\r\n" + FORGED + "\x1b[2J\x85\u2028\tz"
    line = fmt.format(_record("tenant=%s key=%r", evil, "k\n"))
    assert line == (
        "WARNING epistemic_kvcache.test: tenant=a\\r\\n" + FORGED + "\\x1b[2J\\x85\\u2028\\tz"
        " key='k\\n'"
    )
    assert fmt.format(_record("pre-formatted " + evil)).count("\n") == 0
    assert escape_text(escape_text(evil)) == escape_text(evil)  # idempotent
    assert escape_text("plain, printable: \u00e9\\n") == "plain, printable: \u00e9\\n"
    try:
        raise ValueError("bad\n" + FORGED)
    except ValueError as exc:
        text = fmt.format(_record("failed: %s", "x", exc=exc))
    first, *rest = text.split("\n")
    assert first == "WARNING epistemic_kvcache.test: failed: x"
    assert rest
    assert all(line.startswith("    ") for line in rest), text
    assert all("\r" not in line for line in rest)


def test_access_and_refusal_logs_escape_their_fields_with_any_formatter(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An embedder's own formatter (caplog's plain one here) gets escaped fields too."""
    evil = "t\r\n" + FORGED
    with caplog.at_level(logging.INFO):
        AccessLog(enabled=True).record("resp", evil, evil, "get", "ok", 3, 4, 0.001)
        AuthFailureLog().failed("http", "10.0.0.1\n", "bad " + evil)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert all("\n" not in m and "\r" not in m for m in messages), messages
    assert (
        messages[0] == f"resp {escape_text(evil)} {escape_text(evil)} 'get' ok in=3 out=4 1.000ms"
    )


# -- SIGHUP ----------------------------------------------------------------------------------


def test_sighup_reloads_the_token_file_and_ends_revoked_sessions(
    tmp_path: Path, servers: list[ServerProcess]
) -> None:
    old, new = "old-token-0123456789abcd", "new-token-0123456789abcd"
    tokens = tmp_path / "tokens"
    _replace(tokens, f"{old} team\n")
    server = start(servers, tmp_path, "--token-file", str(tokens))
    assert server.http is not None
    assert server.resp is not None
    keep = http.client.HTTPConnection(server.http.host, server.http.port, timeout=10)
    keep.request("GET", "/kv/stats", headers={"Authorization": f"Bearer {old}"})
    assert keep.getresponse().read()
    assert True
    sock_before = keep.sock
    session = redis.Redis(
        host=server.resp.host, port=server.resp.port, password=old, retry=NO_RETRY
    )
    assert session.set("r1", b"v") is True

    _replace(tokens, f"{new} team\n")
    _hup(server, "reload: credentials reloaded")
    # the same keep-alive connection goes on, with the new token only
    keep.request("GET", "/kv/r1", headers={"Authorization": f"Bearer {new}"})
    response = keep.getresponse()
    assert (response.status, response.read()) == (200, b"v")
    assert keep.sock is sock_before
    keep.request("GET", "/kv/r1", headers={"Authorization": f"Bearer {old}"})
    response = keep.getresponse()
    assert response.status == 401
    response.read()
    keep.close()
    # the RESP session authenticated with the revoked token was closed
    with pytest.raises(redis.ConnectionError):
        session.get("r1")
    session.close()
    server.wait_for(r"closed: its credential was revoked")
    fresh = redis.Redis(host=server.resp.host, port=server.resp.port, password=new)
    try:
        assert fresh.get("r1") == b"v"
    finally:
        fresh.close()

    # A broken file is not loaded: the credentials in force stay.
    _replace(tokens, "# nothing here\n")
    _hup(server, "credentials NOT reloaded")
    assert _get(server.http, "/kv/r1", token=new) == (200, b"v")
    assert server.stop() == 0


def test_sighup_refuses_a_garbage_token_file(tmp_path: Path, servers: list[ServerProcess]) -> None:
    """A token file replaced by garbage is not loaded: before, `"\\x00\\xff garbage"`
    loaded as one token for tenant 'garbage' and every real credential was revoked."""
    token = "kept-token-0123456789abcd"
    tokens = tmp_path / "tokens"
    _replace(tokens, f"{token} team\n")
    server = start(servers, tmp_path, "--token-file", str(tokens))
    assert server.http is not None
    assert server.resp is not None
    assert _get(server.http, "/kv/g1", method="PUT", body=b"v", token=token)[0] == 201
    session = redis.Redis(
        host=server.resp.host, port=server.resp.port, password=token, retry=NO_RETRY
    )
    try:
        assert session.get("g1") == b"v"
        for garbage, reason in (
            ("\x00\xff garbage \n", "line 1: control character U+0000"),
            (b"\x00\xff garbage \n", "is not UTF-8 text"),
            (f"{token} team\n\x00\n", "line 2: control character U+0000"),
            ("# emptied by a broken deploy\n", "holds no token"),
        ):
            tmp = tokens.with_suffix(".new")
            tmp.write_bytes(garbage if isinstance(garbage, bytes) else garbage.encode())
            tmp.chmod(0o600)
            tmp.replace(tokens)
            _hup(server, "credentials NOT reloaded")
            line = [ln for ln in server.output if "credentials NOT reloaded" in ln][-1]
            assert "ERROR" in line
            assert reason in line, line
            # the credential in force still works on both wires, the session stays open
            assert _get(server.http, "/kv/g1", token=token) == (200, b"v")
            assert session.get("g1") == b"v"
            assert _get(server.http, "/kv/g1", token="garbage")[0] == 401
    finally:
        session.close()
    assert "revoked" not in server.text
    assert server.stop() == 0


def test_sighup_reloads_jwks(tmp_path: Path, servers: list[ServerProcess]) -> None:
    keys = [ec.generate_private_key(ec.SECP256R1()) for _ in range(2)]

    def jwks(key: ec.EllipticCurvePrivateKey, kid: str) -> str:
        jwk = json.loads(ECAlgorithm.to_jwk(key.public_key()))
        jwk.update(kid=kid, use="sig", alg="ES256")
        return json.dumps({"keys": [jwk]})

    def token(key: ec.EllipticCurvePrivateKey, kid: str) -> str:
        claims = {"tenant": "team", "exp": int(time.time()) + 600}
        return jwt.encode(claims, key, algorithm="ES256", headers={"kid": kid})

    path = tmp_path / "jwks.json"
    _replace(path, jwks(keys[0], "k1"))
    server = start(servers, tmp_path, "--jwt-jwks", str(path))
    assert server.http is not None
    assert _get(server.http, "/kv/stats", token=token(keys[0], "k1"))[0] == 200
    _replace(path, jwks(keys[1], "k2"))
    _hup(server, "reload: credentials reloaded")
    assert _get(server.http, "/kv/stats", token=token(keys[1], "k2"))[0] == 200
    assert _get(server.http, "/kv/stats", token=token(keys[0], "k1"))[0] == 401
    assert server.stop() == 0


def test_sighup_reloads_the_tls_certificate(tmp_path: Path, servers: list[ServerProcess]) -> None:
    ca = trustme.CA()
    cert, key, ca_file = tmp_path / "server.pem", tmp_path / "server.key", tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))

    def issue() -> int:
        issued = ca.issue_cert("127.0.0.1")
        new_cert, new_key = tmp_path / "cert.new", tmp_path / "key.new"
        issued.cert_chain_pems[0].write_to_path(str(new_cert))
        issued.private_key_pem.write_to_path(str(new_key))
        new_key.chmod(0o600)
        new_cert.replace(cert)
        new_key.replace(key)
        from cryptography import x509

        return x509.load_pem_x509_certificate(cert.read_bytes()).serial_number

    first = issue()
    server = start(
        servers, tmp_path, "--token", TOKEN, "--tls-cert", str(cert), "--tls-key", str(key)
    )
    assert server.http is not None
    client_ctx = ssl.create_default_context(cafile=str(ca_file))

    def served_serial() -> int:
        with (
            socket.create_connection((server.http.host, server.http.port), timeout=10) as raw,
            client_ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
        ):
            der = tls.getpeercert(binary_form=True)
        from cryptography import x509

        assert der is not None
        return x509.load_der_x509_certificate(der).serial_number

    assert served_serial() == first
    keep = http.client.HTTPSConnection(
        server.http.host, server.http.port, timeout=10, context=client_ctx
    )
    keep.request("GET", "/kv/stats", headers={"Authorization": f"Bearer {TOKEN}"})
    assert keep.getresponse().read()
    second = issue()
    assert second != first
    _hup(server, "reload: TLS certificate reloaded")
    assert served_serial() == second  # new handshakes get the new certificate
    keep.request("GET", "/kv/stats", headers={"Authorization": f"Bearer {TOKEN}"})
    assert keep.getresponse().status == 200  # the established connection goes on
    keep.close()
    # a bad certificate file is not loaded; the current one stays in use
    cert.write_text("not a certificate\n")
    _hup(server, "TLS NOT reloaded")
    assert served_serial() == second
    assert server.stop() == 0


# -- files -----------------------------------------------------------------------------------


def test_persist_dir_and_token_modes(tmp_path: Path, servers: list[ServerProcess]) -> None:
    old_umask = os.umask(0o022)  # a typical umask: the server must not rely on it
    try:
        server = start(servers, tmp_path)
    finally:
        os.umask(old_umask)
    data = tmp_path / "data"
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    assert stat.S_IMODE((data / "token").stat().st_mode) == 0o600
    assert server.stop() == 0
    data.chmod(0o755)
    again = start(servers, tmp_path)
    again.wait_for(r"persist dir .* is accessible to group/others \(mode 755\): chmod 700 it")
    assert again.stop() == 0


def test_failed_start_writes_no_file(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # no credentials: a first-run token would be generated, had the start succeeded
        rc, out = fail_to_start(
            tmp_path,
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
    assert "address already in use" in out
    assert not (tmp_path / "data").exists()
    rc, out = fail_to_start(
        tmp_path, "--tls-cert", str(tmp_path / "nope.pem"), "--tls-key", str(tmp_path / "k")
    )
    assert rc == 2, out
    assert not (tmp_path / "data").exists()
