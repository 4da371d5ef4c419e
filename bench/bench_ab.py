"""A/B of our server's source trees against redis-server, side by side in one run.

    .venv/bin/python -m bench.bench_ab --trees before=/path/to/old/src,after=src \\
        [--sizes 4KiB,256KiB,4MiB,32MiB] [--repeat 3] [--http] [--cap-mib 64]

For a change to the wire or store path: check the old commit out somewhere (e.g.
`git worktree add /tmp/before main`) and pass its `src`. Each round runs, per block size,
redis-server (no persistence) and then our memory backend from every tree (RESP SET then
GET; with `--http` also HTTP PUT then GET on the same server), with the same load
generator as `bench_server` (bench/loadgen.py). Each tree's server is a fresh process
started with that tree first on PYTHONPATH, for each wire (the HTTP pass used to run on
the server the RESP pass had just filled, which cost it the fresh memory the RESP pass
had: at 32 MiB HTTP PUT read 0.33x of RESP SET that way, 1.00x on a server of its own).
The table gives, per cell, the median GB/s and the median of the per-round ratios to
redis-server of the same round, with every round's ratio, so the spread a shared
machine adds stays visible.

`--cap-mib N` measures a cache in its steady state instead of a fresh server filling:
both servers are capped at N MiB (redis-server `--maxmemory N` with `allkeys-lru`, ours
`--hot-capacity-bytes N` without a warm tier), a first SET pass of `--budget-mib` fills
them, and the measured pass writes as much again, every SET evicting an older block
(and reusing its memory). Only SETs are measured then (a GET would mostly miss).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from bench.bench_cpu import parse_size
from bench.bench_server import (
    TOKEN,
    human,
    measure_http,
    measure_resp,
    measure_resp_sets,
    our_server,
    redis_server,
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", required=True, help="NAME=SRC_DIR,... (our server's sources)")
    ap.add_argument("--sizes", default="4KiB,256KiB,4MiB,32MiB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--budget-mib", type=int, default=128, help="bytes per pass")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--http", action="store_true", help="also HTTP PUT/GET")
    ap.add_argument("--cap-mib", type=int, default=0, help="both servers full: SET only")
    args = ap.parse_args()
    trees = [tuple(t.split("=", 1)) for t in args.trees.split(",")]
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    budget = args.budget_mib << 20
    tmp = Path(tempfile.mkdtemp(prefix="kvbench-ab-"))
    gbps: dict[tuple[str, int, str], list[float]] = {}
    saved = os.environ.get("PYTHONPATH")

    def note(who: str, size: int, op: str, value: float) -> None:
        gbps.setdefault((who, size, op), []).append(value)

    cap = args.cap_mib
    ours_options = (
        ["--hot-capacity-bytes", f"{cap}MiB", "--warm-capacity-bytes", "0",
         "--max-block-bytes", "64MiB"]
        if cap
        else None
    )  # fmt: skip

    def resp(port: int, token: str | None, size: int) -> tuple[float, float]:
        if not cap:
            s, g = measure_resp(port, token, size, budget, args.clients)
            return s.gbps, g.gbps
        measure_resp_sets(port, token, size, budget, args.clients)  # fill the cache
        return measure_resp_sets(port, token, size, budget, args.clients).gbps, 0.0

    try:
        for rnd in range(args.repeat):
            for size in sizes:
                with redis_server(tmp, fsync_always=False, maxmemory_mib=cap) as port:
                    s, g = resp(port, None, size)
                note("redis", size, "SET", s)
                note("redis", size, "GET", g)
                for name, src in trees:
                    os.environ["PYTHONPATH"] = str(Path(src).resolve())
                    launch = (
                        our_server(tmp, "memory", options=ours_options)
                        if ours_options
                        else our_server(tmp, "memory")
                    )
                    with launch as (_, rport):
                        s, g = resp(rport, TOKEN, size)
                        note(name, size, "SET", s)
                        note(name, size, "GET", g)
                    if args.http and not cap:  # a fresh server too, like the RESP pass
                        with our_server(tmp, "memory") as (hport, _):
                            sh, gh = measure_http(hport, size, budget, args.clients)
                        note(f"{name} HTTP", size, "SET", sh.gbps)
                        note(f"{name} HTTP", size, "GET", gh.gbps)
                print(f"round {rnd + 1}/{args.repeat}: {human(size)} done", file=sys.stderr)
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
        shutil.rmtree(tmp, ignore_errors=True)
    names = (
        ["redis"]
        + [n for n, _ in trees]
        + ([f"{n} HTTP" for n, _ in trees] if args.http and not cap else [])
    )
    state = f", both servers full at {cap} MiB (every SET evicts)" if cap else ""
    print(f"# {args.clients} connections, medians of {args.repeat} rounds{state}\n")
    print("| block | op | server | GB/s | ratio to redis-server | each round |")
    print("|---|---|---|---|---|---|")
    for size in sizes:
        for op in ("SET",) if cap else ("SET", "GET"):
            peer = gbps[("redis", size, op)]
            for who in names:
                got = gbps[(who, size, op)]
                ratios = [x / y for x, y in zip(got, peer, strict=True)]
                each = " ".join(f"{r:.2f}" for r in ratios)
                print(
                    f"| {human(size)} | {op} | {who} | {statistics.median(got):.3f} | "
                    f"**{statistics.median(ratios):.2f}x** | {each} |"
                )


if __name__ == "__main__":
    main()
