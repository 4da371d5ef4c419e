"""Fail fast on a stalled or dead server: a real server process, SIGSTOPped or SIGKILLed.

The client's lookups time out after `lookup_timeout_s`, transfers after `read_timeout_s`;
after that one timeout the circuit breaker answers at once until a background probe sees
the server again. The tests set the timeouts so that the outcomes they tell apart are far
apart (a shared, loaded 2-core machine); the measured numbers per LMCache path, with the
default timeouts, are in bench/bench_failures.py and docs/lmcache.md.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from epistemic_kvcache.client import CircuitBreaker, EpistemicGraphKVBackend, PutOutcome
from epistemic_kvcache.integrations.lmcache.l2_native_connector import (
    EpistemicGraphL2Connector,
)
from helpers import held_port as free_port
from helpers import sigstop
from servers import TOKEN, ServeProcess
from test_lmcache_connector import wait

SHORT_TIMEOUT_S = 3.0
"""The one timeout a stall costs here: the lookup timeout (default 1 s), and the transfer
timeout where a test times a transfer out. A request that goes to the stalled server
instead of being answered by the open breaker waits at least this long."""
LONG_TIMEOUT_S = 60.0
"""The timeouts that nothing here may wait for: transfers where the test times out a
lookup, requests that an abort or a close must cut."""
FIRST_TIMEOUT_MAX_S = LONG_TIMEOUT_S / 3
"""The first, timed-out request: `SHORT_TIMEOUT_S`; far from a request that waited for
`LONG_TIMEOUT_S` (or forever), with the slack of a loaded machine."""
FAST_MAX_S = SHORT_TIMEOUT_S / 3
"""Once the breaker is open (measured: milliseconds); far from `SHORT_TIMEOUT_S`."""


@contextmanager
def stopped(server: ServeProcess) -> Iterator[None]:
    """SIGSTOP the server process for the block, every thread of it stopped before the
    block runs (always SIGCONT afterwards)."""
    try:
        sigstop(server.proc.pid)
        yield
    finally:
        server.proc.send_signal(signal.SIGCONT)


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.monotonic()
    value = fn()
    return time.monotonic() - t0, value


def eventually(pred: Callable[[], bool], timeout_s: float) -> float:
    """Seconds until `pred()` held (polled every 50 ms); fails after `timeout_s`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if pred():
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s} s")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServeProcess]:
    s = ServeProcess(tmp_path)
    yield s
    s.stop()


# -- the breaker alone --------------------------------------------------------------------
def test_breaker_opens_probes_with_backoff_and_closes() -> None:
    answers: list[bool] = [False, False, True]
    calls: list[float] = []

    def probe() -> bool:
        calls.append(time.monotonic())
        return answers.pop(0) if answers else True

    b = CircuitBreaker(probe, backoff_s=0.05, max_backoff_s=0.1)
    assert b.allow()
    assert not b.is_open
    b.record_failure("read timed out")
    assert not b.allow()
    assert b.reason == "read timed out"
    b.record_failure("again")  # already open: one trip
    assert b.trips == 1
    eventually(b.allow, 5)
    assert len(calls) == 3  # probed at once, then after 0.05 s, then after 0.1 s
    assert calls[2] - calls[1] >= 0.09
    b.record_failure("second outage")
    assert b.trips == 2
    eventually(b.allow, 5)  # a fresh prober started for the second outage
    b.record_failure("third")
    b.record_success()  # a request in flight answered: closed without waiting for a probe
    assert b.allow()
    b.shutdown(1)
    b.record_failure("after shutdown")  # ignored
    assert b.allow()


def test_breaker_survives_a_raising_probe() -> None:
    state = {"n": 0}

    def probe() -> bool:
        state["n"] += 1
        if state["n"] == 1:
            raise RuntimeError("bug in a probe")
        return True

    b = CircuitBreaker(probe, backoff_s=0.01, max_backoff_s=0.01)
    b.record_failure("x")
    eventually(b.allow, 5)
    b.shutdown(1)


