"""The compiled twin of RESP's inline dispatcher (`run_fast`) against the pure one.

server/resp/fastpath.py is the pure-Python reference; server/resp/_fastpath_c is the
same source compiled by Cython (setup.py), picked at import by server/resp/fast.py. Each
twin runs on a real connection's `Dispatcher` (a real `ServerContext`, the real RESP
framer as its queue, a real store: memory, or durable where a SET is a group-commit
future), fed the same random script: pipelined GET, SET, EXISTS and STRLEN in every
spelling, with the commands the fast path must leave to the task (other commands, extra
arguments, a block too big to store at once, a key that is not UTF-8, malformed input)
mixed in, in reads of random sizes, with a random command limit, a peer that stops
reading at a random write, the access log on or off, and a transaction of the tenant
holding its gate. Both must take the same commands, write the same bytes in the same
writes, leave the same commands to the task, start the same SETs, and keep the same
books: the store's counters, the request metrics, the tenant's INFO tallies.

Where the compiled twin is not built these tests are skipped; tests/test_twins.py checks
that it is built and selected where it should be (in CI, `KVCACHE_REQUIRE_COMPILED=1`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from epistemic_kvcache.errors import RemoteProtocolError
from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.proto.resp import NEED_DATA
from epistemic_kvcache.server.context import ServerContext
from epistemic_kvcache.server.resp import fastpath as pure
from epistemic_kvcache.store import SharedKvIndex, SharedKvStoreBackend
from epistemic_kvcache.store.api import SharedKvBackend
from helpers import compiled_twin
from servers import run_in_context
from test_server_resp_dispatch import TOKEN_A, Conn, cmd

compiled, needs_compiled = compiled_twin("epistemic_kvcache.server.resp._fastpath_c")

KEYS = [b"k", b"k2", b"key:000001", b"\xff\xfe", b"other"]
BIG = 300 << 10  # above what put_nowait stores at once: the task's (WOULD_BLOCK)


def _command(draw: st.DrawFn) -> bytes:
    key = draw(st.sampled_from(KEYS))
    kind = draw(st.sampled_from(["get", "set", "exists", "strlen", "other", "extra", "bad"]))
    if kind == "get":
        return cmd(draw(st.sampled_from([b"GET", b"get", b"Get", b"gEt"])), key)
    if kind == "set":
        size = draw(st.sampled_from([0, 1, 100, 4096, 20_000, 70_000, BIG]))
        fill = draw(st.sampled_from([b"a", b"b"]))
        return cmd(draw(st.sampled_from([b"SET", b"set", b"Set"])), key, fill * size)
    if kind == "exists":
        keys = draw(st.lists(st.sampled_from(KEYS), min_size=1, max_size=3))
        return cmd(draw(st.sampled_from([b"EXISTS", b"exists"])), *keys)
    if kind == "strlen":
        return cmd(draw(st.sampled_from([b"STRLEN", b"strlen"])), key)
    if kind == "other":
        others = [cmd("PING"), cmd("DEL", key), cmd("SET", key, "v", "EX", "9")]
        return draw(st.sampled_from(others))
    if kind == "extra":
        return draw(st.sampled_from([cmd("GET", key, "x"), cmd("STRLEN"), cmd("GET")]))
    return b"*1\r\n$x\r\n"  # malformed: the framer's error, left to the task


@st.composite
def scripts(draw: st.DrawFn) -> dict[str, Any]:
    """The stream, cut into reads; per read the limit, the failing write, the drain."""
    stream = b"".join(draw(st.lists(st.composite(lambda d: _command(d))(), max_size=40)))
    cuts = sorted(draw(st.lists(st.integers(0, len(stream)), max_size=6)))
    pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    steps = [
        {
            "data": piece,
            "limit": draw(st.sampled_from([1, 2, 5, 64])),
            "stall_at": draw(st.sampled_from([None, None, 0, 1])),  # write that says "slow"
            "drain": draw(st.integers(0, 2)),  # commands the "task" takes after the read
            "held": draw(st.booleans()) and draw(st.booleans()),  # a transaction holds
        }
        for piece in pieces
    ]
    return {"steps": steps, "access_log": draw(st.booleans())}


def _step(
    data: bytes, limit: int = 64, stall_at: int | None = None, drain: int = 0
) -> dict[str, Any]:
    return {"data": data, "limit": limit, "stall_at": stall_at, "drain": drain, "held": False}


WORKED = {
    "steps": [
        _step(cmd("SET", "k", "v") * 3 + cmd("GET", "k")),
        _step(cmd("SET", "k", b"x" * BIG) + cmd("GET", "k"), drain=2),  # the task's SET
        # replies past FAST_FLUSH_BYTES are handed over, and a slow peer stops it
        _step(cmd("SET", "k", b"y" * 40_000) + cmd("GET", "k") * 5, stall_at=0),
    ],
    "access_log": False,
}


def _series(ctx: ServerContext) -> dict[tuple[str, ...], tuple[int, int]]:
    out = {}
    for table in ctx.metrics._tables:
        for labels, s in table.items():
            out[labels] = (s.count, sum(s.buckets))
    return out


def _drive(twin: ModuleType, script: dict[str, Any], backend: str, tmp: Path) -> list[object]:
    """Everything `twin.run_fast` did over `script`, in order, then the books."""
    record: list[object] = []
    store: SharedKvBackend
    if backend == "durable":
        store = SharedKvStoreBackend(tmp, StoreOptions(map_size_bytes=64 << 20))
    else:
        store = SharedKvIndex(StoreOptions(warm_capacity_bytes=0))

    async def scenario(ctx: ServerContext) -> None:
        ctx.access_log.enabled = script["access_log"]
        c = Conn(ctx)
        await c.login()
        c.transport.take()
        d = c.proto._dispatcher
        queue = d.queue
        s = d.session
        assert s.identity is not None
        tenant = s.identity.tenant
        for step in script["steps"]:
            writes: list[bytes] = []
            stall_at = step["stall_at"]

            def write(buffers: list[Any], writes: list[bytes] = writes, at: Any = stall_at) -> bool:
                writes.append(b"".join(bytes(b) for b in buffers))
                return len(writes) - 1 != at

            queue.feed(step["data"])
            if step["held"]:
                s.shared.gates.held.add(tenant)
            taken = twin.run_fast(d, write, step["limit"], None)
            s.shared.gates.held.discard(tenant)
            record.append(("took", taken, writes, len(d.started), d._gate))
            if d.started:
                replies = await d.finish_started()
                record.append(("started", [b"".join(map(bytes, d.encode(r))) for r in replies]))
            for _ in range(step["drain"]):
                try:
                    left = queue.next_command()
                except RemoteProtocolError as exc:
                    record.append(("error", str(exc)))
                    return
                if left is NEED_DATA:
                    break
                record.append(("left", [bytes(a) for a in left]))
        record.append(("last", s.last_route, type(s.last_command), type(d.fast_ended)))
        activity = s.shared.activity(tenant)
        record.append(
            (
                "activity",
                activity.commands,
                {r: (st_.calls, st_.failed) for r, st_ in activity.per_command.items()},
            )
        )
        record.append(("series", _series(ctx)))
        record.append(("stats", dataclasses.asdict(store.stats(tenant))))

    run_in_context(scenario, tokens={TOKEN_A: "alpha"}, store=store)
    return record


@needs_compiled
@pytest.mark.parametrize("backend", ["memory", "durable"])
@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(script=scripts())
@example(script=WORKED)
def test_both_twins_dispatch_alike(
    backend: str, script: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    got = {
        name: _drive(twin, script, backend, tmp_path_factory.mktemp(name))
        for name, twin in (("pure", pure), ("compiled", compiled))
    }
    assert got["compiled"] == got["pure"]


@needs_compiled
def test_the_twins_answer_a_pipelined_read_and_stop_where_the_task_must_go_on(
    tmp_path: Path,
) -> None:
    """A worked case, read whole: what each twin writes for a mixed read."""
    data = (
        cmd("SET", "k", "v1")
        + cmd("GET", "k")
        + cmd("EXISTS", "k", "nope", "k")
        + cmd("STRLEN", "k")
        + cmd("get", "nope")
        + cmd("PING")
        + cmd("GET", "k")
    )
    script = {"steps": [_step(data, drain=2)], "access_log": False}
    for twin in (pure, compiled):
        record = _drive(twin, script, "memory", tmp_path / twin.__name__)
        assert record[0] == ("took", 5, [b"+OK\r\n$2\r\nv1\r\n:2\r\n:2\r\n$-1\r\n"], 0, None)
        assert record[1] == ("left", [b"PING"])
        assert record[2] == ("left", [b"GET", b"k"])
