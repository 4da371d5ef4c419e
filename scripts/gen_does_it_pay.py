"""Write docs/does-it-pay.md from measurements, never by hand.

    python scripts/gen_does_it_pay.py --run docs/does-it-pay/cpu-tiny.json \
        [--run MORE.json ...] [--e2e build/e2e-results.jsonl] [--stores STORES.json] \
        [--loops LOOPS.md] [--out docs/does-it-pay.md]

Inputs:
- `--run`: the JSON `epistemic-kvcache does-it-pay` writes (one per machine or run);
  each run's tables say the device, the load average and which figures are scaled.
- `--e2e`: `make e2e`'s `build/e2e-results.jsonl` (vLLM's own timestamps per process);
  when it is absent the page says so.
- `--stores`: the JSON of `python -m bench.bench_lmcache --json` (our server, redis-server
  and Mooncake Store through LMCache, and what each promises, measured).
- `--loops`: the markdown table `bench.bench_loops` printed (the GPU machine's script).

The computed part uses each run's own measured figures (the lookup cost and the range
of load rates of each path, for each model's chunk size) with an H100's datasheet peak
at MFU 30/50/70 %, and `ModelShape.prefill_flops` (no embedding; the output layer on the
last token only).
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from epistemic_kvcache.integrations.lmcache.does_it_pay_report import (
    H100_BF16_DENSE_FLOPS,
    computed_rows,
    crossing,
    fmt_tokens,
)

ROOT = Path(__file__).resolve().parent.parent
GENERATED_ARGS: list[str] = []
"""This run's arguments (repository-relative), quoted at the top of the page."""
PLOTS: dict[str, str] = {}
"""Run name -> its PNG (the command writes it beside the JSON), relative to the page."""


def _load(run: dict[str, Any]) -> str:
    start, end = run["host"]["load_average_start"][0], run["host"]["load_average_end"][0]
    cpus = run["host"]["cpus"] or 1
    text = f"load average {start:.2f} at the start, {end:.2f} at the end, {cpus} CPUs"
    if max(start, end) > cpus:
        text += (
            " — **taken loaded** (other work shared the CPUs): read these as orders of "
            "magnitude, to be remeasured on a quiet machine"
        )
    return text


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f}" if s < 10 else f"{s:.1f} s"


STALE_S = 3600
"""A process name whose last record is this much older than the newest is left out."""