def test_breaker_shutdown_while_the_prober_is_being_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The first failure creates the prober thread and starts it under the breaker's lock;
    # a shutdown from another thread in between (a client's abort while a request fails)
    # must wait for the start, not join a thread that has not started (RuntimeError).
    entered, go = threading.Event(), threading.Event()
    real_start = threading.Thread.start

    def held_start(self: threading.Thread) -> None:
        if self.name.endswith("-probe"):
            entered.set()
            go.wait(10)
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", held_start)
    b = CircuitBreaker(lambda: False, backoff_s=0.01, max_backoff_s=0.01)
    failing = threading.Thread(target=b.record_failure, args=("down",))
    failing.start()
    assert entered.wait(10)
    errors: list[BaseException] = []

    def shut() -> None:
        try:
            b.shutdown(5)
        except BaseException as exc:
            errors.append(exc)

    stopper = threading.Thread(target=shut)
    stopper.start()
    stopper.join(1.0)  # broken: fails at once; fixed: waits for the start (released below)
    go.set()
    stopper.join(10)
    failing.join(10)
    assert not stopper.is_alive()
    assert errors == []


def test_breaker_rejects_bad_backoff() -> None:
    with pytest.raises(ValueError, match="back-off"):
        CircuitBreaker(lambda: True, backoff_s=0, max_backoff_s=1)
    with pytest.raises(ValueError, match="back-off"):
        CircuitBreaker(lambda: True, backoff_s=2, max_backoff_s=1)


# -- the client against a SIGSTOPped server -----------------------------------------------
def test_client_lookup_on_stalled_server_times_out_once_then_fails_fast(
    server: ServeProcess,
) -> None:
    with EpistemicGraphKVBackend(
        base_url=server.url(),
        token=TOKEN,
        lookup_timeout_s=SHORT_TIMEOUT_S,
        read_timeout_s=LONG_TIMEOUT_S,
    ) as c:
        block = os.urandom(256 * 1024)
        assert c.put("k", block) is PutOutcome.NEW
        assert c.exists("k")
        with stopped(server):
            first, found = timed(lambda: c.exists("k"))
            assert found is False
            assert 0.8 * SHORT_TIMEOUT_S <= first <= FIRST_TIMEOUT_MAX_S  # the lookup timeout
            before = c.counters()
            for op in (
                lambda: c.exists("k"),
                lambda: c.exists_many(["k", "j"]),
                lambda: c.get("k"),
                lambda: c.get_into("k", bytearray(len(block))),
                lambda: c.put("k2", b"v"),
                lambda: c.delete("k"),
                c.stats,
            ):
                elapsed, value = timed(op)
                assert elapsed <= FAST_MAX_S
                assert not (any(value) if isinstance(value, list) else value)
            counts = c.counters()
            assert counts.breaker_trips == 1
            assert counts.fast_failures - before.fast_failures >= 7
            assert counts.requests == before.requests  # none of them reached the network
            assert c.breaker is not None
            assert c.breaker.is_open
        # Resumed: the background probe closes the breaker; the data is all there.
        eventually(lambda: c.exists("k"), 30)
        assert c.get("k") == block


def test_client_transfer_on_stalled_server_times_out_within_the_transfer_timeout(
    server: ServeProcess,
) -> None:
    with EpistemicGraphKVBackend(
        base_url=server.url(), token=TOKEN, read_timeout_s=SHORT_TIMEOUT_S
    ) as c:
        assert c.put("big", os.urandom(4 * 1024 * 1024))
        with stopped(server):
            first, got = timed(lambda: c.get("big"))
            assert got is None
            assert 0.75 * SHORT_TIMEOUT_S <= first <= FIRST_TIMEOUT_MAX_S  # transfer timeout
            before = c.counters()
            elapsed, outcome = timed(lambda: c.put("other", os.urandom(1024 * 1024)))
            assert outcome is PutOutcome.FAILED
            assert c.counters().requests == before.requests  # answered by the breaker
            assert elapsed <= FAST_MAX_S


def test_client_abort_cuts_requests_in_flight(server: ServeProcess) -> None:
    c = EpistemicGraphKVBackend(base_url=server.url(), token=TOKEN, read_timeout_s=LONG_TIMEOUT_S)
    assert c.put("k", b"v")
    result: list[object] = []
    with stopped(server):
        t = threading.Thread(target=lambda: result.append(c.get("k")))
        t.start()
        # A delay on purpose: the GET most likely blocks on the stalled server by now (60 s
        # timeout); had it not started yet, the aborted client answers it a miss at once.
        time.sleep(0.3)
        elapsed, _ = timed(c.abort)
        t.join(LONG_TIMEOUT_S / 3)  # cut: at once; not cut: only at its 60 s timeout
        assert not t.is_alive()
        assert result == [None]
        assert elapsed <= LONG_TIMEOUT_S / 3


