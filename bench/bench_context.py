"""Context-bundle benchmarks (issue 5): compile cold vs cache hit, and the hit path's cost
over a plain backend `get`.

    .venv/bin/python -m bench.bench_context [--quick] [--no-server]

For 50, 500 and 5,000 candidates (a quarter belong to another tenant, every tenth has a
redaction, each cites one supporter) it times, as medians:
- cold: a full compile (policy filter, BM25, MMR, budget fit, proof graph, encode);
- hit: a compile whose bundle is in the cache (fetch, policy filter, key, get, decode);
- get: the backend's own `get` of the same key, so `hit - get` is what the compiler adds.
Backends: the in-process `TTLBundleCache`, and the real server (memory backend, started on
a free loopback port) through `EpistemicGraphKVBackend` unless `--no-server`.
Numbers are ratios measured side by side in one run; absolute times mean little here.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

from epistemic_kvcache.context import (
    BundleCacheBackend,
    Candidate,
    ContextCompiler,
    InMemoryCandidateSource,
    NullBundleCache,
    Session,
    TTLBundleCache,
)
from epistemic_kvcache.context.model import to_epoch_us
from epistemic_kvcache.server.process import ServerProcess

TOKEN = "bench-context-token"
AS_OF = datetime(2024, 6, 1, tzinfo=UTC)
VOCAB_TEXT = (
    "kv cache prefix block tenant gpu vllm lmcache disk redis fsync latency throughput "
    "eviction compression checkpoint graph paging policy ingestion interactive bundle "
    "evidence restart durability namespace digest snapshot branch tier hot warm cold"
)
VOCAB = VOCAB_TEXT.split()


def candidates(n: int, seed: int = 5) -> list[Candidate]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = " ".join(rng.choice(VOCAB) for _ in range(rng.randint(30, 70)))
        out.append(
            Candidate(
                id=f"ev{i:05d}",
                text=text,
                source=f"doc://corpus/{i % 97}",
                timestamp_us=to_epoch_us(AS_OF) - rng.randint(0, 365) * 86_400_000_000,
                tenant="other" if i % 4 == 0 else "acme",
                strength=rng.random(),
                redactions=((0, 3),) if i % 10 == 0 else (),
                supported_by=(f"ev{rng.randrange(n):05d}",),
            )
        )
    return out


def median_s(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@contextmanager
def real_server() -> Iterator[str]:
    with (
        tempfile.TemporaryDirectory() as tmp,
        ServerProcess(tmp, backend="memory", token=TOKEN, resp=False) as srv,
    ):
        yield srv.url()


def bench_backend(name: str, backend: BundleCacheBackend, sizes: list[int], reps: int) -> None:
    print(f"\n### backend: {name}\n")
    print("| candidates | bundle bytes | cold ms | hit ms | cold/hit | get ms | hit - get ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    session = Session("bench", "acme")
    for n in sizes:
        comp = ContextCompiler(InMemoryCandidateSource(candidates(n)))
        query = "durable kv cache prefix reuse latency"
        kw = {"token_budget": 2048, "top_k": 8, "as_of": AS_OF}
        cold_reps = max(3, reps // (1 + n // 500))
        cold = median_s(
            lambda: comp.compile(query, session, kv_backend=NullBundleCache(), **kw), cold_reps
        )
        bundle = comp.compile(query, session, kv_backend=backend, **kw)
        hit_b = comp.compile(query, session, kv_backend=backend, **kw)
        if not hit_b.kv_cache_hit or hit_b != bundle:
            raise RuntimeError(f"{name}: expected a cache hit for n={n}")
        hit = median_s(lambda: comp.compile(query, session, kv_backend=backend, **kw), reps)
        get = median_s(lambda: backend.get(bundle.cache_key), reps)
        size = len(bundle.to_bytes())
        print(
            f"| {n:,} | {size:,} | {cold * 1e3:.2f} | {hit * 1e3:.3f} | {cold / hit:.1f}x | "
            f"{get * 1e3:.3f} | {(hit - get) * 1e3:.3f} |"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="context bundle compile: cold vs hit")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--no-server", action="store_true", help="skip the real-server backend")
    args = ap.parse_args(argv)
    reps = 5 if args.quick else 25
    sizes = [50, 500, 5000]
    print(f"# bench_context: python {sys.version.split()[0]}, medians of {reps} runs")
    bench_backend("in-process TTLBundleCache", TTLBundleCache(), sizes, reps)
    if not args.no_server:
        from epistemic_kvcache.client import EpistemicGraphKVBackend

        with real_server() as url, EpistemicGraphKVBackend(base_url=url, token=TOKEN) as client:
            bench_backend("real server (memory) via EpistemicGraphKVBackend", client, sizes, reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
