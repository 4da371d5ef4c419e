"""Cluster mode: a stateless front-end over one Redis/Valkey Cluster (`--cluster-url`).

How it works
------------
- Layout and scripts: `store/cluster_lua.py`. A tenant's key entries, key order,
  epochs and counters share one hash slot, so a PUT's decision (`decide_put`'s rule,
  conditions, first-write-wins, epoch staleness, key quota) is one atomic script there.
  A block lives in the slot of its digest, with its reference count beside its bytes.
- A PUT: hash (BLAKE3) -> take a reference on the block (`BLOB_REF`; the bytes are sent
  only when this front-end has not seen them, or the block turns out to be absent) ->
  write the entry (`ENTRY_PUT`, carrying a random op id so a retried call is recognised)
  -> drop the reference it no longer needs (refused, duplicate) or the one the replaced
  entry held. A reference is always taken before an entry names it and dropped only after
  no entry does, once; an outcome the front-end cannot know (a timeout after sending) is
  never assumed undone, so the worst a crash does is leak a reference, which the scrub
  takes back (`scrub`). With `wait_replicas`, each write is followed on the same
  connection by `WAIT`, so a block is on N replicas before an entry names it and an
  acknowledged PUT is on N replicas.
- A GET: the entry from the tenant's slot (one script: also the epoch check), then the
  bytes from this front-end's RAM tiers (`_BlockCache`, the memory backend keyed by
  digest: a digest's bytes never change, so nothing is invalidated) or from the cluster,
  verified against the digest before they are served or cached. An absent block (the
  cluster evicted it) or a damaged one is a miss, counted; the entry is removed (only if
  it is unchanged) and a damaged block is deleted.
- Routing: redis-py's `RedisCluster` owns the slot map, the node connection pools and
  hiredis parsing. Each operation runs as a pipeline on the node serving its slot (so a
  write and its `WAIT` share one connection); MOVED refreshes redis-py's map, ASK is
  followed with ASKING, TRYAGAIN/CLUSTERDOWN/LOADING/READONLY are retried with backoff
  until `retry_window_s`, and a connection error is retried only when the command was
  never sent or is safe to repeat.
- Losing the cluster: after the retry window the front-end is "down": `health()` is not
  ready, writes fail at once with `ClusterUnavailableError` (retryable), reads are
  answered from RAM when this front-end knows the key's digest and holds the bytes. A
  maintenance thread probes the cluster every second and clears the state by itself; it
  also flushes this front-end's counters into the tenants' shared counters (stats are
  fleet-wide, at most a second behind) and runs the scrub under a lease.
- Epochs: a bump is one script (`EPOCH_BUMP`) that also PUBLISHes `<tenant> <epoch>
  <scope>` on the cluster; a subscriber thread hands every notice to the listener the
  server registered (`set_epoch_listener`), so RESP subscribers on every front-end see it.
"""

from __future__ import annotations

import contextlib
import logging
import random
import secrets
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import Connection, PythonRespSerializer, SSLConnection
from redis.retry import Retry

from epistemic_kvcache.errors import (
    BlockTooLargeError,
    CapacityError,
    ClusterUnavailableError,
    ConfigurationError,
    QuotaExceededError,
    StoreClosedError,
    StoreError,
)
from epistemic_kvcache.options import DEFAULT_STORE_OPTIONS, DedupScope, StoreOptions
from epistemic_kvcache.store import cluster_lua as L
from epistemic_kvcache.store.api import (
    BlockData,
    BranchInfo,
    Buffer,
    ConsistencyReport,
    PutCond,
    PutOutcome,
    PutResult,
    SharedKvBackend,
    SnapshotInfo,
    StoreHealth,
    StoreStats,
    TierStats,
    owned_buffer,
    validate_cond,
    validate_key,
    validate_namespace,
)
from epistemic_kvcache.store.cluster_snapshots import SCRIPTS as SNAPSHOT_SCRIPTS
from epistemic_kvcache.store.cluster_snapshots import ClusterSnapshots
from epistemic_kvcache.store.codec import WarmCodec
from epistemic_kvcache.store.engine import digest_of, validate_scope
from epistemic_kvcache.store.memory import SharedKvIndex

log = logging.getLogger(__name__)

__all__ = ["ClusterBackend", "ClusterTarget", "EpochListener", "parse_cluster_url"]

EpochListener = Callable[[str, str, int], None]
"""Called with (tenant, scope, epoch) for every epoch bump seen on the cluster."""

MAX_INFLIGHT_MS = 60_000
"""A block reference older than this may not be used by an entry write (the PUT fails,
retryably): the scrub relies on it to tell a leaked reference from one in flight."""
RELEASE_LIMIT_MS = 60_000
"""A reference release arriving this long after its entry was removed is refused (the
reference leaks instead): the scrub relies on it to tell a leak from a release in flight."""
SCRUB_SETTLE_MS = RELEASE_LIMIT_MS + 60_000
"""The scrub corrects counts only this long after it started counting: every release of
an entry it did not count has landed (or been refused) by then, with a minute of margin
for clocks."""
SCRUB_GRACE_MS = 2 * MAX_INFLIGHT_MS
"""The scrub leaves alone blocks whose references changed this recently (covers
`MAX_INFLIGHT_MS` plus clock differences between masters of up to a minute)."""
_POP_CHUNK = 500
_SCAN_COUNT = 500
_MEMO_KEYS = 100_000
_UNSAFE_POLICIES = ("allkeys-lru", "allkeys-lfu", "allkeys-random")
_COUNTER_FIELDS = (
    "put_new",
    "put_replaced",
    "put_conflicts",
    "dedup_hits",
    "get_hits",
    "get_misses",
    "stale_missed",
    "integrity_failures",
    "evictions",
    "unique_blocks",
    "resident_bytes",
)


class _Unknown(StoreError):
    """Internal: the command may or may not have run (a connection broke after sending)."""


@dataclass(frozen=True, slots=True)
class ClusterTarget:
    """Where the cluster is and how to log in (from `--cluster-url`)."""

    nodes: tuple[tuple[str, int], ...]
    username: str | None
    password: str | None = field(repr=False)
    tls: bool


def parse_cluster_url(url: str, *, password_file: Path | None = None) -> ClusterTarget:
    """`redis[s]://[user[:password]@]host:port[,host:port...]` -> `ClusterTarget`.

    A password in `password_file` (first line) replaces one in the URL.
    """
    try:
        scheme, rest = url.split("://", 1)
    except ValueError:
        raise ConfigurationError(
            "invalid cluster_url: expected redis://host:port[,host:port...] or rediss://..."
        ) from None
    if scheme not in ("redis", "rediss"):
        raise ConfigurationError(
            f"invalid cluster_url: the scheme must be redis or rediss (got {scheme!r})"
        )
    userinfo, _, hosts = rest.rpartition("@")
    hosts = hosts.rstrip("/")
    username: str | None = None
    password: str | None = None
    if userinfo:
        user, sep, pw = userinfo.partition(":")
        username = urllib.parse.unquote(user) or None
        password = urllib.parse.unquote(pw) if sep else None
    nodes: list[tuple[str, int]] = []
    for part in hosts.split(","):
        host, sep, port = part.strip().rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigurationError(
                f"invalid cluster_url: expected host:port entries (got {part.strip()!r})"
            )
        nodes.append((host, int(port)))
    if password_file is not None:
        try:
            password = password_file.read_text().splitlines()[0].strip() or None
        except (OSError, IndexError) as exc:
            raise ConfigurationError(
                f"invalid cluster_password_file: cannot read a password from "
                f"{str(password_file)!r} ({exc})"
            ) from exc
    return ClusterTarget(tuple(nodes), username, password, scheme == "rediss")


