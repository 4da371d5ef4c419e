"""A real Redis Cluster on loopback for tests and benchmarks (Debian's redis-server).

    with LocalCluster(tmp_path, masters=3, replicas=1) as c:
        c.url            # redis://default:<password>@127.0.0.1:p1,127.0.0.1:p2,...
        c.kill(c.master_of_slot(0))   # SIGKILL, then wait_failover()
        c.add_master(); c.rebalance()

Every node gets two ports (client and cluster bus: `cluster-port`, so nothing
depends on port+10000 being free), held by `helpers.reserve_port()` for the life of the
cluster (a killed node restarts on its own ports and nothing else can take them
meanwhile: see tests/conftest.py), and its own directory; all processes are started in
their own process group and stopped by PID (SIGTERM, then SIGKILL) on exit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import redis

from helpers import PortReservation, reserve_port


@dataclass
class Node:
    port: int
    bus_port: int
    dir: Path
    proc: subprocess.Popen[bytes] | None = None
    node_id: str = ""
    extra: list[str] = field(default_factory=list)
    held: list[PortReservation] = field(default_factory=list)
    """The reservations of `port` and `bus_port`, closed by `LocalCluster.stop()`."""

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class LocalCluster:
    """`masters` masters with `replicas` replicas each, started by `start()`."""

    def __init__(
        self,
        base: Path,
        *,
        masters: int = 3,
        replicas: int = 1,
        password: str = "cluster-secret",
        node_timeout_ms: int = 1500,
        appendfsync: str = "everysec",
        maxmemory: str | None = None,
        maxmemory_policy: str = "volatile-lru",
        tls: tuple[Path, Path, Path] | None = None,
    ) -> None:
        """`tls`: (CA, certificate chain, key) PEM files: the nodes then speak TLS only,
        between themselves too (`tls-cluster`, `tls-replication`)."""
        self.base = base
        self.masters = masters
        self.replicas = replicas
        self.password = password
        self.node_timeout_ms = node_timeout_ms
        self.appendfsync = appendfsync
        self.maxmemory = maxmemory
        self.maxmemory_policy = maxmemory_policy
        self.tls = tls
        self.nodes: list[Node] = []

    # -- lifecycle ----------------------------------------------------------------------
    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        et: type[BaseException] | None,
        e: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def url(self) -> str:
        hosts = ",".join(n.addr for n in self.nodes if n.alive)
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://default:{self.password}@{hosts}"

    def _new_node(self) -> Node:
        held = [reserve_port(), reserve_port()]
        port, bus = held[0].port, held[1].port
        d = self.base / f"node-{port}"
        d.mkdir(parents=True, exist_ok=True)
        node = Node(port, bus, d, held=held)
        self.nodes.append(node)
        return node

    def _spawn(self, node: Node) -> None:
        if self.tls:
            ca, cert, key = self.tls
            ports = [
                "--port", "0", "--tls-port", str(node.port),
                "--tls-cert-file", str(cert), "--tls-key-file", str(key),
                "--tls-ca-cert-file", str(ca), "--tls-cluster", "yes",
                "--tls-replication", "yes", "--tls-auth-clients", "no",
            ]  # fmt: skip
        else:
            ports = ["--port", str(node.port)]
        args = [
            "redis-server",
            *ports,
            "--cluster-port", str(node.bus_port),
            "--bind", "127.0.0.1",
            "--dir", str(node.dir),
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(self.node_timeout_ms),
            "--cluster-replica-validity-factor", "0",  # any replica may take over
            "--appendonly", "yes",
            "--appendfsync", self.appendfsync,
            "--save", "",
            "--protected-mode", "no",
            "--requirepass", self.password,
            "--masterauth", self.password,
            "--maxmemory-policy", self.maxmemory_policy,
            "--logfile", str(node.dir / "redis.log"),
        ]  # fmt: skip
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory]
        args += node.extra
        node.proc = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._wait_ping(node)

    def client(self, node: Node, **kw: object) -> redis.Redis:
        if self.tls:
            kw.update(ssl=True, ssl_ca_certs=str(self.tls[0]))
        return redis.Redis(
            host="127.0.0.1",
            port=node.port,
            password=self.password,
            socket_timeout=10,
            **kw,  # type: ignore[arg-type]
        )

    def _wait_ping(self, node: Node, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if node.proc is not None and node.proc.poll() is not None:
                log = (node.dir / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server on {node.port} exited: {log}")
            try:
                with self.client(node, socket_connect_timeout=0.5) as r:
                    r.ping()
                    return
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _cli(self, *args: str, timeout: float = 120) -> str:
        tls = ["--tls", "--cacert", str(self.tls[0])] if self.tls else []
        cmd = ["redis-cli", *tls, "--no-auth-warning", "-a", self.password, *args]
        out = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            stdin=subprocess.DEVNULL,
        )
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed: {out.stdout}\n{out.stderr}")
        return out.stdout

    def start(self) -> None:
        n = self.masters * (1 + self.replicas)
        for _ in range(n):
            self._spawn(self._new_node())
        self._cli(
            "--cluster",
            "create",
            *(node.addr for node in self.nodes),
            "--cluster-replicas",
            str(self.replicas),
            "--cluster-yes",
        )
        for node in self.nodes:
            with self.client(node) as r:
                node.node_id = r.execute_command("CLUSTER MYID").decode()
        self.wait_healthy()

    def stop(self) -> None:
        for node in self.nodes:
            p = node.proc
            if p is None or p.poll() is not None:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGTERM)
        for node in self.nodes:
            p = node.proc
            if p is None:
                continue
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
                p.wait(10)
        for node in self.nodes:
            for h in node.held:
                h.close()

    # -- state --------------------------------------------------------------------------
    def wait_healthy(self, timeout: float = 60) -> None:
        """Every live node says cluster_state:ok, every slot is served by a live master,
        and every live replica is in sync with its master."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            ok = True
            for node in self.nodes:
                if not node.alive:
                    continue
                try:
                    with self.client(node) as r:
                        info = r.execute_command("CLUSTER INFO")
                        role = r.info("replication")
                except redis.RedisError as exc:
                    ok, last = False, str(exc)
                    break
                if info.get("cluster_state") != "ok" or info.get("cluster_slots_ok") != "16384":
                    ok, last = False, f"{node.port}: {info}"
                    break
                if role.get("role") == "slave" and role.get("master_link_status") != "up":
                    ok, last = False, f"{node.port}: replica link {role.get('master_link_status')}"
                    break
            if ok:
                return
            time.sleep(0.1)
        raise RuntimeError(f"cluster not healthy after {timeout} s: {last}")

    def node_by_port(self, port: int) -> Node:
        return next(n for n in self.nodes if n.port == port)

    def master_of_slot(self, slot: int) -> Node:
        for node in self.nodes:
            if not node.alive:
                continue
            with self.client(node) as r:
                for lo, hi, *nodes in r.execute_command("CLUSTER SLOTS"):
                    if lo <= slot <= hi:
                        return self.node_by_port(int(nodes[0][1]))
        raise RuntimeError(f"slot {slot} not served")

    def masters_now(self) -> list[Node]:
        out = []
        for node in self.nodes:
            if not node.alive:
                continue
            with contextlib.suppress(redis.RedisError), self.client(node) as r:
                if r.info("replication").get("role") == "master":
                    out.append(node)
        return out

    # -- faults and topology changes ------------------------------------------------------
    def kill(self, node: Node) -> None:
        """SIGKILL the node's process (no shutdown, no final AOF write)."""
        assert node.proc is not None
        os.kill(node.proc.pid, signal.SIGKILL)
        node.proc.wait(10)

    def restart(self, node: Node) -> None:
        """Start a killed node again with its data directory (it rejoins as a replica
        when its master role was taken over)."""
        self._spawn(node)

    def wait_failover(self, dead: Node, timeout: float = 60) -> None:
        """Wait until the dead master's slots are served by a live master and the live
        nodes agree the cluster is ok."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                served = {
                    int(nodes[0][1])
                    for node in self.nodes
                    if node.alive
                    for _lo, _hi, *nodes in self._slots(node)
                }
            except redis.RedisError:
                served = {dead.port}
            if dead.port not in served:
                self.wait_healthy(max(1.0, deadline - time.monotonic()))
                return
            time.sleep(0.1)
        raise RuntimeError(f"no failover of {dead.port} within {timeout} s")

    def _slots(self, node: Node) -> list[list[object]]:
        with self.client(node) as r:
            return r.execute_command("CLUSTER SLOTS")  # type: ignore[no-any-return]

    def add_master(self) -> Node:
        """Start a new empty master and join it to the cluster (no slots yet)."""
        node = self._new_node()
        self._spawn(node)
        seed = next(n for n in self.nodes if n.alive and n is not node)
        self._cli("--cluster", "add-node", node.addr, seed.addr)
        with self.client(node) as r:
            node.node_id = r.execute_command("CLUSTER MYID").decode()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # every node knows it
            known = 0
            for other in self.nodes:
                if not other.alive:
                    continue
                with contextlib.suppress(redis.RedisError), self.client(other) as r:
                    nodes = r.execute_command("CLUSTER NODES")
                    known += any(v.get("node_id") == node.node_id for v in nodes.values())
            if known == sum(1 for n in self.nodes if n.alive):
                with self.client(node) as r:
                    if r.execute_command("CLUSTER INFO").get("cluster_state") == "ok":
                        break
            time.sleep(0.1)
        return node

    def wait_agreement(self, seed: Node, timeout: float = 60) -> None:
        """Until `redis-cli --cluster check` passes (every node has the same view)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._cli("--cluster", "check", seed.addr)
                return
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def rebalance(self, *, pipeline: int = 10, timeout: float = 300) -> str:
        """Move slots so every master (the new empty ones too) serves an equal share,
        the way an operator does it (`redis-cli --cluster rebalance`)."""
        seed = next(n for n in self.nodes if n.alive)
        self.wait_agreement(seed)
        return self._cli(
            "--cluster",
            "rebalance",
            seed.addr,
            "--cluster-use-empty-masters",
            "--cluster-pipeline",
            str(pipeline),
            "--cluster-yes",
            timeout=timeout,
        )


