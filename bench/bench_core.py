"""Source trees and twins of our server against redis-server, `redis-benchmark` side by side.

    .venv/bin/python -m bench.bench_core --trees before=/tmp/before/src,now=src,pure=src:store_core \\
        [--rounds 5] [--scale 1.0]

For a change to the hot path of small requests (issue 27: the store's hot core). Each
tree is `NAME=SRC_DIR`, optionally `:TWINS`, the twins that tree runs pure
(`EPISTEMIC_GRAPH_KVCACHE_PURE_PYTHON`, e.g. `store_core`, `resp_framer` or `1`). To
compare with an older commit, check it out (`git worktree add /tmp/before <commit>`) and,
for its compiled RESP framer, build it there or copy the `.so` when the framer's source is
the same. Each round starts redis-server (no persistence) and one memory-backend server
per tree (`OUR_OPTIONS`, one event loop), then runs every command against
each, rotating who goes first; a cell is the median over rounds of requests per second
(its ratio to redis-server's median) and of the server's CPU (user + system) per request.

Without `-r`, redis-benchmark writes one key with the same value again and again: SET is
a duplicate PUT (the store's hit path), GET a hot hit. With `-r 100000` most SETs are of
keys not yet held (the engine's general path).
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import statistics
import subprocess
import tempfile
from contextlib import ExitStack
from pathlib import Path

from bench.bench_cpu import cpu_split, pid_listening
from bench.bench_server import TOKEN, our_server, redis_server
from epistemic_kvcache.config.loading import load_config
from epistemic_kvcache.config.settings import add_arguments
from epistemic_kvcache.options import StoreOptions

PURE_ENV = "EPISTEMIC_GRAPH_KVCACHE_PURE_PYTHON"
OUR_OPTIONS = ["--hot-capacity-bytes", "6GiB", "--warm-capacity-bytes", "0",
               "--max-block-bytes", "64MiB"]  # fmt: skip
"""Our server's flags beside redis-server (memory backend): every block fits in hot."""


def our_store_options() -> StoreOptions:
    """The store options ours runs with here: `OUR_OPTIONS` read as the server reads its
    flags (everything else at its default, no environment), for benchmarks that drive
    the store in process."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return load_config(vars(parser.parse_args(OUR_OPTIONS)), env={}).store


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


# (label, redis-benchmark arguments, requests at --scale 1)
COMMANDS: list[tuple[str, list[str], int]] = [
    ("4 KiB SET -c 8", ["-t", "set", "-d", "4096", "-c", "8"], 40_000),
    ("4 KiB GET -c 8", ["-t", "get", "-d", "4096", "-c", "8"], 40_000),
    ("EXISTS -c 8", ["-c", "8", "EXISTS", "key:__rand_int__"], 40_000),
    ("4 KiB SET -c 8 -P 16", ["-t", "set", "-d", "4096", "-c", "8", "-P", "16"], 160_000),
    ("4 KiB SET -c 8 -r 100000", ["-t", "set", "-d", "4096", "-c", "8", "-r", "100000"], 40_000),
    ("4 KiB GET -c 8 -r 100000", ["-t", "get", "-d", "4096", "-c", "8", "-r", "100000"], 40_000),
    ("256 KiB SET -c 8", ["-t", "set", "-d", "262144", "-c", "8"], 3_000),
    ("256 KiB GET -c 8", ["-t", "get", "-d", "262144", "-c", "8"], 3_000),
]


def parse_trees(spec: str) -> list[tuple[str, Path, str | None]]:
    """`NAME=SRC[:TWINS],...` -> (name, source dir, pure twins or None)."""
    out: list[tuple[str, Path, str | None]] = []
    for part in spec.split(","):
        name, sep, rest = part.partition("=")
        if not sep or not name or not rest:
            raise SystemExit(f"--trees: expected NAME=SRC[:TWINS], got {part!r}")
        src, _, pure = rest.partition(":")
        if not (Path(src) / "epistemic_kvcache").is_dir():
            raise SystemExit(f"--trees: {src} has no epistemic_kvcache package")
        out.append((name, Path(src).resolve(), pure or None))
    return out


def run(
    trees: list[tuple[str, Path, str | None]], rounds: int, scale: float
) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """(command label, server name) -> one (requests/s, CPU µs per request) per round."""
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", PURE_ENV)}
    try:
        for r in range(rounds):
            with tempfile.TemporaryDirectory() as t, ExitStack() as stack:
                tmp = Path(t)
                redis_port = stack.enter_context(redis_server(tmp, fsync_always=False))
                ports: dict[str, tuple[int, str | None]] = {"redis-server": (redis_port, None)}
                for i, (name, src, pure) in enumerate(trees):
                    os.environ["PYTHONPATH"] = str(src)
                    os.environ.pop(PURE_ENV, None)
                    if pure:
                        os.environ[PURE_ENV] = pure
                    d = tmp / f"tree{i}"
                    d.mkdir()
                    options = [*OUR_OPTIONS, "--event-loops", "1"]
                    _, resp = stack.enter_context(our_server(d, "memory", options=options))
                    ports[name] = (resp, TOKEN)
                for label, args, n in COMMANDS:
                    names = list(ports)
                    names = names[r % len(names) :] + names[: r % len(names)]
                    for name in names:
                        port, auth = ports[name]
                        rps, user, system = run_benchmark_split(
                            port, auth, args, max(100, int(n * scale))
                        )
                        results.setdefault((label, name), []).append((rps, user + system))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return results


def table(results: dict[tuple[str, str], list[tuple[float, float]]], names: list[str]) -> str:
    """The medians as a markdown table: req/s (x redis-server), then CPU µs per request."""
    head = " | ".join(f"{n} req/s (x redis)" for n in names)
    lines = [
        f"| command | {head} | CPU µs/req redis-server / {' / '.join(names)} |",
        "|---" * (len(names) + 2) + "|",
    ]
    for label, _, _ in COMMANDS:
        med = {
            n: (
                statistics.median(x[0] for x in results[(label, n)]),
                statistics.median(x[1] for x in results[(label, n)]),
            )
            for n in ["redis-server", *names]
        }
        base = med["redis-server"][0]
        cells = " | ".join(f"{med[n][0]:,.0f} ({med[n][0] / base:.2f}x)" for n in names)
        cpu = " / ".join(f"{med[n][1]:.1f}" for n in ["redis-server", *names])
        lines.append(f"| {label} | {cells} | {cpu} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", required=True, help="NAME=SRC_DIR[:PURE_TWINS],...")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--scale", type=float, default=1.0, help="requests x this")
    args = ap.parse_args(argv)
    trees = parse_trees(args.trees)
    with open("/proc/loadavg") as f:
        before = f.read().split()[:3]
    results = run(trees, args.rounds, args.scale)
    with open("/proc/loadavg") as f:
        after = f.read().split()[:3]
    print(f"medians of {args.rounds} rounds; load average before {before}, after {after}")
    print(table(results, [name for name, _, _ in trees]))


if __name__ == "__main__":
    main()
