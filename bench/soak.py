"""Sustained LMCache load against a durable server with small tiers (issue 22, item 9).

Shared by `bench/bench_soak.py` (the long run, numbers for docs/benchmarks.md) and
`tests/test_soak.py` (the same load, about 25 s per wire, with the checks that fail).

The load is LMCache's L2 traffic on one wire, from `clients` LMCache instances at once
(threads, each with its own connection and its own keys; with several, their
connections spread over the server's event loops), each in a loop:

- store: a batch PUT of `batch` new chunks of `block_bytes` (16 x 4 MiB by default): the
  client's `put_many` on HTTP (the L2 connector's path), `MSET` on RESP;
- lookup: a batch EXISTS over the `batch` chunk keys of a prompt, a prefix of an earlier
  stored batch followed by chunks never stored (`miss_share` of them on average; and an
  early batch may be gone, evicted from the capped cold tier): `exists_many` on HTTP, a
  pipeline of `EXISTS key` on RESP (how redis-py clients batch it);
- load: a batch GET of the hit prefix (LMCache loads the longest prefix it holds):
  `get_many` on HTTP, `MGET` on RESP; every block read is compared with what was written.

The blocks are bf16-shaped (they compress in warm, like real KV) and each is unique (a
16-byte header with its serial number), so nothing deduplicates.

A sampler thread reads the server's RSS (`VmRSS` in /proc/<pid>/status) and `/kv/stats`
(each tier's `bytes` and `peak_bytes`, the high-water mark the store keeps, so a moment
over capacity between two samples is not missed) every `sample_interval_s`. The
verdict:

- RSS slope after `warmup_s`, a least-squares fit in MiB/min;
- RSS against docs/security.md's bound `B + H + W + I + X + N*c + F + P + S`, with `B`
  measured before the load and the other terms from the settings (`rss_bound_mib`);
- every tier's bytes and peak within its capacity;
- errors: failed or refused requests, wrong bytes, a GET missing a block EXISTS just
  reported (counted apart: the cold tier may evict between the two; not an error);
- p99 of the batch GET per `window_s` window.
"""

from __future__ import annotations

import contextlib
import csv
import http.client
import json
import math
import random
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.abuse import TOKEN_B, TOKEN_OPS, rss_kib, start_server
from epistemic_kvcache.server.process import ServerProcess

KiB, MiB = 1024, 1024 * 1024

STORE_THREADS_STACK_MIB = 32.0
"""`I`: 32 store threads, their touched stacks well under 1 MiB each (docs/security.md)."""
PER_CONNECTION_MIB = 0.0625
"""`c`: what one open connection costs beyond the in-flight budget (a few KiB; 64 KiB)."""
SLACK_MIB = 96.0
"""`S`: allocator slack (freed memory kept for reuse); the abuse suite uses the same."""


@dataclass
class SoakConfig:
    wire: str = "http"
    """`http` (our client: put_many / exists_many / get_many) or `resp` (redis-py)."""
    duration_s: float = 1800.0
    warmup_s: float = 120.0
    """Samples before this are left out of the RSS slope (the heap and the tiers fill)."""
    block_bytes: int = 4 * MiB
    batch: int = 16
    miss_share: float = 0.25
    """Share of a prompt's chunks, on average, that were never stored."""
    reuse_window: int = 64
    """A prompt's stored prefix comes from one of the last `reuse_window` batches."""
    hot_capacity_bytes: int = 32 * MiB
    warm_capacity_bytes: int = 64 * MiB
    cold_capacity_bytes: int = 2048 * MiB
    max_inflight_body_bytes: int = 512 * MiB
    receive_prefault_bytes: int = 64 * MiB
    sample_interval_s: float = 1.0
    window_s: float = 60.0
    seed: int = 1
    src: Path | None = None
    """Run the server from this source tree (e.g. an export of an older commit)."""
    options: list[str] = field(default_factory=list)
    """Extra server flags."""
    clients: int = 1
    """LMCache instances at once, each with its own connection and keys (with several,
    their connections spread over the server's event loops)."""

    def server_options(self) -> list[str]:
        return [
            "--hot-capacity-bytes", str(self.hot_capacity_bytes),
            "--warm-capacity-bytes", str(self.warm_capacity_bytes),
            "--cold-capacity-bytes", str(self.cold_capacity_bytes),
            "--max-inflight-body-bytes", str(self.max_inflight_body_bytes),
            "--max-tenant-inflight-bytes", str(self.max_inflight_body_bytes),
            "--receive-prefault-bytes", str(self.receive_prefault_bytes),
            *self.options,
        ]  # fmt: skip


