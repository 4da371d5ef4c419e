"""Refusals a Redis user understands, and what comes before AUTH (issue 40, item 7 and
the small items), each held to a real redis-server 7 where Redis has an answer.

- Every Redis 7.0 command (redis-server's own `COMMAND LIST`) is served or refused on
  purpose, in one style: `-ERR unsupported command '<name>': <reason>`; a typo gets
  redis-server's exact bytes.
- Metrics keep one route for all refused commands (`unsupported`) and one for all typos
  (`unknown`), however many names arrive; the access log names the command, escaped and
  cut short.
- redis-py 8's handshake probe `CLIENT MAINT_NOTIFICATIONS` gets Redis 7.0's answer and is
  counted `ok`.
- Before AUTH: PING, HELLO, QUIT, AUTH and the rest answer as redis-server with
  `requirepass` does; a command refused with NOAUTH is an authentication failure
  (`kvcache_auth_failures_total`, a log line naming the peer with its port).
"""

from __future__ import annotations

import logging
import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from epistemic_kvcache.server.resp import COMMANDS
from epistemic_kvcache.server.resp.refusals import NAME_IN_LOG, UNSUPPORTED
from helpers import eventually
from servers import Listener, running_listener

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]

TOKEN = "refusals-token-0123456789"
PASSWORD = "refusals-password"


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A real redis-server 7 with `requirepass`, on a unix socket (no port to pick)."""
    where = tmp_path_factory.mktemp("redis")
    sock = where / "redis.sock"
    proc = subprocess.Popen(
        ["redis-server", "--port", "0", "--unixsocket", str(sock), "--requirepass", PASSWORD,
         "--save", "", "--appendonly", "no", "--dir", str(where)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip

    def answers() -> bool:
        try:
            with redis.Redis(unix_socket_path=str(sock), password=PASSWORD) as c:
                return bool(c.ping())
        except (redis.ConnectionError, FileNotFoundError):
            return False

    eventually(answers, timeout=30, what="redis-server answers")
    yield sock
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def ours() -> Iterator[Listener]:
    with running_listener("resp", tokens={TOKEN: "default"}) as lst:
        yield lst


def ask(sock: socket.socket, *args: str | bytes) -> bytes:
    """Send one command as a RESP array; its one-line reply (errors, +OK, nil, ...)."""
    parts = [a.encode() if isinstance(a, str) else a for a in args]
    sock.sendall(b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts))
    out = b""
    while not out.endswith(b"\r\n"):
        chunk = sock.recv(65536)
        assert chunk, f"closed after {out!r}"
        out += chunk
    return out


def theirs(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(str(path))
    return s


def mine(lst: Listener) -> socket.socket:
    return lst.raw()


def their_commands(path: Path) -> set[str]:
    with redis.Redis(unix_socket_path=str(path), password=PASSWORD) as c:
        names = {n.decode() if isinstance(n, bytes) else n for n in c.command_list()}
    return {n for n in names if "|" not in n}  # (subcommands are `container|sub`)


# -- every Redis command served or refused with a reason -------------------------------------


def test_every_redis_command_is_served_or_refused_with_a_reason(redis_server: Path) -> None:
    redis_names = their_commands(redis_server)
    served = {n.decode() for n in COMMANDS}
    refused = {n.decode() for n in UNSUPPORTED}
    assert not served & refused
    assert sorted(redis_names - served - refused) == []  # was: RENAME, TIME, WATCH, ...


def test_docs_list_every_refused_command_with_its_reason() -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "resp.md").read_text()
    start = doc.index("| commands | reason |")
    table = doc[start : doc.index("\n\n", start)]
    for name, why in UNSUPPORTED.items():
        word = re.compile(rf"(?<![\w-]){re.escape(name.decode().upper())}(?![\w-])")
        row = next((r for r in table.splitlines() if word.search(r)), None)
        assert row is not None, f"{name.decode().upper()} is not in docs/resp.md"
        if "stores strings only" not in why:
            assert why in row, row


def test_a_refused_command_says_so_and_why_in_one_style(ours: Listener) -> None:
    with redis.Redis(port=ours.port, password=TOKEN) as r:
        r.set("k", b"v")
        for name, why in UNSUPPORTED.items():
            typed = name.decode().title()  # the name as the client sent it comes back
            with pytest.raises(redis.ResponseError) as err:
                r.execute_command(typed, "k", "v")
            assert str(err.value) == f"unsupported command '{typed}': {why}"
        assert r.get("k") == b"v"
        with pytest.raises(redis.ResponseError, match=r"^unsupported command 'APPEND': blocks"):
            r.append("k", "x")
        with pytest.raises(redis.ResponseError, match=r"^unsupported command 'RENAME': keys"):
            r.rename("k", "k2")
        with pytest.raises(redis.ResponseError, match=r"^unsupported command 'SLOWLOG': no slow"):
            r.slowlog_get()


@pytest.mark.parametrize(
    "command",
    [("FOOBAR",), ("foobar", "a", "b"), ("GETT", "x" * 300), ("NOSUCH", *("ab" * 40,) * 3)],
)
def test_a_typo_is_answered_as_redis_server_does(
    command: tuple[str, ...], ours: Listener, redis_server: Path
) -> None:
    with theirs(redis_server) as t:
        assert ask(t, "AUTH", PASSWORD) == b"+OK\r\n"
        expected = ask(t, *command)
    s = mine(ours)
    assert ask(s, "AUTH", TOKEN) == b"+OK\r\n"
    assert ask(s, *command) == expected
    assert expected.startswith(b"-ERR unknown command '")


def test_time_answers_the_clock(ours: Listener) -> None:
    with redis.Redis(port=ours.port, password=TOKEN) as r:
        seconds, micros = r.time()
    assert seconds > 1_700_000_000
    assert 0 <= micros < 1_000_000


# -- metrics and the access log ---------------------------------------------------------------


def _resp_routes(lst: Listener) -> dict[tuple[str, str], float]:
    text = lst.ctx.metrics.render()[0].decode()
    out: dict[tuple[str, str], float] = {}
    for m in re.finditer(
        r'^kvcache_requests_total\{code="",route="([^"]+)",status="(\w+)",wire="resp"\} (\S+)$',
        text,
        re.M,
    ):
        out[(m.group(1), m.group(2))] = float(m.group(3))
    return out


def test_refused_commands_keep_one_bounded_label_each(caplog: pytest.LogCaptureFixture) -> None:
    with (
        running_listener("resp", tokens={TOKEN: "default"}, access_log=_access_log()) as lst,
        redis.Redis(port=lst.port, password=TOKEN) as r,
        caplog.at_level(logging.INFO, logger="epistemic_kvcache.access"),
    ):
        for i in range(200):  # 200 different typos, 3 refused commands
            with pytest.raises(redis.ResponseError):
                r.execute_command(f"TYPO{i}")
        for name in ("HSET", "RENAME", "SLOWLOG"):
            with pytest.raises(redis.ResponseError):
                r.execute_command(name, "x", "y")
        evil = "FOO\x1b[31m\u2028" + "z" * 200
        with pytest.raises(redis.ResponseError):
            r.execute_command(evil)
        routes = _resp_routes(lst)
        assert routes[("unknown", "error")] == 201
        assert routes[("unsupported", "error")] == 3
        assert not [k for k in routes if k[0].startswith("typo")]
        requests = [getattr(rec, "request", "") for rec in caplog.records]
        assert "unknown:TYPO7" in requests
        assert "unsupported:HSET" in requests
        assert "unsupported:SLOWLOG" in requests
        (logged,) = [q for q in requests if q.startswith("unknown:FOO")]
        # escaped (no control character reaches the log), the name's first 64 bytes
        assert logged == "unknown:FOO\\x1b[31m\\u2028" + "z" * (NAME_IN_LOG - 11)


def _access_log() -> object:
    from epistemic_kvcache.server.oplog import AccessLog

    return AccessLog(enabled=True)


def test_redis_py_8_handshake_is_answered_as_redis_7_and_counted_ok(
    ours: Listener, redis_server: Path
) -> None:
    with theirs(redis_server) as t:
        assert ask(t, "AUTH", PASSWORD) == b"+OK\r\n"
        expected = ask(t, "CLIENT", "MAINT_NOTIFICATIONS", "ON", "moving-endpoint-type", "none")
    s = mine(ours)
    assert ask(s, "AUTH", TOKEN) == b"+OK\r\n"
    got = ask(s, "CLIENT", "MAINT_NOTIFICATIONS", "ON", "moving-endpoint-type", "none")
    assert got == expected
    before = _resp_routes(ours)
    for _ in range(3):  # redis-py 8, RESP3, maintenance notifications "auto" (its default)
        with redis.Redis(port=ours.port, password=TOKEN, protocol=3) as r:
            assert r.ping()
    after = _resp_routes(ours)
    assert after.get(("client", "error"), 0) == before.get(("client", "error"), 0)
    assert after[("client", "ok")] >= before.get(("client", "ok"), 0) + 3


# -- before AUTH, as redis-server with requirepass ---------------------------------------------

BEFORE_AUTH = [
    ("PING",),
    ("PING", "hello"),
    ("ECHO", "x"),
    ("HELLO",),
    ("HELLO", "3"),
    ("HELLO", "2"),
    ("HELLO", "4"),
    ("HELLO", "x"),
    ("HELLO", "3", "SETNAME", "n"),
    ("AUTH",),
    ("AUTH", "a", "b", "c"),
    ("AUTH", "wrong-password"),
    ("AUTH", "default", "wrong-password"),
    ("GET", "k"),
    ("GET", "k", "extra"),
    ("SET",),
    ("SET", "k", "v"),
    ("HSET", "h", "f", "v"),
    ("FOOBAR", "x"),
    ("WATCH", "k"),
    ("MULTI",),
    ("CLIENT", "SETNAME", "x"),
    ("SELECT", "0"),
    ("QUIT",),
]


@pytest.mark.parametrize("command", BEFORE_AUTH, ids=" ".join)
def test_before_auth_as_redis_server_with_requirepass(
    command: tuple[str, ...], ours: Listener, redis_server: Path
) -> None:
    with theirs(redis_server) as t:
        expected = ask(t, *command)
    with mine(ours) as s:
        assert ask(s, *command) == expected


def test_reset_before_auth_as_redis_server(ours: Listener, redis_server: Path) -> None:
    with theirs(redis_server) as t:
        expected = ask(t, "RESET")
    with mine(ours) as s:
        assert ask(s, "RESET") == expected == b"+RESET\r\n"


def test_a_ping_probe_without_credentials_fails(ours: Listener) -> None:
    # the "credentials OK?" probe: `redis-cli ping` with no password used to answer PONG
    out = subprocess.run(
        ["redis-cli", "-p", str(ours.port), "PING"], capture_output=True, text=True, timeout=30
    )
    assert out.stdout.strip() == "NOAUTH Authentication required."
    good = subprocess.run(
        ["redis-cli", "-p", str(ours.port), "--no-auth-warning", "-a", TOKEN, "PING"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert good.stdout.strip() == "PONG"


def test_a_command_refused_with_noauth_is_an_auth_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with (
        running_listener("resp", tokens={TOKEN: "default"}) as lst,
        caplog.at_level(logging.WARNING, logger="epistemic_kvcache.auth"),
    ):
        s = lst.raw()
        port = s.getsockname()[1]
        assert ask(s, "GET", "k") == b"-NOAUTH Authentication required.\r\n"
        assert ask(s, "HELLO", "3").startswith(b"-NOAUTH HELLO must be called")
        assert ask(s, "AUTH", "wrong-password").startswith(b"-WRONGPASS")
        assert ask(s, "FOOBAR").startswith(b"-ERR unknown command")  # not an auth failure
        text = lst.ctx.metrics.render()[0].decode()
        assert 'kvcache_auth_failures_total{wire="resp"} 3.0' in text
        assert 'kvcache_auth_failures_total{wire="http"} 0.0' in text
        lines = [r.getMessage() for r in caplog.records]
        assert lines == [
            f"authentication failed wire=resp peer=127.0.0.1:{port} reason=GET before AUTH",
            f"authentication failed wire=resp peer=127.0.0.1:{port} reason=HELLO before AUTH",
            f"authentication failed wire=resp peer=127.0.0.1:{port} reason=invalid credentials",
        ]
