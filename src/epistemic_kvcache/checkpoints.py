"""KV checkpoints: named, tenant- and policy-bound KV states over the server's CAS.

How it works
- A checkpoint id is SHA-256 over six length-prefixed components (u64 big-endian length,
  then the UTF-8 bytes): model identity, quantization, serving engine + version (one
  component, itself the two length-prefixed strings, so ("a/b", "c") != ("a", "b/c")),
  prefix digest, tenant, policy version. Any change gives another id.
- The blob goes to the server under its content key `ckpt:blob:<blake3 hex>` (stored
  once however many checkpoints share it); the record, versioned JSON under
  `ckpt:rec:<id>`, holds only the blob's digest and size plus the components and
  caller metadata. First write wins, as for every key.
- `get_checkpoint` is the one way in: it re-derives the id from the record (a record
  under the wrong key is corrupt), refuses another tenant (`CrossTenantCheckpointError`)
  and another policy version (`StaleCheckpointError`), then loads the blob and checks
  its BLAKE3 digest. `instantiate_agent` and `restore_conversation` go through it and
  write a provenance record `ckpt:prov:<id>:<uuid>` (queryable with `provenance`).
  `restore_conversation(..., allow_cold_start=True)` is the only fallback: a refusal or
  a missing checkpoint then becomes a logged, counted cold start.
- Counters by (operation, outcome) for everything.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import struct
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import blake3

from epistemic_kvcache.client.backend import PutOutcome
from epistemic_kvcache.errors import KvCacheError

log = logging.getLogger(__name__)

RECORD_VERSION = 1
BLOB_PREFIX = "ckpt:blob:"
RECORD_PREFIX = "ckpt:rec:"
PROVENANCE_PREFIX = "ckpt:prov:"
_LEN = struct.Struct(">Q")


class CheckpointError(KvCacheError):
    """A checkpoint cannot be created or used. Subclasses say why."""

    outcome = "error"
    """The counter label of this refusal (see `KVCheckpointStore.counters`)."""


class CheckpointNotFoundError(CheckpointError):
    """No record under this id, or its blob is gone (evicted), or the server is down."""

    outcome = "not_found"


class CrossTenantCheckpointError(CheckpointError):
    """The checkpoint belongs to another tenant; it is never served across tenants."""

    outcome = "cross_tenant"


class StaleCheckpointError(CheckpointError):
    """The checkpoint was made under another policy version than the caller's."""

    outcome = "stale"


class CorruptCheckpointError(CheckpointError):
    """The record does not match its id, is malformed, or the blob fails its digest."""

    outcome = "corrupt"


class CheckpointClient(Protocol):
    """What the store needs from a client (`EpistemicGraphKVBackend` has it)."""

    def get(self, key: str) -> bytes | None: ...

    def put(
        self, key: str, data: Any, *, cond: Literal["nx", "xx"] | None = None
    ) -> PutOutcome: ...

    def exists(self, key: str) -> bool: ...

    def list_keys(
        self, prefix: str = "", *, after: str | None = None, limit: int | None = None
    ) -> list[str]: ...

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]: ...


@dataclass(frozen=True, slots=True)
class CheckpointKey:
    """The six components that name a checkpoint."""

    model: str
    quantization: str
    engine: str
    engine_version: str
    prefix_digest: str
    tenant: str
    policy_version: str

    @property
    def id(self) -> str:
        """The checkpoint id (64 hex digits)."""
        return checkpoint_id(
            self.model,
            self.quantization,
            self.engine,
            self.engine_version,
            self.prefix_digest,
            self.tenant,
            self.policy_version,
        )


def _lp(data: bytes) -> bytes:
    return _LEN.pack(len(data)) + data


def checkpoint_id(
    model: str,
    quantization: str,
    engine: str,
    engine_version: str,
    prefix_digest: str,
    tenant: str,
    policy_version: str,
) -> str:
    """SHA-256 (hex) over the six length-prefixed components; engine + version is one."""
    parts = [
        model.encode("utf-8"),
        quantization.encode("utf-8"),
        _lp(engine.encode("utf-8")) + _lp(engine_version.encode("utf-8")),
        prefix_digest.encode("utf-8"),
        tenant.encode("utf-8"),
        policy_version.encode("utf-8"),
    ]
    return hashlib.sha256(b"".join(_lp(p) for p in parts)).hexdigest()


