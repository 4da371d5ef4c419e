"""Commands a Redis cache user reaches for (issue 28 item 1), driven with redis-py and
redis-cli against our RESP listener and, where the answer should look the same, against
a real redis-server side by side: TTL/PTTL, KEYS, SETNX, GETSET, GETDEL, CLIENT
LIST/INFO/KILL, OBJECT (redis-cli --hotkeys), COMMAND COUNT/DOCS, INFO cpu/replication/
commandstats, `<command> HELP`, SCAN TYPE, the refused commands, all inside MULTI too."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from epistemic_kvcache.server.app import ServerHandle
from epistemic_kvcache.server.resp.commands_keys import KEYS_MAX
from servers import running_server

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli missing"),
]

TOKEN_A = "home-token-a-0123456789"
TOKEN_B = "home-token-b-0123456789"


@pytest.fixture(scope="module", params=["memory", "durable"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerHandle]:
    with running_server(
        tmp_path_factory.mktemp("home"),
        backend=request.param,
        tokens={TOKEN_A: "tenant-a", TOKEN_B: "tenant-b"},
        hot_capacity_bytes="64MiB",
        warm_capacity_bytes="0",
    ) as srv:
        yield srv.handle


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[redis.Redis]:
    """A real redis-server on a unix socket (no TCP port), for reply shapes."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server missing")
    tmp = tmp_path_factory.mktemp("real-redis")
    sock = tmp / "redis.sock"
    proc = subprocess.Popen(
        ["redis-server", "--port", "0", "--unixsocket", str(sock), "--save", "",
         "--appendonly", "no", "--dir", str(tmp)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    client = redis.Redis(unix_socket_path=str(sock), socket_timeout=10)
    deadline = time.monotonic() + 30
    while True:
        try:
            client.ping()
            break
        except (redis.ConnectionError, FileNotFoundError):
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise
            time.sleep(0.05)
    yield client
    client.close()
    proc.kill()
    proc.wait(10)


def port(server: ServerHandle) -> int:
    assert server.resp is not None
    return server.resp.port


@pytest.fixture
def r(server: ServerHandle) -> Iterator[redis.Redis]:
    with redis.Redis(port=port(server), password=TOKEN_A, socket_timeout=30) as client:
        client.flushdb()
        yield client


@pytest.fixture
def rr(real: redis.Redis) -> redis.Redis:
    real.flushall()
    return real


def cli(server: ServerHandle, *args: str, token: str = TOKEN_A) -> str:
    out = subprocess.run(
        ["redis-cli", "-p", str(port(server)), "--no-auth-warning", "-a", token, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def raw(c: redis.Redis, *args: Any) -> Any:
    """A command's reply without redis-py's parsing (it parses COMMAND's replies as the
    command table whatever the subcommand)."""
    conn = c.connection_pool.get_connection()
    try:
        conn.send_command(*args)
        return conn.read_response()
    finally:
        c.connection_pool.release(conn)


def both(ours: redis.Redis, theirs: redis.Redis, *args: Any) -> Any:
    """Run one command on both servers; the replies must be equal (returned)."""
    mine = ours.execute_command(*args)
    real = theirs.execute_command(*args)
    assert mine == real, (args, mine, real)
    return mine


# -- keys -----------------------------------------------------------------------------------


def test_ttl_family_like_redis(r: redis.Redis, rr: redis.Redis) -> None:
    for c in (r, rr):
        c.set("k", b"v")
    assert both(r, rr, "TTL", "k") == -1
    assert both(r, rr, "PTTL", "k") == -1
    assert both(r, rr, "TTL", "missing") == -2
    assert both(r, rr, "PTTL", "missing") == -2
    assert both(r, rr, "EXPIRETIME", "k") == -1
    assert both(r, rr, "PEXPIRETIME", "missing") == -2
    assert both(r, rr, "PERSIST", "k") == 0
    assert r.ttl("k") == -1
    assert r.pttl("missing") == -2
    assert cli_ttl(r) == "-1\n"


def cli_ttl(r: redis.Redis) -> str:
    kw = r.connection_pool.connection_kwargs
    return subprocess.run(
        ["redis-cli", "-p", str(kw["port"]), "--no-auth-warning", "-a", kw["password"],
         "TTL", "k"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip


def test_setnx_getset_getdel_like_redis(r: redis.Redis, rr: redis.Redis) -> None:
    assert both(r, rr, "SETNX", "n", "first") == 1
    assert both(r, rr, "SETNX", "n", "second") == 0
    assert both(r, rr, "GET", "n") == b"first"
    assert both(r, rr, "GETSET", "n", "third") == b"first"
    assert both(r, rr, "GETSET", "fresh", "x") is None
    assert both(r, rr, "GETDEL", "n") == b"third"
    assert both(r, rr, "GETDEL", "n") is None
    assert both(r, rr, "EXISTS", "n") == 0
    assert both(r, rr, "GETEX", "fresh") == b"x"
    assert both(r, rr, "GETEX", "fresh", "PERSIST") == b"x"
    # redis-py's helpers
    assert r.setnx("p", b"1") is True
    assert r.setnx("p", b"2") is False
    assert r.getset("p", b"3") == b"1"
    assert r.getdel("p") == b"3"
    assert r.get("p") is None


def test_getset_is_atomic_under_contention(server: ServerHandle) -> None:
    """Every value GETSET writes is handed back exactly once (by the next GETSET) or is
    the final value: no two GETSETs read the same old value."""
    threads, rounds = 8, 60
    with redis.Redis(port=port(server), password=TOKEN_A) as c:
        c.set("counter", b"init")
    seen: list[bytes] = []
    lock = threading.Lock()

    def worker(n: int) -> None:
        with redis.Redis(port=port(server), password=TOKEN_A, socket_timeout=30) as c:
            got = [c.getset("counter", f"{n}-{i}".encode()) for i in range(rounds)]
        with lock:
            seen.extend(g for g in got if g is not None)

    pool = [threading.Thread(target=worker, args=(n,)) for n in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(120)
    with redis.Redis(port=port(server), password=TOKEN_A) as c:
        final = c.get("counter")
    assert final is not None
    written = {f"{n}-{i}".encode() for n in range(threads) for i in range(rounds)}
    assert sorted([*seen, final]) == sorted([b"init", *written])


def test_getdel_is_atomic_under_contention(server: ServerHandle) -> None:
    """SETNX publishes a value; concurrent GETDELs: each value is taken exactly once."""
    threads, rounds = 6, 60
    taken: list[bytes] = []
    lock = threading.Lock()
    with redis.Redis(port=port(server), password=TOKEN_A) as c:
        c.delete("slot")

    def worker(n: int) -> None:
        mine: list[bytes] = []
        with redis.Redis(port=port(server), password=TOKEN_A, socket_timeout=30) as c:
            for i in range(rounds):
                c.setnx("slot", f"{n}-{i}".encode())
                got = c.getdel("slot")
                if got is not None:
                    mine.append(got)
        with lock:
            taken.extend(mine)

    pool = [threading.Thread(target=worker, args=(n,)) for n in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(120)
    assert len(taken) == len(set(taken)), "a value was taken twice"


def test_keys_bounded(r: redis.Redis, rr: redis.Redis, server: ServerHandle) -> None:
    for c in (r, rr):
        c.mset({"user:1": b"a", "user:2": b"b", "sess:1": b"c"})
    assert sorted(r.keys("user:*")) == sorted(rr.keys("user:*")) == [b"user:1", b"user:2"]
    assert sorted(r.keys("*")) == [b"sess:1", b"user:1", b"user:2"]
    assert cli(server, "KEYS", "sess:*") == "sess:1\n"
    assert both(r, rr, "KEYS", "nothing*") == []
    for start in range(0, KEYS_MAX + 1, 2000):
        r.mset({f"bulk:{i}": b"x" for i in range(start, min(start + 2000, KEYS_MAX + 1))})
    with pytest.raises(redis.ResponseError, match=f"more than {KEYS_MAX} keys.*use SCAN"):
        r.keys("user:*")
    assert len(list(r.scan_iter("user:*", count=1000))) == 2  # what the error points to


def test_scan_type_that_matches_nothing_ends_at_once(r: redis.Redis, rr: redis.Redis) -> None:
    r.mset({f"k{i}": b"v" for i in range(50)})
    assert r.scan(0, count=10, _type="hash") == (0, [])
    assert r.scan(0, count=10, _type="string")[0] != 0
    rr.mset({"only": b"v"})
    assert both(r, rr, "SCAN", "0", "TYPE", "hash") == (0, [])


def test_refused_commands_say_why(r: redis.Redis, server: ServerHandle) -> None:
    r.set("k", b"v")
    for args, why in [
        (("EXPIRE", "k", "10"), "unsupported command 'EXPIRE': entries never expire"),
        (("PEXPIREAT", "k", "10"), "unsupported command 'PEXPIREAT': entries never expire"),
        (("SETEX", "k", "10", "v"), "unsupported command 'SETEX': entries never expire"),
        (("GETEX", "k", "EX", "10"), "GETEX with EX/PX/EXAT/PXAT is not supported: entries"),
        (("HSET", "h", "f", "v"), "'HSET': this server stores strings only.*no hashes"),
        (("LPUSH", "l", "x"), "stores strings only.*no lists"),
        (("ZADD", "z", "1", "m"), "no sorted sets"),
        (("XADD", "s", "*", "f", "v"), "no streams"),
        (("INCR", "k"), "'INCR': blocks are immutable values"),
        (("APPEND", "k", "x"), "'APPEND': blocks are immutable values.*use SET"),
    ]:
        with pytest.raises(redis.ResponseError, match=why):
            r.execute_command(*args)
    assert r.get("k") == b"v"  # nothing lost
    assert "entries never expire" in cli(server, "EXPIRE", "k", "5")
    with pytest.raises(redis.ResponseError, match="unknown command 'NOSUCH'"):
        r.execute_command("NOSUCH")


# -- introspection --------------------------------------------------------------------------


def test_client_list_info_kill_own_tenant_only(server: ServerHandle) -> None:
    p = port(server)
    one = {"single_connection_client": True}
    with (
        redis.Redis(port=p, password=TOKEN_A, client_name="a1", **one) as a1,
        redis.Redis(port=p, password=TOKEN_A, client_name="a2", **one) as a2,
        redis.Redis(port=p, password=TOKEN_B, client_name="b1", **one) as b1,
    ):
        a2.ping()
        b1.ping()
        listed = a1.client_list()
        names = sorted(c["name"] for c in listed)
        assert names == ["a1", "a2"]  # tenant B's connection is not shown
        me = a1.client_info()
        assert me["name"] == "a1"
        assert int(me["id"]) == a1.client_id()
        assert str(me["db"]) == "0"
        assert me["cmd"] in ("client", "client|info")
        a2_id = a2.client_id()
        assert {int(c["id"]) for c in listed} == {a1.client_id(), a2_id}
        b1_id = b1.client_id()
        assert a1.client_kill_filter(_id=b1_id) == 0  # another tenant's: not found
        assert b1.ping() is True
        assert a1.client_kill_filter(_id=a2_id) == 1
        deadline = time.monotonic() + 10
        while len(a1.client_list()) != 1:
            assert time.monotonic() < deadline, a1.client_list()
            time.sleep(0.01)
        assert a2.client_id() != a2_id  # redis-py reconnected: a new connection
        b_addr = b1.client_info()["addr"]
        with pytest.raises(redis.ResponseError, match="No such client"):
            a1.client_kill(b_addr)
        assert b1.ping() is True
        own_id = a1.client_id()
        assert a1.client_kill(a1.client_info()["addr"]) is True  # answered, then closed
        assert a1.client_id() != own_id  # redis-py reconnected
    text = cli(server, "CLIENT", "LIST")
    assert text.startswith("id=")
    assert "cmd=client" in text
    assert "tenant-b" not in text


def test_object_and_hotkeys(r: redis.Redis, rr: redis.Redis, server: ServerHandle) -> None:
    r.set("hot", b"h" * 100)
    r.set("cold", b"c" * 100)
    for _ in range(20):
        r.get("hot")
    assert r.object("freq", "hot") >= 20
    assert r.object("freq", "cold") == 0
    assert r.object("encoding", "hot") == b"raw"
    assert r.object("idletime", "hot") == 0
    assert r.object("refcount", "hot") == 1
    for sub in ("FREQ", "ENCODING", "IDLETIME"):
        assert r.execute_command("OBJECT", sub, "missing") is None
    rr.set("x", b"y")
    assert rr.execute_command("OBJECT", "ENCODING", "missing") is None
    out = cli(server, "--hotkeys")
    assert "hot key found with counter" in out
    assert 'keyname: "hot"' in out
    assert 'keyname: "cold"' not in out  # never read: counter 0, not a hot key


def test_help_subcommands_answer(r: redis.Redis, rr: redis.Redis, server: ServerHandle) -> None:
    for name in ("CLIENT", "OBJECT", "COMMAND", "CONFIG", "MEMORY"):
        lines = raw(r, name, "HELP")
        real_lines = raw(rr, name, "HELP")
        assert lines[0] == real_lines[0], name  # "<NAME> <subcommand> ... Subcommands are:"
        assert lines[-2:] == [b"HELP", b"    Print this help."]
        with pytest.raises(
            redis.ResponseError, match=f"unknown subcommand 'NOPE'. Try {name} HELP"
        ):
            r.execute_command(name, "NOPE")
    assert "GET <pattern>" in cli(server, "CONFIG", "HELP")
    assert "FREQ <key>" in cli(server, "OBJECT", "HELP")


def test_command_count_and_docs_agree(r: redis.Redis) -> None:
    count = r.command_count()
    names = raw(r, "COMMAND", "LIST")
    assert count == len(names) == len(set(names))
    for new in (b"ttl", b"pttl", b"keys", b"setnx", b"getset", b"getdel", b"object", b"client"):
        assert new in names
    for refused in (b"expire", b"hset", b"incr"):
        assert refused not in names  # COMMAND lists what works
    docs = as_map(raw(r, "COMMAND", "DOCS"))
    assert len(docs) == count
    one = as_map(raw(r, "COMMAND", "DOCS", "getdel"))
    assert list(one) == [b"getdel"]
    assert b"summary" in as_map(one[b"getdel"])


def as_map(reply: Any) -> dict[Any, Any]:
    """A map reply as a dict (RESP3 map, or RESP2's flat array)."""
    if isinstance(reply, dict):
        return reply
    return dict(zip(reply[::2], reply[1::2], strict=True))


def test_info_cpu_replication_commandstats(r: redis.Redis, rr: redis.Redis) -> None:
    before = r.info("commandstats")
    r.set("k", b"v")
    for _ in range(5):
        r.get("k")  # answered by the fast path: still counted
    r.execute_command("TTL", "k")
    repl = r.info("replication")
    assert repl["role"] == "master"
    assert repl["connected_slaves"] == 0
    assert set(repl) <= set(rr.info("replication"))
    cpu = r.info("cpu")
    assert cpu["used_cpu_user"] > 0
    assert "used_cpu_sys" in cpu
    stats = r.info("commandstats")

    def calls(table: dict[str, Any], name: str) -> int:
        return int(table.get(f"cmdstat_{name}", {}).get("calls", 0))

    assert calls(stats, "get") - calls(before, "get") == 5
    assert calls(stats, "ttl") - calls(before, "ttl") == 1
    assert calls(stats, "set") - calls(before, "set") == 1
    default = r.info()
    assert "role" in default
    assert "used_cpu_user" in default
    assert "cmdstat_get" not in default  # as Redis: only under INFO all / commandstats
    assert "cmdstat_get" in r.info("all")


def test_commandstats_are_per_tenant(server: ServerHandle) -> None:
    with (
        redis.Redis(port=port(server), password=TOKEN_A) as a,
        redis.Redis(port=port(server), password=TOKEN_B) as b,
    ):
        before = b.info("commandstats").get("cmdstat_getset", {}).get("calls", 0)
        a.getset("z", b"1")
        assert b.info("commandstats").get("cmdstat_getset", {}).get("calls", 0) == before


def test_new_commands_inside_multi(r: redis.Redis, rr: redis.Redis) -> None:
    script = [
        ("SETNX", "m", "1"),
        ("GETSET", "m", "2"),
        ("TTL", "m"),
        ("PTTL", "nothing"),
        ("KEYS", "m*"),
        ("OBJECT", "ENCODING", "nothing"),
        ("GETDEL", "m"),
        ("SCAN", "0", "TYPE", "list"),
        ("EXISTS", "m"),
    ]
    replies = []
    for c in (r, rr):
        with c.pipeline(transaction=True) as pipe:
            for args in script:
                pipe.execute_command(*args)
            replies.append(pipe.execute())
    assert replies[0] == replies[1]
    assert replies[0][:3] == [1, b"1", -1]
    with r.pipeline(transaction=True) as pipe:
        pipe.execute_command("CLIENT", "INFO")
        pipe.execute_command("OBJECT", "HELP")
        pipe.execute_command("INFO", "replication")
        info, helped, repl = pipe.execute()
    assert b"id=" in info
    assert helped[0].startswith(b"OBJECT")
    assert repl["role"] == "master"
    with r.pipeline(transaction=True) as pipe:
        pipe.execute_command("EXPIRE", "m", "5")  # refused while queuing: EXECABORT
        with pytest.raises(redis.ResponseError, match="unsupported command 'EXPIRE'"):
            pipe.execute()


def test_unauthenticated_gets_noauth_not_the_reason(server: ServerHandle, tmp_path: Path) -> None:
    out = subprocess.run(
        ["redis-cli", "-p", str(port(server)), "HSET", "h", "f", "v"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert "NOAUTH" in out.stdout + out.stderr