@dataclass
class Sample:
    t_s: float
    rss_mib: float
    tiers: dict[str, dict[str, int]]


@dataclass
class SoakResult:
    wire: str
    duration_s: float
    clients: int = 1
    iterations: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    exists_asked: int = 0
    exists_hits: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    vanished: int = 0
    """Blocks EXISTS reported that the GET right after did not find (evicted between)."""
    baseline_rss_mib: float = 0.0
    rss_bound_mib: float = 0.0
    rss_max_mib: float = 0.0
    rss_first_after_warmup_mib: float = 0.0
    rss_last_mib: float = 0.0
    rss_slope_mib_per_min: float = 0.0
    tier_max_bytes: dict[str, int] = field(default_factory=dict)
    tier_peak_bytes: dict[str, int] = field(default_factory=dict)
    tier_capacity_bytes: dict[str, int] = field(default_factory=dict)
    tiers_over_capacity: list[str] = field(default_factory=list)
    get_p99_ms_by_window: list[tuple[float, float, int]] = field(default_factory=list)
    """(window start s, p99 ms of batch GET, batch GETs in the window)."""
    put_p99_ms: float = 0.0
    get_p99_ms: float = 0.0
    loops: list[dict[str, Any]] = field(default_factory=list)
    """`/kv/stats` "loops" at the end: connections and requests per event loop."""
    samples: list[Sample] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("samples")
        return d


def rss_bound_mib(cfg: SoakConfig, baseline_mib: float, connections: int) -> float:
    """docs/security.md: RSS <= B + H + W + I + X + N*c + F + P + S, with `F` one batch
    answer per connection (the largest reply this load makes)."""
    reply_mib = cfg.batch * cfg.block_bytes / MiB
    return (
        baseline_mib
        + (cfg.hot_capacity_bytes + cfg.warm_capacity_bytes) / MiB
        + STORE_THREADS_STACK_MIB
        + cfg.max_inflight_body_bytes / MiB
        + connections * PER_CONNECTION_MIB
        + connections * reply_mib
        + cfg.receive_prefault_bytes / MiB
        + SLACK_MIB
    )


def slope_allowance_mib_per_min(cfg: SoakConfig) -> float:
    """The RSS slope a bounded server may show over the fit window: twice what one lasting
    step of one batch per client (the allocator keeping one more batch's worth of freed
    memory, a legitimate plateau change) makes in the middle of the window, `1.5 * step / window`.
    A server whose tiers grow with the data written climbs by a batch every round, many
    times faster (see docs/benchmarks.md, "Sustained LMCache load")."""
    window_s = max(1.0, cfg.duration_s - cfg.warmup_s)
    step_mib = cfg.clients * cfg.batch * cfg.block_bytes / MiB  # a batch per client in flight
    return 2 * 1.5 * step_mib / window_s * 60


def slope_mib_per_min(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB) points, in MiB per minute."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return 0.0
    cov = sum((t - mt) * (v - mv) for t, v in points)
    return cov / var * 60.0


def p99(values: Sequence[float]) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)]


