"""The floor of a Python server on uvloop, side by side with ours and redis-server (issues 27, 29).

    .venv/bin/python -m bench.bench_floor [--rounds 3] [--quick] [--event-loops 1]
    .venv/bin/python -m bench.bench_floor --floors dict,blake3,store,spin   # its variants too
    .venv/bin/python -m bench.bench_floor --serve 0 [--floor store]   # one floor alone (0: any port)

How much of our CPU per request could a compiled twin of our Python still remove? This
answers it with a third server: the least a Python server on uvloop does to answer
`redis-benchmark` correctly. It is one `asyncio.BufferedProtocol` per connection on
uvloop, framing with our own RESP framer (`RespParser`, the compiled twin when built),
a plain dict for the data, and the replies written with one `transport.write` per read.
It has no auth check (AUTH says OK), no store, no tiers, no hashing, no metrics, no
limits beyond the framer's: nothing else a real server needs. (A protocol error is
answered and closes the connection, as ours does.) What it spends per request is the event loop's
callbacks, the framer and the kernel's socket calls; what ours spends above it is our
Python (dispatch, store, BLAKE3, metrics), which is all a compiled twin can reach;
whatever the floor spends above redis-server stays while the server runs on uvloop.

All three run at once; each round drives each with the same `redis-benchmark` commands
(`COMMANDS`), one server after the other (the order rotates per round), and the
medians are printed. CPU is the server process's utime and stime per request, from
/proc before and after each command (the load generator is another process).

`--floors dict,blake3,store` adds variants of the floor beside it, to split ours minus
the floor into its parts:
- `blake3`: the floor that also takes the BLAKE3 digest of every SET's value (the hash
  our content addressing needs), and nothing else;
- `store`: the floor with our real store (`SharedKvIndex`, the memory backend with ours'
  capacities) in place of its dict, called as our fast path calls it (`get_nowait`,
  `put_nowait`, `exists_nowait`; the blocking call on `WOULD_BLOCK`).
- `spin`: the floor that busy-waits `SPIN_S` (9 µs) per command and does nothing else:
  how the kernel's share of a request grows when the server is slower (the load
  generator sleeps more, and each reply has to wake it).
Ours minus `store` is then our connection, auth, dispatch, fast path and metrics; `store`
minus the floor is the store with its hash.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import select
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import cast

from bench.bench_core import OUR_OPTIONS, our_store_options, run_benchmark_split
from bench.bench_server import TOKEN, our_server, redis_server

# (label, redis-benchmark arguments, requests): keys are fixed (no -r), so GET and
# EXISTS find the key the SET before them wrote.
COMMANDS: list[tuple[str, list[str], int]] = [
    ("4 KiB SET -c 8", ["-t", "set", "-d", "4096", "-c", "8"], 40_000),
    ("4 KiB GET -c 8", ["-t", "get", "-d", "4096", "-c", "8"], 40_000),
    ("4 KiB SET -c 8 -P 16", ["-t", "set", "-d", "4096", "-c", "8", "-P", "16"], 160_000),
    ("4 KiB GET -c 8 -P 16", ["-t", "get", "-d", "4096", "-c", "8", "-P", "16"], 160_000),
    ("EXISTS -c 1", ["-c", "1", "EXISTS", "key:__rand_int__"], 20_000),
    ("EXISTS -c 8", ["-c", "8", "EXISTS", "key:__rand_int__"], 40_000),
    ("256 KiB SET -c 8", ["-t", "set", "-d", "262144", "-c", "8"], 3_000),
    ("256 KiB GET -c 8", ["-t", "get", "-d", "262144", "-c", "8"], 3_000),
]

FLOORS = {"dict": "floor", "blake3": "floor+blake3", "store": "floor+store", "spin": "floor+spin"}
"""The floor's variants (`--floor`) and their names in the tables."""
STORE_NS = "bench"
SPIN_S = 9e-6
"""The `spin` floor's busy wait per command: about ours' Python above the floor's."""


# -- the floor server ----------------------------------------------------------------


