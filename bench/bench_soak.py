"""Sustained LMCache load on a durable server with small tiers: RSS, tiers, batch GET p99.

    .venv/bin/python -m bench.bench_soak [--wire http resp] [--duration-s 1800]
        [--clients 1] [--warmup-s 120] [--out bench/out/soak] [--src DIR] [--option FLAG]

Per wire, a fresh server process (durable backend, hot 32 MiB, warm 64 MiB, cold 2 GiB,
in-flight budget 512 MiB) under LMCache's store and load patterns (bench/soak.py: batch
PUT of 16 x 4 MiB, batch EXISTS with a quarter of misses, batch GET of the hit prefix)
for `--duration-s`, from `--clients` LMCache instances at once. Prints the markdown table of docs/benchmarks.md ("Sustained LMCache
load") and writes, under `--out`, a CSV of the samples per wire (`soak-<wire>.csv`:
RSS and each tier's bytes / peak / capacity over time), the batch GET p99 per window
(`soak-<wire>-windows.csv`), `soak.json` and the plot `soak.png`. Exits 1 when a check
fails: an error, a tier over its capacity, RSS over the bound, or an RSS slope after
warm-up above `--max-slope-mib-per-min`. `--src` runs the server from another source
tree, e.g. an export of an older commit:

    git archive main | tar -x -C /tmp/kv-before
    .venv/bin/python -m bench.bench_soak --src /tmp/kv-before/src --duration-s 60
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from bench import soak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wire", nargs="+", choices=sorted(soak.WIRES), default=["http", "resp"])
    p.add_argument("--duration-s", type=float, default=1800.0, help="per wire (default 30 min)")
    p.add_argument("--warmup-s", type=float, default=120.0)
    p.add_argument("--window-s", type=float, default=60.0)
    p.add_argument("--sample-interval-s", type=float, default=1.0)
    p.add_argument("--block-mib", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument(
        "--clients", type=int, default=1, help="LMCache instances at once, one connection each"
    )
    p.add_argument("--miss-share", type=float, default=0.25)
    p.add_argument(
        "--max-slope-mib-per-min",
        type=float,
        help="default: soak.slope_allowance_mib_per_min (twice a one-batch step's slope)",
    )
    p.add_argument("--out", type=Path, default=Path("bench/out/soak"))
    p.add_argument("--src", type=Path, help="run the server from this source tree")
    p.add_argument("--option", action="append", default=[], help="extra server flag")
    args = p.parse_args()
    results = []
    cfg = soak.SoakConfig()
    for wire in args.wire:
        cfg = soak.SoakConfig(
            wire=wire,
            duration_s=args.duration_s,
            warmup_s=args.warmup_s,
            window_s=args.window_s,
            sample_interval_s=args.sample_interval_s,
            block_bytes=args.block_mib * soak.MiB,
            batch=args.batch,
            clients=args.clients,
            miss_share=args.miss_share,
            src=args.src,
            options=[o for opt in args.option for o in opt.split(" ", 1)],
        )
        with tempfile.TemporaryDirectory(prefix=f"soak-{wire}-") as tmp:
            results.append(soak.run(cfg, Path(tmp), log=lambda m: print(m, flush=True)))
    paths = soak.write_outputs(results, cfg, args.out)
    print(soak.table(results))
    for r in results:
        print(f"\n[{r.wire}] batch GET p99 per {cfg.window_s:.0f} s window (ms):")
        print("  " + ", ".join(f"{w:.0f}s {ms:.0f}" for w, ms, _n in r.get_p99_ms_by_window))
        if r.error_samples:
            print(f"[{r.wire}] errors: {r.error_samples}")
    print("\n" + "\n".join(f"wrote {p}" for p in paths.values()))
    allowance = args.max_slope_mib_per_min or soak.slope_allowance_mib_per_min(cfg)
    print(f"RSS slope allowance: {allowance:.2f} MiB/min")
    failed = [
        f"{r.wire}: {why}"
        for r in results
        for why in (
            [f"{r.errors} errors"] * bool(r.errors)
            + r.tiers_over_capacity
            + [f"RSS max {r.rss_max_mib:.0f} > bound {r.rss_bound_mib:.0f}"]
            * (r.rss_max_mib > r.rss_bound_mib)
            + [f"RSS slope {r.rss_slope_mib_per_min:+.2f} > {allowance:.2f} MiB/min"]
            * (r.rss_slope_mib_per_min > allowance)
        )
    ]
    if failed:
        print("FAILED: " + "; ".join(failed))
        sys.exit(1)
    print("OK")


if __name__ == "__main__":
    main()