def test_client_recovers_after_restart_on_the_same_port(tmp_path: Path) -> None:
    http, resp = free_port(), free_port()
    opts = ("--backend", "durable", "--addr", f"127.0.0.1:{http}")
    opts += ("--resp-addr", f"127.0.0.1:{resp}")
    srv = ServeProcess(tmp_path, *opts)
    try:
        with EpistemicGraphKVBackend(
            base_url=srv.url(),
            token=TOKEN,
            breaker_max_backoff_s=1.0,
            connect_timeout_s=LONG_TIMEOUT_S,  # what waiting instead of a refusal costs
            read_timeout_s=LONG_TIMEOUT_S,
        ) as c:
            assert c.put("durable", b"survives")
            srv.kill()
            srv.stop()
            elapsed, value = timed(lambda: c.get("durable"))
            assert value is None
            assert elapsed <= FAST_MAX_S  # refused at once
            assert c.breaker is not None
            assert c.breaker.is_open
            srv = ServeProcess(tmp_path, *opts)
            # Back within the probe interval (1 s here) of the server answering: a few
            # intervals of slack for a loaded machine; a prober that stopped never is.
            assert eventually(lambda: c.get("durable") == b"survives", 30) <= 5.0
    finally:
        srv.stop()


# -- the native connector (what LMCache's MP server drives) --------------------------------
def test_connector_on_stalled_server(server: ServeProcess) -> None:
    conn = EpistemicGraphL2Connector(
        base_url=server.url(),
        token=TOKEN,
        num_workers=4,
        lookup_timeout_s=SHORT_TIMEOUT_S,
        timeout_s=LONG_TIMEOUT_S,
    )
    try:
        keys = [f"m@00000000@0@stall{i}" for i in range(4)]
        blocks = [os.urandom(64 * 1024) for _ in keys]
        assert wait(conn, conn.submit_batch_set(keys, [memoryview(b) for b in blocks]))[1]
        with stopped(server):
            first, (_, ok, _err, res) = timed(lambda: wait(conn, conn.submit_batch_exists(keys)))
            assert res == [False] * 4  # a miss, not an error
            assert first <= FIRST_TIMEOUT_MAX_S
            before = conn.client.counters()
            second, (_, _, _, res) = timed(lambda: wait(conn, conn.submit_batch_exists(keys)))
            assert res == [False] * 4
            assert second <= FAST_MAX_S
            bufs = [memoryview(bytearray(len(b))) for b in blocks]
            elapsed, (_, ok, _err, res) = timed(
                lambda: wait(conn, conn.submit_batch_get(keys, bufs))
            )
            assert (ok, res) == (False, [False] * 4)
            assert elapsed <= FAST_MAX_S
            assert conn.client.counters().requests == before.requests  # all by the breaker
        eventually(lambda: wait(conn, conn.submit_batch_exists(keys))[3] == [True] * 4, 30)
    finally:
        conn.close()


def test_connector_close_is_bounded_with_requests_stuck(server: ServeProcess) -> None:
    conn = EpistemicGraphL2Connector(
        base_url=server.url(), token=TOKEN, num_workers=2, timeout_s=LONG_TIMEOUT_S
    )
    key = "m@00000000@0@close"
    assert wait(conn, conn.submit_batch_set([key], [memoryview(b"x" * 1000)]))[1]
    with stopped(server):
        buf = memoryview(bytearray(1000))
        conn.submit_batch_get([key], [buf])  # blocks on the stalled server (60 s timeout)
        conn.submit_batch_exists([key])
        time.sleep(0.3)  # a delay on purpose: the workers most likely block by now
        elapsed, _ = timed(conn.close)
        # One second of grace for work in flight, then the connections are cut; not cut,
        # they would hold the close up until their 60 s timeout.
        assert elapsed <= LONG_TIMEOUT_S / 3


