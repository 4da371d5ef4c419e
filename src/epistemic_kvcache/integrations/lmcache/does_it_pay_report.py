"""Break-even arithmetic, the text table and the plot of `does-it-pay` (no torch here).

Shared with scripts/gen_does_it_pay.py, which builds docs/does-it-pay.md from the JSON.

- `crossing(prefill, fetch)`: the measured break-even. Both curves are measured at the
  same prompt lengths; the break-even is the length from which on fetching takes less
  time than recomputing at every longer length measured, interpolated between the two
  measured lengths around it (log-log), or "every length measured" / "beyond the longest
  length measured" (never extrapolated).
- `computed_break_even(shape, rate, fixed_s, peak, mfu)`: the smallest n with
  `fixed_s + n x KV bytes / rate < prefill_flops(n) / (peak x mfu)`: the arithmetic the
  docs use for GPUs this project could not measure on, with every input named.
- `fetch_fit(points)`: a least-squares line `fixed + n / tokens_per_s` through a path's
  measured total fetch times, and the range of load rates its points showed.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from epistemic_kvcache.integrations.lmcache.does_it_pay_models import ModelShape

H100_BF16_DENSE_FLOPS = 989e12
"""NVIDIA H100 SXM datasheet, dense BF16 (the H200 has the same compute)."""
PEAKS = {"H100": H100_BF16_DENSE_FLOPS, "H200": H100_BF16_DENSE_FLOPS}
NEVER_TOKENS = 1 << 20
"""Beyond every common context window: reported as "never"."""


def crossing(prefill: list[dict[str, Any]], fetch: list[dict[str, Any]]) -> dict[str, Any]:
    """From what measured length on fetching takes less time than recomputing, at that
    length and every longer one measured (a shorter length where it also won does not
    count: noise at short lengths must not hide a loss above them)."""
    pre = {p["tokens"]: p["seconds"] for p in prefill}
    pairs = sorted(
        (p["tokens"], pre[p["tokens"]], p["total_s"]) for p in fetch if p["tokens"] in pre
    )
    if not pairs:
        return {"kind": "none", "tokens": None, "text": "no common lengths measured"}
    losing = [i for i, (_, p, f) in enumerate(pairs) if f >= p]
    if not losing:
        n0 = pairs[0][0]
        return {"kind": "below", "tokens": n0, "text": f"<= {n0:,} (pays at every length measured)"}
    last = losing[-1]
    if last == len(pairs) - 1:
        nl = pairs[-1][0]
        return {
            "kind": "beyond",
            "tokens": nl,
            "text": f"> {nl:,} (not within the lengths measured)",
        }
    (na, pa, fa), (nb, pb, fb) = pairs[last], pairs[last + 1]
    # log(f/p) goes from >= 0 at na to < 0 at nb: interpolate its zero in log n
    da, db = math.log(fa / pa), math.log(fb / pb)
    n = round(math.exp(math.log(na) + (math.log(nb) - math.log(na)) * da / (da - db)))
    return {"kind": "interpolated", "tokens": n, "text": f"{n:,}"}


def fetch_fit(points: list[dict[str, Any]]) -> dict[str, float]:
    """Least squares `total_s = fixed_s + tokens / tokens_per_s`, and the load rates seen."""
    xs = [float(p["tokens"]) for p in points]
    ys = [float(p["total_s"]) for p in points]
    rates = [p["bytes"] / p["total_s"] for p in points if p["total_s"] > 0]
    lookups = [p["lookup_s"] for p in points]
    out = {
        "rate_min_Bps": min(rates),
        "rate_max_Bps": max(rates),
        "lookup_min_s": min(lookups),
        "lookup_max_s": max(lookups),
        "lookup_median_s": statistics.median(lookups),
    }
    if len(xs) >= 2 and len(set(xs)) >= 2:
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
            (x - mx) ** 2 for x in xs
        )
        fixed = my - slope * mx
        out["fixed_s"] = max(0.0, fixed)
        out["tokens_per_s"] = 1.0 / slope if slope > 0 else math.inf
    return out


def computed_break_even(
    shape: ModelShape, rate_Bps: float, fixed_s: float, peak: float, mfu: float
) -> float:
    """Smallest n where `fixed_s + n x kv / rate < flops(n) / (peak x mfu)` (math.inf: never
    below NEVER_TOKENS). `shape` is what one GPU computes and fetches (a rank's share)."""
    f = peak * mfu
    a = 2.0 * shape.layers * shape.heads * shape.head_dim / f  # n^2 term (n (n+1) ~ n^2 + n)
    b = (
        2.0 * shape.layers * shape.layer_matrix_params()
        + 2.0 * shape.layers * shape.heads * shape.head_dim
    ) / f - shape.kv_bytes_per_token() / rate_Bps
    c = 2.0 * shape.hidden * shape.vocab / f - fixed_s
    # a n^2 + b n + c > 0 with a > 0: past the larger root (c < 0: exactly one positive root)
    disc = b * b - 4 * a * c
    if disc < 0:
        return 1.0
    n = (-b + math.sqrt(disc)) / (2 * a)
    if n <= 1:
        return 1.0
    return n if n < NEVER_TOKENS else math.inf


MFUS = (0.3, 0.5, 0.7)


def path_rates(points: list[dict[str, Any]]) -> tuple[float, float, float, float]:
    """(median lookup s, slowest, median, fastest load rate in B/s) of a path's measured
    points; the load rate is bytes / (load + copy to the device)."""
    rates = [q["bytes"] / (q["load_s"] + q["to_device_s"]) for q in points]
    lookup = statistics.median(q["lookup_s"] for q in points)
    return lookup, min(rates), statistics.median(rates), max(rates)


def computed_rows(run: dict[str, Any], peak: float = H100_BF16_DENSE_FLOPS) -> list[dict[str, Any]]:
    """For each real model (not the CI one) and measured path of a `does-it-pay` run: the
    measured lookup and load rates, and `computed_break_even` at each MFU of `MFUS` for the
    slowest, median and fastest rate (keys "30/slowest", ...)."""
    rows = []
    for m in run["models"]:
        shape = ModelShape(**m["rank_shape"])
        if shape.kv_bytes_per_token() < 4096:  # the CI model: no GPU question to answer
            continue
        for path, v in m["paths"].items():
            if v.get("skipped") or not v.get("points"):
                continue
            lookup, lo, mid, hi = path_rates(v["points"])
            rates = {"slowest": lo, "median": mid, "fastest": hi}
            rows.append(
                {
                    "label": m["label"],
                    "path": path,
                    "lookup_s": lookup,
                    "rates": rates,
                    "recompute_1k": prefill_rate(shape, 1024, peak, 0.5),
                    "recompute_32k": prefill_rate(shape, 32768, peak, 0.5),
                    "break_even": {
                        f"{round(mfu * 100)}/{k}": computed_break_even(shape, r, lookup, peak, mfu)
                        for mfu in MFUS
                        for k, r in rates.items()
                    },
                }
            )
    return rows


def prefill_rate(shape: ModelShape, n: int, peak: float, mfu: float) -> float:
    """Tokens per second an n-token prefill reaches at `peak x mfu` FLOP/s."""
    return n / (shape.prefill_flops(n) / (peak * mfu))


def fmt_tokens(n: float) -> str:
    if math.isinf(n):
        return "never"
    if n < 1000:
        return f"{n:.0f}"
    return f"{n / 1000:.1f}k" if n < 100_000 else f"{n / 1000:.0f}k"


def text_table(result: dict[str, Any]) -> list[str]:
    """The command's printed summary: one line per model and path."""
    lines = [
        "| model | path | break-even (prompt tokens) | lookup ms | load GB/s (range) | prefill |",
        "|---|---|---|---|---|---|",
    ]
    for m in result["models"]:
        pre = m.get("prefill")
        how = "not measured"
        if pre:
            how = (
                "measured"
                if pre["measured_layers"] == pre["layers"]
                else (f"scaled from {pre['measured_layers']} of {pre['layers']} layers")
            )
        for path, p in m["paths"].items():
            if p.get("skipped") or not p.get("points"):
                why = p.get("skipped") or f"failed: {p.get('stopped')}"
                lines.append(f"| {m['label']} | {path} | not measured: {why} | | | |")
                continue
            fit = p["fit"]
            be = m["break_even"].get(path, {}).get("text", "-")
            if p.get("stopped"):
                be += f" (stopped: {p['stopped']})"
            lines.append(
                f"| {m['label']} | {path} | {be} | {fit['lookup_min_s'] * 1e3:.2f}-"
                f"{fit['lookup_max_s'] * 1e3:.2f} | {fit['rate_min_Bps'] / 1e9:.2f}-"
                f"{fit['rate_max_Bps'] / 1e9:.2f} | {how} |"
            )
    return lines


def plot(result: dict[str, Any], out: Path) -> str | None:
    """The two curves per model (prefill, and each path's lookup + fetch + copy to the
    device) on log axes, into `out`; why not (None: written)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
    models = [m for m in result["models"] if m["paths"] or m.get("prefill")]
    if not models:
        return "nothing was measured"
    fig, axes = plt.subplots(1, len(models), figsize=(6.4 * len(models), 4.8), squeeze=False)
    for ax, m in zip(axes[0], models, strict=True):
        pre = m.get("prefill")
        if pre and pre["points"]:
            scaled = pre["measured_layers"] != pre["layers"]
            ax.plot(
                [p["tokens"] for p in pre["points"]],
                [p["seconds"] for p in pre["points"]],
                "k-o",
                lw=2,
                label="prefill (scaled)" if scaled else "prefill (measured)",
            )
        for path, p in m["paths"].items():
            if p.get("points"):
                ax.plot(
                    [q["tokens"] for q in p["points"]],
                    [q["total_s"] for q in p["points"]],
                    "--.",
                    label=f"fetch: {path}",
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("seconds")
        ax.set_title(m["label"], fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"does it pay? {result['device']['name']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return None
