"""The RESP framer's compiled twin vs its pure twin vs redis-server (issue 27), one run.

    .venv/bin/python -m bench.bench_twins [--rounds 3] [--quick] [--event-loops N]
    .venv/bin/python -m bench.bench_twins --framer   # the two framers alone, in process

Three servers, side by side: redis-server without persistence, our memory backend with
the compiled twin of the RESP framer, and the same with the pure-Python twin
(EPISTEMIC_GRAPH_KVCACHE_PURE_PYTHON=1). Each round starts all three and drives each with
the same `redis-benchmark` commands, one server after the other, alternating which goes
first; the rounds repeat that and the medians are printed. For each command: requests/s
(redis-benchmark's own count) and the server's CPU time per request (utime + stime of
the server process from /proc across the command, the load generator excluded, as
bench/bench_cpu.py reads it). Prints `uptime` before and after: the machine's load.
`--event-loops N` runs our two servers with N event loops (0, the default: the server's
own default, one per usable core).

`--framer` times the two framers alone instead, in this process (thread CPU time, best
of 5): the way a connection drives them (`get_buffer`, copy a read in, `buffer_updated`,
take every command, read `has_error` and `pending_bytes`), one command per read and 16
pipelined, for a 4 KiB SET and an EXISTS.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from bench.bench_cpu import cpu_split, pid_listening
from bench.bench_server import TOKEN, our_server, redis_server
from epistemic_kvcache.config.loading import load_config
from epistemic_kvcache.config.settings import add_arguments
from epistemic_kvcache.options import StoreOptions

PURE_ENV = "EPISTEMIC_GRAPH_KVCACHE_PURE_PYTHON"
OUR_OPTIONS = ["--hot-capacity-bytes", "6GiB", "--warm-capacity-bytes", "0",
               "--max-block-bytes", "64MiB"]  # fmt: skip


def our_store_options() -> StoreOptions:
    """The store options ours runs with here: `OUR_OPTIONS` read as the server reads its
    flags (everything else at its default, no environment), for benchmarks that drive
    the store in process."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return load_config(vars(parser.parse_args(OUR_OPTIONS)), env={}).store


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


def run_benchmark_split(
    port: int, auth: str | None, args: list[str], n: int
) -> tuple[float, float, float]:
    """(requests/s, server user and system CPU microseconds per request) of one
    redis-benchmark command."""
    pid = pid_listening(port)
    cmd = ["redis-benchmark", "-p", str(port), "-n", str(n), "--csv", *args]
    if auth is not None:
        cmd[1:1] = ["-a", auth]
    u0, s0 = cpu_split(pid)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600).stdout
    u1, s1 = cpu_split(pid)
    rows = [r for r in csv.reader(io.StringIO(out)) if r and r[0] != "test"]
    return float(rows[-1][1]), (u1 - u0) / n * 1e6, (s1 - s0) / n * 1e6


def run_benchmark(port: int, auth: str | None, args: list[str], n: int) -> tuple[float, float]:
    """(requests/s, server CPU microseconds per request) of one redis-benchmark command."""
    rps, user, system = run_benchmark_split(port, auth, args, n)
    return rps, user + system


@contextmanager
def servers(
    tmp: Path, round_no: int, loops: int = 0
) -> Iterator[dict[str, tuple[int, str | None]]]:
    """The three servers of one round: name -> (RESP port, password); ours with `loops`
    event loops (0: their default)."""
    extra = ["--event-loops", str(loops)] if loops else []
    with ExitStack() as stack:
        out: dict[str, tuple[int, str | None]] = {}
        out["redis-server"] = (stack.enter_context(redis_server(tmp, fsync_always=False)), None)
        for name, pure in (("compiled twin", False), ("pure twin", True)):
            old = os.environ.pop(PURE_ENV, None)
            if pure:
                os.environ[PURE_ENV] = "1"
            try:
                d = tmp / f"r{round_no}-{'pure' if pure else 'compiled'}"
                d.mkdir()
                _, resp = stack.enter_context(
                    our_server(d, "memory", options=[*OUR_OPTIONS, *extra])
                )
            finally:
                os.environ.pop(PURE_ENV, None)
                if old is not None:
                    os.environ[PURE_ENV] = old
            out[name] = (resp, TOKEN)
        yield out


def framer_alone() -> None:
    from epistemic_kvcache.proto import resp_parser

    try:
        from epistemic_kvcache.proto import _resp_parser_c as compiled
    except ImportError:
        raise SystemExit(
            "the compiled twin is not built: python setup.py build_ext --inplace"
        ) from None
    from epistemic_kvcache.proto.resp import NEED_DATA

    key = b"key:000000000001"
    cases = {
        "4 KiB SET": b"*3\r\n$3\r\nSET\r\n$16\r\n%s\r\n$4096\r\n%s\r\n" % (key, b"x" * 4096),
        "EXISTS": b"*2\r\n$6\r\nEXISTS\r\n$16\r\n%s\r\n" % key,
    }

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

    print("| command | commands per read | pure us/command | compiled us/command | speedup |")
    print("|---|---|---|---|---|")
    for label, payload in cases.items():
        for per_read in (1, 16):
            pure = min(per_command(resp_parser.RespParser, payload, per_read) for _ in range(5))
            comp = min(per_command(compiled.RespParser, payload, per_read) for _ in range(5))
            print(f"| {label} | {per_read} | {pure:.2f} | {comp:.2f} | {pure / comp:.1f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a quarter of the requests")
    ap.add_argument("--framer", action="store_true", help="the two framers alone")
    ap.add_argument("--event-loops", type=int, default=0, help="ours: N loops (0: default)")
    args = ap.parse_args()
    if args.framer:
        print("load:", subprocess.run(["uptime"], capture_output=True, text=True).stdout)
        framer_alone()
        return
    names = ["redis-server", "compiled twin", "pure twin"]
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    print("load before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout)
    with tempfile.TemporaryDirectory(prefix="kvbench-twins-") as t:
        for r in range(args.rounds):
            with servers(Path(t), r, args.event_loops) as ports:
                for label, bargs, n in COMMANDS:
                    n = n // 4 if args.quick else n
                    order = names[r % 3 :] + names[: r % 3]
                    for name in order:
                        port, auth = ports[name]
                        results.setdefault((label, name), []).append(
                            run_benchmark(port, auth, bargs, n)
                        )
    print("load after:", subprocess.run(["uptime"], capture_output=True, text=True).stdout)
    loops = args.event_loops or "default"
    print(f"medians of {args.rounds} rounds; CPU = server process utime+stime per request; "
          f"ours with --event-loops {loops}\n")  # fmt: skip
    print(
        "| command | redis-server req/s | compiled req/s | pure req/s | compiled / redis "
        "| pure / redis | redis CPU us/req | compiled CPU us/req | pure CPU us/req |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for label, _, _ in COMMANDS:
        rps = {n: statistics.median(x[0] for x in results[(label, n)]) for n in names}
        cpu = {n: statistics.median(x[1] for x in results[(label, n)]) for n in names}
        print(
            f"| {label} | {rps['redis-server']:,.0f} | {rps['compiled twin']:,.0f} "
            f"| {rps['pure twin']:,.0f} | {rps['compiled twin'] / rps['redis-server']:.2f}x "
            f"| {rps['pure twin'] / rps['redis-server']:.2f}x | {cpu['redis-server']:.1f} "
            f"| {cpu['compiled twin']:.1f} | {cpu['pure twin']:.1f} |"
        )


if __name__ == "__main__":
    main()
