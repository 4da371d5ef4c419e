"""`EpistemicGraphL2Connector` protocol behaviour and `validate-adapter`, without lmcache.

The connector itself imports neither lmcache nor torch, so these run everywhere; the
same object driven by LMCache's real adapter is in test_lmcache.py.
"""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from epistemic_kvcache.errors import ConfigurationError
from epistemic_kvcache.integrations.lmcache.l2_native_connector import (
    EpistemicGraphL2Connector,
    _groups,
)
from helpers import held_port as free_port
from servers import TOKEN, ServeProcess

Completion = tuple[int, bool, str, list[bool] | None]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    s = ServeProcess(tmp_path_factory.mktemp("kv"))
    yield s
    s.stop()


@pytest.fixture
def conn(server: ServeProcess) -> Iterator[EpistemicGraphL2Connector]:
    c = EpistemicGraphL2Connector(base_url=server.url(), token=TOKEN, num_workers=4)
    yield c
    c.close()


def wait(conn: EpistemicGraphL2Connector, fid: int, timeout_s: float = 30) -> Completion:
    """What LMCache's demux thread does: poll the eventfd, drain, match the future id."""
    poller = select.poll()
    poller.register(conn.event_fd(), select.POLLIN)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if poller.poll(200):
            for c in conn.drain_completions():
                if c[0] == fid:
                    return c
    raise AssertionError(f"future {fid} did not complete")


def test_set_exists_get_per_key(conn: EpistemicGraphL2Connector) -> None:
    keys = [f"org/model@{i:08x}@0@{os.urandom(8).hex()}" for i in range(10)]
    blocks = [os.urandom(64 * 1024 * (1 + i % 3)) for i in range(10)]
    _, ok, err, res = wait(conn, conn.submit_batch_set(keys, [memoryview(b) for b in blocks]))
    assert (ok, err, res) == (True, "", [True] * 10)
    _, ok, err, res = wait(conn, conn.submit_batch_exists([keys[0], "nope", keys[9]]))
    assert ok  # a lookup succeeds even when some keys are absent
    assert res == [True, False, True]
    bufs = [bytearray(len(b)) for b in blocks]
    bufs[4] = bytearray(len(blocks[4]) + 1)  # wrong size: reported not loaded
    _, ok, err, res = wait(conn, conn.submit_batch_get(keys, [memoryview(b) for b in bufs]))
    assert not ok
    assert "1 of 10" in err
    assert res == [i != 4 for i in range(10)]
    assert all(bufs[i] == blocks[i] for i in range(10) if i != 4)


def test_empty_batches_and_many_futures(conn: EpistemicGraphL2Connector) -> None:
    assert wait(conn, conn.submit_batch_get([], []))[1:] == (True, "", [])
    assert wait(conn, conn.submit_batch_exists([]))[1:] == (True, "", [])
    fids = {conn.submit_batch_exists([f"k{i}"]) for i in range(50)}
    assert len(fids) == 50
    seen: set[int] = set()
    poller = select.poll()
    poller.register(conn.event_fd(), select.POLLIN)
    deadline = time.monotonic() + 30
    while seen != fids and time.monotonic() < deadline:
        poller.poll(200)
        seen.update(c[0] for c in conn.drain_completions())
    assert seen == fids
    # A worker bumps the eventfd just after queueing its completion, so one spurious
    # wake-up may follow the last drain; once drained again, the fd stays quiet.
    time.sleep(0.2)  # a delay on purpose: room for a wrong late completion to show up
    assert conn.drain_completions() == []
    assert not poller.poll(50)