def _never_sent(exc: BaseException) -> bool:
    """Whether a redis-py connection error happened before the command left."""
    text = str(exc)
    return "connecting to" in text or "Timeout connecting" in text


def _connection_class(tls: bool, ca: str | None) -> type[Connection]:
    """redis-py's connection (TLS: verifying against `ca`, or the system CAs) packing
    commands in Python: with hiredis installed redis-py packs them with
    `hiredis.pack_command`, which copies a 4 MiB argument slowly enough to cut a SET to a
    quarter of the raw socket's rate; the Python packer sends large arguments as they are.
    (Passing `ssl=True` would make redis-py replace this class with its own.)"""
    base: type[Connection] = SSLConnection if tls else Connection

    class _Conn(base):  # type: ignore[valid-type, misc]
        def __init__(self, **kw: Any) -> None:
            if tls:
                kw.setdefault("ssl_cert_reqs", "required")
                if ca is not None:
                    kw.setdefault("ssl_ca_certs", ca)
            super().__init__(**kw)

        def _construct_command_packer(self, packer: Any) -> Any:
            if packer is not None:
                return packer
            return PythonRespSerializer(self._buffer_cutoff, self.encoder.encode)

    return _Conn


class _BlockCache(SharedKvIndex):
    """This front-end's hot and warm tiers: the memory backend, keyed (tenant, digest hex).

    Blocks enter already verified (`admit`), so they are not hashed again; reads from
    warm are verified by the engine as usual."""

    def admit(self, ns: str, digest: bytes, data: Buffer) -> None:
        """Cache a verified block that the store owns already (`owned_buffer`'s answer, or
        bytes read from the cluster); a block the tiers cannot hold is simply not cached."""
        sdig = self._scoped(ns.encode(), digest)
        if sdig not in self._blobs:  # unlocked look: new bytes will need room in hot
            self._make_hot_room((len(data),))  # codec work outside the lock
        with self._lock:
            if self._lookup(ns, digest.hex()) is not None:
                return
            with contextlib.suppress(CapacityError):  # within the tiers' capacities, always
                self._put_locked(ns, digest.hex(), sdig, digest, data)

    def has(self, ns: str, digest: bytes) -> bool:
        with self._lock:
            return self._lookup(ns, digest.hex()) is not None


@dataclass(slots=True)
class _Deltas:
    """Counters of one tenant not yet added to its shared counters."""

    values: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, n: int = 1) -> None:
        self.values[name] = self.values.get(name, 0) + n


