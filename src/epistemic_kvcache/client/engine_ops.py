"""The engine features of the client: snapshots, branches, epochs, paging, key listing.

`EngineOps` adds them to the transport (docs/engine-features.md); each call is one JSON
request (`_call`). Reads and advisory calls degrade to None / False like the data path;
calls whose silent failure would mislead (`epoch_bump`, `epoch_get`, listings) raise
`KvCacheUnavailableError`, and those not safe to repeat raise
`KvCacheOutcomeUnknownError` when the connection broke after they were sent.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import fields
from typing import Any

from epistemic_kvcache.client.transport import HttpTransport, _TransportFailure
from epistemic_kvcache.errors import LocalProtocolError, RemoteProtocolError
from epistemic_kvcache.graph import Edge, PageInResult
from epistemic_kvcache.proto.http import (
    JSON_CONTENT_TYPE,
    OCTET_CONTENT_TYPE,
    ROUTE_KEYS,
    ROUTE_PAGE_IN,
    ROUTE_SNAPSHOTS,
    quote_key,
)
from epistemic_kvcache.shared import BranchInfo, SnapshotInfo, validate_key


def _fields_of(doc: object, names: Sequence[str], what: str) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise RemoteProtocolError(f"{what}: expected a JSON object")
    try:
        return {name: doc[name] for name in names}
    except KeyError as exc:
        raise RemoteProtocolError(f"{what}: answer lacks {exc}") from exc


_SNAPSHOT_FIELDS = tuple(f.name for f in fields(SnapshotInfo))
_BRANCH_FIELDS = tuple(f.name for f in fields(BranchInfo))


class EngineOps(HttpTransport):
    """Snapshots, branches, epochs, paging and listing over `HttpTransport`."""

    @staticmethod
    def _scope_header(scope: str) -> str:
        raw = scope.encode("utf-8")
        if not 0 < len(raw) <= 1024 or any(c in raw for c in b"\r\n\x00"):
            raise ValueError(f"invalid epoch scope {scope!r}: 1..1024 bytes, no CR/LF/NUL")
        return raw.decode("latin-1")  # http.client re-encodes latin-1: the UTF-8 bytes go out

    def _call(self, method: str, path: str, *, doc: object = None, what: str) -> tuple[int, Any]:
        """A JSON request: `(status, parsed body)`; the body is None for 204 and 404.

        Raises `_TransportFailure` (counted) and the errors of `_check_status`.
        """
        body: bytes | None = None
        headers: dict[str, str] | None = None
        if doc is not None:
            body = json.dumps(doc, separators=(",", ":")).encode("utf-8")
            headers = {"Content-Type": JSON_CONTENT_TYPE}
        resp = self._request(method, path, body=body, headers=headers, what=what)
        data = resp.data
        resp.release_conn()
        if resp.status in (204, 404):
            return resp.status, None
        try:
            return resp.status, json.loads(data)
        except ValueError as exc:
            raise RemoteProtocolError(f"{what}: answer is not JSON ({exc})") from exc

    def _call_or_raise(
        self, method: str, path: str, *, doc: object = None, what: str
    ) -> tuple[int, Any]:
        try:
            return self._call(method, path, doc=doc, what=what)
        except _TransportFailure as exc:
            raise self._unavailable(what, exc) from exc

    def _id_path(self, kind: str, ident: str, suffix: str = "") -> str:
        if not ident:
            raise ValueError(f"empty {kind} id")
        return f"{self._prefix}/kv/{kind}/{urllib.parse.quote(ident, safe='')}{suffix}"

    def snapshot(
        self,
        keys: Sequence[str] | None = None,
        prefix: str | None = None,
        ttl_s: float | None = None,
    ) -> SnapshotInfo | None:
        """Snapshot `keys` (absent ones skipped) or every key with `prefix` (neither: the
        whole namespace); no bytes are copied. None when the server is unreachable or has
        no snapshot routes: fall back to plain copies."""
        if keys is not None and prefix is not None:
            raise ValueError("give keys or prefix, not both")
        doc: dict[str, Any] = {}
        if keys is not None:
            for k in keys:
                validate_key(k)
            doc["keys"] = list(keys)
        if prefix is not None:
            doc["prefix"] = prefix
        if ttl_s is not None:
            doc["ttl_s"] = ttl_s
        rec = self._create(f"{self._prefix}{ROUTE_SNAPSHOTS}", doc, "snapshot", _SNAPSHOT_FIELDS)
        return SnapshotInfo(**rec) if rec is not None else None

    def _record(self, kind: str, rid: str, fields: tuple[str, ...]) -> dict[str, Any] | None:
        """GET a snapshot/branch record's fields; None if absent or unreachable."""
        try:
            status, answer = self._call("GET", self._id_path(kind, rid), what=f"{kind} info")
        except _TransportFailure:
            return None
        if status == 404:
            return None
        return _fields_of(answer, fields, f"{kind} info")

    def _records(self, kind: str, fields: tuple[str, ...]) -> list[dict[str, Any]]:
        """The caller's snapshot/branch records (raises when unreachable)."""
        plural = "branches" if kind == "branch" else f"{kind}s"
        _, answer = self._call_or_raise("GET", f"{self._prefix}/kv/{kind}", what=plural)
        items = _fields_of(answer, (plural,), plural)[plural]
        if not isinstance(items, list):
            raise RemoteProtocolError(f"{plural}: {plural!r} is not a list")
        return [_fields_of(d, fields, plural) for d in items]

    def _delete_record(self, kind: str, rid: str) -> bool:
        try:
            status, _ = self._call("DELETE", self._id_path(kind, rid), what=f"{kind} delete")
        except _TransportFailure:
            return False
        return status == 204

    def snapshot_info(self, snapshot_id: str) -> SnapshotInfo | None:
        """The snapshot, or None (absent, expired, or the server unreachable)."""
        rec = self._record("snapshot", snapshot_id, _SNAPSHOT_FIELDS)
        return SnapshotInfo(**rec) if rec is not None else None

    def list_snapshots(self) -> list[SnapshotInfo]:
        """Live snapshots of the caller's namespace, oldest first."""
        return [SnapshotInfo(**d) for d in self._records("snapshot", _SNAPSHOT_FIELDS)]

    def delete_snapshot(self, snapshot_id: str) -> bool:
        """Release the snapshot (and its branches). False if absent or unreachable."""
        return self._delete_record("snapshot", snapshot_id)

    def snapshot_get(self, snapshot_id: str, key: str) -> bytes | None:
        """`key` as of the snapshot, or None."""
        validate_key(key)
        return self._read(self._id_path("snapshot", snapshot_id, "/" + quote_key(key)))

    def fork(self, snapshot_id: str) -> BranchInfo | None:
        """Make a copy-on-write branch of a snapshot (zero bytes copied).

        None when the snapshot does not exist, or the server is unreachable or has no
        snapshot routes."""
        path = self._id_path("snapshot", snapshot_id, "/fork")
        rec = self._create(path, None, "fork", _BRANCH_FIELDS)
        return BranchInfo(**rec) if rec is not None else None

    def _create(
        self, path: str, doc: object, what: str, fields: tuple[str, ...]
    ) -> dict[str, Any] | None:
        """POST a snapshot or fork: the new record's fields, or None when the server is
        unreachable, has no such route, or the snapshot to fork does not exist. A request
        that may have been applied raises `KvCacheOutcomeUnknownError` (not retried)."""
        try:
            status, answer = self._call("POST", path, doc=doc, what=what)
        except _TransportFailure as exc:
            if exc.outcome_unknown:
                raise self._unavailable(what, exc) from exc
            return None
        except LocalProtocolError as exc:
            if exc.status_hint in (404, 405):  # a server without the route
                return None
            raise
        if status == 404:
            return None
        return _fields_of(answer, fields, what)

    def branch_info(self, branch_id: str) -> BranchInfo | None:
        """The branch (with its private and shared bytes), or None."""
        rec = self._record("branch", branch_id, _BRANCH_FIELDS)
        return BranchInfo(**rec) if rec is not None else None

    def list_branches(self) -> list[BranchInfo]:
        """Branches of the caller's namespace, oldest first."""
        return [BranchInfo(**d) for d in self._records("branch", _BRANCH_FIELDS)]

    def delete_branch(self, branch_id: str) -> bool:
        """Release the branch's overlay. False if absent or unreachable."""
        return self._delete_record("branch", branch_id)

    def branch_get(self, branch_id: str, key: str) -> bytes | None:
        """`key` in the branch: its overlay's block, else the snapshot's; or None."""
        validate_key(key)
        return self._read(self._id_path("branch", branch_id, "/" + quote_key(key)))

    def branch_put(self, branch_id: str, key: str, data: Any) -> bool:
        """Write `key` into the branch overlay only. False when the branch does not exist
        or the server is unreachable."""
        validate_key(key)
        try:
            resp = self._request(
                "PUT",
                self._id_path("branch", branch_id, "/" + quote_key(key)),
                body=data,
                headers={"Content-Type": OCTET_CONTENT_TYPE},
                what="branch PUT",
            )
        except _TransportFailure:
            self._count(puts_failed=1)
            return False
        resp.release_conn()
        ok = resp.status in (200, 201)
        self._count(**({"puts_ok": 1} if ok else {"puts_failed": 1}))
        return ok

    def epoch_bump(self, scope: str) -> int:
        """Make every entry written with `epoch_scope=scope` stale; returns the new epoch.

        Raises `KvCacheUnavailableError` when the bump could not be made."""
        self._scope_header(scope)
        path = f"{self._prefix}/kv/epoch/{urllib.parse.quote(scope, safe='')}/bump"
        status, answer = self._call_or_raise("POST", path, what="epoch bump")
        if status == 404:
            raise LocalProtocolError("epoch bump: the server has no epoch routes", status_hint=404)
        epoch = _fields_of(answer, ("epoch",), "epoch bump")["epoch"]
        if not isinstance(epoch, int):
            raise RemoteProtocolError("epoch bump: 'epoch' is not an integer")
        return epoch

    def epoch_get(self, scope: str) -> int:
        """The current epoch of `scope` (0 if never bumped)."""
        self._scope_header(scope)
        path = f"{self._prefix}/kv/epoch/{urllib.parse.quote(scope, safe='')}"
        status, answer = self._call_or_raise("GET", path, what="epoch")
        if status == 404:
            raise LocalProtocolError("epoch: the server has no epoch routes", status_hint=404)
        epoch = _fields_of(answer, ("epoch",), "epoch")["epoch"]
        if not isinstance(epoch, int):
            raise RemoteProtocolError("epoch: 'epoch' is not an integer")
        return epoch

    def page_in_ranked(
        self,
        edges: Iterable[Edge],
        node_keys: Mapping[str, Sequence[str]],
        budget_bytes: int,
        *,
        damping: float = 0.85,
    ) -> PageInResult | None:
        """Rank the graph's nodes by PageRank and promote their blocks into the server's
        hot tier, most central first, within `budget_bytes`. Nodes are strings. None when
        the server is unreachable (paging is advisory)."""
        doc = {
            "edges": [list(e) for e in edges],
            "node_keys": {node: list(keys) for node, keys in node_keys.items()},
            "budget_bytes": budget_bytes,
            "damping": damping,
        }
        try:
            status, answer = self._call(
                "POST", f"{self._prefix}{ROUTE_PAGE_IN}", doc=doc, what="page-in"
            )
        except _TransportFailure:
            return None
        if status == 404 or not isinstance(answer, dict):
            return None
        try:
            return PageInResult.from_dict(answer)
        except (KeyError, TypeError, ValueError) as exc:
            raise RemoteProtocolError(f"page-in: bad answer ({exc})") from exc

    def list_keys(
        self, prefix: str = "", *, after: str | None = None, limit: int | None = None
    ) -> list[str]:
        """Keys of the caller's namespace starting with `prefix`, sorted, strictly after
        `after`; all of them, or the first `limit`. Raises `KvCacheUnavailableError`."""
        out: list[str] = []
        cursor = after
        while limit is None or len(out) < limit:
            page = 1000 if limit is None else min(1000, limit - len(out))
            query: dict[str, str] = {"prefix": prefix, "limit": str(page)}
            if cursor is not None:
                query["after"] = cursor
            qs = urllib.parse.urlencode(query, quote_via=urllib.parse.quote)
            path = f"{self._prefix}{ROUTE_KEYS}?{qs}"
            status, answer = self._call_or_raise("GET", path, what="list keys")
            if status == 404:
                raise LocalProtocolError(
                    "list keys: the server has no /kv/keys route", status_hint=404
                )
            got = _fields_of(answer, ("keys", "next_after"), "list keys")
            keys, cursor = got["keys"], got["next_after"]
            if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
                raise RemoteProtocolError("list keys: 'keys' is not a list of strings")
            out.extend(keys)
            if cursor is None:
                break
            if not isinstance(cursor, str):
                raise RemoteProtocolError("list keys: 'next_after' is not a string")
        return out
