#!/usr/bin/env python3
"""Measure whether rendered context bundles reuse a serving engine's prefix cache.

For each of `--bundles` fresh bundles (a per-run nonce leads every system prompt, so
every cold call is novel to the engine) it sends one cold and one warm call — the warm
call asks a *different* question over the same bundle — and reads
`vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total` from the server's
`/metrics` before and after each call. Prints latency, prompt tokens, queried and hit
tokens per call, then a summary.

    python scripts/measure_bundle_kv_reuse.py --base-url http://127.0.0.1:8000/v1

Against vLLM (`vllm serve <model>`) the counters are the engine's own; the tests run it
against `tests/prefix_cache_standin.py`, a stand-in that computes
prefix reuse on token blocks the same way (vLLM cannot run on CPU-only machines).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import urllib.request
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from epistemic_kvcache.context import (
    DEFAULT_SYSTEM_PREAMBLE,
    Candidate,
    ContextCompiler,
    InMemoryCandidateSource,
    KVCacheLayeringPolicy,
    NullBundleCache,
    PriorityClass,
    Session,
    bundle_chat_completion,
    make_openai_client,
)

HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
TOPICS = [
    "prefix cache reuse across turns",
    "durable kv block storage and fsync",
    "tenant isolation of cached evidence",
    "graph aware paging of hot blocks",
    "layering policy for background ingestion",
    "compression of warm tier blocks",
    "eviction under memory pressure",
    "checkpoint restore after restart",
]
VOCAB_TEXT = (
    "kv cache prefix block tenant gpu vllm lmcache disk redis fsync latency throughput "
    "eviction compression checkpoint graph paging policy ingestion interactive bundle "
    "evidence restart durability namespace digest snapshot branch tier hot warm cold"
)
VOCAB = VOCAB_TEXT.split()


@dataclass
class Row:
    bundle: int
    call: str
    latency_ms: float
    prompt_tokens: int
    queried_tokens: int
    hit_tokens: int
    skip_save: bool | None


def read_counters(metrics_url: str, timeout_s: float) -> tuple[float, float]:
    """(hits, queries) summed over every label set."""
    with urllib.request.urlopen(metrics_url, timeout=timeout_s) as resp:
        text = resp.read().decode("utf-8")
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in HITS + QUERIES:
                found[sample.name] = found.get(sample.name, 0.0) + sample.value
    hits = next((found[n] for n in HITS if n in found), None)
    queries = next((found[n] for n in QUERIES if n in found), None)
    if hits is None or queries is None:
        raise SystemExit(
            f"error: {metrics_url} has no vllm:prefix_cache_hits_total / _queries_total "
            "(is prefix caching enabled on the server?)"
        )
    return hits, queries


def make_candidates(rng: random.Random, n: int, nonce: str) -> list[Candidate]:
    now_us = int(time.time() * 1_000_000)
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        body = " ".join(rng.choice(VOCAB) for _ in range(rng.randint(25, 60)))
        out.append(
            Candidate(
                id=f"{nonce}-ev{i}",
                text=f"{topic}: {body}.",
                source=f"doc://{nonce}/{i % 17}",
                timestamp_us=now_us - rng.randint(0, 90) * 86_400_000_000,
                tenant="measure",
                strength=rng.random(),
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1] if __doc__ else None)
    ap.add_argument("--base-url", required=True, help="OpenAI base URL, e.g. http://h:8000/v1")
    ap.add_argument("--metrics-url", help="default: base URL without /v1, plus /metrics")
    ap.add_argument("--model", help="default: the first model the server lists")
    ap.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY or EMPTY")
    ap.add_argument("--bundles", type=int, default=4)
    ap.add_argument("--candidates", type=int, default=200)
    ap.add_argument("--token-budget", type=int, default=1500)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=60.0, help="per request, seconds")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--json", action="store_true", help="also print rows as JSON lines")
    args = ap.parse_args(argv)

    base = args.base_url.rstrip("/")
    metrics_url = args.metrics_url or base.removesuffix("/v1") + "/metrics"
    client = make_openai_client(
        base_url=base, api_key=args.api_key, timeout_s=args.timeout, max_retries=2
    )
    model = args.model or next(iter(client.models.list())).id
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    nonce = uuid.uuid4().hex[:12]
    print(f"# seed={seed} nonce={nonce} model={model} metrics={metrics_url}")
    rng = random.Random(seed)
    compiler = ContextCompiler(
        InMemoryCandidateSource(make_candidates(rng, args.candidates, nonce))
    )
    policy = KVCacheLayeringPolicy()
    session = Session("measure", "measure")

    rows: list[Row] = []
    for b in range(args.bundles):
        bundle = compiler.compile(
            TOPICS[b % len(TOPICS)] + f" {b}",
            session,
            token_budget=args.token_budget,
            top_k=args.top_k,
            kv_backend=NullBundleCache(),
        )
        preamble = f"[run {nonce} bundle {b}] {DEFAULT_SYSTEM_PREAMBLE}"
        for call, turn in (
            ("cold", "What does the evidence say about durability?"),
            ("warm", "Summarise the evidence about latency in one sentence."),
        ):
            h0, q0 = read_counters(metrics_url, args.timeout)
            res = bundle_chat_completion(
                bundle,
                turn,
                client=client,
                model=model,
                policy=policy,
                priority=PriorityClass.INTERACTIVE,
                system_preamble=preamble,
                max_tokens=args.max_tokens,
                temperature=0.0,
            )
            h1, q1 = read_counters(metrics_url, args.timeout)
            usage = res.completion.usage
            rows.append(
                Row(
                    bundle=b,
                    call=call,
                    latency_ms=res.latency_s * 1000,
                    prompt_tokens=usage.prompt_tokens if usage else -1,
                    queried_tokens=int(q1 - q0),
                    hit_tokens=int(h1 - h0),
                    skip_save=None if res.decision is None else not res.decision.store,
                )
            )

    print(f"{'bundle':>6} {'call':>5} {'latency_ms':>11} {'prompt_tok':>10} "
          f"{'queried':>8} {'hit_tok':>8} {'hit%':>6} {'skip_save':>9}")  # fmt: skip
    for r in rows:
        pct = 100.0 * r.hit_tokens / r.queried_tokens if r.queried_tokens else 0.0
        print(
            f"{r.bundle:>6} {r.call:>5} {r.latency_ms:>11.1f} {r.prompt_tokens:>10} "
            f"{r.queried_tokens:>8} {r.hit_tokens:>8} {pct:>6.1f} {r.skip_save!s:>9}"
        )
    summary: dict[str, Any] = {}
    for call in ("cold", "warm"):
        sel = [r for r in rows if r.call == call]
        queried = sum(r.queried_tokens for r in sel)
        summary[call] = {
            "calls": len(sel),
            "mean_latency_ms": sum(r.latency_ms for r in sel) / max(1, len(sel)),
            "hit_tokens": sum(r.hit_tokens for r in sel),
            "queried_tokens": queried,
            "hit_rate": sum(r.hit_tokens for r in sel) / queried if queried else 0.0,
        }
    cold_ms, warm_ms = summary["cold"]["mean_latency_ms"], summary["warm"]["mean_latency_ms"]
    print(
        f"# cold: hit rate {summary['cold']['hit_rate']:.1%}, mean {cold_ms:.1f} ms; "
        f"warm: hit rate {summary['warm']['hit_rate']:.1%}, mean {warm_ms:.1f} ms; "
        f"cold/warm latency {cold_ms / warm_ms if warm_ms else float('nan'):.2f}x"
    )
    if args.json:
        for r in rows:
            print(json.dumps({"row": asdict(r)}))
        print(json.dumps({"summary": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