def test_server_down_is_per_key_failure_never_an_exception() -> None:
    conn = EpistemicGraphL2Connector(
        base_url=f"http://127.0.0.1:{free_port()}",
        token=TOKEN,
        num_workers=2,
        check_on_start=False,
    )
    try:
        block = memoryview(bytearray(1000))
        _, ok, _err, res = wait(conn, conn.submit_batch_set(["a", "b"], [block, block]))
        assert not ok
        assert res == [False, False]
        _, ok, _, res = wait(conn, conn.submit_batch_exists(["a"]))
        assert res == [False]
        _, ok, _, res = wait(conn, conn.submit_batch_get(["a"], [block]))
        assert (ok, res) == (False, [False])
        counts = conn.client.counters()
        assert counts.breaker_trips == 1  # the first refusal; the rest failed at once
        assert counts.transport_errors + counts.fast_failures >= 3
    finally:
        conn.close()


def test_auth_and_bad_keys_become_errors_in_the_completion(
    server: ServeProcess, caplog: pytest.LogCaptureFixture
) -> None:
    # A token revoked after start-up (the start-up check would refuse a wrong one).
    conn = EpistemicGraphL2Connector(
        base_url=server.url(), token="not-the-token-xxxxxxxx", check_on_start=False
    )
    try:
        with caplog.at_level("ERROR"):
            for _ in range(20):
                _, ok, err, res = wait(conn, conn.submit_batch_exists(["a"]))
                assert not ok
                assert "AuthError" in err
                assert res == [False]
        # One line, no traceback, for twenty failing batches.
        errors = [r for r in caplog.records if r.levelname == "ERROR"]
        assert len(errors) == 1
        assert not errors[0].exc_info
        assert "AuthError" in errors[0].getMessage()
    finally:
        conn.close()
    conn = EpistemicGraphL2Connector(base_url=server.url(), token=TOKEN)
    try:
        _, ok, err, res = wait(conn, conn.submit_batch_set([""], [memoryview(b"x")]))
        assert not ok
        assert "InvalidKeyError" in err
        _, ok, err, _ = wait(conn, conn.submit_batch_set(["a", "b"], [memoryview(b"x")]))
        assert not ok
        assert "differ in length" in err
    finally:
        conn.close()


def test_server_killed_mid_batch(tmp_path: Path) -> None:
    srv = ServeProcess(tmp_path)
    conn = EpistemicGraphL2Connector(base_url=srv.url(), token=TOKEN, num_workers=2)
    try:
        blocks = [os.urandom(16 * 1024 * 1024) for _ in range(4)]
        keys = [f"kill{i}" for i in range(4)]
        views = [memoryview(b) for b in blocks]
        fid = conn.submit_batch_set(keys, views)
        threading.Timer(0.02, srv.kill).start()
        _, ok, _, res = wait(conn, fid)
        assert res is not None
        assert len(res) == 4
        bufs = [memoryview(bytearray(len(b))) for b in blocks]
        _, ok, _, res = wait(conn, conn.submit_batch_get(keys, bufs))
        assert (ok, res) == (False, [False] * 4)
    finally:
        conn.close()
        srv.stop()


def test_construction_rules(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="verify_tls"):
        EpistemicGraphL2Connector(base_url="https://kv.example", verify_tls=False)
    with pytest.raises(ConfigurationError, match="plain http"):
        EpistemicGraphL2Connector(base_url="http://10.2.3.4:9130")
    with pytest.raises(ConfigurationError, match="num_workers"):
        EpistemicGraphL2Connector(num_workers=0)
    with pytest.raises(ConfigurationError, match="not both"):
        EpistemicGraphL2Connector(base_url="http://127.0.0.1:1", addr="127.0.0.1:1")
    with pytest.raises(TypeError):
        EpistemicGraphL2Connector(hots="typo")  # type: ignore[call-arg]
    monkeypatch.setenv("EPISTEMIC_GRAPH_KVCACHE_ADDR", "127.0.0.1:7777")
    monkeypatch.setenv("EPISTEMIC_GRAPH_KVCACHE_TOKEN", "env-token")
    c = EpistemicGraphL2Connector(check_on_start=False)
    try:
        assert c.config.base_url == "http://127.0.0.1:7777"
        assert c.config.token == "env-token"
    finally:
        c.close()
        c.close()  # idempotent
    token_file = tmp_path / "token"
    token_file.write_text("file-token\n")
    c = EpistemicGraphL2Connector(
        addr="localhost:1",
        token_file=str(token_file),
        timeout_s=5,
        lookup_timeout_s=0.5,
        breaker_max_backoff_s=0,
        check_on_start=False,
    )
    try:
        assert (c.config.base_url, c.config.token) == ("http://localhost:1", "file-token")
        assert c.config.read_timeout_s == 5.0
        assert c.config.lookup_timeout_s == 0.5
        assert c.client.breaker is None
    finally:
        c.close()
    with pytest.raises(ConfigurationError, match="check_on_start"):
        EpistemicGraphL2Connector(check_on_start="yes")  # type: ignore[arg-type]