def _utc(stamp: str) -> datetime:
    """An e2e record's `ts_utc` (ISO 8601, `Z` or an offset) as an aware datetime."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def e2e_section(path: Path) -> list[str]:
    out = ["## 1. vLLM end to end: the tiny model through each LMCache path", ""]
    if not path.exists():
        return [
            *out,
            f"`{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}` was not there "
            "when this page was generated: `make e2e` (tests/e2e/, vLLM's CPU build, LMCache "
            "and this server, see docs/lmcache.md) writes it, then run this script again. "
            "Nothing from an earlier run is copied here by hand.",
            "",
        ]
    records: dict[str, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            records[rec["name"]] = rec  # the last run of each process counts
    # A name whose last record is much older than the newest is a process the tests no
    # longer start (renamed or removed): left out, and counted.
    stamps = [r["ts_utc"] for r in records.values() if r.get("ts_utc")]
    stale: list[str] = []
    if stamps:
        newest = _utc(max(stamps, key=_utc))
        stale = [
            n for n, r in records.items()
            if r.get("ts_utc") and (newest - _utc(r["ts_utc"])).total_seconds() > STALE_S
        ]  # fmt: skip
        for n in stale:
            del records[n]
    loads = [r["load_average"][0] for r in records.values() if r.get("load_average")]
    when = sorted(r["ts_utc"] for r in records.values() if r.get("ts_utc"))
    out += [
        "`make e2e` (tests/e2e/) runs vLLM (CPU build) with LMCache and this server on "
        "loopback, each LMCache path in turn: a first process (`-p1`; `-y`, `-z`: other "
        "prompts) computes prompts and stores their chunks; later fresh processes load what "
        "they can from this server (the cached tokens column) and compute the rest: after "
        "the server was SIGKILLed and restarted (`-p2`), with one entry's bytes zeroed "
        "(`-p2-corrupt`: a full hit, another output), with the server SIGKILLed under them "
        "(`-server-down`: recomputed) and as a second tenant (`-tenant-b`: no hit). "
        "`hybrid-` rows are the hybrid model (attention and Gated DeltaNet layers) through "
        "LMCache MP. TTFT = arrival to first token, prefill = scheduled to first token "
        "(LMCache's load included), from vLLM's `RequestOutput.metrics`. One sample per "
        "row; the last record of each name in the file, in the order first written; a name "
        f"whose last record is over {STALE_S // 3600} h older than the newest is left out "
        "(a process the tests no longer start).",
        "",
        f"Source: `{path.name}`, {len(records)} processes"
        + (f" ({len(stale)} stale name{'s' * (len(stale) > 1)} left out)" if stale else "")
        + (f", {when[0]} to {when[-1]}" if when else "")
        + (
            f", load average {min(loads):.1f}-{max(loads):.1f}"
            if loads
            else ", load average not recorded"
        )
        + ".",
        "",
        "| process | at (UTC) | load | prompt tokens | cached tokens | TTFT | prefill |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in records.items():
        load = f"{r['load_average'][0]:.1f}" if r.get("load_average") else "—"
        out.append(
            f"| {name} | {(r.get('ts_utc') or '')[11:19] or '—'} | {load} | {r['prompt_tokens']} "
            f"| {r['num_cached_tokens']} | {r['ttft_s']:.3f} s | {r['prefill_s']:.3f} s |"
        )
    out += [
        "",
        "Which outputs must equal which (a hit's and plain vLLM's, a corrupted entry's "
        "recompute) the tests in tests/e2e/ assert; this table only reports the timings.",
    ]
    return [*out, ""]


def run_section(run: dict[str, Any], name: str) -> list[str]:
    dev = run["device"]
    out = [
        f"### {dev['name']} ({dev['type']}, torch {dev['torch']}): `{name}`",
        "",
        f"`{run['command']}`, {run['started_utc']} to {run['finished_utc']}; {_load(run)}. "
        f"Server {run['server']['url']} (RESP {run['server']['resp'] or 'not given'}); "
        f"LMCache: {run['lmcache']}; chunks of {run['chunk_tokens']} tokens; medians of "
        f"{run['repeats']} timed runs after a verified warm-up.",
        "",
    ]
    if plot := PLOTS.get(name):
        out += [f"![the two curves of `{name}`]({plot})", ""]
    for m in run["models"]:
        rank_kv = m["rank_kv_bytes_per_token"]
        out += [
            f"**{m['label']}**: {rank_kv:,} KV bytes per token"
            + (
                f" per rank ({m['kv_bytes_per_token']:,} for the whole model)"
                if m["tensor_parallel"] > 1
                else ""
            )
            + ".",
            "",
        ]
        pre = m.get("prefill")
        if pre:
            out += [
                f"Prefill ({pre['engine']} engine, {pre['dtype']}): {pre['what']}."
                + (f" {pre['stopped']}." if pre.get("stopped") else ""),
                "",
            ]
        paths = {p: v for p, v in m["paths"].items() if v.get("points")}
        head = (
            "| tokens | KV bytes |"
            + (" prefill ms |" if pre else "")
            + "".join(f" {p}: lookup / total ms |" for p in paths)
        )
        out += [head, "|---|---|" + ("---|" if pre else "") + "---|" * len(paths)]
        pre_at = {p["tokens"]: p["seconds"] for p in (pre or {}).get("points", [])}
        for n in run["lengths"]:
            row = f"| {n:,} | {n * rank_kv:,} |"
            if pre:
                row += f" {_ms(pre_at[n])} |" if n in pre_at else " — |"
            for v in paths.values():
                pt = next((q for q in v["points"] if q["tokens"] == n), None)
                row += f" {_ms(pt['lookup_s'])} / {_ms(pt['total_s'])} |" if pt else " — |"
            out.append(row)
        out.append("")
        for p, v in m["paths"].items():
            if v.get("skipped"):
                out.append(f"- {p}: not measured: {v['skipped']}")
            elif v.get("stopped"):
                out.append(f"- {p}: stopped: {v['stopped']}; longer prompts not tried")
        # recomputed from the points, so every run on the page uses one definition
        breaks = {p: crossing(pre["points"], v["points"]) for p, v in paths.items()} if pre else {}
        if breaks:
            out += [
                "",
                "Break-even on this machine: the prompt length from which on fetching beat "
                "recomputing at every longer length measured (interpolated between the two "
                "measured lengths around it, never extrapolated):",
                "",
            ]
            out += [f"- {p}: **{b['text']}** tokens" for p, b in breaks.items()]
        out.append("")
    return out


def computed_section(runs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    peak = H100_BF16_DENSE_FLOPS
    out = [
        "## 3. Computed for a GPU: this run's fetch figures against an H100's compute",
        "",
        "No GPU measurement is part of this page unless section 2 names a CUDA device. "
        "Below, the fetch side is what section 2 measured for each model's chunk size "
        "(per path: the median lookup cost, and the load rate = bytes / (load + copy to "
        "the device) across the lengths measured, slowest to fastest); the prefill side is "
        f"computed: `prefill_flops(n)` at {peak / 1e12:.0f} TFLOP/s (NVIDIA H100 SXM "
        "datasheet, dense BF16; the H200 has the same compute) times a model FLOPs "
        "utilisation (MFU). `prefill_flops(n) = 2 n x (every layer's matrix weights) + "
        "2 x layers x heads x head_dim x n (n + 1) + 2 x hidden x vocab`: no embedding (a "
        "table lookup), the output layer on the last token only. A cell is the prompt "
        "length from which fetching (lookup + n x KV bytes / rate) takes less time than "
        'recomputing; "never": not below 1M tokens. A tensor-parallel model is computed '
        "per rank: each GPU computes its share and fetches its share of the KV at the "
        "rate measured for one client (the server must then deliver that rate to every "
        "rank at once, which was not measured).",
        "",
    ]
    rows, sens = [], []
    for name, run in runs:
        for r in computed_rows(run, peak):
            rates, be = r["rates"], r["break_even"]
            rows.append(
                f"| {r['label']} | {r['path']} | {r['lookup_s'] * 1e3:.2f} ms "
                f"| {rates['slowest'] / 1e9:.2f} / {rates['median'] / 1e9:.2f} / "
                f"{rates['fastest'] / 1e9:.2f} | {r['recompute_1k'] / 1e3:.1f}k / "
                f"{r['recompute_32k'] / 1e3:.1f}k | **{fmt_tokens(be['50/median'])}** | `{name}` |"
            )
            cells = [
                f"{fmt_tokens(be[f'{m}/slowest'])} - {fmt_tokens(be[f'{m}/fastest'])}"
                for m in (30, 50, 70)
            ]
            sens.append(f"| {r['label']} | {r['path']} | " + " | ".join(cells) + " |")
    if not rows:
        return [
            *out,
            "No run measured the fetch of a real model's chunk size: nothing to compute.",
            "",
        ]
    out += [
        "| model | path | lookup (measured) | load GB/s: slowest / median / fastest "
        "(measured) | recompute tok/s at 1k / 32k tokens, MFU 50 % | break-even, MFU 50 %, "
        "median rate | run |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        "**Sensitivity**: the break-even at the slowest - the fastest load rate measured (a "
        "faster rate pays sooner), at three MFUs (a higher MFU recomputes faster, so "
        "fetching pays later):",
        "",
        "| model | path | MFU 30 % | MFU 50 % | MFU 70 % |",
        "|---|---|---|---|---|",
        *sens,
        "",
        "`python -m bench.does_it_pay RUN.json` prints the same table for any run.",
        "",
        "What this arithmetic leaves out: the fetch rates are one client against a server on "
        "the same machine (a fleet's clients reach it over a network, many at once); a hit "
        "costs the GPU no FLOPs, so under load every fetched token is compute left for other "
        "requests even where the fetch is slower than the recompute for that one request; "
        "LMCache's MP mode loads asynchronously. Section 5 is the measurement that replaces "
        "the computed prefill with a GPU's.",
        "",
    ]
    return out


def stores_section(path: Path | None) -> list[str]:
    out = ["## 4. Three stores through LMCache: this server, redis-server, Mooncake Store", ""]
    if path is None or not path.exists():
        return [
            *out,
            "No `bench.bench_lmcache --json` output was given to this run of the generator.",
            "",
        ]
    doc = json.loads(path.read_text())
    out += [
        "The same LMCache v1 layer in front of each store: LMCache's `RESPConnector` "
        "(`resp://`) into this server (its "
        f"{doc.get('backend', 'durable')} backend, a token) and into redis-server (no "
        "persistence, no password), and LMCache's `mooncakestore://` connector into Mooncake "
        "Store (`mooncake-transfer-engine-non-cuda` 0.3.13.post1: a `mooncake_master` with "
        "its HTTP metadata server and one storage process holding the memory, the engine "
        "mounting none, TCP transport bound to loopback; LMCache 0.5.6 passes "
        "`master_server_address` where Mooncake reads `master_server_addr`, so the setting "
        "is given as `mooncake_master_server_addr`; LMCache's 1 s `transfer_timeout`, after "
        "which a put is reported done while its copy goes on, is raised to 120 s). Batches "
        "of new chunks (distinct bytes), stored then loaded, medians of the rounds; "
        "exists(64): one lookup of 64 keys.",
        "",
    ]
    out += [
        f"`{doc['command']}`, {doc['started_utc']}; load average "
        f"{doc['load_average_start'][0]:.2f} at the start, "
        f"{doc['load_average_end'][0]:.2f} at the end"
        + (
            " — **taken loaded**: to be remeasured quiet"
            if max(doc["load_average_start"][0], doc["load_average_end"][0])
            > (doc.get("cpus") or 2)
            else ""
        )
        + ".",
        "",
    ]
    out += [
        "| batch | store (path) | store GB/s | load GB/s | exists(64) p50 ms |",
        "|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        out.append(
            f"| {r['batch']} | {r['name']} | {r['store_gbps']:.2f} | {r['load_gbps']:.2f} "
            f"| {r['exists_ms']:.2f} |"
        )
    for why in doc.get("not_measured", []):
        out.append(f"\n- not measured: {why}")
    if doc.get("promises"):
        out += [
            "",
            "What each store promises, each cell checked by `bench/store_promises.py` "
            "(`python -m bench.store_promises` alone), not taken from its docs:",
            "",
            "| store | " + " | ".join(doc["promise_names"]) + " |",
            "|---|" + "---|" * len(doc["promise_names"]),
        ]
        for store, cells in doc["promises"].items():
            out.append(
                f"| {store} | "
                + " | ".join(cells.get(k, "not checked") for k in doc["promise_names"])
                + " |"
            )
    return [*out, ""]


def gpu_section(loops: Path | None, runs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    out = ["## 5. On a GPU machine", ""]
    cuda = [n for n, r in runs if r["device"]["type"] == "cuda"]
    if cuda:
        out.append(f"Measured on a GPU: {', '.join(f'`{n}`' for n in cuda)} (section 2).")
    else:
        out.append(
            "No GPU machine was available for the runs on this page. "
            "`scripts/gpu_does_it_pay.sh` is the prepared run (at most 8 minutes: "
            "does-it-pay for Llama-3-8B and Llama-3-70B per rank with this server on "
            "the same machine, and the event-loop scaling table against "
            "redis-server); its outputs go through this script like the ones above."
        )
    if loops is not None and loops.exists():
        out += ["", "Event-loop scaling (`bench.bench_loops`):", "", loops.read_text().strip()]
    return [*out, ""]


def render(
    runs: list[tuple[str, dict[str, Any]]], e2e: Path, stores: Path | None, loops: Path | None
) -> str:
    lines = [
        "# Does it pay? Fetching a prefix's KV from this server vs recomputing it",
        "",
        "<!-- generated by scripts/gen_does_it_pay.py from measurement files; edit the "
        "script or rerun the measurements, not this page -->",
        "",
        "From what prompt length does loading a prefix's KV from this server beat "
        "recomputing it? `epistemic-kvcache does-it-pay` answers that on the machine it runs "
        "on, for a model's shape, through each LMCache path: it times a prefill with a "
        "random-weight model of that shape on the best device present, and the lookup, "
        "load and copy to the device of the same tokens' KV through each path, and writes "
        "the JSON this page is generated from, with a plot of the two curves.",
        "",
        "```text",
        "pip install '.[does-it-pay]'   # torch (the lmcache extra) and matplotlib",
        "epistemic-kvcache does-it-pay --model llama-3-8b --url http://HOST:9130 \\",
        "    --resp-addr HOST:6379 --token $TOKEN --out does-it-pay",
        "python scripts/gen_does_it_pay.py --run does-it-pay/does-it-pay.json [--run ...] \\",
        "    [--stores STORES.json] [--loops LOOPS.md]",
        "```",
        "",
        "`--model` takes a built-in shape (llama-3-8b, llama-3-70b, qwen2.5-7b, tiny) or a "
        "Hugging Face `config.json`; `--paths` the paths to drive (default: every one that "
        "can run there); `--prefill skip` measures the fetch alone. This page was generated "
        "by `python scripts/gen_does_it_pay.py " + " ".join(GENERATED_ARGS) + "`.",
        "",
    ]
    lines += e2e_section(e2e)
    lines += ["## 2. Measured by `epistemic-kvcache does-it-pay`", ""]
    for name, run in runs:
        lines += run_section(run, name)
    lines += computed_section(runs)
    lines += stores_section(stores)
    lines += gpu_section(loops, runs)
    text = "\n".join(lines).rstrip() + "\n"
    return text.replace("\n\n\n", "\n\n")


def _rel(arg: str) -> str:
    """`arg`, repository-relative when it is a path inside the repository."""
    path = Path(arg)
    if path.exists() and path.resolve().is_relative_to(ROOT):
        return str(path.resolve().relative_to(ROOT))
    return arg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", action="append", required=True, help="does-it-pay JSON (repeatable)")
    ap.add_argument("--e2e", default=str(ROOT / "build" / "e2e-results.jsonl"))
    ap.add_argument("--stores", default=None, help="bench.bench_lmcache --json output")
    ap.add_argument("--loops", default=None, help="bench.bench_loops markdown output")
    ap.add_argument("--out", default=str(ROOT / "docs" / "does-it-pay.md"))
    args = ap.parse_args()
    out_dir = Path(args.out).resolve().parent
    GENERATED_ARGS.extend(_rel(a) for a in sys.argv[1:])
    runs = []
    for r in args.run:
        path = Path(r).resolve()
        png = path.with_suffix(".png")
        if png.exists() and png.is_relative_to(out_dir):
            PLOTS[str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name] = str(
                png.relative_to(out_dir)
            )
        runs.append(
            (
                str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name,
                json.loads(path.read_text()),
            )
        )
    text = render(
        runs,
        Path(args.e2e).resolve(),
        Path(args.stores) if args.stores else None,
        Path(args.loops) if args.loops else None,
    )
    Path(args.out).write_text(text)
    print(f"wrote {args.out} ({len(text.splitlines())} lines)")


if __name__ == "__main__":
    main()
