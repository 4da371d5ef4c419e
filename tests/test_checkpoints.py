"""KV checkpoints against a real server: ids, refusal matrix, cold start, CAS, provenance."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Iterator

import blake3
import pytest

from epistemic_kvcache.checkpoints import (
    CheckpointKey,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    CrossTenantCheckpointError,
    KVCheckpointStore,
    StaleCheckpointError,
    checkpoint_id,
)
from epistemic_kvcache.client import EpistemicGraphKVBackend
from epistemic_kvcache.errors import KvCacheError
from epistemic_kvcache.server.app import ServerHandle
from servers import running_server

TOKEN_A = "token-ckpt-a-0123456789"
TOKEN_B = "token-ckpt-b-0123456789"

KEY = CheckpointKey(
    model="meta-llama/Llama-3-8B",
    quantization="bf16",
    engine="vllm",
    engine_version="0.9.1",
    prefix_digest="ab" * 32,
    tenant="acme",
    policy_version="policy-7",
)
BLOB = bytes(range(256)) * 4096  # 1 MiB


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    tokens = {TOKEN_A: "tenant-a", TOKEN_B: "tenant-b"}
    with running_server(tmp_path_factory.mktemp("ckpt"), tokens=tokens, resp=False) as srv:
        yield srv.handle


def _client(server: ServerHandle, token: str) -> EpistemicGraphKVBackend:
    return EpistemicGraphKVBackend(
        base_url=f"http://{server.http.host}:{server.http.port}", token=token
    )


@pytest.fixture
def client(server: ServerHandle) -> Iterator[EpistemicGraphKVBackend]:
    with _client(server, TOKEN_A) as c:
        yield c
        for key in c.list_keys("ckpt:"):
            c.delete(key)


@pytest.fixture
def store(client: EpistemicGraphKVBackend) -> KVCheckpointStore:
    return KVCheckpointStore(client)


# -- ids ----------------------------------------------------------------------------------------
def test_id_is_sha256_over_six_length_prefixed_components() -> None:
    def lp(b: bytes) -> bytes:
        return len(b).to_bytes(8, "big") + b

    engine = lp(b"vllm") + lp(b"0.9.1")
    parts = [b"meta-llama/Llama-3-8B", b"bf16", engine, b"ab" * 32, b"acme", b"policy-7"]
    want = hashlib.sha256(b"".join(lp(p) for p in parts)).hexdigest()
    assert KEY.id == want
    assert checkpoint_id(*dataclasses.astuple(KEY)) == want


@pytest.mark.parametrize("component", [f.name for f in dataclasses.fields(CheckpointKey)])
def test_each_component_changes_the_id(component: str) -> None:
    changed = dataclasses.replace(KEY, **{component: getattr(KEY, component) + "x"})
    assert changed.id != KEY.id


def test_component_boundaries_cannot_be_shifted() -> None:
    a = dataclasses.replace(KEY, engine="vllm/0", engine_version="9.1")
    b = dataclasses.replace(KEY, engine="vllm", engine_version="0/9.1")
    assert a.id != b.id
    c = dataclasses.replace(KEY, model="ab", quantization="c")
    d = dataclasses.replace(KEY, model="a", quantization="bc")
    assert c.id != d.id
    e = dataclasses.replace(KEY, tenant="", policy_version="acme")
    f = dataclasses.replace(KEY, tenant="acme", policy_version="")
    assert e.id != f.id


# -- create / get ---------------------------------------------------------------------------------
def test_create_and_get_round_trip_blob_in_cas_record_holds_only_the_digest(
    store: KVCheckpointStore, client: EpistemicGraphKVBackend
) -> None:
    before = client.stats()
    assert before is not None
    record = store.create_checkpoint(KEY, BLOB, {"turns": 12, "note": "after tool call"})
    digest = blake3.blake3(BLOB).hexdigest()
    assert (record.id, record.blob_digest, record.blob_size) == (KEY.id, digest, len(BLOB))
    assert client.get(f"ckpt:blob:{digest}") == BLOB
    raw = client.get(f"ckpt:rec:{KEY.id}")
    assert raw is not None
    assert len(raw) < 2048  # the record is metadata only
    doc = json.loads(raw)
    assert doc["version"] == 1
    assert doc["blob_digest"] == digest
    assert doc["metadata"] == {"turns": 12, "note": "after tool call"}

    loaded = store.get_checkpoint(KEY.id, "acme", "policy-7")
    assert loaded.blob == BLOB
    assert loaded.record == record

    # A second checkpoint with the same bytes stores them once (CAS).
    other = dataclasses.replace(KEY, prefix_digest="cd" * 32)
    store.create_checkpoint(other, BLOB)
    after = client.stats()
    assert after is not None
    blob_blocks = after.unique_blocks - before.unique_blocks
    assert blob_blocks == 3  # one blob + two records
    assert after.resident_bytes - before.resident_bytes < len(BLOB) + 4096

    # Creating an existing id keeps the first record (first write wins).
    again = store.create_checkpoint(KEY, b"other bytes", {"turns": 99})
    assert again == record
    counts = store.counters()
    assert counts[("create", "ok")] == 2
    assert counts[("create", "existed")] == 1
    assert counts[("get", "ok")] == 1


def test_refusal_matrix(store: KVCheckpointStore) -> None:
    store.create_checkpoint(KEY, BLOB)
    cases = [
        (("acme", "policy-7"), None),
        (("other", "policy-7"), CrossTenantCheckpointError),
        (("acme", "policy-6"), StaleCheckpointError),
        (("other", "policy-6"), CrossTenantCheckpointError),  # tenant is checked first
    ]
    for (tenant, policy), err in cases:
        ops = [
            lambda t=tenant, p=policy: store.get_checkpoint(KEY.id, t, p),
            lambda t=tenant, p=policy: store.instantiate_agent(KEY.id, t, p, "run-1"),
            lambda t=tenant, p=policy: store.restore_conversation(KEY.id, "conv-1", t, p),
        ]
        for op in ops:
            if err is None:
                op()
            else:
                with pytest.raises(err):
                    op()
    with pytest.raises(CheckpointNotFoundError):
        store.get_checkpoint("0" * 64, "acme", "policy-7")
    with pytest.raises(CheckpointNotFoundError):
        store.get_checkpoint("not-an-id", "acme", "policy-7")
    counts = store.counters()
    # get_checkpoint ran for every call (instantiate and restore go through it).
    assert counts[("get", "ok")] == 3
    assert counts[("get", "cross_tenant")] == 6
    assert counts[("get", "stale")] == 3
    assert counts[("get", "not_found")] == 2
    assert counts[("instantiate_agent", "ok")] == 1
    assert counts[("instantiate_agent", "cross_tenant")] == 2
    assert counts[("instantiate_agent", "stale")] == 1
    assert counts[("restore_conversation", "ok")] == 1
    assert counts[("restore_conversation", "cross_tenant")] == 2
    assert counts[("restore_conversation", "stale")] == 1
    assert ("restore_conversation", "cold_start") not in counts


def test_cold_start_only_when_allowed_logged_counted_and_recorded(
    store: KVCheckpointStore, caplog: pytest.LogCaptureFixture
) -> None:
    store.create_checkpoint(KEY, BLOB)
    with pytest.raises(StaleCheckpointError):
        store.restore_conversation(KEY.id, "conv-9", "acme", "policy-8")
    with caplog.at_level(logging.WARNING, logger="epistemic_kvcache.checkpoints"):
        cold = store.restore_conversation(
            KEY.id, "conv-9", "acme", "policy-8", allow_cold_start=True
        )
    assert cold.cold_start is True
    assert cold.checkpoint is None
    assert cold.reason is not None
    assert cold.reason.startswith("StaleCheckpointError")
    assert "cold start" in caplog.text
    assert "conv-9" in caplog.text
    missing = store.restore_conversation(
        "f" * 64, "conv-10", "acme", "policy-7", allow_cold_start=True
    )
    assert missing.cold_start is True
    warm = store.restore_conversation(KEY.id, "conv-11", "acme", "policy-7", allow_cold_start=True)
    assert warm.cold_start is False
    assert warm.checkpoint is not None
    assert warm.checkpoint.blob == BLOB
    counts = store.counters()
    assert counts[("restore_conversation", "cold_start")] == 2
    assert counts[("restore_conversation", "stale")] == 1
    assert counts[("restore_conversation", "ok")] == 1
    outcomes = sorted((r.subject, r.outcome) for r in store.provenance(KEY.id))
    assert outcomes == [("conv-11", "restored"), ("conv-9", "cold_start")]


def test_blob_is_verified_on_load(
    store: KVCheckpointStore, client: EpistemicGraphKVBackend
) -> None:
    record = store.create_checkpoint(KEY, BLOB)
    # Replace the CAS entry with other bytes (delete, then first write wins again).
    assert client.delete(record.blob_key)
    assert client.put(record.blob_key, BLOB[:-1] + b"\x00")
    with pytest.raises(CorruptCheckpointError, match="digest"):
        store.get_checkpoint(KEY.id, "acme", "policy-7")
    assert client.delete(record.blob_key)  # evicted / gone
    with pytest.raises(CheckpointNotFoundError, match="blob"):
        store.instantiate_agent(KEY.id, "acme", "policy-7", "run-2")
    counts = store.counters()
    assert counts[("get", "corrupt")] == 1
    assert counts[("instantiate_agent", "not_found")] == 1


def test_a_record_under_the_wrong_id_is_corrupt(
    store: KVCheckpointStore, client: EpistemicGraphKVBackend
) -> None:
    store.create_checkpoint(KEY, BLOB)
    raw = client.get(f"ckpt:rec:{KEY.id}")
    assert raw is not None
    forged = dataclasses.replace(KEY, policy_version="policy-8").id
    assert client.put(f"ckpt:rec:{forged}", raw)  # the policy-7 record planted as policy-8
    with pytest.raises(CorruptCheckpointError, match="another id"):
        store.get_checkpoint(forged, "acme", "policy-7")
    doc = json.loads(raw)
    doc["id"] = forged
    doc["policy_version"] = "policy-8"
    doc["blob_size"] = "big"
    assert client.delete(f"ckpt:rec:{forged}")
    assert client.put(f"ckpt:rec:{forged}", json.dumps(doc).encode())
    with pytest.raises(CorruptCheckpointError, match="bad record"):
        store.get_checkpoint(forged, "acme", "policy-8")


def test_provenance_is_queryable_by_listing(
    store: KVCheckpointStore, client: EpistemicGraphKVBackend
) -> None:
    store.create_checkpoint(KEY, BLOB)
    other = dataclasses.replace(KEY, model="other-model")
    store.create_checkpoint(other, b"other")
    a1 = store.instantiate_agent(KEY.id, "acme", "policy-7", "run-a")
    a2 = store.instantiate_agent(KEY.id, "acme", "policy-7", "run-b")
    conv = store.restore_conversation(KEY.id, "conv-a", "acme", "policy-7")
    store.instantiate_agent(other.id, "acme", "policy-7", "run-other")
    keys = client.list_keys(f"ckpt:prov:{KEY.id}:")
    assert sorted(keys) == sorted([a1.provenance_key, a2.provenance_key, conv.provenance_key])
    records = store.provenance(KEY.id)
    assert [(r.kind, r.subject, r.outcome) for r in records] == [
        ("agent_run", "run-a", "restored"),
        ("agent_run", "run-b", "restored"),
        ("conversation", "conv-a", "restored"),
    ]
    assert all(r.checkpoint_id == KEY.id and r.tenant == "acme" for r in records)
    assert [r.subject for r in store.provenance(other.id)] == ["run-other"]
    assert a1.checkpoint.blob == BLOB


def test_server_tenants_do_not_share_checkpoints(
    store: KVCheckpointStore, server: ServerHandle
) -> None:
    store.create_checkpoint(KEY, BLOB)
    with _client(server, TOKEN_B) as other_client:
        other = KVCheckpointStore(other_client)
        # Same id, same app tenant and policy: the server's namespace still separates them.
        with pytest.raises(CheckpointNotFoundError):
            other.get_checkpoint(KEY.id, "acme", "policy-7")
        cold = other.restore_conversation(KEY.id, "c", "acme", "policy-7", allow_cold_start=True)
        assert cold.cold_start is True
        for key in other_client.list_keys("ckpt:"):
            other_client.delete(key)


def test_unreachable_server() -> None:
    with EpistemicGraphKVBackend(base_url="http://127.0.0.1:9", token=TOKEN_A) as down:
        store = KVCheckpointStore(down)
        with pytest.raises(KvCacheError):
            store.create_checkpoint(KEY, BLOB)
        with pytest.raises(CheckpointNotFoundError):
            store.get_checkpoint(KEY.id, "acme", "policy-7")
        cold = store.restore_conversation(KEY.id, "c", "acme", "policy-7", allow_cold_start=True)
        assert cold.cold_start is True
        assert cold.provenance_key is None  # could not be recorded either; still a cold start
        assert store.counters()[("provenance", "not_stored")] == 1
