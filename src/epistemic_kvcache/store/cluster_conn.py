"""Cluster mode's connection: where the cluster is, and running commands on it.

How it works
------------
redis-py's `RedisCluster` owns the slot map, the node connection pools and hiredis
parsing; `ClusterConnection.exec` runs the commands of one slot as a pipeline on the node
serving it (so a write and its `WAIT` share one connection). MOVED refreshes redis-py's
map (at most every 0.2 s, whatever the thread count), ASK is followed with ASKING,
NOSCRIPT loads the scripts on that node, TRYAGAIN/CLUSTERDOWN/LOADING/READONLY are
retried with backoff until `retry_window_s`, and a connection error is retried only when
the command was never sent or is safe to repeat (otherwise `Unknown`: the outcome cannot
be known). A command that fails for the whole window marks the cluster "down": later
commands fail at once with `ClusterUnavailableError` until one succeeds again or `probe`
(the maintenance thread, every second) sees every slot served.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import Connection, PythonRespSerializer, SSLConnection
from redis.retry import Retry

from epistemic_kvcache.errors import (
    CapacityError,
    ClusterUnavailableError,
    ConfigurationError,
    StoreClosedError,
    StoreError,
)
from epistemic_kvcache.store.cluster_lua import Script

log = logging.getLogger(__name__)

__all__ = [
    "ClusterConnection",
    "ClusterTarget",
    "Unknown",
    "connection_class",
    "parse_cluster_url",
]

_UNSAFE_POLICIES = ("allkeys-lru", "allkeys-lfu", "allkeys-random")
_REDIS_ERRORS = (redis.RedisError, redis.RedisClusterException, OSError)
SCAN_COUNT = 500
"""How many fields one HSCAN/SCAN step asks for."""


def config_key(prefix: str) -> bytes:
    """The deployment's meta key (its dedup scope), also the slot asked for the time."""
    return f"{{{prefix}}}:config".encode()


class Unknown(StoreError):
    """The command may or may not have run (a connection broke after sending)."""


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


def connection_class(tls: bool, ca: str | None) -> type[Connection]:
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


def _credentials_refused(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, redis.AuthenticationError) or any(
        w in text for w in ("NOAUTH", "WRONGPASS", "username-password", "password")
    )


def _first_error(out: Sequence[Any]) -> Exception | None:
    """The first error among a pipeline's answers (or inside a MULTI's EXEC answer: a
    script that was not loaded)."""
    err = next((r for r in out if isinstance(r, Exception)), None)
    if err is not None:
        return err
    return next(
        (
            x
            for r in out
            if isinstance(r, list)
            for x in r
            if isinstance(x, redis.exceptions.NoScriptError)
        ),
        None,
    )


_RETRIED_ERRORS = (
    redis.exceptions.TryAgainError
    | redis.BusyLoadingError
    | redis.exceptions.MasterDownError
    | redis.ConnectionError
)


