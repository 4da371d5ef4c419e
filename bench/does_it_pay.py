"""Fetch from this server vs recompute on an H100: the computed table, from a measured run.

    .venv/bin/epistemic-kvcache does-it-pay --model llama-3-8b --model llama-3-70b \
        --prefill skip --paths mp-native,client --lengths 256,1024,4096 --out build/dip
    .venv/bin/python -m bench.does_it_pay build/dip/does-it-pay.json [--peak-tflops 989]

No rate here is typed in by hand: each path's lookup cost and range of load rates come
from the `does-it-pay` run given (measured for each model's own chunk size; a
tensor-parallel model per rank). The prefill side is computed:
`ModelShape.prefill_flops(n)` (no embedding, the output layer on the last token only) at
the GPU's datasheet peak (H100/H200 SXM dense BF16: 989 TFLOP/s) times an MFU of 30, 50
and 70 %. Prints, per model and path, the break-even prompt length at each MFU for the
slowest, median and fastest load rate measured (`does_it_pay_report.computed_rows`, the
same arithmetic docs/does-it-pay.md is generated with).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from epistemic_kvcache.integrations.lmcache.does_it_pay_report import (
    H100_BF16_DENSE_FLOPS,
    computed_rows,
    fmt_tokens,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="the JSON `epistemic-kvcache does-it-pay` wrote")
    ap.add_argument("--peak-tflops", type=float, default=H100_BF16_DENSE_FLOPS / 1e12)
    args = ap.parse_args()
    run = json.loads(Path(args.run).read_text())
    load = run["host"]["load_average_start"][0], run["host"]["load_average_end"][0]
    print(f"fetch measured by: {run['command']}")
    print(f"  on {run['device']['name']}, load average {load[0]:.2f} -> {load[1]:.2f}")
    print(f"prefill computed at {args.peak_tflops:.0f} TFLOP/s x MFU\n")
    print("| model | path | lookup ms | load GB/s slowest/median/fastest | "
          "MFU 30 % | MFU 50 % | MFU 70 % |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in computed_rows(run, args.peak_tflops * 1e12):
        rates, be = r["rates"], r["break_even"]
        cells = [
            f"{fmt_tokens(be[f'{m}/slowest'])} / {fmt_tokens(be[f'{m}/median'])} / "
            f"{fmt_tokens(be[f'{m}/fastest'])}"
            for m in (30, 50, 70)
        ]
        print(f"| {r['label']} | {r['path']} | {r['lookup_s'] * 1e3:.2f} | "
              f"{rates['slowest'] / 1e9:.2f} / {rates['median'] / 1e9:.2f} / "
              f"{rates['fastest'] / 1e9:.2f} | " + " | ".join(cells) + " |")  # fmt: skip


if __name__ == "__main__":
    main()