@dataclass
class Parts:
    """Cluster mode's collaborators wired as `ClusterBackend` wires them, without the
    backend (for the unit tests of each module: tests/test_cluster_<module>.py)."""

    conn: Any
    counters: Any
    ram: Any
    blocks: Any
    entries: Any
    prefix: str

    def close(self) -> None:
        self.ram.cache.close()
        self.conn.close()


def cluster_parts(
    url: str,
    prefix: str,
    *,
    hot_capacity_bytes: int = 8 << 20,
    first_write_wins: bool | frozenset[str] = False,
    **conn_options: Any,
) -> Parts:
    """`Parts` over the cluster at `url`, keys under `prefix`; `conn_options` override
    `ClusterConnection`'s (`retry_window_s`, `wait_replicas`, ...)."""
    from epistemic_kvcache.options import StoreOptions
    from epistemic_kvcache.store import cluster_lua as L
    from epistemic_kvcache.store.cluster_blocks import ClusterBlocks
    from epistemic_kvcache.store.cluster_conn import ClusterConnection, parse_cluster_url
    from epistemic_kvcache.store.cluster_counters import SharedCounters
    from epistemic_kvcache.store.cluster_entries import ClusterEntries
    from epistemic_kvcache.store.cluster_ram import BlockCache, RamTier
    from epistemic_kvcache.store.cluster_snapshots import SCRIPTS

    options: dict[str, Any] = {
        "tls_ca": None,
        "socket_timeout_s": 5.0,
        "retry_window_s": 5.0,
        "wait_replicas": 0,
        "wait_timeout_s": 1.0,
        "scripts": (*L.SCRIPTS, *SCRIPTS),
    }
    options.update(conn_options)
    conn = ClusterConnection(parse_cluster_url(url), **options)
    counters = SharedCounters(conn, prefix)
    cache = BlockCache(
        StoreOptions(
            hot_capacity_bytes=hot_capacity_bytes,
            warm_capacity_bytes=0,
            max_block_bytes=hot_capacity_bytes,
        )
    )
    ram = RamTier(cache)
    blocks = ClusterBlocks(
        conn, cache, counters, prefix=prefix, dedup_scope="namespace", block_ttl_ms=0
    )
    entries = ClusterEntries(
        conn, blocks, ram, counters, prefix=prefix, first_write_wins=first_write_wins
    )
    return Parts(conn, counters, ram, blocks, entries, prefix)


def redis_marks() -> list[Any]:
    """`pytestmark` of a module that starts redis-server."""
    import shutil

    import pytest

    return [
        pytest.mark.redis,
        pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
    ]


def module_cluster(**options: Any) -> Any:
    """A module-scoped fixture `cluster`: a `LocalCluster` of 3 masters and no replicas
    (`options` override). Assign it to a module global named `cluster`."""
    import pytest

    @pytest.fixture(scope="module")
    def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
        kw: dict[str, Any] = {"masters": 3, "replicas": 0, **options}
        with LocalCluster(tmp_path_factory.mktemp("cluster"), **kw) as c:
            yield c

    return cluster


def parts_fixture(tag: str) -> Any:
    """A fixture `parts`: `cluster_parts` over the module's `cluster` under a fresh prefix
    starting with `tag` (every test starts from an empty deployment)."""
    import secrets

    import pytest

    @pytest.fixture
    def parts(cluster: LocalCluster) -> Iterator[Parts]:
        p = cluster_parts(cluster.url, f"{tag}{secrets.token_hex(4)}")
        yield p
        p.close()

    return parts
