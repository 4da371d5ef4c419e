"""The Python cost of one read on the RESP inline fast path, in this process (issue 29).

    PYTHONPATH=src .venv/bin/python -m bench.bench_fastpath [--n 40000]
    PYTHONPATH=/path/to/old/src .venv/bin/python -m bench.bench_fastpath   # a before
    .venv/bin/python -m bench.bench_fastpath --twins [--pipeline 32]      # issue 27
    .venv/bin/python -m bench.bench_fastpath --framer   # the RESP framer's two twins alone

One connection (`make_resp_factory`) over the recording transport of the tests
(tests/helpers.py `FakeTransport`), a real `SharedKvIndex` behind it (tests/servers.py
`run_in_context`); each read is one command (EXISTS of a present key, a 4 KiB GET, a
4 KiB SET), or `--pipeline K` of them, copied into `get_buffer` and handed over by
`buffer_updated`, as uvloop does. Prints the thread CPU time per read, best of 5: the
read callback, the framer, the dispatcher, the store and the metrics, without the socket
and the event loop (those are the rest of a server's CPU per request: `bench_floor`).
The machine's load hardly moves it, so two source trees compare well one after the
other. `--twins` times both twins of `run_fast` (server/resp/fast.py) on the same
connection, alternately round by round (which goes first alternates too), and prints
per command; many short rounds (`--n 2000 --rounds 40`) resist a noisy host best.

`--framer` times the RESP framer's two twins alone instead (`RespParser`, pure and
compiled; thread CPU time, best of 5), driven as a connection drives them: `get_buffer`,
copy a read in, `buffer_updated`, take every command, read `has_error` and
`pending_bytes`; one command per read and 16 pipelined, for a 4 KiB SET and an EXISTS.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from epistemic_kvcache.proto.resp import serialize
from epistemic_kvcache.server.context import ServerContext
from epistemic_kvcache.server.resp import fastpath, make_resp_factory
from epistemic_kvcache.server.resp.fastpath import INLINE_MAX_COMMANDS
from helpers import FakeTransport
from servers import run_in_context

TOKEN = "bench-fastpath-token-0123"


def cmd(*args: str | bytes) -> bytes:
    """One command as a RESP array of bulk strings."""
    parts = [a.encode() if isinstance(a, str) else a for a in args]
    return b"".join(bytes(b) for b in serialize(parts, 2))


def deliver(proto: Any, data: bytes) -> None:
    """`data` as uvloop hands it over: into `get_buffer`, in as many reads as it needs."""
    view = memoryview(data)
    while view:
        buf = proto.get_buffer(len(view))
        step = min(len(buf), len(view))
        buf[:step] = view[:step]
        proto.buffer_updated(step)
        view = view[step:]


def _twins() -> list[tuple[str, Callable[..., int] | None]]:
    """`run_fast`'s two twins to time, as (label, function)."""
    try:
        from epistemic_kvcache.server.resp import _fastpath_c
    except ImportError as exc:
        raise SystemExit(f"--twins: the compiled twin is not built ({exc})") from None
    return [("pure", fastpath.run_fast), ("compiled", _fastpath_c.run_fast)]


def framer_alone() -> dict[str, float]:
    """µs per command of each framer twin: "<command> <per read> <twin>" -> µs."""
    from epistemic_kvcache.proto import resp_parser
    from epistemic_kvcache.proto.resp import NEED_DATA

    try:
        from epistemic_kvcache.proto import _resp_parser_c as compiled
    except ImportError as exc:
        raise SystemExit(f"--framer: the compiled twin is not built ({exc})") from None
    key = b"key:000000000001"
    cases = {"4 KiB SET": cmd("SET", key, b"x" * 4096), "EXISTS": cmd("EXISTS", key)}

    def per_command(cls: type, payload: bytes, per_read: int, n: int = 64_000) -> float:
        p = cls(authenticated=True)
        data = payload * per_read
        t0 = time.thread_time()
        for _ in range(n // per_read):
            buf = p.get_buffer(-1)
            buf[: len(data)] = data
            p.buffer_updated(len(data))
            while p.next_command() is not NEED_DATA:
                pass
            _ = p.has_error, p.pending_bytes
        return (time.thread_time() - t0) / n * 1e6

    results: dict[str, float] = {}
    print("| command | commands per read | pure µs/command | compiled µs/command | speedup |")
    print("|---|---|---|---|---|")
    for label, payload in cases.items():
        for per_read in (1, 16):
            pure = min(per_command(resp_parser.RespParser, payload, per_read) for _ in range(5))
            comp = min(per_command(compiled.RespParser, payload, per_read) for _ in range(5))
            results[f"{label} {per_read} pure"] = pure
            results[f"{label} {per_read} compiled"] = comp
            print(f"| {label} | {per_read} | {pure:.2f} | {comp:.2f} | {pure / comp:.1f}x |")
    return results


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=40_000, help="reads per timing")
    ap.add_argument("--pipeline", type=int, default=1, help="commands per read (at most 64)")
    ap.add_argument("--twins", action="store_true", help="time both twins of run_fast")
    ap.add_argument("--rounds", type=int, default=5, help="timings per figure (the best)")
    ap.add_argument("--framer", action="store_true", help="the RESP framer's twins alone")
    args = ap.parse_args(argv)
    if args.framer:
        return framer_alone()
    n, k = args.n, args.pipeline
    if not 1 <= k <= INLINE_MAX_COMMANDS:
        raise SystemExit(f"--pipeline: 1 to {INLINE_MAX_COMMANDS} (what one read answers inline)")
    twins = _twins() if args.twins else [("", None)]  # None: leave the twin fast.py picked
    results: dict[str, float] = {}

    async def scenario(ctx: ServerContext) -> None:
        proto: Any = make_resp_factory(ctx)()
        tr = FakeTransport().connect(proto)
        for setup in (cmd("AUTH", TOKEN), cmd("SET", "key:1", b"x" * 4096)):
            tr.receive(setup)
            await asyncio.sleep(0.05)
        tr.take()
        dispatcher = proto._dispatcher
        reads = {
            "EXISTS": cmd("EXISTS", "key:1") * k,
            "4 KiB GET": cmd("GET", "key:1") * k,
            "4 KiB SET": cmd("SET", "key:1", b"x" * 4096) * k,
        }
        for label, data in reads.items():
            best = dict.fromkeys((f"{label} {name}".strip() for name, _ in twins), float("inf"))
            for r in range(args.rounds):
                for name, fn in twins[r % 2 :] + twins[: r % 2]:  # alternately, by round
                    if fn is not None:
                        dispatcher.run_fast = types.MethodType(fn, dispatcher)
                    t0 = time.thread_time()
                    for _ in range(n):
                        deliver(proto, data)
                        tr.written.clear()
                    key = f"{label} {name}".strip()
                    best[key] = min(best[key], (time.thread_time() - t0) / n * 1e6)
                    await asyncio.sleep(0)
            results.update(best)

    run_in_context(scenario, tokens={TOKEN: "alpha"})
    if args.twins:
        print(" | ".join(f"{key} {v / k:.3f} us/command" for key, v in results.items()))
    else:
        print(" | ".join(f"{key} {v:.2f} us/read" for key, v in results.items()))
    return results


if __name__ == "__main__":
    main()
