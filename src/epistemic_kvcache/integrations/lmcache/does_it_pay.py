"""`epistemic-kvcache does-it-pay`: from what prompt length does a hit beat recomputing, here?

For each model shape (a built-in name or a Hugging Face `config.json`) it measures, on
this machine:

(a) the prefill: `does_it_pay_prefill.measure_prefill` times a random-weight model of
    that shape on the best device present, for each prompt length (a layer subset,
    scaled, when the model does not fit; a tensor-parallel model: one rank's share);
(b) the fetch, for each path named (`does_it_pay_paths`): the prompt's KV (whole
    LMCache chunks of `--chunk-tokens` tokens, `KV bytes per token x tokens` bytes;
    a rank's share for a tensor-parallel model) is first stored into the server, then
    timed, `--repeats` times after one verified warm-up round: the lookup of every
    chunk's key through that path, the load into host memory (pinned when CUDA is
    present) and the copy into preallocated memory on the device. Every key the run
    wrote (LMCache's own key names included) is deleted after each length.

It prints the break-even per model and path (`does_it_pay_report.crossing`), writes
`does-it-pay.json` (every measured figure, which are scaled, the load average before
and after) and `does-it-pay.png` (the two curves) into `--out`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from epistemic_kvcache.client.backend import EpistemicGraphKVBackend
from epistemic_kvcache.client.config import KvCacheConfig
from epistemic_kvcache.errors import ConfigurationError
from epistemic_kvcache.integrations.lmcache import does_it_pay_report as report
from epistemic_kvcache.integrations.lmcache.does_it_pay_models import BUILTIN, ModelShape, resolve
from epistemic_kvcache.integrations.lmcache.does_it_pay_paths import (
    LABELS,
    PATHS,
    WORKERS,
    Target,
    unavailable,
)

SCHEMA = "epistemic-kvcache/does-it-pay/1"
CUDA_LENGTHS = "256,512,1024,2048,4096,8192,16384,32768"
CPU_LENGTHS = "256,512,1024,2048,4096"
STORE_BATCH = 4
"""Chunks stored per call before a measurement: a 4k-token Llama-3-8B prompt in one batch
is 512 MiB, a server's whole default in-flight share of one tenant (max_tenant_inflight_bytes),
and was refused with 429 tenant_busy."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's flags (no torch imported here)."""
    parser.add_argument(
        "--model",
        action="append",
        default=None,
        metavar="NAME|CONFIG",
        help=f"a built-in model ({', '.join(BUILTIN)}) or a Hugging Face config.json (or "
        "its folder); repeatable; default llama-3-8b",
    )
    parser.add_argument(
        "--tensor-parallel",
        type=int,
        default=None,
        metavar="N",
        help="GPUs a model is split over (default: 1; llama-3-70b: 4); "
        "measured and reported per rank",
    )
    parser.add_argument(
        "--url",
        default=None,
        help="the server's HTTP base URL (default: EPISTEMIC_GRAPH_KVCACHE_URL / _ADDR)",
    )
    parser.add_argument(
        "--resp-addr",
        default=None,
        metavar="HOST:PORT",
        help="the server's RESP listener (for mp-resp, v1-resp, v1-redis)",
    )
    parser.add_argument(
        "--token",
        default=None,
        help="a token of the server (default: EPISTEMIC_GRAPH_KVCACHE_TOKEN)",
    )
    parser.add_argument("--token-file", default=None, help="read the token from this file")
    parser.add_argument(
        "--paths",
        default="all",
        help=f"comma-separated, of {', '.join(PATHS)}; default all that can "
        "run here (the LMCache paths need lmcache, the RESP ones --resp-addr)",
    )
    parser.add_argument(
        "--lengths",
        default=None,
        help=f"prompt lengths in tokens, multiples of --chunk-tokens (default "
        f"{CUDA_LENGTHS} on CUDA, {CPU_LENGTHS} on a CPU)",
    )
    parser.add_argument("--chunk-tokens", type=int, default=256, help="LMCache's chunk size (256)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per length (median)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument(
        "--engine",
        default="auto",
        choices=["auto", "torch", "transformers"],
        help="auto: transformers when installed, else this package's own decoder stack",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="auto: bfloat16 on CUDA and on CPUs with native bf16, else float32",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="torch's CPU threads for the prefill (default: torch's own)",
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        metavar="N",
        help="build at most N layers and scale (default: all that fit)",
    )
    parser.add_argument(
        "--prefill",
        default="measure",
        choices=["measure", "skip"],
        help="skip: measure only the fetch half",
    )
    parser.add_argument("--workers", type=int, default=WORKERS, help="I/O workers per client (8)")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=None,
        help="our clients' transfer and lookup timeouts (default: theirs, 2 s and 1 s: what "
        "a deployment runs with); LMCache's own clients keep their own",
    )
    parser.add_argument("--out", default="does-it-pay", help="folder for the JSON and the PNG")