@dataclass(frozen=True, slots=True)
class CheckpointRecord:
    """What `ckpt:rec:<id>` holds: the components, the blob's digest, metadata."""

    id: str
    key: CheckpointKey
    blob_digest: str
    """BLAKE3 hex digest of the blob (its CAS key is `ckpt:blob:<digest>`)."""
    blob_size: int
    created_at: float
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def blob_key(self) -> str:
        return BLOB_PREFIX + self.blob_digest

    def to_json(self) -> bytes:
        doc = {
            "version": RECORD_VERSION,
            "id": self.id,
            "model": self.key.model,
            "quantization": self.key.quantization,
            "engine": self.key.engine,
            "engine_version": self.key.engine_version,
            "prefix_digest": self.key.prefix_digest,
            "tenant": self.key.tenant,
            "policy_version": self.key.policy_version,
            "blob_digest": self.blob_digest,
            "blob_size": self.blob_size,
            "created_at": self.created_at,
            "metadata": self.metadata,
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes, expected_id: str) -> CheckpointRecord:
        """Parse and check a stored record; `CorruptCheckpointError` if anything is off."""
        try:
            doc = json.loads(data)
            if not isinstance(doc, dict):
                raise TypeError("not an object")
            if doc.get("version") != RECORD_VERSION:
                raise ValueError(f"unsupported record version {doc.get('version')!r}")
            strings = {
                name: doc[name]
                for name in (
                    "model",
                    "quantization",
                    "engine",
                    "engine_version",
                    "prefix_digest",
                    "tenant",
                    "policy_version",
                    "blob_digest",
                )
            }
            if not all(isinstance(v, str) for v in strings.values()):
                raise TypeError("a component is not a string")
            blob_size, created_at, metadata = doc["blob_size"], doc["created_at"], doc["metadata"]
            if type(blob_size) is not int or not isinstance(metadata, dict):
                raise TypeError("blob_size or metadata has the wrong type")
            digest = strings.pop("blob_digest")
            key = CheckpointKey(**strings)
            record = cls(doc["id"], key, digest, blob_size, float(created_at), metadata)
        except (ValueError, TypeError, KeyError) as exc:
            raise CorruptCheckpointError(f"checkpoint {expected_id}: bad record ({exc})") from exc
        if record.id != expected_id or key.id != expected_id:
            raise CorruptCheckpointError(
                f"checkpoint {expected_id}: the record's components derive another id"
            )
        return record


@dataclass(frozen=True, slots=True)
class LoadedCheckpoint:
    """A checked record and its verified blob."""

    record: CheckpointRecord
    blob: bytes


@dataclass(frozen=True, slots=True)
class AgentInstance:
    """An agent run initialised from a checkpoint."""

    run_id: str
    checkpoint: LoadedCheckpoint
    provenance_key: str


@dataclass(frozen=True, slots=True)
class RestoredConversation:
    """A conversation restored from a checkpoint, or (only if allowed) a cold start."""

    conversation_id: str
    checkpoint: LoadedCheckpoint | None
    """None for a cold start."""
    cold_start: bool
    reason: str | None
    """Why the restore fell back to a cold start (the refusal's class name and message)."""
    provenance_key: str | None
    """None only when a cold start's provenance record could not be written."""


@dataclass(frozen=True, slots=True)
class ProvenanceRecord:
    """Which run or conversation was initialised from which checkpoint, and how."""

    key: str
    checkpoint_id: str
    kind: str
    """`"agent_run"` or `"conversation"`."""
    subject: str
    """The run id or conversation id."""
    tenant: str
    policy_version: str
    outcome: str
    """`"restored"` or `"cold_start"`."""
    at: float
    reason: str | None = None