class ClusterBackend(SharedKvBackend):
    """The store over a Redis/Valkey Cluster. Thread-safe; every call may block on I/O."""

    def __init__(
        self,
        url: str,
        options: StoreOptions = DEFAULT_STORE_OPTIONS,
        *,
        tls_ca: Path | None = None,
        password_file: Path | None = None,
        codec: WarmCodec | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`url`, `tls_ca`, `password_file`: the cluster and how to reach it; `options`:
        the tiers of this front-end's RAM cache, the quotas and the `cluster_*` tuning;
        `clock`: wall-clock seconds for snapshot TTLs and creation times (tests pass a
        fake clock they advance)."""
        self._clock = clock
        self.options = options
        self.max_block_bytes = options.max_block_bytes
        self.dedup_scope: DedupScope = options.dedup_scope
        self.wait_replicas = options.cluster_wait_replicas
        self.wait_timeout_s = options.cluster_wait_timeout_s
        self.retry_window_s = options.cluster_retry_window_s
        self.prefix = options.cluster_key_prefix
        self.block_ttl_ms = int(options.cluster_block_ttl_s * 1000)
        self.scrub_interval_s = options.cluster_scrub_interval_s
        self.max_keys_per_tenant = options.max_keys_per_tenant
        self.max_epoch_scopes_per_tenant = options.max_epoch_scopes_per_tenant
        self.max_pinned_fraction = options.max_pinned_fraction
        self.max_snapshots_per_tenant = options.max_snapshots_per_tenant
        self.first_write_wins = options.first_write_wins
        self._snaps = ClusterSnapshots(self)
        # the RAM cache holds blocks only: its tiers, none of the quotas (the cluster's)
        cache_options = StoreOptions(
            hot_capacity_bytes=options.hot_capacity_bytes,
            warm_capacity_bytes=options.warm_capacity_bytes,
            max_block_bytes=options.max_block_bytes,
            dedup_scope=options.dedup_scope,
        )
        self._cache = _BlockCache(cache_options, codec=codec)
        self.target = parse_cluster_url(url, password_file=password_file)
        self._lock = threading.Lock()
        self._closed = False
        self._deltas: dict[str, _Deltas] = {}
        self._memo: OrderedDict[tuple[str, str], tuple[bytes, int]] = OrderedDict()
        self._tenants_seen: set[str] = set()
        self._retire_cursor: dict[str, int] = {}
        self.release_limit_ms = RELEASE_LIMIT_MS
        self.scrub_settle_ms = SCRUB_SETTLE_MS
        self._clients: dict[int, Any] = {}
        self._down_since: float | None = None
        self._down_reason: str | None = None
        self._last_reinit = 0.0
        self._reinit_lock = threading.Lock()
        self._listener: EpochListener | None = None
        self._fe: dict[str, int] = {
            "retries": 0,
            "unavailable_errors": 0,
            "leaked_refs": 0,
            "ram_answers_while_down": 0,
            "scrubs": 0,
            "scrub_fixed_blocks": 0,
            "scrub_removed_entries": 0,
        }
        self.capacity_bytes = 0
        kwargs: dict[str, Any] = {
            "username": self.target.username,
            "password": self.target.password,
            "socket_timeout": options.cluster_socket_timeout_s,
            "socket_connect_timeout": min(2.0, options.cluster_socket_timeout_s),
            "retry": Retry(NoBackoff(), 0),
            "decode_responses": False,
        }
        if not self.target.tls and tls_ca is not None:
            raise ConfigurationError(
                "invalid cluster_tls_ca: the cluster URL is redis:// (use rediss:// for TLS)"
            )
        kwargs["connection_class"] = _connection_class(
            self.target.tls, str(tls_ca) if tls_ca is not None else None
        )
        self._rc: Any = self._connect(kwargs)  # redis-py's cluster API is untyped
        try:
            self._check_cluster()
        except BaseException:
            self._rc.close()
            raise
        self._stop = threading.Event()
        self._maint = threading.Thread(
            target=self._maintenance_loop, name="kvcache-cluster-maint", daemon=True
        )
        self._subscriber = threading.Thread(
            target=self._subscribe_loop, name="kvcache-cluster-epochs", daemon=True
        )
        self._maint.start()
        self._subscriber.start()

    # -- connection ----------------------------------------------------------------------
    def _connect(self, kwargs: dict[str, Any]) -> Any:
        make_node: Any = ClusterNode
        nodes = [make_node(h, p) for h, p in self.target.nodes]
        deadline = time.monotonic() + self.retry_window_s
        while True:
            try:
                # `url` (scheme redis, no credentials) only makes redis-py build node pools
                # from `connection_class` (ours: TLS and the packer) instead of its own
                host, port = self.target.nodes[0]
                url = f"redis://[{host}]:{port}" if ":" in host else f"redis://{host}:{port}"
                return RedisCluster(url=url, startup_nodes=nodes, **kwargs)
            except redis.AuthenticationError as exc:
                raise ConfigurationError(
                    f"invalid cluster_url: the cluster refused the credentials ({exc})"
                ) from exc
            except (redis.RedisError, redis.RedisClusterException, OSError) as exc:
                text = str(exc)
                if any(w in text for w in ("NOAUTH", "WRONGPASS", "username-password", "password")):
                    raise ConfigurationError(
                        f"invalid cluster_url: the cluster refused the credentials ({exc})"
                    ) from exc
                if time.monotonic() > deadline:
                    raise ConfigurationError(
                        f"cannot reach the cluster at "
                        f"{', '.join(f'{h}:{p}' for h, p in self.target.nodes)}: {exc}"
                    ) from exc
                time.sleep(0.2)

    def _check_cluster(self) -> None:
        """Refuse an eviction policy that could drop tenant metadata; agree on settings."""
        total = 0
        for node in self._rc.get_primaries():
            info = self._client(node).info("memory")
            policy = str(info.get("maxmemory_policy", "noeviction"))
            if policy in _UNSAFE_POLICIES:
                raise ConfigurationError(
                    f"the cluster node {node.name} has maxmemory-policy {policy}: it may evict "
                    "the tenants' key indexes; use noeviction or a volatile-* policy "
                    "(see docs/cluster.md)"
                )
            total += int(info.get("maxmemory", 0) or 0)
        self.capacity_bytes = total
        meta = f"{{{self.prefix}}}:config".encode()
        want = f"dedup_scope={self.dedup_scope}".encode()
        self._exec(meta, [("SET", meta, want, "NX")])
        have = self._exec(meta, [("GET", meta)])[0]
        if have != want:
            raise ConfigurationError(
                f"invalid dedup_scope: the cluster's front-ends use "
                f"{(have or b'?').decode(errors='replace')} under prefix {self.prefix!r}; "
                "every front-end of one cluster must use the same"
            )

    def _client(self, node: Any) -> Any:
        """The node's redis-py client, remembered so `close` closes it even when a topology
        refresh has replaced it meanwhile."""
        client = self._rc.get_redis_connection(node)
        if id(client) not in self._clients:
            with self._lock:
                self._clients[id(client)] = client
        return client

    def _reinitialize(self) -> None:
        """Refresh redis-py's slot map (at most every 0.2 s, whatever the thread count)."""
        with self._reinit_lock:
            if time.monotonic() - self._last_reinit < 0.2:
                return
            self._last_reinit = time.monotonic()
            try:
                self._rc.nodes_manager.initialize()
            except (redis.RedisError, redis.RedisClusterException, OSError) as exc:
                log.debug("cluster topology refresh failed: %s", exc)

    def _exec(
        self,
        slot_key: bytes,
        cmds: Sequence[tuple[Any, ...]],
        *,
        safe: bool = True,
        durable: bool = False,
        window_s: float | None = None,
    ) -> list[Any]:
        """Run `cmds` (one slot) on the node serving `slot_key`, in one pipeline.

        `safe`: the commands may run twice (reads, or writes made idempotent); otherwise a
        connection error after sending raises `_Unknown`. `durable`: follow with WAIT
        when `wait_replicas` is set. Raises `ClusterUnavailableError` once the retry
        window is spent, `CapacityError` when the cluster is out of memory.
        """
        if self._closed:
            raise StoreClosedError("the store is closed")
        window = self.retry_window_s if window_s is None else window_s
        down = self._down_since
        if down is not None and time.monotonic() - down > window and window_s is None:
            self._fe["unavailable_errors"] += 1
            raise ClusterUnavailableError(f"the cluster is unreachable: {self._down_reason}")
        deadline = time.monotonic() + window
        ask: Any = None
        delay = 0.02
        wait = durable and self.wait_replicas > 0
        while True:
            try:
                node = ask if ask is not None else self._rc.get_node_from_key(slot_key)
                client = self._client(node)
                if len(cmds) == 1 and not wait and ask is None:
                    try:  # the common case without a pipeline object (~40 us less)
                        out = [client.execute_command(*cmds[0])]
                    except redis.ResponseError as exc:
                        out = [exc]
                else:
                    pipe = client.pipeline(transaction=False)
                    if ask is not None:
                        pipe.execute_command("ASKING")
                    for c in cmds:
                        pipe.execute_command(*c)
                    if wait:
                        pipe.execute_command(
                            "WAIT", self.wait_replicas, int(self.wait_timeout_s * 1000)
                        )
                    out = pipe.execute(raise_on_error=False)
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if not safe and not _never_sent(exc):
                    raise _Unknown(f"cluster connection lost mid-command: {exc}") from exc
                problem = f"{type(exc).__name__}: {exc}"
                self._reinitialize()
            except (redis.RedisClusterException, redis.RedisError) as exc:
                problem = f"{type(exc).__name__}: {exc}"
                self._reinitialize()
            else:
                if ask is not None:
                    out = out[1:]
                    ask = None
                err = next((r for r in out if isinstance(r, Exception)), None)
                if err is None:  # a runtime error inside a MULTI's EXEC
                    err = next(
                        (
                            x
                            for r in out
                            if isinstance(r, list)
                            for x in r
                            if isinstance(x, redis.exceptions.NoScriptError)
                        ),
                        None,
                    )
                if err is None:
                    if wait and int(out[-1]) < self.wait_replicas:
                        self._fe["unavailable_errors"] += 1
                        raise ClusterUnavailableError(
                            f"the write was acknowledged by {out[-1]} of "
                            f"{self.wait_replicas} replicas within {self.wait_timeout_s} s "
                            "(it may still be applied)"
                        )
                    self._up()
                    return list(out[: len(cmds)])
                problem = f"{type(err).__name__}: {err}"
                if isinstance(err, redis.exceptions.MovedError):
                    self._reinitialize()
                elif isinstance(err, redis.exceptions.AskError):
                    ask = self._rc.get_node(host=err.host, port=int(err.port))
                    if ask is None:
                        self._reinitialize()
                    continue
                elif isinstance(err, redis.exceptions.NoScriptError):
                    self._load_scripts(node)
                    continue
                elif isinstance(err, redis.exceptions.OutOfMemoryError):
                    raise CapacityError(f"the cluster is out of memory: {err}")
                elif isinstance(err, redis.exceptions.ClusterDownError | redis.ReadOnlyError):
                    self._reinitialize()
                elif not isinstance(
                    err,
                    redis.exceptions.TryAgainError
                    | redis.BusyLoadingError
                    | redis.exceptions.MasterDownError
                    | redis.ConnectionError,
                ):
                    raise StoreError(f"cluster error: {problem}")
            self._fe["retries"] += 1
            if time.monotonic() > deadline:
                self._down(problem)
                self._fe["unavailable_errors"] += 1
                raise ClusterUnavailableError(f"the cluster did not answer in time: {problem}")
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def _load_scripts(self, node: Any) -> None:
        client = self._client(node)
        for s in (*L.SCRIPTS, *SNAPSHOT_SCRIPTS):
            client.script_load(s.source)

    def _script(
        self,
        script: L.Script,
        keys: Sequence[bytes],
        args: Sequence[Any],
        *,
        safe: bool = True,
        durable: bool = False,
    ) -> Any:
        cmd = ("EVALSHA", script.sha, len(keys), *keys, *args)
        return self._exec(keys[0], [cmd], safe=safe, durable=durable)[0]

    def _up(self) -> None:
        if self._down_since is not None:
            log.warning("the cluster answers again")
            self._down_since = None
            self._down_reason = None

    def _down(self, reason: str) -> None:
        if self._down_since is None:
            log.error("lost the cluster: %s", reason)
            self._down_since = time.monotonic()
        self._down_reason = reason

    # -- helpers -------------------------------------------------------------------------
    def _tk(self, ns: str) -> L.TenantKeys:
        return L.TenantKeys.of(self.prefix, ns)

    def _bkey(self, ns: str, digest: bytes) -> bytes:
        return L.blob_key(self.prefix, digest, None if self.dedup_scope == "global" else ns)

    def _fww(self, ns: str) -> bool:
        f = self.first_write_wins
        return f if isinstance(f, bool) else ns in f

    def _count(self, ns: str, name: str, n: int = 1) -> None:
        with self._lock:
            d = self._deltas.get(ns)
            if d is None:
                d = self._deltas[ns] = _Deltas()
            d.add(name, n)

    def _remember(self, ns: str, key: str, digest: bytes, size: int) -> None:
        with self._lock:
            self._memo[(ns, key)] = (digest, size)
            self._memo.move_to_end((ns, key))
            while len(self._memo) > _MEMO_KEYS:
                self._memo.popitem(last=False)

    def _forget(self, ns: str, key: str) -> None:
        with self._lock:
            self._memo.pop((ns, key), None)

    def _register_tenant(self, ns: str) -> None:
        if ns in self._tenants_seen:
            return
        k = L.tenants_key(self.prefix)
        self._exec(k, [("SADD", k, ns.encode().hex())])
        with self._lock:
            self._tenants_seen.add(ns)

    def _validate(self, ns: str, key: str) -> None:
        validate_namespace(ns)
        validate_key(key)
        if self._closed:
            raise StoreClosedError("the store is closed")

    def _entries(self, ns: str, keys: Sequence[str]) -> list[tuple[bool, L.Entry] | None]:
        """Per key: None (absent) or (stale, entry)."""
        tk = self._tk(ns)
        raw = self._script(L.ENTRY_GET, [tk.entries, tk.epochs], [k.encode() for k in keys])
        out: list[tuple[bool, L.Entry] | None] = []
        for r in raw:
            if not r:
                out.append(None)
            else:
                out.append((r[0] == b"stale", L.parse_entry(r[1])))
        return out

    def _unref(
        self,
        ns: str,
        digest: bytes,
        gen: bytes,
        *,
        refs: int = -1,
        pins: int = 0,
        removed_ms: int = 0,
    ) -> None:
        """Drop references (and pins) on a block, once; a failure leaks (the scrub takes
        it back). `removed_ms`: when the entry naming them was removed (tenant master's
        clock); the release is refused past `release_limit_ms` (see `scrub`)."""
        bkey = self._bkey(ns, digest)
        try:
            left, freed = self._script(
                L.BLOB_ADJ,
                [bkey],
                [gen, refs, pins, self.block_ttl_ms, int(removed_ms), self.release_limit_ms],
                safe=False,
            )
        except (StoreError, redis.RedisError) as exc:
            self._fe["leaked_refs"] += 1
            log.warning("block reference not released (the scrub will): %s", exc)
            return
        if int(left) == -2:
            self._fe["leaked_refs"] += 1
            log.warning("block reference released too late; left for the scrub")
        elif int(left) == 0 and int(freed) >= 0 and refs < 0:
            self._count(ns, "unique_blocks", -1)
            self._count(ns, "resident_bytes", -int(freed))

    def _blob_ref(self, ns: str, digest: bytes, data: Buffer) -> tuple[bytes, int, bool]:
        """Take a reference on the block, storing it if absent: (generation, ms, created)."""
        bkey = self._bkey(ns, digest)
        gen = secrets.token_bytes(L.GEN_LEN)
        ttl = self.block_ttl_ms
        if self._cache.has(ns, digest):  # probably stored already: no bytes on the wire
            r = self._script(L.BLOB_REF, [bkey], [gen, ttl], durable=True)
            if r:
                return bytes(r[0]), int(r[1]), False
        r = self._store_block(bkey, data, gen)
        created = bool(int(r[2]))
        if created:
            self._count(ns, "unique_blocks")
            self._count(ns, "resident_bytes", len(data))
        return bytes(r[0]), int(r[1]), created

    def _store_block(self, bkey: bytes, data: Buffer, gen: bytes) -> Any:
        """HSETNX the bytes and take the reference in one MULTI (the bytes go to Redis as
        a plain argument, never through Lua)."""
        payload = data if isinstance(data, bytes | memoryview) else memoryview(data)
        out = self._exec(
            bkey,
            [
                ("MULTI",),
                ("HSETNX", bkey, "d", payload),
                ("EVALSHA", L.BLOB_REF.sha, 1, bkey, gen, self.block_ttl_ms),
                ("EXEC",),
            ],
            durable=True,
        )
        return out[3][1]

    # -- single-key operations ---------------------------------------------------------
    def put(
        self,
        ns: str,
        key: str,
        data: BlockData,
        *,
        epoch_scope: str | None = None,
        cond: PutCond = None,
    ) -> PutResult:
        self._validate(ns, key)
        if len(data) > self.max_block_bytes:
            raise BlockTooLargeError(
                f"block of {len(data)} bytes exceeds max_block_bytes={self.max_block_bytes}"
            )
        validate_cond(cond)
        if epoch_scope is not None:
            validate_scope(epoch_scope)
        data = owned_buffer(data)
        self._register_tenant(ns)
        return self._put_to(
            ns, self._tk(ns), key, data, epoch_scope, cond, self.max_keys_per_tenant, memo=True
        )

    def _put_to(
        self,
        ns: str,
        tk: L.TenantKeys,
        key: str,
        data: Buffer,
        epoch_scope: str | None,
        cond: PutCond,
        quota: int,
        *,
        memo: bool,
    ) -> PutResult:
        """PUT into the entries `tk` names (the tenant's, or a branch overlay's)."""
        digest = digest_of(data)
        op = secrets.token_bytes(L.OP_LEN)
        size = len(data)
        created = False
        for attempt in range(4):
            # every attempt holds a reference of its own: after an unknown outcome the
            # earlier attempt's reference may already have been consumed by its entry and
            # released by whoever replaced that entry since
            gen, t_ref, new_block = self._blob_ref(ns, digest, data)
            created = created or new_block
            try:
                outcome_raw, cur_raw, removed_ms = self._script(
                    L.ENTRY_PUT,
                    [tk.entries, tk.order, tk.epochs, tk.counters],
                    [
                        key.encode(),
                        digest + gen,
                        op,
                        size,
                        (epoch_scope or "").encode(),
                        cond or "",
                        "1" if self._fww(ns) else "0",
                        t_ref,
                        MAX_INFLIGHT_MS,
                        quota,
                    ],
                    safe=False,
                    durable=True,
                )
                break
            except _Unknown as exc:
                self._fe["leaked_refs"] += 1  # this attempt's reference: consumed or leaked
                if attempt == 3:
                    raise ClusterUnavailableError(
                        f"the write's outcome is unknown after {attempt + 1} tries: {exc}"
                    ) from exc
        outcome = outcome_raw.decode()
        cur = L.parse_entry(cur_raw) if cur_raw else None
        if outcome == "again":
            # an earlier attempt of this very call is in place and holds its own reference
            self._unref(ns, digest, gen)
            self._cache.admit(ns, digest, data)
            if memo:
                self._remember(ns, key, digest, size)
            self._count(ns, "put_new")
            return PutResult(PutOutcome.NEW, digest, size)
        if outcome in ("missing", "conflict", "expired", "quota") or (
            outcome == "duplicate" and cur is not None and cur.ref == digest + gen
        ):
            self._unref(ns, digest, gen)  # the entry does not name our reference
        if outcome == "expired":
            raise ClusterUnavailableError("the write took too long to complete; retry")
        if outcome == "quota":
            raise QuotaExceededError(
                f"key quota exceeded: this tenant holds {quota} keys "
                "(its limit); delete some first",
                resource="keys",
            )
        if outcome == "missing":
            return PutResult(PutOutcome.MISSING, digest, size)
        if outcome == "conflict":
            self._count(ns, "put_conflicts")
            assert cur is not None
            return PutResult(PutOutcome.CONFLICT, cur.digest, cur.size)
        self._cache.admit(ns, digest, data)
        if memo:
            self._remember(ns, key, digest, size)
        if cur is not None and cur.ref != digest + gen:
            # the entry no longer names cur's reference; its pins move to the new block
            self._unref(ns, cur.digest, cur.gen, pins=-cur.pins, removed_ms=removed_ms)
            if cur.pins:
                self._unref(ns, digest, gen, refs=0, pins=cur.pins)
        if outcome == "duplicate":
            self._count(ns, "dedup_hits")
            return PutResult(PutOutcome.DUPLICATE, digest, size)
        result = PutOutcome.NEW if outcome == "new" else PutOutcome.REPLACED
        self._count(ns, "put_new" if result is PutOutcome.NEW else "put_replaced")
        if not created:
            self._count(ns, "dedup_hits")
        return PutResult(result, digest, size)

    def get(self, ns: str, key: str) -> Buffer | None:
        self._validate(ns, key)
        try:
            found = self._entries(ns, [key])[0]
        except ClusterUnavailableError:
            data = self._from_ram(ns, key)
            if data is None:
                raise
            return data
        return self._read(ns, key, found)

    def _from_ram(self, ns: str, key: str) -> Buffer | None:
        """While the cluster is unreachable: the block last seen under `key`, if cached."""
        with self._lock:
            seen = self._memo.get((ns, key))
        if seen is None:
            return None
        data = self._cache.get(ns, seen[0].hex())
        if data is not None:
            self._fe["ram_answers_while_down"] += 1
        return data

    def _read(self, ns: str, key: str, found: tuple[bool, L.Entry] | None) -> Buffer | None:
        if found is None or found[0]:
            self._count(ns, "get_misses")
            if found is not None:
                self._count(ns, "stale_missed")
            self._forget(ns, key)
            return None
        e = found[1]
        self._remember(ns, key, e.digest, e.size)
        data = self._cache.get(ns, e.digest.hex())
        if data is None:
            data = self._fetch(ns, key, e)
        self._count(ns, "get_hits" if data is not None else "get_misses")
        return data

    def _fetch(self, ns: str, key: str, e: L.Entry, *, live: bool = True) -> Buffer | None:
        """The block from the cluster, verified; None (and cleanup) when gone or damaged.
        `live`: the entry is the tenant's (not a snapshot's or an overlay's)."""
        bkey = self._bkey(ns, e.digest)
        gen, data = self._exec(bkey, [("HMGET", bkey, "g", "d")])[0]
        return self._verified(ns, key, e, gen, data, live=live)

    def _block(self, ns: str, e: L.Entry) -> Buffer | None:
        """A snapshot's or an overlay's block: RAM, else the cluster (verified)."""
        data = self._cache.get(ns, e.digest.hex())
        return data if data is not None else self._fetch(ns, "", e, live=False)

    def _verified(
        self,
        ns: str,
        key: str,
        e: L.Entry,
        gen: bytes | None,
        data: bytes | None,
        *,
        live: bool = True,
    ) -> Buffer | None:
        """`data` if it is the entry's block and matches its digest; else None, counted,
        and the entry (and a damaged block) removed."""
        if gen is None or gen != e.gen or data is None:
            self._count(ns, "evictions")
            if live:
                self._drop_entry(ns, key, e)
            return None
        if len(data) != e.size or digest_of(data) != e.digest:
            log.error(
                "integrity failure: block %s of tenant %r in the cluster does not match its "
                "digest; deleted, never served",
                e.digest.hex(),
                ns,
            )
            self._count(ns, "integrity_failures")
            bkey = self._bkey(ns, e.digest)
            with contextlib.suppress(StoreError):
                freed = int(self._script(L.BLOB_DROP, [bkey], [e.gen], safe=False))
                if freed:
                    self._count(ns, "unique_blocks", -1)
                    self._count(ns, "resident_bytes", -freed)
            if live:
                self._drop_entry(ns, key, e)
            return None
        self._cache.admit(ns, e.digest, data)
        return data

    def _drop_entry(self, ns: str, key: str, e: L.Entry) -> None:
        """Remove an entry whose block is gone, if it is still that entry."""
        tk = self._tk(ns)
        self._forget(ns, key)
        with contextlib.suppress(StoreError):
            self._script(L.ENTRY_DEL, [tk.entries, tk.order, tk.counters], [key.encode(), e.raw])

    def _live_block(self, ns: str, e: L.Entry) -> bool:
        """Whether the entry's block is still in the cluster (or in this front-end's RAM)."""
        if self._cache.has(ns, e.digest):
            return True
        bkey = self._bkey(ns, e.digest)
        return bool(self._exec(bkey, [("HGET", bkey, "g")])[0] == e.gen)

    def size(self, ns: str, key: str) -> int | None:
        self._validate(ns, key)
        found = self._entries(ns, [key])[0]
        if found is None or found[0] or not self._live_block(ns, found[1]):
            return None
        return found[1].size

    def exists(self, ns: str, key: str) -> bool:
        return self.size(ns, key) is not None

    def _reads(self, cmds: list[tuple[Any, ...]]) -> list[Any]:
        """Read-only commands on many slots at once (redis-py's cluster pipeline routes
        them, one round trip per node); one by one if that fails."""
        if len(cmds) == 1:
            return self._exec(cmds[0][1], cmds)
        try:
            pipe = self._rc.pipeline()
            for c in cmds:
                pipe.execute_command(*c)
            return list(pipe.execute())
        except (redis.RedisError, redis.RedisClusterException) as exc:
            log.debug("cluster pipeline failed (%s); one by one", exc)
            return [self._exec(c[1], [c])[0] for c in cmds]

    def exists_many(self, ns: str, keys: Sequence[str]) -> list[bool]:
        for key in keys:
            self._validate(ns, key)
        if not keys:
            return []
        found = self._entries(ns, keys)
        out = [f is not None and not f[0] for f in found]
        ask = [
            (i, f[1])
            for i, f in enumerate(found)
            if f is not None and not f[0] and not self._cache.has(ns, f[1].digest)
        ]
        if ask:
            gens = self._reads([("HGET", self._bkey(ns, e.digest), "g") for _i, e in ask])
            for (i, e), g in zip(ask, gens, strict=True):
                out[i] = g == e.gen
        return out

    def get_many(self, ns: str, keys: Sequence[str]) -> list[Buffer | None]:
        for key in keys:
            self._validate(ns, key)
        if not keys:
            return []
        try:
            found = self._entries(ns, keys)
        except ClusterUnavailableError:
            ram = [self._from_ram(ns, k) for k in keys]
            if any(d is None for d in ram):
                raise
            return ram
        out: list[Buffer | None] = [None] * len(keys)
        fetch: list[tuple[int, L.Entry]] = []
        for i, (key, f) in enumerate(zip(keys, found, strict=True)):
            if f is None or f[0]:
                out[i] = self._read(ns, key, f)  # a miss, counted
                continue
            cached = self._cache.get(ns, f[1].digest.hex())
            self._remember(ns, key, f[1].digest, f[1].size)
            if cached is not None:
                self._count(ns, "get_hits")
                out[i] = cached
            else:
                fetch.append((i, f[1]))
        if fetch:
            got = self._reads([("HMGET", self._bkey(ns, e.digest), "g", "d") for _i, e in fetch])
            for (i, e), (gen, data) in zip(fetch, got, strict=True):
                out[i] = self._verified(ns, keys[i], e, gen, data)
                self._count(ns, "get_hits" if out[i] is not None else "get_misses")
        return out

    def delete(self, ns: str, key: str) -> bool:
        self._validate(ns, key)
        tk = self._tk(ns)
        raw = self._script(
            L.ENTRY_DEL, [tk.entries, tk.order, tk.counters], [key.encode(), b""], durable=True
        )
        self._forget(ns, key)
        if not raw:
            return False
        e = L.parse_entry(raw[0])
        self._unref(ns, e.digest, e.gen, pins=-e.pins, removed_ms=raw[1])
        return True

    def flush(self, ns: str) -> int:
        validate_namespace(ns)
        tk = self._tk(ns)
        n = 0
        while True:
            removed_ms, popped = self._script(
                L.ENTRY_POP, [tk.entries, tk.order, tk.counters], [_POP_CHUNK], durable=True
            )
            for raw in popped:
                e = L.parse_entry(raw)
                self._unref(ns, e.digest, e.gen, pins=-e.pins, removed_ms=removed_ms)
            n += len(popped)
            if len(popped) < _POP_CHUNK:
                break
        with self._lock:
            for k in [k for k in self._memo if k[0] == ns]:
                del self._memo[k]
        return n

    def _pin(self, ns: str, key: str, delta: int) -> bool:
        self._validate(ns, key)
        tk = self._tk(ns)
        limit = int(self.capacity_bytes * self.max_pinned_fraction)
        raw = self._script(
            L.ENTRY_PIN, [tk.entries, tk.epochs, tk.counters], [key.encode(), delta, limit]
        )
        if not raw or raw == b"nopin":
            return False
        if raw == b"quota":
            raise QuotaExceededError(
                f"pin quota exceeded: this tenant's pinned keys would pass {limit} bytes "
                f"({self.max_pinned_fraction:.0%} of the cluster's {self.capacity_bytes} bytes "
                "of maxmemory)",
                resource="pins",
            )
        e = L.parse_entry(raw)
        self._unref(ns, e.digest, e.gen, refs=0, pins=delta)
        return True

    def pin(self, ns: str, key: str) -> bool:
        return self._pin(ns, key, +1)

    def unpin(self, ns: str, key: str) -> bool:
        return self._pin(ns, key, -1)

    def evict(self, ns: str, key: str) -> bool:
        self._validate(ns, key)
        found = self._entries(ns, [key])[0]
        if found is None or found[0] or found[1].pins:
            return False
        self._cache.delete(ns, found[1].digest.hex())
        return True

    def promote(self, ns: str, key: str) -> bool:
        return self.get(ns, key) is not None

    def set_importance(self, ns: str, key: str, score: float) -> bool:
        self._validate(ns, key)
        if not 0.0 <= score <= 1.0:
            raise ValueError(f"importance must be in [0, 1] (got {score!r})")
        found = self._entries(ns, [key])[0]
        if found is None or found[0]:
            return False
        self._cache.set_importance(ns, found[1].digest.hex(), score)
        return True

    def keys(self, ns: str, *, after: str | None = None, limit: int = 1000) -> list[str]:
        validate_namespace(ns)
        if limit <= 0:
            return []
        tk = self._tk(ns)
        lo = b"(" + after.encode() if after is not None else b"-"
        raw = self._exec(tk.order, [("ZRANGEBYLEX", tk.order, lo, b"+", "LIMIT", 0, limit)])[0]
        return [bytes(k).decode() for k in raw]

    def count(self, ns: str) -> int:
        validate_namespace(ns)
        tk = self._tk(ns)
        return int(self._exec(tk.order, [("ZCARD", tk.order)])[0])

    # -- stats -----------------------------------------------------------------------------
    def _shared_counters(self, ns: str) -> dict[str, int]:
        tk = self._tk(ns)
        raw = self._exec(tk.counters, [("HGETALL", tk.counters)])[0]
        out = {bytes(k).decode(): int(v) for k, v in dict(raw).items()}
        with self._lock:
            d = self._deltas.get(ns)
            for name, n in (d.values if d is not None else {}).items():
                out[name] = out.get(name, 0) + n
        return out

    def _all_tenants(self) -> list[str]:
        k = L.tenants_key(self.prefix)
        raw = self._exec(k, [("SMEMBERS", k)])[0]
        return sorted(bytes.fromhex(bytes(t).decode()).decode() for t in raw)

    def stats(self, ns: str | None = None) -> StoreStats:
        if ns is None:
            c: dict[str, int] = {}
            for tenant in self._all_tenants():
                for name, n in self._shared_counters(tenant).items():
                    c[name] = c.get(name, 0) + n
        else:
            c = self._shared_counters(ns)
        local = self._cache.stats(ns)
        logical = c.get("logical_bytes", 0)
        resident = c.get("resident_bytes", 0)
        s = StoreStats(
            unique_blocks=c.get("unique_blocks", 0),
            total_refs=c.get("keys", 0),
            logical_bytes=logical,
            resident_bytes=resident,
            dedup_savings_bytes=max(0, logical - resident),
            dedup_hits=c.get("dedup_hits", 0),
            put_new=c.get("put_new", 0),
            put_conflicts=c.get("put_conflicts", 0),
            put_replaced=c.get("put_replaced", 0),
            get_hits=c.get("get_hits", 0),
            get_misses=c.get("get_misses", 0),
            stale_missed=c.get("stale_missed", 0),
            integrity_failures=c.get("integrity_failures", 0),
            evictions=c.get("evictions", 0),
            promotions=local.promotions,
            demotions=local.demotions,
            pinned_blocks=c.get("pinned_keys", 0),
        )
        s.tiers["hot"] = local.tiers["hot"]
        s.tiers["warm"] = local.tiers["warm"]
        s.tiers["cluster"] = TierStats(  # no high-water mark kept: the peak reads as now
            c.get("unique_blocks", 0), resident, self.capacity_bytes, resident, resident
        )
        if ns is None:
            s.extra.update(self._fe)
            s.extra["namespaces"] = len(self._all_tenants())
            s.extra["cluster_masters"] = len(self._rc.get_primaries())
            s.extra["cluster_down"] = int(self._down_since is not None)
        return s

    def _flush_counters(self) -> None:
        with self._lock:
            pending, self._deltas = self._deltas, {}
        for ns, d in pending.items():
            items = [(k, v) for k, v in d.values.items() if v]
            if not items:
                continue
            tk = self._tk(ns)
            try:
                self._exec(
                    tk.counters,
                    [("HINCRBY", tk.counters, k, v) for k, v in items],
                    safe=False,
                    window_s=1.0,
                )
            except _Unknown:
                pass  # may have been added: never add twice
            except StoreError:
                with self._lock:  # not added: keep them for the next flush
                    again = self._deltas.setdefault(ns, _Deltas())
                    for k, v in items:
                        again.add(k, v)

    # -- epochs ----------------------------------------------------------------------------
    def epoch_get(self, ns: str, scope: str) -> int:
        validate_namespace(ns)
        validate_scope(scope)
        tk = self._tk(ns)
        raw = self._exec(tk.epochs, [("HGET", tk.epochs, scope.encode())])[0]
        return int(raw) if raw is not None else 0

    def epoch_bump(self, ns: str, scope: str) -> int:
        validate_namespace(ns)
        validate_scope(scope)
        tk = self._tk(ns)
        n = int(
            self._script(
                L.EPOCH_BUMP,
                [tk.epochs],
                [
                    scope.encode(),
                    self.max_epoch_scopes_per_tenant,
                    L.epoch_channel(self.prefix),
                    ns.encode().hex(),
                ],
                durable=True,
            )
        )
        if n < 0:
            raise QuotaExceededError(
                f"epoch scope quota exceeded: this tenant has "
                f"{self.max_epoch_scopes_per_tenant} scopes (its limit)",
                resource="epoch_scopes",
            )
        return n

    def set_epoch_listener(self, listener: EpochListener | None) -> bool:
        self._listener = listener
        return True

    def _subscribe_loop(self) -> None:
        channel = L.epoch_channel(self.prefix)
        while not self._stop.is_set():
            pubsub = None
            try:
                nodes = self._rc.get_nodes()
                node = random.choice(nodes)
                pubsub = self._client(node).pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(channel)
                while not self._stop.is_set():
                    msg = pubsub.get_message(timeout=0.5)
                    if msg is not None and msg.get("type") == "message":
                        self._deliver(bytes(msg["data"]))
            except Exception as exc:  # reconnect on anything; the loop must not die
                log.debug("epoch subscription lost: %s", exc)
                self._stop.wait(0.5)
            finally:
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        pubsub.close()

    def _deliver(self, data: bytes) -> None:
        try:
            tenant_hex, epoch, scope = data.split(b" ", 2)
            tenant = bytes.fromhex(tenant_hex.decode()).decode()
            n = int(epoch)
        except ValueError:
            log.warning("ignored a malformed epoch notice on the cluster")
            return
        listener = self._listener
        if listener is not None:
            try:
                listener(tenant, scope.decode(), n)
            except Exception:
                log.exception("epoch listener failed")

    def retire_stale(self, *, max_items: int = 1000, budget_s: float = 0.05) -> int:
        """Remove stale entries (entries whose epoch scope moved on) and expired snapshots,
        bounded per call; every front-end may run it (removals are compare-and-delete)."""
        deadline = time.monotonic() + budget_s
        removed = 0
        try:
            tenants = self._all_tenants()
        except StoreError:
            return 0
        random.shuffle(tenants)
        for ns in tenants:
            if removed >= max_items or (removed and time.monotonic() > deadline):
                break
            # expired snapshots, interrupted drops (every front-end may finish them)
            removed += self._snaps.retire(ns, max_items - removed)
            if removed >= max_items or time.monotonic() > deadline:
                continue
            tk = self._tk(ns)
            epochs = self._exec(tk.epochs, [("HGETALL", tk.epochs)])[0]
            if not epochs:
                continue
            current = {bytes(k).decode(): int(v) for k, v in dict(epochs).items()}
            cursor: Any = self._retire_cursor.get(ns, 0)  # resume where the last call stopped
            while True:
                cursor, page = self._exec(
                    tk.entries, [("HSCAN", tk.entries, cursor, "COUNT", _SCAN_COUNT)]
                )[0]
                for k, v in dict(page).items():
                    e = L.parse_entry(bytes(v))
                    if e.epoch is not None and e.epoch < current.get(e.scope, 0):
                        raw = self._script(
                            L.ENTRY_DEL,
                            [tk.entries, tk.order, tk.counters],
                            [bytes(k), e.raw],
                        )
                        if raw:
                            self._unref(ns, e.digest, e.gen, pins=-e.pins, removed_ms=raw[1])
                            removed += 1
                if int(cursor) == 0 or removed >= max_items or time.monotonic() > deadline:
                    self._retire_cursor[ns] = int(cursor)
                    break
        return removed

    # -- health, maintenance ----------------------------------------------------------------
    def health(self) -> StoreHealth:
        if self._closed:
            return StoreHealth(ready=False, writable=False, reason="the store is closed")
        if self._down_since is not None:
            return StoreHealth(
                ready=False,
                writable=False,
                reason=f"the cluster is unreachable: {self._down_reason}",
            )
        return StoreHealth()

    def _probe(self) -> None:
        """Ask the nodes whether the cluster serves every slot; mark up or down."""
        last = "no node answered"
        for node in self._rc.get_nodes():
            try:
                info = self._client(node).execute_command("CLUSTER INFO")
            except (redis.RedisError, OSError) as exc:
                last = f"{node.name}: {exc}"
                continue
            state = info.get("cluster_state") if isinstance(info, dict) else None
            if state == "ok":
                self._up()
                return
            last = f"{node.name}: cluster_state {state}"
        self._reinitialize()
        self._down(last)

    def _maintenance_loop(self) -> None:
        next_scrub = time.monotonic() + self.scrub_interval_s * random.uniform(0.5, 1.0)
        scrubber: threading.Thread | None = None
        while not self._stop.wait(1.0):
            try:
                self._probe()
                self._flush_counters()
                if (
                    self.scrub_interval_s > 0
                    and time.monotonic() >= next_scrub
                    and (scrubber is None or not scrubber.is_alive())
                ):
                    next_scrub = time.monotonic() + self.scrub_interval_s
                    # its own thread: a scrub waits minutes before it corrects anything
                    scrubber = threading.Thread(
                        target=self._scrub_quietly, name="kvcache-cluster-scrub", daemon=True
                    )
                    scrubber.start()
            except Exception:
                log.exception("cluster maintenance failed")
        if scrubber is not None:
            scrubber.join(5.0)

    def _scrub_quietly(self) -> None:
        try:
            report = self.scrub()
            if not report.ok:
                log.info(
                    "scrub: %d blocks with leaked references, %d orphan blocks, %d keys "
                    "whose block the cluster lost",
                    len(report.refcount_mismatches),
                    len(report.orphan_blobs),
                    len(report.orphan_index_entries),
                )
        except Exception:
            log.exception("cluster scrub failed")

    # -- the scrub ---------------------------------------------------------------------------
    def _cluster_ms(self) -> int:
        meta = f"{{{self.prefix}}}:config".encode()
        sec, usec = self._exec(meta, [("TIME",)])[0]
        return int(sec) * 1000 + int(usec) // 1000

    def scrub(self, *, fix: bool = True, deep: bool = False) -> ConsistencyReport:
        """Recount every block's references from the entries; with `fix`, give back
        leaked references (blocks untouched for `SCRUB_GRACE_MS`: nothing in flight),
        delete blocks nothing names, and remove entries whose block the cluster lost.
        One front-end at a time (a lease in the cluster). `deep` re-hashes every block."""
        report = ConsistencyReport()
        lock = L.lock_key(self.prefix)
        token = secrets.token_hex(8)
        if fix and not self._exec(lock, [("SET", lock, token, "NX", "PX", 600_000)])[0]:
            return report  # another front-end is scrubbing
        try:
            self._scrub(report, fix=fix, deep=deep)
            self._fe["scrubs"] += 1
        finally:
            if fix:
                with contextlib.suppress(StoreError):
                    if self._exec(lock, [("GET", lock)])[0] == token.encode():
                        self._exec(lock, [("DEL", lock)])
        return report

    def _scrub(self, report: ConsistencyReport, *, fix: bool, deep: bool) -> None:
        t0 = self._cluster_ms()
        refs: dict[tuple[bytes, bytes], list[int]] = {}  # (block key, gen) -> [refs, pins]
        named: list[tuple[str, bytes, L.Entry]] = []  # (tenant, key, entry)
        for ns in self._all_tenants():
            tk = self._tk(ns)
            cursor: Any = 0
            while True:
                cursor, page = self._exec(
                    tk.entries, [("HSCAN", tk.entries, cursor, "COUNT", _SCAN_COUNT)]
                )[0]
                for k, v in dict(page).items():
                    try:
                        e = L.parse_entry(bytes(v))
                    except ValueError:
                        report.orphan_index_entries.append(f"{ns}/{bytes(k)!r}: not an entry")
                        continue
                    report.keys += 1
                    slot = refs.setdefault((self._bkey(ns, e.digest), e.gen), [0, 0])
                    slot[0] += 1
                    slot[1] += 1 if e.pins else 0
                    named.append((ns, bytes(k), e))
                if int(cursor) == 0:
                    break
            for h in self._snaps.entry_hashes(ns):  # snapshots and branch overlays
                cursor = 0
                while True:
                    cursor, page = self._exec(h, [("HSCAN", h, cursor, "COUNT", _SCAN_COUNT)])[0]
                    for v in dict(page).values():
                        e = L.parse_entry(bytes(v))
                        slot = refs.setdefault((self._bkey(ns, e.digest), e.gen), [0, 0])
                        slot[0] += 1
                        slot[1] += 1 if e.pins else 0
                    if int(cursor) == 0:
                        break
        seen: set[tuple[bytes, bytes]] = set()
        fixes: list[tuple[bytes, Any, Any, Any, int, int]] = []
        pattern = f"{self.prefix}:b:*".encode()
        for node in self._rc.get_primaries():
            client = self._client(node)
            for found in client.scan_iter(match=pattern, count=_SCAN_COUNT):
                bkey = bytes(found)
                try:
                    g, r, p, t = self._exec(bkey, [("HMGET", bkey, "g", "r", "p", "t")])[0]
                except StoreError:
                    continue
                if g is None:
                    if fix:  # bytes nobody initialised: marked now, deleted next time
                        self._script(L.SCRUB_BARE, [bkey], [t0, SCRUB_GRACE_MS], safe=False)
                    continue
                report.blocks += 1
                seen.add((bkey, bytes(g)))
                counted = refs.get((bkey, bytes(g)), [0, 0])
                if deep:
                    self._scrub_deep(report, bkey, bytes(g))
                if int(r) == counted[0] and int(p or 0) == counted[1]:
                    continue
                name = bkey.decode(errors="replace")
                if counted[0] == 0:
                    report.orphan_blobs.append(name)
                else:
                    report.refcount_mismatches.append(f"{name}: {int(r)} != {counted[0]}")
                if fix and int(t) < t0 - SCRUB_GRACE_MS:
                    fixes.append((bkey, g, r, t, counted[0], counted[1]))
        if fixes:
            # every release of an entry that was gone when counting began lands (or is
            # refused) within release_limit_ms: wait that long, then correct only the blocks
            # nobody touched since they were read (compare-and-set)
            wait_ms = t0 + self.scrub_settle_ms - self._cluster_ms()
            if wait_ms > 0 and self._stop.wait(wait_ms / 1000):
                return  # closing: fix nothing early
            for bkey, g, r, t, n_refs, n_pins in fixes:
                res = int(
                    self._script(
                        L.SCRUB_FIX,
                        [bkey],
                        [g, r, t, n_refs, n_pins, self.block_ttl_ms],
                        safe=False,
                    )
                )
                if res >= 0:
                    self._fe["scrub_fixed_blocks"] += 1
        for ns, key, e in named:
            bkey = self._bkey(ns, e.digest)
            if (bkey, e.gen) in seen:
                continue
            if self._exec(bkey, [("HGET", bkey, "g")])[0] == e.gen:
                continue  # created after the scan passed its slot
            report.orphan_index_entries.append(f"{ns}/{key.decode(errors='replace')}")
            if fix:
                tk = self._tk(ns)
                if self._script(L.ENTRY_DEL, [tk.entries, tk.order, tk.counters], [key, e.raw]):
                    self._fe["scrub_removed_entries"] += 1
                    self._count(ns, "evictions")

    def _scrub_deep(self, report: ConsistencyReport, bkey: bytes, gen: bytes) -> None:
        data = self._exec(bkey, [("HGET", bkey, "d")])[0]
        hexd = bkey.split(b"{", 1)[1].split(b"}", 1)[0]
        if data is None or digest_of(data) != bytes.fromhex(hexd.decode()):
            report.corrupt_blobs.append(bkey.decode(errors="replace"))

    def check(self, *, deep: bool = False) -> ConsistencyReport:
        return self.scrub(fix=False, deep=deep)

    def close(self) -> None:
        if self._closed:
            return
        self._stop.set()
        with contextlib.suppress(Exception):
            self._flush_counters()
        self._closed = True
        self._maint.join(5.0)
        self._subscriber.join(5.0)
        self._cache.close()
        with contextlib.suppress(Exception):
            self._rc.close()
        for client in self._clients.values():
            with contextlib.suppress(Exception):
                client.connection_pool.disconnect()

    # -- snapshots and branches (store/cluster_snapshots.py) ---------------------------
    def snapshot_create(
        self,
        ns: str,
        *,
        keys: Sequence[str] | None = None,
        prefix: str | None = None,
        ttl_s: float | None = None,
    ) -> SnapshotInfo:
        return self._snaps.create(ns, keys, prefix, ttl_s)

    def snapshot_info(self, ns: str, snapshot_id: str) -> SnapshotInfo | None:
        return self._snaps.info(ns, snapshot_id)

    def snapshot_list(self, ns: str) -> list[SnapshotInfo]:
        return self._snaps.listing(ns)

    def snapshot_delete(self, ns: str, snapshot_id: str) -> bool:
        return self._snaps.delete(ns, snapshot_id)

    def snapshot_get(self, ns: str, snapshot_id: str, key: str) -> Buffer | None:
        return self._snaps.get(ns, snapshot_id, key)

    def branch_create(self, ns: str, snapshot_id: str) -> BranchInfo:
        return self._snaps.branch_create(ns, snapshot_id)

    def branch_info(self, ns: str, branch_id: str) -> BranchInfo | None:
        return self._snaps.branch_info(ns, branch_id)

    def branch_list(self, ns: str) -> list[BranchInfo]:
        return self._snaps.branch_list(ns)

    def branch_delete(self, ns: str, branch_id: str) -> bool:
        return self._snaps.branch_delete(ns, branch_id)

    def branch_get(self, ns: str, branch_id: str, key: str) -> Buffer | None:
        return self._snaps.branch_get(ns, branch_id, key)

    def branch_size(self, ns: str, branch_id: str, key: str) -> int | None:
        return self._snaps.branch_size(ns, branch_id, key)

    def branch_put(self, ns: str, branch_id: str, key: str, data: BlockData) -> PutResult:
        return self._snaps.branch_put(ns, branch_id, key, data)


def run_check(config: Any, *, fix: bool, deep: bool) -> int:
    """`epistemic-kvcache cluster check|scrub`: print the report as JSON; exit 0 when the
    cluster is consistent (after repairs, with `fix`), 1 otherwise."""
    import dataclasses
    import json

    if config.cluster_url is None:
        raise ConfigurationError("invalid cluster_url: cluster check needs --cluster-url")
    options = dataclasses.replace(
        config.store, hot_capacity_bytes=0, warm_capacity_bytes=0, cluster_scrub_interval_s=0.0
    )
    store = ClusterBackend(
        config.cluster_url,
        options,
        tls_ca=config.cluster_tls_ca,
        password_file=config.cluster_password_file,
    )
    try:
        report = store.scrub(fix=fix, deep=deep)
        if fix:
            report = store.scrub(fix=False, deep=False)
        print(json.dumps({"ok": report.ok, **dataclasses.asdict(report)}, indent=2))
        return 0 if report.ok else 1
    finally:
        store.close()
