"""Cluster mode's epochs: bumps, and their notices to every front-end.

How it works
------------
A tenant's epochs are a hash in its slot (`{P:t:T}:e`, scope -> epoch). A bump is one
script (`EPOCH_BUMP`: the scope quota, the increment, and a PUBLISH of
`<tenant hex> <epoch> <scope>` on the channel `<prefix>:epochs`). Every front-end runs a
subscriber thread (`EpochNotices`) on a random node of the cluster (a cluster PUBLISH
reaches every node); it resubscribes after any failure, and hands each notice to the
listener the server registered, so RESP subscribers on every front-end see every bump.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
from collections.abc import Callable

from epistemic_kvcache.errors import QuotaExceededError
from epistemic_kvcache.store import cluster_lua as L
from epistemic_kvcache.store.cluster_conn import ClusterConnection

log = logging.getLogger(__name__)

__all__ = ["EpochListener", "EpochNotices", "bump", "current"]

EpochListener = Callable[[str, str, int], None]
"""Called with (tenant, scope, epoch) for every epoch bump seen on the cluster."""


def current(conn: ClusterConnection, prefix: str, ns: str, scope: str) -> int:
    """The scope's epoch (0 before its first bump)."""
    tk = L.TenantKeys.of(prefix, ns)
    raw = conn.exec(tk.epochs, [("HGET", tk.epochs, scope.encode())])[0]
    return int(raw) if raw is not None else 0


def bump(conn: ClusterConnection, prefix: str, ns: str, scope: str, max_scopes: int) -> int:
    """Bump the scope's epoch and announce it -> the new epoch."""
    tk = L.TenantKeys.of(prefix, ns)
    n = int(
        conn.script(
            L.EPOCH_BUMP,
            [tk.epochs],
            [scope.encode(), max_scopes, L.epoch_channel(prefix), ns.encode().hex()],
            durable=True,
        )
    )
    if n < 0:
        raise QuotaExceededError(
            f"epoch scope quota exceeded: this tenant has {max_scopes} scopes (its limit)",
            resource="epoch_scopes",
        )
    return n


class EpochNotices:
    """The subscriber thread of one front-end, and the listener it calls."""

    def __init__(self, conn: ClusterConnection, prefix: str, stop: threading.Event) -> None:
        self.conn = conn
        self.channel = L.epoch_channel(prefix)
        self.stop = stop
        self.listener: EpochListener | None = None
        self.thread = threading.Thread(
            target=self._loop, name="kvcache-cluster-epochs", daemon=True
        )

    def start(self) -> None:
        self.thread.start()

    def join(self, timeout_s: float) -> None:
        self.thread.join(timeout_s)

    def _loop(self) -> None:
        while not self.stop.is_set():
            pubsub = None
            try:
                node = random.choice(self.conn.nodes())
                pubsub = self.conn.client(node).pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(self.channel)
                while not self.stop.is_set():
                    msg = pubsub.get_message(timeout=0.5)
                    if msg is not None and msg.get("type") == "message":
                        self.deliver(bytes(msg["data"]))
            except Exception as exc:  # reconnect on anything; the loop must not die
                log.debug("epoch subscription lost: %s", exc)
                self.stop.wait(0.5)
            finally:
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        pubsub.close()

    def deliver(self, data: bytes) -> None:
        """Hand one notice (`<tenant hex> <epoch> <scope>`) to the listener; a malformed
        notice is logged and dropped, a failing listener logged."""
        try:
            tenant_hex, epoch, scope = data.split(b" ", 2)
            tenant = bytes.fromhex(tenant_hex.decode()).decode()
            n = int(epoch)
        except ValueError:
            log.warning("ignored a malformed epoch notice on the cluster")
            return
        listener = self.listener
        if listener is not None:
            try:
                listener(tenant, scope.decode(), n)
            except Exception:
                log.exception("epoch listener failed")