def _target(args: argparse.Namespace) -> Target:
    env = KvCacheConfig.from_env()
    url = args.url or env.base_url
    token = args.token
    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as exc:
            raise ConfigurationError(f"invalid --token-file: {exc}") from None
    token = token or env.token
    if not token:
        raise ConfigurationError(
            "no token: give --token / --token-file or set EPISTEMIC_GRAPH_KVCACHE_TOKEN"
        )
    resp = None
    if args.resp_addr:
        host, sep, port = args.resp_addr.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigurationError(
                f"invalid --resp-addr: expected HOST:PORT (got {args.resp_addr!r})"
            )
        resp = (host.strip("[]"), int(port))
    if args.workers < 1:
        raise ConfigurationError(
            f"invalid --workers: expected a positive integer (got {args.workers})"
        )
    if args.timeout_s is not None and not args.timeout_s > 0:
        raise ConfigurationError(
            f"invalid --timeout-s: expected seconds > 0 (got {args.timeout_s})"
        )
    return Target(url.rstrip("/"), resp, token, args.workers, args.timeout_s)


def _lengths(text: str, chunk: int) -> list[int]:
    try:
        lengths = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ConfigurationError(f"invalid --lengths: expected integers (got {text!r})") from None
    bad = [n for n in lengths if n < chunk or n % chunk]
    if not lengths or bad:
        raise ConfigurationError(
            f"invalid --lengths: each must be a positive multiple of --chunk-tokens {chunk} "
            f"(LMCache stores whole chunks; got {bad or text!r})"
        )
    return lengths


def measure_fetch(
    path: str,
    target: Target,
    shape: ModelShape,
    lengths: list[int],
    *,
    chunk_tokens: int,
    device: Any,
    repeats: int,
    run_id: str,
    log: Callable[[str], None],
) -> tuple[list[dict[str, Any]], str | None]:
    """Lookup + load + copy to `device` of each length's chunks through `path` (see the
    module docstring); `shape` is what one GPU fetches (a rank's share)."""
    import torch

    from epistemic_kvcache.integrations.lmcache.does_it_pay_paths import make_driver

    size = chunk_tokens * shape.kv_bytes_per_token()
    count = max(lengths) // chunk_tokens
    kv_shape = (shape.layers, 2, chunk_tokens, shape.kv_heads, shape.head_dim)
    pin = device.type == "cuda"
    threads = torch.get_num_threads()
    if not pin:  # one memcpy per chunk, as LMCache's copy; no OpenMP team to wait for
        torch.set_num_threads(1)
    prefix = f"does-it-pay/{run_id}/"
    sweeper = EpistemicGraphKVBackend(**target.client())
    driver = make_driver(
        path,
        target,
        count=count,
        size=size,
        kv_shape=kv_shape,
        model=f"{prefix}{shape.name}",
        pin=pin,
    )
    dev = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(count)]
    points: list[dict[str, Any]] = []
    stopped = None
    try:
        for n in lengths:
            k = n // chunk_tokens
            keys = [f"{prefix}{path}/{n}/{i:04x}" for i in range(k)]
            driver.fill(f"{run_id[:6]}{n:07x}")
            lookup, load, copy = [], [], []
            try:
                for at in range(0, k, STORE_BATCH):  # not timed: what the lookups will find
                    if not _store(driver, keys[at : at + STORE_BATCH], at):
                        raise _Stopped(
                            f"{n} tokens: storing chunks {at}-{min(k, at + STORE_BATCH) - 1} failed"
                        )
                for r in range(repeats + 1):
                    t0 = time.perf_counter()
                    found = driver.exists(keys)
                    t1 = time.perf_counter()
                    loaded = driver.load(keys)
                    t2 = time.perf_counter()
                    for src, dst in zip(driver.host(k), dev, strict=False):
                        dst.copy_(src.reshape(-1).view(torch.uint8), non_blocking=pin)
                    if pin:
                        torch.cuda.synchronize(device)
                    t3 = time.perf_counter()
                    hits = found if isinstance(found, int) else sum(bool(x) for x in found or [])
                    if hits != k or not loaded:
                        raise _Stopped(
                            f"{n} tokens: the lookup found {hits} of {k} chunks, load ok={loaded}"
                        )
                    if r == 0:
                        if not driver.verify(k):
                            raise RuntimeError(f"{path}: loaded bytes differ from stored bytes")
                        continue
                    lookup.append(t1 - t0)
                    load.append(t2 - t1)
                    copy.append(t3 - t2)
            finally:  # every key this path wrote (LMCache's own names too)
                sweeper.delete_many(sweeper.list_keys(prefix))
            total = [a + b + c for a, b, c in zip(lookup, load, copy, strict=True)]
            point: dict[str, Any] = {
                "tokens": n,
                "chunks": k,
                "bytes": k * size,
                "lookup_s": statistics.median(lookup),
                "load_s": statistics.median(load),
                "to_device_s": statistics.median(copy),
                "total_s": statistics.median(total),
                "runs_total_s": total,
            }
            points.append(point)
            log(
                f"  {path:<9} {n:>7} tokens: lookup {point['lookup_s'] * 1e3:8.2f} ms  load "
                f"{point['load_s'] * 1e3:9.2f} ms  to {device.type} "
                f"{point['to_device_s'] * 1e3:8.2f} ms  = {point['total_s'] * 1e3:9.2f} ms "
                f"({k * size / point['total_s'] / 1e9:.2f} GB/s)"
            )
    except _Stopped as exc:
        stopped = str(exc)
        log(f"  {path}: stopped: {stopped}; longer prompts not tried")
    finally:
        driver.close()
        sweeper.close()
        del dev
        torch.set_num_threads(threads)
    return points, stopped


