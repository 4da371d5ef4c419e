"""Serving wire: bundle_chat_completion through the real `openai` client against the
prefix-cache stand-in, the stand-in's block accounting, and the measurement script."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from epistemic_kvcache.context import (
    Candidate,
    ContextBundle,
    ContextCompiler,
    InMemoryCandidateSource,
    KVCacheLayeringPolicy,
    NullBundleCache,
    PriorityClass,
    Session,
    bundle_chat_completion,
    make_openai_client,
)
from epistemic_kvcache.context.model import to_epoch_us
from prefix_cache_standin import (
    BlockPrefixCache,
    PrefixCacheStandin,
    render_chat,
    tokenize,
)

ROOT = Path(__file__).resolve().parent.parent
AS_OF = datetime(2024, 6, 1, tzinfo=UTC)


@pytest.fixture
def standin() -> Iterator[PrefixCacheStandin]:
    with PrefixCacheStandin(prefill_us_per_token=0.0) as s:
        yield s


def make_bundle(topic: str, n: int = 30) -> ContextBundle:
    cands = [
        Candidate(
            id=f"{topic}-{i}",
            text=f"{topic} evidence {i}: kv cache blocks reuse prefix number {i * 7}",
            source=f"doc://{topic}/{i}",
            timestamp_us=to_epoch_us(AS_OF) - i * 86_400_000_000,
            tenant="acme",
        )
        for i in range(n)
    ]
    comp = ContextCompiler(InMemoryCandidateSource(cands))
    return comp.compile(
        f"{topic} kv cache", Session("s", "acme"), as_of=AS_OF, kv_backend=NullBundleCache()
    )


# -- stand-in accounting ---------------------------------------------------------------


def test_block_cache_hits_only_whole_shared_leading_blocks() -> None:
    c = BlockPrefixCache(block_tokens=4)
    a = [f" t{i}" for i in range(10)]  # 2 full blocks + 2 tokens
    assert c.lookup_and_insert(a) == 0
    assert c.lookup_and_insert(a) == 8
    b = a[:6] + [" other"] * 4  # shares the first block only
    assert c.lookup_and_insert(b) == 4
    d = [" x", *a[1:]]  # same tokens after a different first one: chain breaks
    assert c.lookup_and_insert(d) == 0
    exact = a[:8]  # fully cached prompt: the last block is recomputed
    assert c.lookup_and_insert(exact) == 4
    assert (c.queries_total, c.hits_total) == (10 + 10 + 10 + 10 + 8, 8 + 4 + 4)


def test_render_and_tokenize_are_deterministic() -> None:
    msgs = [{"role": "system", "content": "a  b\nc"}, {"role": "user", "content": "d"}]
    text = render_chat(msgs)
    assert text == "<|system|>\na  b\nc\n<|user|>\nd\n<|assistant|>\n"
    assert "".join(tokenize(text)) == text.rstrip()


def test_standin_rejects_bad_requests(standin: PrefixCacheStandin) -> None:
    req = urllib.request.Request(
        standin.base_url + "/chat/completions", data=b"{nope", method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=5)
    assert err.value.code == 400
    err.value.close()
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(standin.url + "/nowhere", timeout=5)
    assert err.value.code == 404
    err.value.close()


# -- bundle_chat_completion ------------------------------------------------------------


def metrics(standin: PrefixCacheStandin) -> dict[str, float]:
    with urllib.request.urlopen(standin.url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = float(value)
    return out


def test_second_turn_over_a_bundle_reuses_the_prefix(standin: PrefixCacheStandin) -> None:
    client = make_openai_client(base_url=standin.base_url, timeout_s=5, max_retries=0)
    bundle = make_bundle("alpha")
    policy = KVCacheLayeringPolicy(min_prompt_tokens=16)

    first = bundle_chat_completion(
        bundle, "first question?", client=client, model="standin", policy=policy
    )
    m1 = metrics(standin)
    second = bundle_chat_completion(
        bundle, "a different second question?", client=client, model="standin", policy=policy
    )
    m2 = metrics(standin)

    assert first.messages[0] == second.messages[0]
    assert first.completion.usage is not None
    assert second.completion.usage is not None
    prompt = second.completion.usage.prompt_tokens
    hits = m2["vllm:prefix_cache_hits_total"] - m1["vllm:prefix_cache_hits_total"]
    assert m1["vllm:prefix_cache_hits_total"] == 0
    # Every full block of the system message is reused; only the turn's tail is new.
    system_tokens = len(tokenize(render_chat(first.messages[:1])))
    assert hits >= system_tokens - 16
    assert hits < prompt
    assert m2["vllm:prefix_cache_queries_total"] == first.completion.usage.prompt_tokens + prompt

    # A different bundle shares (almost) nothing beyond the preamble.
    other = bundle_chat_completion(
        make_bundle("omega"), "first question?", client=client, model="standin"
    )
    m3 = metrics(standin)
    assert other.completion.usage is not None
    a_tokens = tokenize(render_chat(first.messages))
    b_tokens = tokenize(render_chat(other.messages))
    common = next(
        (i for i, (x, y) in enumerate(zip(a_tokens, b_tokens, strict=False)) if x != y),
        min(len(a_tokens), len(b_tokens)),
    )
    other_hits = m3["vllm:prefix_cache_hits_total"] - m2["vllm:prefix_cache_hits_total"]
    assert other_hits == (common // 16) * 16
    assert other_hits < hits / 2


def test_layering_decision_travels_in_extra_body(standin: PrefixCacheStandin) -> None:
    client = make_openai_client(base_url=standin.base_url, timeout_s=5, max_retries=0)
    bundle = make_bundle("beta")
    policy = KVCacheLayeringPolicy(min_prompt_tokens=16, min_expected_reuse=2)

    r = bundle_chat_completion(
        bundle, "q", client=client, policy=policy, priority=PriorityClass.BACKGROUND_INGESTION
    )
    assert r.decision is not None
    assert r.decision.reason == "background_ingestion"
    assert standin.requests[-1]["kv_transfer_params"] == {"lmcache.skip_save": True}

    r = bundle_chat_completion(
        bundle,
        "q",
        client=client,
        policy=policy,
        extra_body={"kv_transfer_params": {"lmcache.tag": "x"}, "top_k": 5},
    )
    assert r.decision is not None
    assert r.decision.reason == "shared_bundle_prefix"  # second sighting of the bundle
    assert standin.requests[-1]["kv_transfer_params"] == {
        "lmcache.tag": "x",
        "lmcache.skip_save": False,
    }

    r = bundle_chat_completion(bundle, "q", client=client)  # no policy: no params
    assert r.decision is None
    assert standin.requests[-1]["kv_transfer_params"] is None


def test_client_timeout_is_bounded() -> None:
    client = make_openai_client(base_url="http://127.0.0.1:9/v1", timeout_s=1.5, max_retries=0)
    assert client.timeout == 1.5
    assert client.max_retries == 0
    import openai

    with pytest.raises(openai.APIConnectionError):
        bundle_chat_completion(make_bundle("gamma", 3), "q", client=client)


# -- the measurement script ------------------------------------------------------------


def test_measure_script_against_the_standin() -> None:
    with PrefixCacheStandin(prefill_us_per_token=200.0) as standin:
        proc = subprocess.run(
            [
                sys.executable,
                str(ROOT / "scripts" / "measure_bundle_kv_reuse.py"),
                "--base-url",
                standin.base_url,
                "--bundles",
                "3",
                "--candidates",
                "60",
                "--seed",
                "7",
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    rows = [json.loads(x)["row"] for x in lines if x.startswith('{"row"')]
    summary = json.loads(next(x for x in lines if x.startswith('{"summary"')))["summary"]
    assert [(r["bundle"], r["call"]) for r in rows] == [
        (b, c) for b in range(3) for c in ("cold", "warm")
    ]
    for r in rows:
        assert r["queried_tokens"] == r["prompt_tokens"] > 0
        if r["call"] == "cold":
            assert r["hit_tokens"] == 0  # the nonce makes every cold call novel
        else:
            assert r["hit_tokens"] > 0.8 * r["prompt_tokens"]
    assert summary["warm"]["hit_rate"] > 0.8
    # 200 us per uncached token: cold prefills take visibly longer than warm ones.
    assert summary["cold"]["mean_latency_ms"] > summary["warm"]["mean_latency_ms"]
    assert "hit%" in proc.stdout