def serve_floor(port: int, variant: str = "dict") -> None:
    """Run the floor server (`variant`: a key of `FLOORS`) on loopback `port` (0: one
    the kernel picks) until killed; prints the port it listens on."""
    import uvloop
    from blake3 import blake3

    from epistemic_kvcache.buffers import received_block
    from epistemic_kvcache.errors import RemoteProtocolError
    from epistemic_kvcache.proto.resp import NEED_DATA
    from epistemic_kvcache.proto.resp_framer import IMPLEMENTATION, RespParser
    from epistemic_kvcache.store import SharedKvIndex
    from epistemic_kvcache.store.api import WOULD_BLOCK, Buffer

    data: dict[bytes, bytes] = {}
    hashing = variant == "blake3"
    spin = SPIN_S if variant == "spin" else 0.0
    store = SharedKvIndex(our_store_options()) if variant == "store" else None

    def get(key: bytes) -> Buffer | None:
        if store is None:
            return data.get(key)
        value = store.get_nowait(STORE_NS, str(key, "utf-8"))
        if value is WOULD_BLOCK:
            value = store.get(STORE_NS, str(key, "utf-8"))
        return value  # (formatted into the reply as it is: no copy first)

    def put(key: bytes, value: bytes | bytearray | memoryview) -> None:
        if store is None:
            data[key] = value if type(value) is bytes else bytes(value)
            if hashing:
                blake3(data[key]).digest()
            return
        block = value if type(value) is bytes else received_block(value)
        if store.put_nowait(STORE_NS, str(key, "utf-8"), block) is WOULD_BLOCK:
            store.put(STORE_NS, str(key, "utf-8"), block)

    def exists(keys: list[bytes]) -> int:
        if store is None:
            return sum(k in data for k in keys)
        return store.exists_nowait(STORE_NS, [str(k, "utf-8") for k in keys])  # (RAM: at once)

    class Floor(asyncio.BufferedProtocol):
        def __init__(self) -> None:
            self.parser = RespParser(authenticated=True)
            self.get_buffer = self.parser.get_buffer  # type: ignore[method-assign]
            self.transport: asyncio.Transport | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = cast(asyncio.Transport, transport)  # (uvloop's: not a subclass)

        def get_buffer(self, sizehint: int) -> memoryview:  # (bound per instance above)
            return self.parser.get_buffer(sizehint)

        def buffer_updated(self, nbytes: int) -> None:
            parser = self.parser
            parser.buffer_updated(nbytes)
            out: list[bytes] = []
            failed = False
            while True:
                try:
                    cmd = parser.next_command()
                except RemoteProtocolError as exc:
                    out.append(b"-ERR %s\r\n" % str(exc).encode())
                    failed = True
                    break
                if cmd is NEED_DATA:
                    break
                out.append(answer(cmd))
                if spin:
                    until = time.perf_counter() + spin
                    while time.perf_counter() < until:
                        pass
            if out and self.transport is not None:
                self.transport.write(out[0] if len(out) == 1 else b"".join(out))
            if failed and self.transport is not None:
                self.transport.close()

    def answer(cmd: list[bytes | bytearray | memoryview]) -> bytes:
        name = bytes(cmd[0]).upper() if cmd else b""
        if name == b"GET" and len(cmd) == 2:
            value = get(bytes(cmd[1]))
            return b"$-1\r\n" if value is None else b"$%d\r\n%s\r\n" % (len(value), value)
        if name == b"SET" and len(cmd) == 3:
            put(bytes(cmd[1]), cmd[2])
            return b"+OK\r\n"
        if name == b"MSET" and len(cmd) >= 3 and len(cmd) % 2 == 1:  # (bench_lookup's keys)
            for k, v in zip(cmd[1::2], cmd[2::2], strict=True):
                put(bytes(k), v)
            return b"+OK\r\n"
        if name == b"EXISTS" and len(cmd) >= 2:
            return b":%d\r\n" % exists([bytes(k) for k in cmd[1:]])
        if name == b"HELLO":  # (redis-py 7 opens with HELLO 3; AUTH in it is not checked)
            proto = bytes(cmd[1]) if len(cmd) > 1 else b"2"
            if proto not in (b"2", b"3"):
                return b"-NOPROTO unsupported protocol version\r\n"
            fields = b"$6\r\nserver\r\n$5\r\nfloor\r\n$5\r\nproto\r\n:%s\r\n" % proto
            return (b"%2\r\n" if proto == b"3" else b"*4\r\n") + fields
        if name in (b"AUTH", b"PING"):
            return b"+OK\r\n" if name == b"AUTH" else b"+PONG\r\n"
        if name == b"CONFIG":
            return b"*0\r\n"  # (redis-benchmark asks for `save` and `appendonly`)
        return b"-ERR unknown command\r\n"

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Floor, "127.0.0.1", port)
        bound = server.sockets[0].getsockname()[1]
        print(
            f"floor listening on 127.0.0.1:{bound} (framer: {IMPLEMENTATION}, {variant})",
            flush=True,
        )
        async with server:
            await server.serve_forever()

    uvloop.run(main())


