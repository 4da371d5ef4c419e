"""Abuse scenarios (issue 10): a well-behaved client's latency and the server's RSS.

    .venv/bin/python -m bench.bench_abuse [--src DIR] [--only NAME ...] [--loaded-s 6]

For every scenario of `bench/abuse.py`, on a fresh server process (durable backend,
default limits): tenant B's 4 KiB GET p99 over RESP and HTTP, unloaded and while the
attack runs, the failures the attack caused for tenant B, and the server's RSS before
and at its peak (sampled from /proc every 20 ms). `--src` runs the server from another
source tree, e.g. an export of an older commit for a before/after comparison:

    git archive main | tar -x -C /tmp/kv-before
    .venv/bin/python -m bench.bench_abuse --src /tmp/kv-before/src
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench import abuse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, help="run the server from this source tree")
    parser.add_argument("--only", nargs="*", choices=sorted(abuse.SCENARIOS_BY_NAME))
    parser.add_argument("--unloaded-s", type=float, default=2.0)
    parser.add_argument("--loaded-s", type=float, default=6.0)
    parser.add_argument("--json", type=Path, help="also write the outcomes here")
    parser.add_argument("--option", action="append", default=[], help="extra server flag")
    args = parser.parse_args()
    names = args.only or [s.name for s in abuse.SCENARIOS]
    print(abuse.HEADER, flush=True)
    outcomes = []
    for name in names:
        outcome = abuse.run_isolated(
            abuse.SCENARIOS_BY_NAME[name],
            src=args.src,
            options=[o for opt in args.option for o in opt.split(" ", 1)],
            unloaded_s=args.unloaded_s,
            loaded_s=args.loaded_s,
        )
        outcomes.append(outcome)
        print(outcome.row(), flush=True)
        if outcome.errors:
            print(f"<!-- {name}: {outcome.errors[:3]} -->", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps([o.__dict__ for o in outcomes], indent=1))


if __name__ == "__main__":
    main()
