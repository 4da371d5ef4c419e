"""The Python client against the real server (a subprocess), real TLS and failure stubs."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from epistemic_kvcache.client import (
    EpistemicGraphKVBackend,
    KvCacheConfig,
    PutOutcome,
    is_loopback_host,
)
from epistemic_kvcache.errors import AuthError, ConfigurationError, InvalidKeyError
from helpers import held_port
from servers import TOKEN, ServeProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    s = ServeProcess(tmp_path_factory.mktemp("kv"))
    yield s
    s.stop()


@pytest.fixture
def client(server: ServeProcess) -> Iterator[EpistemicGraphKVBackend]:
    with EpistemicGraphKVBackend(KvCacheConfig(base_url=server.url(), token=TOKEN)) as c:
        yield c


def free_port() -> int:
    """A port held for the rest of the run (`helpers.held_port`): never a released one."""
    return held_port()


# -- configuration and trust rules (no network) ---------------------------------------
@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1:9130", "http://localhost:1", "http://[::1]:9130", "http://127.8.9.10/x/"],
)
def test_plain_http_is_accepted_for_loopback(url: str) -> None:
    cfg = KvCacheConfig(base_url=url)
    assert cfg.scheme == "http"
    assert not cfg.base_url.endswith("/")


@pytest.mark.parametrize(
    "url", ["http://10.0.0.5:9130", "http://kv.example.com", "http://0.0.0.0:9130"]
)
def test_plain_http_is_refused_for_remote_hosts(url: str) -> None:
    with pytest.raises(ConfigurationError, match="plain http is allowed only for loopback"):
        KvCacheConfig(base_url=url)


def test_https_remote_is_accepted_and_there_is_no_verification_switch() -> None:
    cfg = KvCacheConfig(base_url="https://kv.example.com:9130")
    assert cfg.port == 9130
    assert not any("verify" in name for name in KvCacheConfig.__dataclass_fields__)
    with pytest.raises(TypeError):
        KvCacheConfig(base_url="https://kv.example.com", verify_tls=False)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"base_url": "ftp://127.0.0.1"}, "scheme"),
        ({"base_url": "http://127.0.0.1:99999"}, "port"),
        ({"base_url": "http://user:pw@127.0.0.1"}, "user-info"),
        ({"read_timeout_s": 0}, "read_timeout_s"),
        ({"connect_timeout_s": -1.0}, "connect_timeout_s"),
        ({"max_connections": 0}, "max_connections"),
        ({"token": "a\nb"}, "token"),
        ({"base_url": "https://kv.example", "client_key": "/x.pem"}, "client_key"),
        ({"base_url": "https://kv.example", "ca_file": "/nonexistent.pem"}, "ca_file"),
        ({"client_cert": "/etc/hostname"}, "client certificate needs an https"),
    ],
)
def test_bad_settings_fail_at_construction(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        KvCacheConfig(**kwargs)  # type: ignore[arg-type]


def test_from_env_url_wins_and_addr_picks_the_scheme(tmp_path: Path) -> None:
    env = {
        "EPISTEMIC_GRAPH_KVCACHE_URL": "http://127.0.0.1:1234",
        "EPISTEMIC_GRAPH_KVCACHE_ADDR": "10.1.1.1:9",
        "EPISTEMIC_GRAPH_KVCACHE_TOKEN": "tok",
        "EPISTEMIC_GRAPH_KVCACHE_READ_TIMEOUT_S": "7.5",
    }
    cfg = KvCacheConfig.from_env(env)
    assert (cfg.base_url, cfg.token, cfg.read_timeout_s) == ("http://127.0.0.1:1234", "tok", 7.5)
    assert "tok" not in repr(cfg)
    assert KvCacheConfig.from_env({}).base_url == "http://127.0.0.1:9130"
    remote = KvCacheConfig.from_env({"EPISTEMIC_GRAPH_KVCACHE_ADDR": "10.1.1.1:9"})
    assert remote.base_url == "https://10.1.1.1:9"
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    cfg = KvCacheConfig.from_env(
        {"EPISTEMIC_GRAPH_KVCACHE_ADDR": "kv.example:9", "REQUESTS_CA_BUNDLE": str(ca)}
    )
    assert cfg.ca_file == str(ca)
    with pytest.raises(ConfigurationError, match="READ_TIMEOUT"):
        KvCacheConfig.from_env({"EPISTEMIC_GRAPH_KVCACHE_READ_TIMEOUT_S": "soon"})
    with pytest.raises(ConfigurationError, match="plain http"):
        KvCacheConfig.from_env({"EPISTEMIC_GRAPH_KVCACHE_URL": "http://10.0.0.1:1"})


def test_loopback_detection() -> None:
    assert is_loopback_host("127.0.0.1")
    assert is_loopback_host("[::1]")
    assert is_loopback_host("localhost")
    assert not is_loopback_host("localhost.example.com")
    # *.localhost is resolved through DNS by glibc: not trusted for plain http
    assert not is_loopback_host("kv.localhost")
    assert not is_loopback_host("127.0.0.1.nip.io")
    assert not is_loopback_host("::")
    assert not is_loopback_host("192.168.1.1")


# -- behaviour against the real server --------------------------------------------------
LMCACHE_KEY = "meta-llama/Llama-3-8B@00000000@0@1a2b3c4d@salt%x é"


def test_round_trip_with_lmcache_shaped_keys(client: EpistemicGraphKVBackend) -> None:
    data = os.urandom(300_000)
    assert client.get(LMCACHE_KEY) is None
    assert client.put(LMCACHE_KEY, data)
    assert client.get(LMCACHE_KEY) == data
    assert client.exists(LMCACHE_KEY)
    assert client.size(LMCACHE_KEY) == len(data)
    buf = bytearray(len(data))
    assert client.get_into(LMCACHE_KEY, buf) == len(data)
    assert buf == data
    # Size mismatch is a miss, and does not break the pooled connection.
    assert client.get_into(LMCACHE_KEY, bytearray(len(data) - 1)) is None
    assert client.get_into(LMCACHE_KEY, bytearray(len(data) + 1)) is None
    big = bytearray(len(data) + 10)
    assert client.get_into(LMCACHE_KEY, big, exact=False) == len(data)
    assert client.counters().size_mismatches == 2
    assert client.delete(LMCACHE_KEY)
    assert not client.delete(LMCACHE_KEY)
    assert client.get(LMCACHE_KEY) is None
    assert not client.exists(LMCACHE_KEY)


def test_get_into_numpy_and_readonly_buffers(client: EpistemicGraphKVBackend) -> None:
    np = pytest.importorskip("numpy")
    arr = np.arange(4096, dtype=np.float32).reshape(64, 64)
    assert client.put("np-block", arr)
    out = np.zeros_like(arr)
    assert client.get_into("np-block", out) == arr.nbytes
    assert (out == arr).all()
    with pytest.raises(TypeError):
        client.get_into("np-block", b"\0" * arr.nbytes)


def test_batches_and_route_name_keys(client: EpistemicGraphKVBackend) -> None:
    blocks = {f"batch-{i}": os.urandom(1000 + i) for i in range(20)}
    blocks["stats"] = b"a key named like a route"
    assert client.put_many(blocks.items()) == [PutOutcome.NEW] * len(blocks)
    keys = [*blocks, "absent"]
    assert client.exists_many(keys) == [True] * len(blocks) + [False]
    assert client.get_many(keys) == [*blocks.values(), None]
    assert client.get("stats") == blocks["stats"]
    assert client.exists("stats")
    bufs = [bytearray(len(v)) for v in blocks.values()] + [bytearray(5)]
    bufs[0] = bytearray(3)  # wrong size -> miss, the rest still read correctly
    sizes = client.get_many_into(keys, bufs)
    assert sizes[0] is None
    assert sizes[-1] is None
    for i, (k, v) in enumerate(blocks.items()):
        if i:
            assert sizes[i] == len(v), k
            assert bufs[i] == v, k


def test_invalid_keys_raise_locally(client: EpistemicGraphKVBackend) -> None:
    with pytest.raises(InvalidKeyError):
        client.get("")
    with pytest.raises(InvalidKeyError):
        client.put("k" * 1025, b"x")


def test_stats_show_dedup(client: EpistemicGraphKVBackend) -> None:
    before = client.stats()
    assert before is not None
    data = os.urandom(50_000)
    assert client.put("dedup-a", data)
    mid = client.stats()
    assert mid is not None
    assert mid.unique_blocks == before.unique_blocks + 1
    assert mid.logical_bytes == before.logical_bytes + len(data)
    assert client.put("dedup-a", data)
    after = client.stats()
    assert after is not None
    assert after.dedup_hits == mid.dedup_hits + 1
    assert after.resident_bytes == mid.resident_bytes
    assert "hot" in after.tiers
    assert after.tiers["hot"].capacity_bytes > 0


def test_auth_failure_is_raised(server: ServeProcess) -> None:
    with EpistemicGraphKVBackend(base_url=server.url(), token="wrong-token-wrong-token") as c:
        with pytest.raises(AuthError, match="401"):
            c.get("x")
        with pytest.raises(AuthError):
            c.put("x", b"y")
        with pytest.raises(AuthError):
            c.exists_many(["x"])
        assert c.health()  # /healthz needs no credentials
    with EpistemicGraphKVBackend(base_url=server.url()) as c, pytest.raises(AuthError):
        c.stats()


def test_supports_fork_never_raises(client: EpistemicGraphKVBackend) -> None:
    assert client.supports_fork() in (True, False)
    with EpistemicGraphKVBackend(base_url=f"http://127.0.0.1:{free_port()}") as down:
        assert down.supports_fork() is False


def test_threads_share_one_client(client: EpistemicGraphKVBackend) -> None:
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            for i in range(20):
                k, v = f"t{n}-{i}", os.urandom(2000)
                assert client.put(k, v)
                assert client.get(k) == v
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert client.counters().transport_errors == 0


# -- degrade to a miss ------------------------------------------------------------------
def test_server_down_degrades_to_miss() -> None:
    port = free_port()
    with EpistemicGraphKVBackend(base_url=f"http://127.0.0.1:{port}", token="t") as c:
        t0 = time.monotonic()
        assert c.get("k") is None
        assert c.get_into("k", bytearray(4)) is None
        assert c.put("k", b"data") is PutOutcome.FAILED
        assert c.exists("k") is False
        assert c.exists_many(["a", "b"]) == [False, False]
        assert c.get_many(["a", "b"]) == [None, None]
        assert c.put_many([("a", b"1")]) == [PutOutcome.FAILED]
        assert c.stats() is None
        assert not c.health()
        assert time.monotonic() - t0 < 5
        counts = c.counters()
        # The first refused connection opens the breaker; the rest fail without a socket.
        assert counts.transport_errors >= 1
        assert counts.breaker_trips == 1
        assert counts.transport_errors + counts.fast_failures >= 9
        assert counts.puts_failed == 2
        assert counts.misses == 4


def test_server_killed_between_and_during_requests(tmp_path: Path) -> None:
    srv = ServeProcess(tmp_path)
    try:
        with EpistemicGraphKVBackend(base_url=srv.url(), token=TOKEN) as c:
            big = os.urandom(64 * 1024 * 1024)
            assert c.put("big", big)
            result: list[object] = []
            t = threading.Thread(target=lambda: result.append(c.get("big")))
            t.start()
            time.sleep(0.05)  # a delay on purpose: the kill most likely cuts the transfer
            srv.kill()
            t.join(30)
            assert not t.is_alive()
            # Either the transfer finished before the kill, or it degraded to a miss.
            assert result in ([big], [None])
            # Kept-alive sockets to a dead server: a miss, not an exception.
            assert c.get("big") is None
            assert c.put("k", b"v") is PutOutcome.FAILED
            counts = c.counters()
            assert counts.transport_errors + counts.fast_failures >= 2
    finally:
        srv.stop()


class StubServer:
    """A raw-socket HTTP server answering every request with a canned reply."""

    def __init__(self, reply: bytes, *, close_after: bool = True) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = int(self.sock.getsockname()[1])
        self.reply = reply
        self.close_after = close_after
        self.requests = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                data = b""
                try:
                    while b"\r\n\r\n" not in data:
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        data += chunk
                    self.requests += 1
                    conn.sendall(self.reply)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def test_http_500_degrades_to_miss() -> None:
    body = b'{"error": "internal", "message": "boom"}'
    stub = StubServer(
        b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
    )
    try:
        with EpistemicGraphKVBackend(base_url=f"http://127.0.0.1:{stub.port}", token="t") as c:
            assert c.get("k") is None
            # an internal error says nothing about whether the write was applied
            assert c.put("k", b"v") is PutOutcome.UNKNOWN
            assert c.exists_many(["k"]) == [False]
            assert c.get_into("k", bytearray(3)) is None
            assert c.counters().server_errors == 4
        assert stub.requests == 4
    finally:
        stub.close()


def test_body_cut_short_is_a_miss() -> None:
    stub = StubServer(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
        b"Content-Length: 100000\r\n\r\n" + b"x" * 1000
    )
    try:
        with EpistemicGraphKVBackend(base_url=f"http://127.0.0.1:{stub.port}", token="t") as c:
            assert c.get_into("k", bytearray(100000)) is None
            assert c.get("k") is None
            counts = c.counters()
            assert counts.transport_errors + counts.fast_failures >= 2
    finally:
        stub.close()


# -- TLS ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def tls_files(ca: trustme.CA, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("tls")
    server_cert = ca.issue_cert("127.0.0.1", "localhost")
    client_cert = ca.issue_cert("client@example")
    files = {
        "ca": d / "ca.pem",
        "cert": d / "server.pem",
        "key": d / "server.key",
        "client": d / "client.pem",
        "client_key": d / "client.key",
    }
    ca.cert_pem.write_to_path(str(files["ca"]))
    server_cert.private_key_pem.write_to_path(str(files["key"]))
    server_cert.cert_chain_pems[0].write_to_path(str(files["cert"]))
    for pem in server_cert.cert_chain_pems[1:]:
        pem.write_to_path(str(files["cert"]), append=True)
    client_cert.cert_chain_pems[0].write_to_path(str(files["client"]))
    client_cert.private_key_pem.write_to_path(str(files["client_key"]))
    return {k: str(v) for k, v in files.items()}


def test_https_with_a_test_ca(tls_files: dict[str, str], tmp_path: Path) -> None:
    srv = ServeProcess(tmp_path, "--tls-cert", tls_files["cert"], "--tls-key", tls_files["key"])
    try:
        with EpistemicGraphKVBackend(
            base_url=srv.url("https", "localhost"), token=TOKEN, ca_file=tls_files["ca"]
        ) as c:
            assert c.put("tls-key", b"secret bytes")
            assert c.get("tls-key") == b"secret bytes"
        env = {"SSL_CERT_FILE": tls_files["ca"], "EPISTEMIC_GRAPH_KVCACHE_TOKEN": TOKEN}
        env["EPISTEMIC_GRAPH_KVCACHE_URL"] = srv.url("https")
        with EpistemicGraphKVBackend(KvCacheConfig.from_env(env)) as c:
            assert c.get("tls-key") == b"secret bytes"
        # A CA the server's certificate does not chain to: loud, not a silent miss.
        other = trustme.CA()
        other_pem = tmp_path / "other.pem"
        other.cert_pem.write_to_path(str(other_pem))
        with (
            EpistemicGraphKVBackend(
                base_url=srv.url("https"), token=TOKEN, ca_file=str(other_pem)
            ) as c,
            pytest.raises(ConfigurationError, match="TLS verification"),
        ):
            c.get("tls-key")
        # Plain http to a TLS listener fails as a transport error (miss).
        with EpistemicGraphKVBackend(base_url=srv.url("http"), token=TOKEN) as c:
            assert c.get("tls-key") is None
    finally:
        srv.stop()


def test_mutual_tls(tls_files: dict[str, str], tmp_path: Path) -> None:
    srv = ServeProcess(
        tmp_path,
        "--tls-cert",
        tls_files["cert"],
        "--tls-key",
        tls_files["key"],
        "--tls-client-ca",
        tls_files["ca"],
    )
    try:
        with EpistemicGraphKVBackend(
            base_url=srv.url("https"),
            token=TOKEN,
            ca_file=tls_files["ca"],
            client_cert=tls_files["client"],
            client_key=tls_files["client_key"],
        ) as c:
            assert c.put("mtls", b"v")
            assert c.get("mtls") == b"v"
        with EpistemicGraphKVBackend(
            base_url=srv.url("https"), token=TOKEN, ca_file=tls_files["ca"]
        ) as c:
            # No client certificate: the handshake is refused; never a hit.
            assert c.get("mtls") is None
            assert c.counters().transport_errors >= 1
    finally:
        srv.stop()


def test_batch_gets_into_buffers_split_by_bytes() -> None:
    from epistemic_kvcache.client.backend import (
        MAX_BATCH_KEYS,
        MAX_BATCH_PUT_BYTES,
        _byte_bounded_chunks,
    )

    mib32 = 32 << 20
    sizes = [mib32] * 20  # 640 MiB of buffers: more than one 256 MiB batch
    ranges = _byte_bounded_chunks(sizes)
    assert ranges[0] == (0, MAX_BATCH_PUT_BYTES // mib32)
    assert all(sum(sizes[a:b]) <= MAX_BATCH_PUT_BYTES for a, b in ranges)
    assert [i for a, b in ranges for i in range(a, b)] == list(range(20))
    assert _byte_bounded_chunks([MAX_BATCH_PUT_BYTES + 1, 1]) == [(0, 1), (1, 2)]
    assert len(_byte_bounded_chunks([1] * (MAX_BATCH_KEYS + 1))) == 2
    assert _byte_bounded_chunks([]) == []


def test_get_many_splits_when_the_hits_exceed_the_server_batch_limit(tmp_path: Path) -> None:
    server = ServeProcess(
        tmp_path,
        "--max-batch-bytes",
        "1MiB",
        "--max-block-bytes",
        "1MiB",
        "--max-inflight-body-bytes",
        "64MiB",
    )
    try:
        with EpistemicGraphKVBackend(base_url=server.url(), token=TOKEN) as c:
            blocks = {f"b{i}": os.urandom(600 << 10) for i in range(4)}  # 2.4 MiB of hits
            for k, v in blocks.items():
                assert c.put(k, v)
            got = c.get_many([*blocks, "absent"])
            assert got == [*blocks.values(), None]
    finally:
        server.stop()