# -- through LMCache's own objects -----------------------------------------------------------
@pytest.mark.lmcache
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_lmcache_mp_native_adapter_on_stalled_server(
    server: ServeProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("lmcache")
    import argparse
    import json

    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    from epistemic_kvcache.integrations.lmcache.checks import tensor_obj
    from test_lmcache import DEPLOY, wait_for

    monkeypatch.setenv("EPISTEMIC_GRAPH_KVCACHE_URL", server.url())
    monkeypatch.setenv("EPISTEMIC_GRAPH_KVCACHE_TOKEN", TOKEN)
    monkeypatch.setenv("EPISTEMIC_GRAPH_KVCACHE_CLIENT_LOOKUP_TIMEOUT_S", str(SHORT_TIMEOUT_S))
    monkeypatch.setenv("EPISTEMIC_GRAPH_KVCACHE_CLIENT_READ_TIMEOUT_S", str(LONG_TIMEOUT_S))
    spec = (DEPLOY / "mp-native-plugin.json").read_text()
    args = argparse.Namespace(l2_adapter=[json.dumps(json.loads(spec))])
    adapter = create_l2_adapter(parse_args_to_l2_adapters_config(args).adapters[0])
    key = ObjectKey(chunk_hash=os.urandom(16), model_name="m/stall", kv_rank=0)
    source = tensor_obj(os.urandom(8192))

    def lookup() -> bool:
        task = adapter.submit_lookup_and_lock_task([key], {})
        bitmap = wait_for(
            adapter.get_lookup_and_lock_event_fd(),
            lambda: adapter.query_lookup_and_lock_result(task),
        )
        return bool(bitmap.test(0))

    def load() -> bool:
        target = tensor_obj(bytes(8192))
        task = adapter.submit_load_task([key], [target])
        bitmap = wait_for(adapter.get_load_event_fd(), lambda: adapter.query_load_result(task))
        return bool(bitmap.test(0))

    try:
        task = adapter.submit_store_task([key], [source])
        done: dict[int, object] = {}

        def stored() -> object:
            done.update(adapter.pop_completed_store_tasks())
            return done.get(task)

        wait_for(adapter.get_store_event_fd(), stored)
        assert lookup()
        adapter.submit_unlock([key])
        with stopped(server):
            first, hit = timed(lookup)
            assert hit is False
            assert first <= FIRST_TIMEOUT_MAX_S
            for op in (lookup, load):
                elapsed, ok = timed(op)
                assert ok is False
                assert elapsed <= FAST_MAX_S
            elapsed, _ = timed(adapter.close)
            assert elapsed <= FIRST_TIMEOUT_MAX_S
    finally:
        adapter.close()


@pytest.mark.lmcache
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_lmcache_path_a_on_stalled_server(
    server: ServeProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("lmcache")
    import torch
    from lmcache.utils import CacheEngineKey

    from test_lmcache import _filled, path_a_backend

    monkeypatch.setenv("EPISTEMIC_GRAPH_KVCACHE_TOKEN", TOKEN)
    monkeypatch.setenv("EPISTEMIC_GRAPH_KVCACHE_CLIENT_LOOKUP_TIMEOUT_S", str(SHORT_TIMEOUT_S))
    monkeypatch.setenv("EPISTEMIC_GRAPH_KVCACHE_CLIENT_READ_TIMEOUT_S", str(LONG_TIMEOUT_S))
    with path_a_backend(server.url()) as (backend, local_cpu):
        key = CacheEngineKey("test/model", 1, 0, 4242, torch.float16)
        obj = _filled(local_cpu)
        futures = backend.batched_submit_put_task([key], [obj])
        assert futures is not None
        assert futures[0].result(30) == [True]
        obj.ref_count_down()
        assert backend.batched_contains([key]) == 1
        with stopped(server):
            first, found = timed(lambda: backend.batched_contains([key]))
            assert found == 0
            assert first <= FIRST_TIMEOUT_MAX_S
            elapsed, found = timed(lambda: backend.contains(key))
            assert found is False
            assert elapsed <= FAST_MAX_S
            elapsed, got = timed(lambda: backend.get_blocking(key))
            assert got is None
            assert elapsed <= FAST_MAX_S
            elapsed, _ = timed(backend.close)
            assert elapsed <= FIRST_TIMEOUT_MAX_S
