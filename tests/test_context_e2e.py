"""End to end: two processes compile the same bundle through the real KV server; the
second is a cache hit served by `EpistemicGraphKVBackend`.

Skipped only while `epistemic_kvcache.client` or the server cannot be imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("epistemic_kvcache.client")
pytest.importorskip("epistemic_kvcache.server.app")
from servers import ServeProcess

TOKEN = "e2e-token-0123456789"

WORKER = textwrap.dedent(
    """
    import hashlib, json, sys
    from datetime import UTC, datetime
    from epistemic_kvcache.context import (
        ContextCompiler, JsonlCandidateSource, Session, SessionPolicy,
        resolve_context_compiler_cache,
    )

    backend = resolve_context_compiler_cache()
    compiler = ContextCompiler(JsonlCandidateSource(sys.argv[1]))
    bundle = compiler.compile(
        "durable kv cache for prefix reuse",
        Session("sess-1", "acme", SessionPolicy(version="3")),
        token_budget=800,
        top_k=5,
        as_of=datetime(2024, 6, 1, tzinfo=UTC),
    )
    s = compiler.stats
    print(json.dumps({
        "backend": type(backend).__module__ + "." + type(backend).__name__,
        "hit": bundle.kv_cache_hit,
        "key": bundle.cache_key,
        "sha": hashlib.sha256(bundle.to_bytes()).hexdigest(),
        "text_sha": hashlib.sha256(bundle.as_text().encode()).hexdigest(),
        "items": [i.evidence_id for i in bundle.items],
        "stores": s.cache_stores,
        "errors": s.cache_backend_errors,
    }))
    """
)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[str]:
    """The real server on a free loopback port; yields its base URL."""
    srv = ServeProcess(tmp_path / "data", token=TOKEN, resp=False)
    try:
        yield srv.url()
    finally:
        srv.stop()


def run_worker(evidence: Path, url: str) -> dict[str, object]:
    env = dict(os.environ)
    for name in list(env):
        if name.startswith("EPISTEMIC_GRAPH_KVCACHE_"):
            del env[name]
    env.update(
        MODEL_CONTEXT_COMPILER_CACHE_ENABLED="true",
        EPISTEMIC_GRAPH_KVCACHE_URL=url,
        EPISTEMIC_GRAPH_KVCACHE_TOKEN=TOKEN,
    )
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, str(evidence)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_second_process_hits_the_bundle_through_the_kv_server(server: str, tmp_path: Path) -> None:
    evidence = tmp_path / "evidence.jsonl"
    rows = [
        {
            "id": f"ev{i}",
            "text": f"note {i}: durable kv cache blocks survive restarts; prefix reuse {i}",
            "source": f"doc://notes/{i}",
            "timestamp": f"2024-05-{1 + i % 28:02d}T00:00:00Z",
            "tenant": "acme" if i % 4 else "globex",
            "strength": round(0.3 + 0.05 * (i % 10), 2),
            "supported_by": [f"ev{(i + 1) % 40}"],
        }
        for i in range(40)
    ]
    evidence.write_text("".join(json.dumps(r) + "\n" for r in rows))

    first = run_worker(evidence, server)
    second = run_worker(evidence, server)

    assert first["backend"] == "epistemic_kvcache.client.backend.EpistemicGraphKVBackend"
    assert first["hit"] is False
    assert first["stores"] == 1
    assert first["errors"] == 0
    assert second["hit"] is True
    assert second["errors"] == 0
    assert second["stores"] == 0
    assert second["key"] == first["key"]
    assert second["sha"] == first["sha"]  # the same bundle, byte for byte
    assert second["text_sha"] == first["text_sha"]  # and the same prompt prefix
    assert second["items"] == first["items"]

    # The bundle really lives on the server, under its ctxbundle key.
    from epistemic_kvcache.client import EpistemicGraphKVBackend
    from epistemic_kvcache.context import ContextBundle

    with EpistemicGraphKVBackend(base_url=server, token=TOKEN) as client:
        raw = client.get(str(first["key"]))
    assert raw is not None
    stored = ContextBundle.from_bytes(raw)
    assert stored.cache_key == first["key"]
    assert [i.evidence_id for i in stored.items] == first["items"]
    globex = {f"ev{i}" for i in range(0, 40, 4)}
    assert not set(stored.evidence_ids) & globex  # another tenant's evidence never enters