def test_start_up_check_fails_once_and_clearly(
    server: ServeProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("EPISTEMIC_GRAPH_KVCACHE_TOKEN", raising=False)
    with pytest.raises(ConfigurationError, match=r"no token .* EPISTEMIC_GRAPH_KVCACHE_TOKEN"):
        EpistemicGraphL2Connector(base_url=server.url())
    with pytest.raises(ConfigurationError, match="refused the token"):
        EpistemicGraphL2Connector(base_url=server.url(), token="wrong-token-wrong-token")
    down = f"http://127.0.0.1:{free_port()}"
    # Nothing listens there: refused at once. Connect and lookup timeouts of 30 s are what
    # a check that waited for a timeout (or retried until one) would cost.
    monkeypatch.setenv("EPISTEMIC_GRAPH_KVCACHE_CLIENT_CONNECT_TIMEOUT_S", "30")
    t0 = time.monotonic()
    refused = f"cannot use the kv-cache server at {down}: .*Connection refused"
    with pytest.raises(ConfigurationError, match=refused):
        EpistemicGraphL2Connector(base_url=down, token=TOKEN, lookup_timeout_s=30)
    assert time.monotonic() - t0 < 10
    ok = EpistemicGraphL2Connector(base_url=server.url(), token=TOKEN)
    ok.close()


def test_batch_delete_really_deletes(conn: EpistemicGraphL2Connector) -> None:
    keys = [f"org/model@00000000@0@del{i}-{os.urandom(4).hex()}" for i in range(6)]
    blocks = [os.urandom(1000) for _ in keys]
    _, ok, err, _ = wait(conn, conn.submit_batch_set(keys[:4], [memoryview(b) for b in blocks[:4]]))
    assert ok, err
    # Keys 0, 2, 4: two existed, one never did.
    _, ok, err, res = wait(conn, conn.submit_batch_delete([keys[0], keys[2], keys[4]]))
    assert ok, err
    assert res == [True, True, False]
    _, ok, _, res = wait(conn, conn.submit_batch_exists(keys[:4]))
    assert res == [False, True, False, True]
    assert wait(conn, conn.submit_batch_delete([]))[1:] == (True, "", [])
    many = [f"org/model@00000000@0@many{i}-{os.urandom(4).hex()}" for i in range(40)]
    wait(conn, conn.submit_batch_set(many, [memoryview(b"x" * 10)] * 40))
    _, ok, _, res = wait(conn, conn.submit_batch_delete(many))
    assert (ok, res) == (True, [True] * 40)


@pytest.mark.parametrize(
    ("sizes", "k"),
    [([4] * 16, 8), ([32] * 4, 8), ([1, 1, 1, 100], 2), ([0, 0, 0], 2), ([5], 8)],
)
def test_groups_cover_every_key_once(sizes: list[int], k: int) -> None:
    groups = _groups(sizes, k)
    assert 1 <= len(groups) <= min(k, len(sizes))
    assert [i for g in groups for i in g] == list(range(len(sizes)))