# -- the two wires ---------------------------------------------------------------------
class Wire:
    """Batch PUT, batch EXISTS, batch GET; failures raise (counted by the caller)."""

    connections = 1

    def put_many(self, items: list[tuple[str, memoryview]]) -> None: ...
    def exists_many(self, keys: list[str]) -> list[bool]: ...
    def get_many(self, keys: list[str]) -> list[bytes | None]: ...
    def close(self) -> None: ...


class HttpWire(Wire):
    def __init__(self, server: ServerProcess) -> None:
        from epistemic_kvcache.client import EpistemicGraphKVBackend, KvCacheConfig

        self.client = EpistemicGraphKVBackend(
            KvCacheConfig(
                base_url=f"http://127.0.0.1:{server.http_port}", token=TOKEN_B, read_timeout_s=60.0
            )
        )
        self._seen = self._failures()

    def _failures(self) -> int:
        c = self.client.counters()
        return (
            c.puts_failed
            + c.transport_errors
            + c.server_errors
            + c.size_mismatches
            + c.fast_failures
        )

    def _check(self, what: str) -> None:
        """The client degrades failures to misses and counts them: raise on a new one."""
        now = self._failures()
        if now != self._seen:
            n, self._seen = now - self._seen, now
            raise RuntimeError(f"{what}: {n} failed (client counters {self.client.counters()})")

    def put_many(self, items: list[tuple[str, memoryview]]) -> None:
        outcomes = self.client.put_many(items)
        self._check("put_many")
        bad = [o for o in outcomes if not o.stored]
        if bad:
            raise RuntimeError(f"put_many: {len(bad)} not stored ({bad[0]})")

    def exists_many(self, keys: list[str]) -> list[bool]:
        out = self.client.exists_many(keys)
        self._check("exists_many")
        return out

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        out = self.client.get_many(keys)
        self._check("get_many")
        return out

    def close(self) -> None:
        self.client.close()


class RespWire(Wire):
    def __init__(self, server: ServerProcess) -> None:
        import redis

        self.r = redis.Redis(
            host="127.0.0.1", port=server.resp_port, password=TOKEN_B, socket_timeout=60
        )

    def put_many(self, items: list[tuple[str, memoryview]]) -> None:
        if not self.r.mset({k: bytes(v) for k, v in items}):
            raise RuntimeError("MSET did not answer OK")

    def exists_many(self, keys: list[str]) -> list[bool]:
        with self.r.pipeline(transaction=False) as p:
            for k in keys:
                p.exists(k)
            return [bool(n) for n in p.execute()]

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        return list(self.r.mget(keys)) if keys else []

    def close(self) -> None:
        self.r.close()


WIRES: dict[str, Callable[[ServerProcess], Wire]] = {"http": HttpWire, "resp": RespWire}