class ClusterConnection:
    """The cluster's nodes, one slot's commands at a time, with retries. Thread-safe."""

    def __init__(
        self,
        target: ClusterTarget,
        *,
        tls_ca: Path | None,
        socket_timeout_s: float,
        retry_window_s: float,
        wait_replicas: int,
        wait_timeout_s: float,
        scripts: Sequence[Script],
    ) -> None:
        """`scripts`: loaded on a node that answers NOSCRIPT. Connects (retrying for
        `retry_window_s`); a refused login or an unreachable cluster is a
        `ConfigurationError`."""
        if not target.tls and tls_ca is not None:
            raise ConfigurationError(
                "invalid cluster_tls_ca: the cluster URL is redis:// (use rediss:// for TLS)"
            )
        self.target = target
        self.retry_window_s = retry_window_s
        self.wait_replicas = wait_replicas
        self.wait_timeout_s = wait_timeout_s
        self.scripts = tuple(scripts)
        self.closed = False
        self.counts = {"retries": 0, "unavailable_errors": 0}
        self.down_since: float | None = None
        self.down_reason: str | None = None
        self._clients: dict[int, Any] = {}
        self._last_reinit = 0.0
        self._lock = threading.Lock()
        self._reinit_lock = threading.Lock()
        self.rc: Any = self._connect(  # redis-py's cluster API is untyped
            {
                "username": target.username,
                "password": target.password,
                "socket_timeout": socket_timeout_s,
                "socket_connect_timeout": min(2.0, socket_timeout_s),
                "retry": Retry(NoBackoff(), 0),
                "decode_responses": False,
                "connection_class": connection_class(
                    target.tls, str(tls_ca) if tls_ca is not None else None
                ),
            }
        )

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
            except _REDIS_ERRORS as exc:
                if _credentials_refused(exc):
                    raise ConfigurationError(
                        f"invalid cluster_url: the cluster refused the credentials ({exc})"
                    ) from exc
                if time.monotonic() > deadline:
                    raise ConfigurationError(
                        f"cannot reach the cluster at "
                        f"{', '.join(f'{h}:{p}' for h, p in self.target.nodes)}: {exc}"
                    ) from exc
                time.sleep(0.2)

    def check(self, prefix: str, dedup_scope: str) -> int:
        """Refuse an eviction policy that could drop tenant metadata, and a dedup scope
        other than the one the cluster's front-ends use; the masters' maxmemory summed."""
        total = 0
        for node in self.rc.get_primaries():
            info = self.client(node).info("memory")
            policy = str(info.get("maxmemory_policy", "noeviction"))
            if policy in _UNSAFE_POLICIES:
                raise ConfigurationError(
                    f"the cluster node {node.name} has maxmemory-policy {policy}: it may evict "
                    "the tenants' key indexes; use noeviction or a volatile-* policy "
                    "(see docs/cluster.md)"
                )
            total += int(info.get("maxmemory", 0) or 0)
        meta = config_key(prefix)
        want = f"dedup_scope={dedup_scope}".encode()
        self.exec(meta, [("SET", meta, want, "NX")])
        have = self.exec(meta, [("GET", meta)])[0]
        if have != want:
            raise ConfigurationError(
                f"invalid dedup_scope: the cluster's front-ends use "
                f"{(have or b'?').decode(errors='replace')} under prefix {prefix!r}; "
                "every front-end of one cluster must use the same"
            )
        return total

    def client(self, node: Any) -> Any:
        """The node's redis-py client, remembered so `close` closes it even when a topology
        refresh has replaced it meanwhile."""
        client = self.rc.get_redis_connection(node)
        if id(client) not in self._clients:
            with self._lock:
                self._clients[id(client)] = client
        return client

    def node_of(self, key: bytes) -> Any:
        """The node serving `key`'s slot (as redis-py's map says now)."""
        return self.rc.get_node_from_key(key)

    def primaries(self) -> list[Any]:
        return list(self.rc.get_primaries())

    def nodes(self) -> list[Any]:
        return list(self.rc.get_nodes())

    def reinitialize(self) -> None:
        """Refresh redis-py's slot map (at most every 0.2 s, whatever the thread count)."""
        with self._reinit_lock:
            if time.monotonic() - self._last_reinit < 0.2:
                return
            self._last_reinit = time.monotonic()
            try:
                self.rc.nodes_manager.initialize()
            except _REDIS_ERRORS as exc:
                log.debug("cluster topology refresh failed: %s", exc)

    def _unavailable(self, message: str) -> ClusterUnavailableError:
        self.counts["unavailable_errors"] += 1
        return ClusterUnavailableError(message)

    def exec(
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
        connection error after sending raises `Unknown`. `durable`: follow with WAIT
        when `wait_replicas` is set. `window_s`: retry this long instead of
        `retry_window_s`, even while the cluster is down. Raises `ClusterUnavailableError`
        once the retry window is spent, `CapacityError` when the cluster is out of memory.
        """
        if self.closed:
            raise StoreClosedError("the store is closed")
        window = self.retry_window_s if window_s is None else window_s
        down = self.down_since
        if down is not None and time.monotonic() - down > window and window_s is None:
            raise self._unavailable(f"the cluster is unreachable: {self.down_reason}")
        deadline = time.monotonic() + window
        ask: Any = None
        delay = 0.02
        wait = durable and self.wait_replicas > 0
        while True:
            try:
                node = ask if ask is not None else self.rc.get_node_from_key(slot_key)
                out = self._send(self.client(node), cmds, ask=ask is not None, wait=wait)
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if not safe and not _never_sent(exc):
                    raise Unknown(f"cluster connection lost mid-command: {exc}") from exc
                problem = f"{type(exc).__name__}: {exc}"
                self.reinitialize()
            except (redis.RedisClusterException, redis.RedisError) as exc:
                problem = f"{type(exc).__name__}: {exc}"
                self.reinitialize()
            else:
                if ask is not None:
                    out = out[1:]
                    ask = None
                err = _first_error(out)
                if err is None:
                    if wait and int(out[-1]) < self.wait_replicas:
                        raise self._unavailable(
                            f"the write was acknowledged by {out[-1]} of "
                            f"{self.wait_replicas} replicas within {self.wait_timeout_s} s "
                            "(it may still be applied)"
                        )
                    self.mark_up()
                    return list(out[: len(cmds)])
                problem = f"{type(err).__name__}: {err}"
                if isinstance(err, redis.exceptions.AskError):
                    ask = self.rc.get_node(host=err.host, port=int(err.port))
                    if ask is None:
                        self.reinitialize()
                    continue
                if isinstance(err, redis.exceptions.NoScriptError):
                    self.load_scripts(node)
                    continue
                if isinstance(err, redis.exceptions.OutOfMemoryError):
                    raise CapacityError(f"the cluster is out of memory: {err}")
                if isinstance(
                    err,
                    redis.exceptions.MovedError
                    | redis.exceptions.ClusterDownError
                    | redis.ReadOnlyError,
                ):
                    self.reinitialize()
                elif not isinstance(err, _RETRIED_ERRORS):
                    raise StoreError(f"cluster error: {problem}")
            self.counts["retries"] += 1
            if time.monotonic() > deadline:
                self.mark_down(problem)
                raise self._unavailable(f"the cluster did not answer in time: {problem}")
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def _send(
        self, client: Any, cmds: Sequence[tuple[Any, ...]], *, ask: bool, wait: bool
    ) -> list[Any]:
        """One round trip: the commands (after ASKING, before WAIT) -> their answers, an
        error answer as its exception."""
        if len(cmds) == 1 and not wait and not ask:
            try:  # the common case without a pipeline object (~40 us less)
                return [client.execute_command(*cmds[0])]
            except redis.ResponseError as exc:
                return [exc]
        pipe = client.pipeline(transaction=False)
        if ask:
            pipe.execute_command("ASKING")
        for c in cmds:
            pipe.execute_command(*c)
        if wait:
            pipe.execute_command("WAIT", self.wait_replicas, int(self.wait_timeout_s * 1000))
        return list(pipe.execute(raise_on_error=False))

    def script(
        self,
        script: Script,
        keys: Sequence[bytes],
        args: Sequence[Any],
        *,
        safe: bool = True,
        durable: bool = False,
    ) -> Any:
        """EVALSHA `script` in the slot of `keys[0]` (see `exec`)."""
        cmd = ("EVALSHA", script.sha, len(keys), *keys, *args)
        return self.exec(keys[0], [cmd], safe=safe, durable=durable)[0]

    def reads(self, cmds: list[tuple[Any, ...]]) -> list[Any]:
        """Read-only commands (their key second) on many slots at once: redis-py's cluster
        pipeline routes them, one round trip per node; one by one if that fails."""
        if len(cmds) == 1:
            return self.exec(cmds[0][1], cmds)
        try:
            pipe = self.rc.pipeline()
            for c in cmds:
                pipe.execute_command(*c)
            return list(pipe.execute())
        except (redis.RedisError, redis.RedisClusterException) as exc:
            log.debug("cluster pipeline failed (%s); one by one", exc)
            return [self.exec(c[1], [c])[0] for c in cmds]

    def hscan(self, key: bytes, cursor: int = 0) -> tuple[int, dict[bytes, bytes]]:
        """One page of a hash: (the next cursor, 0 at the end; field -> value)."""
        nxt, page = self.exec(key, [("HSCAN", key, cursor, "COUNT", SCAN_COUNT)])[0]
        return int(nxt), {bytes(k): bytes(v) for k, v in dict(page).items()}

    def load_scripts(self, node: Any) -> None:
        client = self.client(node)
        for s in self.scripts:
            client.script_load(s.source)

    def server_ms(self, prefix: str) -> int:
        """The clock of the master serving `prefix`'s meta slot, in ms."""
        meta = config_key(prefix)
        sec, usec = self.exec(meta, [("TIME",)])[0]
        return int(sec) * 1000 + int(usec) // 1000

    # -- up and down -----------------------------------------------------------------------
    def mark_up(self) -> None:
        if self.down_since is not None:
            log.warning("the cluster answers again")
            self.down_since = None
            self.down_reason = None

    def mark_down(self, reason: str) -> None:
        if self.down_since is None:
            log.error("lost the cluster: %s", reason)
            self.down_since = time.monotonic()
        self.down_reason = reason

    def probe(self) -> None:
        """Ask the nodes whether the cluster serves every slot; mark up or down."""
        last = "no node answered"
        for node in self.rc.get_nodes():
            try:
                info = self.client(node).execute_command("CLUSTER INFO")
            except (redis.RedisError, OSError) as exc:
                last = f"{node.name}: {exc}"
                continue
            state = info.get("cluster_state") if isinstance(info, dict) else None
            if state == "ok":
                self.mark_up()
                return
            last = f"{node.name}: cluster_state {state}"
        self.reinitialize()
        self.mark_down(last)

    def close(self) -> None:
        """Refuse further commands and close every connection."""
        self.closed = True
        with contextlib.suppress(Exception):
            self.rc.close()
        for client in self._clients.values():
            with contextlib.suppress(Exception):
                client.connection_pool.disconnect()