class KVCheckpointStore:
    """Checkpoints over a kv-cache client (thread-safe if the client is)."""

    def __init__(self, client: CheckpointClient) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}

    # -- counters -----------------------------------------------------------------------
    def _count(self, op: str, outcome: str) -> None:
        with self._lock:
            self._counts[(op, outcome)] = self._counts.get((op, outcome), 0) + 1

    @contextlib.contextmanager
    def _counting_refusals(self, op: str) -> Iterator[None]:
        """Count a `CheckpointError` raised inside under `(op, its outcome)`; re-raise it."""
        try:
            yield
        except CheckpointError as exc:
            self._count(op, exc.outcome)
            raise

    def counters(self) -> dict[tuple[str, str], int]:
        """A copy of the counters: `(operation, outcome) -> count`."""
        with self._lock:
            return dict(self._counts)

    # -- create / get ---------------------------------------------------------------------
    def create_checkpoint(
        self, key: CheckpointKey, blob: Any, metadata: Mapping[str, Any] | None = None
    ) -> CheckpointRecord:
        """Store `blob` in the CAS and the record under `ckpt:rec:<id>`.

        If a record with this id exists already it stays (first write wins) and is
        returned (after the same checks as `get_checkpoint`, without loading its blob).
        Raises `CheckpointError` when the server does not take the blob or the record.
        """
        op = "create"
        meta = dict(metadata or {})
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as exc:
            self._count(op, "bad_metadata")
            raise ValueError(f"checkpoint metadata must be JSON-serialisable ({exc})") from exc
        view = memoryview(blob).cast("B")
        digest = blake3.blake3(view).hexdigest()
        record = CheckpointRecord(key.id, key, digest, view.nbytes, time.time(), meta)
        if not self._client.put(record.blob_key, view):
            self._count(op, "blob_not_stored")
            raise CheckpointError(f"checkpoint {record.id}: the server did not store the blob")
        # First write wins for records: a create-only PUT keeps an existing record (two
        # writers racing on one id both read back the same, first, record).
        outcome = self._client.put(RECORD_PREFIX + record.id, record.to_json(), cond="nx")
        if outcome not in (PutOutcome.NEW, PutOutcome.DUPLICATE, PutOutcome.CONFLICT):
            self._count(op, "record_not_stored")
            raise CheckpointError(f"checkpoint {record.id}: the server did not store the record")
        stored = self._client.get(RECORD_PREFIX + record.id)
        if stored is None:
            self._count(op, "record_not_stored")
            raise CheckpointError(f"checkpoint {record.id}: the record does not read back")
        with self._counting_refusals(op):
            kept = self._checked(
                CheckpointRecord.from_json(stored, record.id), key.tenant, key.policy_version
            )
        self._count(op, "ok" if bytes(stored) == record.to_json() else "existed")
        return kept

    @staticmethod
    def _checked(record: CheckpointRecord, tenant: str, policy_version: str) -> CheckpointRecord:
        if record.key.tenant != tenant:
            raise CrossTenantCheckpointError(
                f"checkpoint {record.id} belongs to another tenant; refusing to load it"
            )
        if record.key.policy_version != policy_version:
            raise StaleCheckpointError(
                f"checkpoint {record.id} was made under policy version "
                f"{record.key.policy_version!r}, the caller runs {policy_version!r}"
            )
        return record

    def get_checkpoint(
        self, checkpoint_id: str, tenant: str, policy_version: str
    ) -> LoadedCheckpoint:
        """Load a checkpoint for `tenant` under `policy_version`, or refuse.

        Raises `CheckpointNotFoundError`, `CrossTenantCheckpointError`,
        `StaleCheckpointError`, `CorruptCheckpointError`."""
        op = "get"
        with self._counting_refusals(op):
            loaded = self._load(checkpoint_id, tenant, policy_version)
        self._count(op, "ok")
        return loaded

    def _load(self, checkpoint_id: str, tenant: str, policy_version: str) -> LoadedCheckpoint:
        if len(checkpoint_id) != 64 or any(c not in "0123456789abcdef" for c in checkpoint_id):
            raise CheckpointNotFoundError(f"invalid checkpoint id {checkpoint_id!r}")
        data = self._client.get(RECORD_PREFIX + checkpoint_id)
        if data is None:
            raise CheckpointNotFoundError(f"no checkpoint {checkpoint_id}")
        record = self._checked(
            CheckpointRecord.from_json(data, checkpoint_id), tenant, policy_version
        )
        blob = self._client.get(record.blob_key)
        if blob is None:
            raise CheckpointNotFoundError(
                f"checkpoint {checkpoint_id}: its blob {record.blob_digest} is gone"
            )
        if len(blob) != record.blob_size or blake3.blake3(blob).hexdigest() != record.blob_digest:
            raise CorruptCheckpointError(
                f"checkpoint {checkpoint_id}: the blob does not match its digest"
            )
        return LoadedCheckpoint(record, blob)

    # -- use ------------------------------------------------------------------------------
    def instantiate_agent(
        self, checkpoint_id: str, tenant: str, policy_version: str, run_id: str
    ) -> AgentInstance:
        """Initialise agent run `run_id` from a checkpoint (no fallback) and record it."""
        op = "instantiate_agent"
        with self._counting_refusals(op):
            loaded = self.get_checkpoint(checkpoint_id, tenant, policy_version)
        prov = self._record_restored(
            op,
            checkpoint_id,
            "agent_run",
            run_id,
            tenant,
            policy_version,
            failure=f"could not record that run {run_id} used it",
        )
        return AgentInstance(run_id, loaded, prov)

    def restore_conversation(
        self,
        checkpoint_id: str,
        conversation_id: str,
        tenant: str,
        policy_version: str,
        *,
        allow_cold_start: bool = False,
    ) -> RestoredConversation:
        """Restore `conversation_id` from a checkpoint.

        Any refusal raises, unless `allow_cold_start` is True: then the conversation
        starts cold (logged at WARNING, counted as `("restore_conversation",
        "cold_start")`, recorded in provenance). That is the only fallback.
        """
        op = "restore_conversation"
        try:
            loaded = self.get_checkpoint(checkpoint_id, tenant, policy_version)
        except CheckpointError as exc:
            if not allow_cold_start:
                self._count(op, exc.outcome)
                raise
            reason = f"{type(exc).__name__}: {exc}"
            log.warning(
                "conversation %s: cold start instead of checkpoint %s (%s)",
                conversation_id,
                checkpoint_id,
                reason,
            )
            self._count(op, "cold_start")
            prov = self._provenance(
                checkpoint_id,
                "conversation",
                conversation_id,
                tenant,
                policy_version,
                "cold_start",
                reason,
            )
            return RestoredConversation(conversation_id, None, True, reason, prov)
        prov = self._record_restored(
            op,
            checkpoint_id,
            "conversation",
            conversation_id,
            tenant,
            policy_version,
            failure=f"could not record that conversation {conversation_id} was restored from it",
        )
        return RestoredConversation(conversation_id, loaded, False, None, prov)

    def _record_restored(
        self,
        op: str,
        checkpoint_id: str,
        kind: str,
        subject: str,
        tenant: str,
        policy_version: str,
        *,
        failure: str,
    ) -> str:
        """The provenance key of a successful use, counted `ok`; raises (`failure` says
        what could not be recorded) when the record is not stored."""
        prov = self._provenance(
            checkpoint_id, kind, subject, tenant, policy_version, "restored", None
        )
        if prov is None:
            self._count(op, "provenance_not_stored")
            raise CheckpointError(f"checkpoint {checkpoint_id}: {failure}")
        self._count(op, "ok")
        return prov

    # -- provenance ---------------------------------------------------------------------------
    def _provenance(
        self,
        checkpoint_id: str,
        kind: str,
        subject: str,
        tenant: str,
        policy_version: str,
        outcome: str,
        reason: str | None,
    ) -> str | None:
        key = f"{PROVENANCE_PREFIX}{checkpoint_id}:{uuid.uuid4().hex}"
        doc = {
            "version": RECORD_VERSION,
            "checkpoint_id": checkpoint_id,
            "kind": kind,
            "subject": subject,
            "tenant": tenant,
            "policy_version": policy_version,
            "outcome": outcome,
            "at": time.time(),
            "reason": reason,
        }
        ok = self._client.put(key, json.dumps(doc, sort_keys=True).encode("utf-8"))
        self._count("provenance", "ok" if ok else "not_stored")
        if not ok:
            log.warning("checkpoint %s: provenance record %s was not stored", checkpoint_id, key)
        return key if ok else None

    def provenance(self, checkpoint_id: str) -> list[ProvenanceRecord]:
        """Every provenance record of a checkpoint (runs and conversations), oldest first.

        Raises `KvCacheUnavailableError` (from the client) when it cannot be listed."""
        keys = self._client.list_keys(f"{PROVENANCE_PREFIX}{checkpoint_id}:")
        out: list[ProvenanceRecord] = []
        for key, data in zip(keys, self._client.get_many(keys), strict=True):
            if data is None:  # deleted or evicted since it was listed
                continue
            try:
                doc = json.loads(data)
                out.append(
                    ProvenanceRecord(
                        key=key,
                        checkpoint_id=str(doc["checkpoint_id"]),
                        kind=str(doc["kind"]),
                        subject=str(doc["subject"]),
                        tenant=str(doc["tenant"]),
                        policy_version=str(doc["policy_version"]),
                        outcome=str(doc["outcome"]),
                        at=float(doc["at"]),
                        reason=doc.get("reason"),
                    )
                )
            except (ValueError, TypeError, KeyError) as exc:
                raise CorruptCheckpointError(f"provenance record {key}: malformed ({exc})") from exc
        self._count("provenance_query", "ok")
        return sorted(out, key=lambda r: r.at)