@contextmanager
def floor_server(variant: str = "dict") -> Iterator[int]:
    """The floor server (`variant`: a key of `FLOORS`) in a child process -> its port
    (the kernel picks it)."""
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root / "src"), str(root)]))
    p = subprocess.Popen(
        [sys.executable, "-m", "bench.bench_floor", "--serve", "0", "--floor", variant],
        env=env, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert p.stdout is not None
        # its first line says it listens ("" once it died); a child that hangs is waited
        # for 60 s, not forever
        ready, _, _ = select.select([p.stdout], [], [], 60)
        line = p.stdout.readline() if ready else "(nothing within 60 s)"
        found = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
        if found is None:
            raise RuntimeError(f"the floor server did not start: {line!r}")
        yield int(found.group(1))
    finally:
        p.terminate()
        p.wait(10)
        if p.stdout is not None:
            p.stdout.close()


# -- the comparison ------------------------------------------------------------------


@contextmanager
def servers(
    tmp: Path, loops: int, floors: list[str]
) -> Iterator[dict[str, tuple[int, str | None]]]:
    """name -> (RESP port, password) of redis-server, the floors and ours."""
    extra = ["--event-loops", str(loops)] if loops else []
    with ExitStack() as stack:
        ports: dict[str, tuple[int, str | None]] = {}
        ports["redis-server"] = (stack.enter_context(redis_server(tmp, fsync_always=False)), None)
        for variant in floors:
            ports[FLOORS[variant]] = (stack.enter_context(floor_server(variant)), None)
        ours = stack.enter_context(our_server(tmp, "memory", options=[*OUR_OPTIONS, *extra]))
        ports["ours"] = (ours[1], TOKEN)
        yield ports


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a quarter of the requests")
    ap.add_argument("--event-loops", type=int, default=1, help="ours: N loops (0: default)")
    ap.add_argument("--scale", type=float, default=1.0, help="requests x this (--quick: 0.25)")
    ap.add_argument("--floors", default="dict", help="the floor's variants beside ours: "
                    "any of dict, blake3, store, spin, comma-separated")  # fmt: skip
    ap.add_argument("--serve", type=int, metavar="PORT", help="run one floor server alone")
    ap.add_argument("--floor", default="dict", choices=sorted(FLOORS), help="its variant")
    args = ap.parse_args()
    if args.serve is not None:
        serve_floor(args.serve, args.floor)
        return
    floors = [f for f in args.floors.split(",") if f]
    unknown = sorted(set(floors) - set(FLOORS))
    if unknown or not floors:
        ap.error(f"--floors: expected some of {', '.join(FLOORS)} (got {args.floors!r})")
    names = ["redis-server", *(FLOORS[f] for f in floors), "ours"]
    results: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    print("load before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout)
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="kvbench-floor-") as t,
        servers(Path(t), args.event_loops, floors) as ports,
    ):
        for r in range(args.rounds):
            for label, bargs, n in COMMANDS:
                n = max(1, int(n * (0.25 if args.quick else args.scale)))
                shift = r % len(names)
                for name in names[shift:] + names[:shift]:
                    port, auth = ports[name]
                    results.setdefault((label, name), []).append(
                        run_benchmark_split(port, auth, bargs, n)
                    )
    print("load after:", subprocess.run(["uptime"], capture_output=True, text=True).stdout)
    loops = args.event_loops or "default"
    print(f"medians of {args.rounds} rounds ({time.monotonic() - started:.0f} s); CPU = server "
          f"process user + system time per request; ours with --event-loops {loops}\n")  # fmt: skip
    others = names[1:]
    print(
        f"| command | req/s {' / '.join(names)} | "
        + " | ".join(f"{n} / redis" for n in others)
        + f" | CPU us/req (user+sys) {' | '.join(names)} | ours - {names[1]} |"
    )
    print("|---" * (2 + len(others) + len(names)) + "|")
    for label, _, _ in COMMANDS:
        rps = {s: statistics.median(x[0] for x in results[(label, s)]) for s in names}
        user = {s: statistics.median(x[1] for x in results[(label, s)]) for s in names}
        sys_ = {s: statistics.median(x[2] for x in results[(label, s)]) for s in names}
        cpu = {s: user[s] + sys_[s] for s in names}
        ratios = " | ".join(f"{rps[s] / rps['redis-server']:.2f}x" for s in others)
        cells = " | ".join(f"{cpu[s]:.1f} ({user[s]:.1f}+{sys_[s]:.1f})" for s in names)
        print(
            f"| {label} | {' / '.join(f'{rps[s]:,.0f}' for s in names)} | {ratios} "
            f"| {cells} | {cpu['ours'] - cpu[names[1]]:+.1f} |"
        )


if __name__ == "__main__":
    main()