# -- the sampler -----------------------------------------------------------------------
def read_stats(port: int, token: str = TOKEN_B) -> dict[str, Any]:
    """`/kv/stats` as `token`'s tenant sees it."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/kv/stats", headers={"Authorization": f"Bearer {token}"})
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"/kv/stats answered {resp.status}: {body[:200]!r}")
        stats: dict[str, Any] = json.loads(body)
        return stats
    finally:
        conn.close()


def read_tiers(port: int) -> dict[str, dict[str, int]]:
    tiers: dict[str, dict[str, int]] = read_stats(port)["tiers"]
    return tiers


class Sampler(threading.Thread):
    def __init__(self, server: ServerProcess, interval_s: float, t0: float) -> None:
        super().__init__(daemon=True, name="soak-sampler")
        self.server = server
        self.interval_s = interval_s
        self.t0 = t0
        self.samples: list[Sample] = []
        self.errors: list[str] = []
        self._stop_event = threading.Event()

    def sample(self) -> None:
        rss = rss_kib(self.server.pid) / 1024
        try:
            tiers = read_tiers(self.server.http_port)
        except (OSError, RuntimeError, ValueError) as exc:
            self.errors.append(f"stats: {exc}")
            return
        self.samples.append(Sample(time.monotonic() - self.t0, rss, tiers))

    def run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            self.sample()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(30)
        self.sample()  # the state at the end


# -- the load --------------------------------------------------------------------------
class Blocks:
    """Unique bf16-shaped blocks: `batch` base buffers, each block a 16-byte serial
    header on one of them (so a block is rebuilt, and checked, from its serial)."""

    def __init__(self, cfg: SoakConfig) -> None:
        rng = np.random.default_rng(cfg.seed)
        self.bufs: list[bytearray] = []
        for _ in range(cfg.batch):
            vals = rng.standard_normal(cfg.block_bytes // 2).astype(np.float32)
            self.bufs.append(bytearray((vals.view(np.uint32) >> 16).astype(np.uint16).tobytes()))

    @staticmethod
    def header(serial: int) -> bytes:
        return struct.pack(">QQ", serial, serial ^ 0x5EED5EED5EED5EED)

    def make(self, slot: int, serial: int) -> memoryview:
        buf = self.bufs[slot]
        buf[:16] = self.header(serial)
        return memoryview(buf)

    def matches(self, slot: int, serial: int, got: bytes) -> bool:
        buf = self.bufs[slot]
        return (
            len(got) == len(buf)
            and got[:16] == self.header(serial)
            and memoryview(got)[16:] == memoryview(buf)[16:]
        )


class Client(threading.Thread):
    """One LMCache instance: its own connection(s) and key space, the store / lookup /
    load rounds until the deadline. Its tallies go into its own `SoakResult`."""

    def __init__(self, cfg: SoakConfig, index: int, server: ServerProcess, t0: float) -> None:
        super().__init__(daemon=True, name=f"soak-client-{index}")
        self.cfg = cfg
        self.index = index
        self.server = server
        self.t0 = t0
        self.rng = random.Random(cfg.seed * 1000 + index)
        self.result = SoakResult(wire=cfg.wire, duration_s=cfg.duration_s)
        self.gets: list[tuple[float, float]] = []  # (t, seconds)
        self.puts: list[float] = []
        self.connections = 1

    def run(self) -> None:
        cfg, result, rng = self.cfg, self.result, self.rng
        try:
            blocks = Blocks(cfg)
            wire = WIRES[cfg.wire](self.server)
        except Exception as exc:
            _error(result, f"client {self.index} start: {exc!r}")
            return
        self.connections = wire.connections
        stored: list[list[tuple[str, int, int]]] = []  # per batch: (key, slot, serial)
        serial = 0
        tag = f"c{self.index:02x}"
        try:
            while time.monotonic() - self.t0 < cfg.duration_s:
                it = result.iterations
                # store: a batch PUT of new chunks
                batch = []
                for slot in range(cfg.batch):
                    serial += 1
                    batch.append((f"soak@{tag}@{it:08x}@{slot:02x}", slot, serial))
                items = [(k, blocks.make(s, n)) for k, s, n in batch]
                t = time.perf_counter()
                try:
                    wire.put_many(items)
                    stored.append(batch)
                    result.bytes_written += cfg.batch * cfg.block_bytes
                except Exception as exc:
                    _error(result, f"put_many: {exc!r}")
                self.puts.append(time.perf_counter() - t)
                del stored[: -cfg.reuse_window]
                # lookup: a prompt = a stored prefix + chunks never stored
                if stored:
                    src = rng.choice(stored)
                    k = sum(rng.random() >= cfg.miss_share for _ in range(cfg.batch))
                    prompt = src[:k]
                    keys = [key for key, _s, _n in prompt]
                    keys += [f"soak@{tag}@never@{it:08x}@{i:02x}" for i in range(cfg.batch - k)]
                    try:
                        present = wire.exists_many(keys)
                    except Exception as exc:
                        _error(result, f"exists_many: {exc!r}")
                        present = []
                    result.exists_asked += len(keys)
                    result.exists_hits += sum(present)
                    if any(present[k:]):
                        _error(result, "EXISTS found a key that was never stored")
                    hits = 0
                    while hits < len(present) and present[hits]:
                        hits += 1
                    # load: a batch GET of the hit prefix (regenerated blocks are checked)
                    if hits:
                        t = time.perf_counter()
                        try:
                            got = wire.get_many(keys[:hits])
                        except Exception as exc:
                            _error(result, f"get_many: {exc!r}")
                            got = []
                        self.gets.append((time.monotonic() - self.t0, time.perf_counter() - t))
                        for (_key, slot, n), g in zip(prompt[:hits], got, strict=False):
                            if g is None:
                                result.vanished += 1
                            elif not blocks.matches(slot, n, g):
                                _error(result, f"wrong bytes for serial {n}")
                            else:
                                result.bytes_read += len(g)
                result.iterations += 1
        except Exception as exc:  # a bug in the load itself: count it, do not hang
            _error(result, f"client {self.index}: {exc!r}")
        finally:
            wire.close()


def read_loops(port: int) -> list[dict[str, Any]]:
    """`/kv/stats` "loops" (an operator tenant's view): requests per event loop."""
    loops: list[dict[str, Any]] = read_stats(port, TOKEN_OPS).get("loops", [])
    return loops


def run(cfg: SoakConfig, workdir: Path, *, log: Callable[[str], None] = print) -> SoakResult:
    """One soak on a fresh server in `workdir`, `cfg.clients` clients at once; the result
    holds every sample and the clients' merged tallies."""
    result = SoakResult(wire=cfg.wire, duration_s=cfg.duration_s, clients=cfg.clients)
    with start_server(workdir, src=cfg.src, options=cfg.server_options()) as server:
        baseline = 0.0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # settled: two equal reads 200 ms apart
            a = rss_kib(server.pid)
            time.sleep(0.2)
            if rss_kib(server.pid) == a:
                break
        baseline = rss_kib(server.pid) / 1024
        t0 = time.monotonic()
        sampler = Sampler(server, cfg.sample_interval_s, t0)
        sampler.sample()
        sampler.start()
        clients = [Client(cfg, i, server, t0) for i in range(cfg.clients)]
        try:
            for c in clients:
                c.start()
            while alive := [c for c in clients if c.is_alive()]:
                alive[0].join(30)
                rounds = sum(c.result.iterations for c in clients)
                errors = sum(c.result.errors for c in clients)
                s = sampler.samples[-1] if sampler.samples else None
                log(
                    f"[{cfg.wire}] {time.monotonic() - t0:6.0f} s: {rounds} rounds, "
                    f"{errors} errors" + (f", RSS {s.rss_mib:.0f} MiB" if s else "")
                )
            try:
                result.loops = read_loops(server.http_port)
            except (OSError, RuntimeError, ValueError) as exc:
                _error(result, f"stats (loops): {exc}")
        finally:
            sampler.stop()
        for e in sampler.errors:
            _error(result, e)
        gets: list[tuple[float, float]] = []
        puts: list[float] = []
        for c in clients:
            _merge(result, c.result)
            gets += c.gets
            puts += c.puts
        gets.sort()
        connections = sum(c.connections for c in clients) + 1  # + the sampler's
        result.baseline_rss_mib = baseline
        result.rss_bound_mib = rss_bound_mib(cfg, baseline, connections)
        _analyse(cfg, result, sampler.samples, gets, puts)
    return result


def _merge(into: SoakResult, part: SoakResult) -> None:
    for name in ("iterations", "bytes_written", "bytes_read", "exists_asked", "exists_hits",
                 "vanished"):  # fmt: skip
        setattr(into, name, getattr(into, name) + getattr(part, name))
    into.errors += part.errors
    into.error_samples += part.error_samples[: max(0, 10 - len(into.error_samples))]


def _error(result: SoakResult, what: str) -> None:
    result.errors += 1
    if len(result.error_samples) < 10:
        result.error_samples.append(what)


def _analyse(
    cfg: SoakConfig,
    result: SoakResult,
    samples: list[Sample],
    gets: list[tuple[float, float]],
    puts: list[float],
) -> None:
    result.samples = samples
    rss = [(s.t_s, s.rss_mib) for s in samples]
    after = [(t, v) for t, v in rss if t >= cfg.warmup_s]
    result.rss_max_mib = max((v for _, v in rss), default=0.0)
    result.rss_last_mib = rss[-1][1] if rss else 0.0
    result.rss_first_after_warmup_mib = after[0][1] if after else 0.0
    result.rss_slope_mib_per_min = slope_mib_per_min(after)
    for s in samples:
        for name, t in s.tiers.items():
            result.tier_max_bytes[name] = max(result.tier_max_bytes.get(name, 0), t["bytes"])
            peak = t.get("peak_bytes", t["bytes"])
            result.tier_peak_bytes[name] = max(result.tier_peak_bytes.get(name, 0), peak)
            result.tier_capacity_bytes[name] = t["capacity_bytes"]
    result.tiers_over_capacity = [
        f"{name}: max {result.tier_max_bytes[name]}, peak {result.tier_peak_bytes[name]}, "
        f"capacity {cap}"
        for name, cap in result.tier_capacity_bytes.items()
        if max(result.tier_max_bytes[name], result.tier_peak_bytes[name]) > cap
    ]
    result.put_p99_ms = p99(puts) * 1000
    result.get_p99_ms = p99([d for _, d in gets]) * 1000
    end = max((t for t, _ in gets), default=0.0)
    w = 0.0
    while w <= end:
        in_w = [d for t, d in gets if w <= t < w + cfg.window_s]
        if in_w:
            result.get_p99_ms_by_window.append((w, p99(in_w) * 1000, len(in_w)))
        w += cfg.window_s


# -- output ----------------------------------------------------------------------------
def write_csv(result: SoakResult, path: Path) -> Path:
    """One row per sample: time, RSS, and per tier bytes / peak / capacity."""
    names = sorted({n for s in result.samples for n in s.tiers})
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            ["t_s", "rss_mib"]
            + [f"{n}_{c}" for n in names for c in ("bytes", "peak_bytes", "capacity_bytes")]
        )
        for s in result.samples:
            row: list[object] = [f"{s.t_s:.2f}", f"{s.rss_mib:.1f}"]
            for n in names:
                t = s.tiers.get(n, {})
                row += [t.get("bytes", ""), t.get("peak_bytes", ""), t.get("capacity_bytes", "")]
            w.writerow(row)
    return path