def _store(driver: Any, keys: list[str], at: int, tries: int = 3) -> bool:
    """Store before a measurement (not timed); a refused or timed-out batch is tried again
    after a second (the client's breaker probes the server again meanwhile)."""
    for attempt in range(tries):
        if driver.store(keys, at):
            return True
        if attempt + 1 < tries:
            time.sleep(1.0)
    return False


class _Stopped(RuntimeError):
    """A store or load of one length failed: longer lengths of that path are not tried."""


def _dtype(wanted: str, device: Any) -> str:
    if wanted != "auto":
        return wanted
    if device.type == "cuda":
        return "bfloat16"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        flags = ""
    return "bfloat16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "float32"


def run(args: argparse.Namespace) -> int:
    """Measure, print, write; 0 when every path that could run was measured at every
    length, 1 when one stopped early or failed (what it measured is still written)."""
    import torch

    from epistemic_kvcache.integrations.lmcache.checks import lmcache_missing
    from epistemic_kvcache.integrations.lmcache.does_it_pay_paths import lmcache_quiet
    from epistemic_kvcache.integrations.lmcache.does_it_pay_prefill import (
        device_name,
        measure_prefill,
        pick_device,
    )

    target = _target(args)
    if args.chunk_tokens < 1 or args.repeats < 1:
        raise ConfigurationError("invalid --chunk-tokens / --repeats: expected positive integers")
    device = pick_device(args.device)
    lengths = _lengths(
        args.lengths or (CUDA_LENGTHS if device.type == "cuda" else CPU_LENGTHS), args.chunk_tokens
    )
    if args.tensor_parallel is not None and args.tensor_parallel < 1:
        raise ConfigurationError(
            f"invalid --tensor-parallel: expected a positive integer (got {args.tensor_parallel})"
        )
    models = [resolve(m, args.tensor_parallel) for m in (args.model or ["llama-3-8b"])]
    missing = lmcache_missing()
    wanted = (
        list(PATHS)
        if args.paths == "all"
        else [p.strip() for p in args.paths.split(",") if p.strip()]
    )
    skipped = {p: unavailable(p, target, missing) for p in wanted}
    if args.paths != "all" and any(skipped.values()):
        bad = "; ".join(f"{p}: {why}" for p, why in skipped.items() if why)
        raise ConfigurationError(f"cannot drive the paths asked for: {bad}")
    if missing is None:
        lmcache_quiet()
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigurationError(
                f"invalid --threads: expected a positive integer (got {args.threads})"
            )
        torch.set_num_threads(args.threads)
    dtype = _dtype(args.dtype, device)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    run_id = secrets.token_hex(6)
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "command": _command_line(),
        "started_utc": _now(),
        "host": {
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "load_average_start": list(os.getloadavg()),
        },
        "device": {
            "type": device.type,
            "name": device_name(device),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cuda": torch.version.cuda if device.type == "cuda" else None,
        },
        "server": {
            "url": target.url,
            "resp": f"{target.resp[0]}:{target.resp[1]}" if target.resp else None,
        },
        "chunk_tokens": args.chunk_tokens,
        "repeats": args.repeats,
        "lengths": lengths,
        "dtype": dtype,
        "kv_bytes_per_value": 2,
        "lmcache": missing or "installed",
        "models": [],
    }
    print(
        f"does-it-pay on {result['device']['name']} ({dtype}), server {target.url}, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    failed = 0
    for shape in models:
        rank = shape.rank()
        entry: dict[str, Any] = {
            "name": shape.name,
            "label": shape.label,
            "shape": shape.describe(),
            "tensor_parallel": shape.tensor_parallel,
            "rank_shape": rank.describe(),
            "kv_bytes_per_token": shape.kv_bytes_per_token(),
            "rank_kv_bytes_per_token": rank.kv_bytes_per_token(),
            "prefill": None,
            "paths": {},
            "break_even": {},
        }
        print(
            f"{shape.label}: {rank.kv_bytes_per_token():,} KV bytes per token"
            + (" (per rank)" if shape.tensor_parallel > 1 else "")
        )
        if args.prefill == "measure":
            pre = measure_prefill(
                rank,
                lengths,
                device=device,
                engine=args.engine,
                dtype=dtype,
                repeats=args.repeats,
                max_layers=args.layers,
            )
            entry["prefill"] = {
                "engine": pre.engine,
                "dtype": pre.dtype,
                "layers": pre.layers,
                "measured_layers": pre.measured_layers,
                "why_subset": pre.why_subset,
                "scaled": pre.scaled,
                "stopped": pre.stopped,
                "points": pre.points,
                "what": (
                    "measured: one rank's share (heads, KV heads, MLP width and vocabulary "
                    f"/ {shape.tensor_parallel}), no all-reduce"
                    if shape.tensor_parallel > 1
                    else "measured"
                )
                + (
                    f"; scaled from {pre.measured_layers} of {pre.layers} layers ({pre.why_subset})"
                    if pre.scaled
                    else ""
                ),
            }
        for path in wanted:
            why = skipped[path]
            if why:
                entry["paths"][path] = {"label": LABELS[path], "skipped": why}
                print(f"  {path}: skipped ({why})")
                continue
            try:
                points, stopped = measure_fetch(
                    path,
                    target,
                    rank,
                    lengths,
                    chunk_tokens=args.chunk_tokens,
                    device=device,
                    repeats=args.repeats,
                    run_id=run_id,
                    log=print,
                )
            except Exception as exc:  # one broken path is reported; the others still run
                points, stopped = [], f"{type(exc).__name__}: {exc}"
                print(f"  {path}: failed: {stopped}")
            failed += stopped is not None
            entry["paths"][path] = {
                "label": LABELS[path],
                "skipped": None,
                "stopped": stopped,
                "points": points,
                "fit": report.fetch_fit(points) if points else None,
                "what": "measured",
            }
            if points and entry["prefill"] and entry["prefill"]["points"]:
                entry["break_even"][path] = report.crossing(entry["prefill"]["points"], points)
        result["models"].append(entry)
        # after each model: a run stopped later still leaves what it measured
        result["host"]["load_average_end"] = list(os.getloadavg())
        result["finished_utc"] = _now()
        (out_dir / "does-it-pay.json").write_text(json.dumps(result, indent=1) + "\n")
    why_no_plot = report.plot(result, out_dir / "does-it-pay.png")
    print()
    print("\n".join(report.text_table(result)))
    print(
        f"\nwrote {out_dir / 'does-it-pay.json'}"
        + (
            f" and {out_dir / 'does-it-pay.png'}"
            if why_no_plot is None
            else f" (no plot: {why_no_plot})"
        )
    )
    print(
        f"load average {result['host']['load_average_start'][0]:.2f} at the start, "
        f"{result['host']['load_average_end'][0]:.2f} at the end"
    )
    if failed:
        print(f"{failed} path(s) stopped before the longest length: see 'stopped' in the JSON")
    return 1 if failed else 0


def _command_line() -> str:
    """This process's command line, the token's value hidden."""
    argv = sys.argv[1:]
    words = argv[argv.index("does-it-pay") + 1 :] if "does-it-pay" in argv else argv
    shown: list[str] = []
    for i, word in enumerate(words):
        hidden = i > 0 and words[i - 1] == "--token"
        shown.append(
            "(hidden)" if hidden else "--token=(hidden)" if word.startswith("--token=") else word
        )
    return "epistemic-kvcache does-it-pay " + " ".join(shown)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
