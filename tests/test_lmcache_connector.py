"""`EpistemicGraphL2Connector` protocol behaviour and `validate-adapter`, without lmcache.

The connector itself imports neither lmcache nor torch, so these run everywhere; the
same object driven by LMCache's real adapter is in test_lmcache.py.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
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
from test_client import TOKEN, Server, free_port

Completion = tuple[int, bool, str, list[bool] | None]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(tmp_path_factory.mktemp("kv"))
    yield s
    s.stop()


@pytest.fixture
def conn(server: Server) -> Iterator[EpistemicGraphL2Connector]:
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
    time.sleep(0.2)
    assert conn.drain_completions() == []
    assert not poller.poll(50)


def test_server_down_is_per_key_failure_never_an_exception() -> None:
    conn = EpistemicGraphL2Connector(base_url=f"http://127.0.0.1:{free_port()}", num_workers=2)
    try:
        block = memoryview(bytearray(1000))
        _, ok, _err, res = wait(conn, conn.submit_batch_set(["a", "b"], [block, block]))
        assert not ok
        assert res == [False, False]
        _, ok, _, res = wait(conn, conn.submit_batch_exists(["a"]))
        assert res == [False]
        _, ok, _, res = wait(conn, conn.submit_batch_get(["a"], [block]))
        assert (ok, res) == (False, [False])
        assert conn.client.counters().transport_errors >= 3
    finally:
        conn.close()


def test_auth_and_bad_keys_become_errors_in_the_completion(server: Server) -> None:
    conn = EpistemicGraphL2Connector(base_url=server.url(), token="not-the-token-xxxxxxxx")
    try:
        _, ok, err, res = wait(conn, conn.submit_batch_exists(["a"]))
        assert not ok
        assert "AuthError" in err
        assert res == [False]
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
    srv = Server(tmp_path)
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
    c = EpistemicGraphL2Connector()
    try:
        assert c.config.base_url == "http://127.0.0.1:7777"
        assert c.config.token == "env-token"
    finally:
        c.close()
        c.close()  # idempotent
    token_file = tmp_path / "token"
    token_file.write_text("file-token\n")
    c = EpistemicGraphL2Connector(addr="localhost:1", token_file=str(token_file), timeout_s=5)
    try:
        assert (c.config.base_url, c.config.token) == ("http://localhost:1", "file-token")
        assert c.config.read_timeout_s == 5.0
    finally:
        c.close()


@pytest.mark.parametrize(
    ("sizes", "k"),
    [([4] * 16, 8), ([32] * 4, 8), ([1, 1, 1, 100], 2), ([0, 0, 0], 2), ([5], 8)],
)
def test_groups_cover_every_key_once(sizes: list[int], k: int) -> None:
    groups = _groups(sizes, k)
    assert 1 <= len(groups) <= min(k, len(sizes))
    assert [i for g in groups for i in g] == list(range(len(sizes)))


def test_validate_adapter_command(server: Server) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPISTEMIC_GRAPH_")}
    cmd = [sys.executable, "-m", "epistemic_kvcache", "validate-adapter", "--url", server.url()]
    ok = subprocess.run(
        [*cmd, "--token", TOKEN, "--block-bytes", "100000"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "validate-adapter: PASS" in ok.stdout
    assert "[PASS] dedup_hits rose" in ok.stdout
    assert "[PASS] resident_bytes flat" in ok.stdout
    bad = subprocess.run(
        [*cmd, "--token", "wrong-token-wrong-token"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 1
    assert "FAIL" in bad.stdout
    down = subprocess.run(
        [sys.executable, "-m", "epistemic_kvcache", "validate-adapter"],
        env={**env, "EPISTEMIC_GRAPH_KVCACHE_URL": f"http://127.0.0.1:{free_port()}"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert down.returncode == 1
    assert "[FAIL] stats reachable" in down.stdout