def write_windows_csv(result: SoakResult, path: Path) -> Path:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["window_start_s", "get_many_p99_ms", "get_many_count"])
        for start, ms, n in result.get_p99_ms_by_window:
            w.writerow([f"{start:.0f}", f"{ms:.1f}", n])
    return path


def plot(results: Sequence[SoakResult], cfg: SoakConfig, out: Path) -> Path:
    """RSS (with the bound and the fit), tier bytes against capacity, batch GET p99."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 10), dpi=100, sharex=True)
    ax_rss, ax_tier, ax_p99 = axes
    for r in results:
        ts = [s.t_s / 60 for s in r.samples]
        line = ax_rss.plot(ts, [s.rss_mib for s in r.samples], label=f"{r.wire} RSS")[0]
        ax_rss.axhline(r.rss_bound_mib, color=line.get_color(), linestyle=":", linewidth=0.8)
        ax_rss.text(0, r.rss_bound_mib, f" {r.wire} bound", fontsize=7, va="bottom")
        for tier, style in (("hot", "-"), ("warm", "--"), ("cold", ":")):
            ys = [s.tiers.get(tier, {}).get("bytes", 0) / MiB for s in r.samples]
            ax_tier.plot(ts, ys, linestyle=style, label=f"{r.wire} {tier}")
        wins = r.get_p99_ms_by_window
        ax_p99.plot(
            [(w + cfg.window_s / 2) / 60 for w, _, _ in wins],
            [ms for _, ms, _ in wins],
            marker="o",
            label=f"{r.wire} batch GET p99",
        )
    for tier, cap in (
        ("hot", cfg.hot_capacity_bytes),
        ("warm", cfg.warm_capacity_bytes),
        ("cold", cfg.cold_capacity_bytes),
    ):
        ax_tier.axhline(cap / MiB, color="grey", linewidth=0.6)
        ax_tier.text(0, cap / MiB, f" {tier} capacity", fontsize=7, va="bottom")
    ax_rss.axvline(cfg.warmup_s / 60, color="grey", linewidth=0.6, linestyle="--")
    ax_rss.set_ylabel("server RSS (MiB)")
    ax_rss.set_ylim(bottom=0)
    ax_tier.set_ylabel("tier bytes (MiB)")
    ax_tier.set_yscale("symlog", linthresh=64)
    ax_p99.set_ylabel(f"batch GET p99 (ms, {cfg.window_s:.0f} s windows)")
    ax_p99.set_xlabel("minutes")
    ax_p99.set_ylim(bottom=0)
    for ax in axes:
        ax.legend(fontsize=7, loc="upper right")
    fig.suptitle(
        f"Sustained LMCache load, durable, {cfg.batch} x {cfg.block_bytes // MiB} MiB batches, "
        f"hot {cfg.hot_capacity_bytes // MiB} / warm {cfg.warm_capacity_bytes // MiB} / "
        f"cold {cfg.cold_capacity_bytes // MiB} MiB",
        fontsize=9,
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def table(results: Sequence[SoakResult]) -> str:
    """The markdown table docs/benchmarks.md shows."""
    rows = [
        "| wire | run | clients | rounds | GiB written / read | EXISTS hit share | errors | "
        "vanished | RSS start → max → end (MiB) | RSS slope after warm-up (MiB/min) | "
        "RSS bound (MiB) | hot / warm / cold peak vs capacity (MiB) | batch PUT p99 (ms) | "
        "batch GET p99 (ms) | requests per event loop |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        tiers = " / ".join(
            f"{r.tier_peak_bytes.get(n, 0) / MiB:.0f} of {r.tier_capacity_bytes.get(n, 0) / MiB:.0f}"
            for n in ("hot", "warm", "cold")
        )
        share = r.exists_hits / r.exists_asked if r.exists_asked else 0.0
        per_loop = " / ".join(str(v.get("requests", "?")) for v in r.loops) or "-"
        rows.append(
            f"| {r.wire} | {r.duration_s / 60:.1f} min | {r.clients} | {r.iterations} | "
            f"{r.bytes_written / 2**30:.1f} / {r.bytes_read / 2**30:.1f} | {share:.2f} | "
            f"{r.errors} | {r.vanished} | {r.baseline_rss_mib:.0f} → {r.rss_max_mib:.0f} → "
            f"{r.rss_last_mib:.0f} | {r.rss_slope_mib_per_min:+.2f} | {r.rss_bound_mib:.0f} | "
            f"{tiers} | {r.put_p99_ms:.0f} | {r.get_p99_ms:.0f} | {per_loop} |"
        )
    return "\n".join(rows)


def write_outputs(results: Sequence[SoakResult], cfg: SoakConfig, out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for r in results:
        paths[f"{r.wire}_csv"] = write_csv(r, out_dir / f"soak-{r.wire}.csv")
        paths[f"{r.wire}_windows"] = write_windows_csv(r, out_dir / f"soak-{r.wire}-windows.csv")
    paths["plot"] = plot(results, cfg, out_dir / "soak.png")
    summary = out_dir / "soak.json"
    summary.write_text(json.dumps([r.summary() for r in results], indent=1))
    paths["json"] = summary
    with contextlib.suppress(OSError):
        (out_dir / "soak.md").write_text(table(results) + "\n")
    return paths
