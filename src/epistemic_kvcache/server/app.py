"""The server runner: config -> store, authenticator, listeners; graceful stop; reload.

How it works:
- `serve(config)` does every check that can fail before it writes anything: it reads
  the credentials (a first-run token is generated in memory, not written yet), loads
  TLS, checks each listener's bind rule, and binds both listeners without accepting.
  Then it creates the persist dir (mode 0700) if needed, opens the store, writes the
  first-run token (0600), and only then starts accepting. A start-up that fails
  leaves no token file and removes a persist dir it created. Each bound address is
  logged as one parseable line, `listening http=127.0.0.1:40123` /
  `listening resp=127.0.0.1:40124` (port 0 shows the real port), followed by one
  `started epistemic-kvcache <version> ...` line.
- The graceful stop (a rolling restart cuts no client). On SIGTERM/SIGINT (or
  `ServerHandle.stop()`) the server is not ready at once (`/readyz` 503 "shutting down"
  on every loop) and, for `drain_delay_s`, keeps serving and accepting, so a load
  balancer that polls readiness sends new connections elsewhere first (the signal
  again ends the delay). Then the listeners stop accepting and every connection
  closes at its next boundary between requests (server/loops.py `drain`): an idle
  one at once, an HTTP one after answering what it received, the last answer with
  `Connection: close`, a RESP one after its reply when no command is half-received
  and no MULTI is open. The write side is shut first (the peer reads its replies,
  then EOF, and reconnects before it sends again). The runner exits as soon as no
  connection has anything in flight, every answer is sent and no store call runs;
  `shutdown_timeout_s` bounds that wait, and cuts what is left. Then it drains the
  thread pool and closes the store.
- A listener whose protocol factory fails (server/loops.py `LateFactory`) keeps
  accepting and closes those connections; readiness fails and the error is logged.
- SIGHUP (or `ServerHandle.reload()`) re-reads the token file, the generated token, the
  JWT secret/public key/JWKS and the TLS certificate, key and client CA, without
  dropping a connection: new credentials and certificates apply to new authentications
  and handshakes; RESP connections authenticated with a credential that no longer
  verifies are closed. Anything that fails to load is logged and the old value kept.
- Background tasks (server/background.py): the stats log line, `retire_forever` and
  `watch_epochs_forever`, started with the listeners and cancelled at stop.
- `event_loops` N > 1 (server/loops.py): N-1 more event loops on threads of their own,
  each with its own listeners on the same addresses (SO_REUSEPORT), over the one store.
  This loop (loop 0) keeps the signals, the background tasks, start-up and the stop:
  a stop drains every loop at once within `shutdown_timeout_s`, a reload re-checks the
  connections of every loop on that loop; `1` runs no extra thread at all.
- `ServerThread` runs the same `serve` in a background thread with its own loop, for
  tests and embedding.
- What the server sets in its process (the allocator, the garbage collector, the GIL
  switch interval, the signal handlers) is server/runtime.py's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import shutil
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from epistemic_kvcache.buffers import configure_prefault
from epistemic_kvcache.config import Address, ServerConfig, effective_settings
from epistemic_kvcache.errors import ConfigurationError
from epistemic_kvcache.server.auth import AuthPlan, ReloadableAuthenticator, plan_authenticator
from epistemic_kvcache.server.background import (
    log_stats_forever,
    retire_forever,
    sample_loop_forever,
    watch_epochs_forever,
)
from epistemic_kvcache.server.balance import Balancer, LoopSeat
from epistemic_kvcache.server.context import LiveConnection, ServerContext, on_loop
from epistemic_kvcache.server.loops import (
    CountingExecutor,
    LateFactory,
    ListenerError,  # noqa: F401  (raised by serve; imported from here)
    LoopWorker,
    Serving,
    abort_all,
    check_unshared,
    drain,
    listen,
    socket_inodes,
)
from epistemic_kvcache.server.oplog import AccessLog
from epistemic_kvcache.server.runtime import (
    install_signals,
    tune_allocator,
    tune_gc,
    tune_switch_interval,
)
from epistemic_kvcache.server.tls import check_bind, ssl_context_from_config
from epistemic_kvcache.store import core as store_core
from epistemic_kvcache.store.api import SharedKvBackend

log = logging.getLogger("epistemic_kvcache.server")


@dataclass(frozen=True, slots=True)
class ServerHandle:
    """A running server: where it listens and how to stop it (thread-safe)."""

    http_addrs: tuple[Address, ...]
    resp_addrs: tuple[Address, ...]
    tls: bool
    _loop: asyncio.AbstractEventLoop = field(repr=False)
    _stop: asyncio.Event = field(repr=False)
    _reload: Callable[[], None] = field(repr=False, default=lambda: None)
    event_loops: int = 1
    """How many event loops serve (`event_loops`, resolved)."""

    @property
    def http(self) -> Address:
        """The first bound HTTP address."""
        return self.http_addrs[0]

    @property
    def resp(self) -> Address | None:
        """The first bound RESP address, or None when RESP is off."""
        return self.resp_addrs[0] if self.resp_addrs else None

    @property
    def http_url(self) -> str:
        """Base URL of the HTTP listener."""
        return f"{'https' if self.tls else 'http'}://{self.http}"

    def stop(self) -> None:
        """Ask the server to shut down gracefully. Safe from any thread; idempotent."""
        with contextlib.suppress(RuntimeError):  # loop already closed: nothing to stop
            self._loop.call_soon_threadsafe(self._stop.set)

    def reload(self) -> None:
        """What SIGHUP does: re-read credentials and certificates. Safe from any thread."""
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._reload)


# -- building blocks -------------------------------------------------------------------


def build_store(config: ServerConfig) -> SharedKvBackend:
    """The store `config` describes (durable in `persist_dir`, or in RAM)."""
    from epistemic_kvcache.store import SharedKvIndex, SharedKvStoreBackend

    if config.cluster_url is not None:
        from epistemic_kvcache.store.cluster import ClusterBackend

        return ClusterBackend(
            config.cluster_url,
            config.store,
            tls_ca=config.cluster_tls_ca,
            password_file=config.cluster_password_file,
        )
    if config.backend == "memory":
        return SharedKvIndex(config.store)
    epoch_dir = config.epoch_dir if config.epoch_dir is not None else config.persist_dir / "epochs"
    return SharedKvStoreBackend(
        config.persist_dir,
        config.store,
        epoch_dir=epoch_dir,
        shutdown_timeout_s=config.shutdown_timeout_s,
    )


def _make_persist_dir(config: ServerConfig) -> bool:
    """Create the persist dir (mode 0700) if it is missing; True when created here."""
    path = config.persist_dir
    if path.is_dir():
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            log.warning(
                "persist dir %s is accessible to group/others (mode %o): chmod 700 it",
                path,
                mode,
            )
        return False
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        raise ConfigurationError(
            f"invalid persist_dir: '{path}' exists and is not a directory"
        ) from None
    except OSError as exc:
        raise ConfigurationError(
            f"invalid persist_dir: cannot create '{path}': {exc.strerror}"
        ) from None
    path.chmod(0o700)  # mkdir's mode is filtered by the umask; make it exact
    return True


def server_version() -> str:
    """The installed package's version ("0" when running from an uninstalled tree)."""
    from importlib import metadata

    try:
        return metadata.version("epistemic-kvcache")
    except metadata.PackageNotFoundError:
        return "0"


def reload_tls(config: ServerConfig, live: ssl.SSLContext) -> None:
    """Load the configured certificate chain (and client CA) into the listeners' live
    context: new handshakes use them, established connections keep theirs. The files
    are checked with a fresh context first, so a bad file changes nothing."""
    if config.tls_cert is None or config.tls_key is None:
        return
    ssl_context_from_config(config)  # raises ConfigurationError for a bad file
    live.load_cert_chain(certfile=str(config.tls_cert), keyfile=str(config.tls_key))
    if config.tls_client_ca is not None:
        live.load_verify_locations(cafile=str(config.tls_client_ca))


def _reload(config: ServerConfig, ctx: ServerContext, tls: ssl.SSLContext | None) -> None:
    """SIGHUP: credentials and certificates re-read; failures logged, old ones kept."""
    auth = ctx.auth
    if isinstance(auth, ReloadableAuthenticator):
        try:
            summary = auth.reload()
        except (ConfigurationError, OSError) as exc:
            log.error("reload: credentials NOT reloaded, the previous ones stay in force: %s", exc)
        else:
            log.info("reload: credentials reloaded (%s)", summary)
            for peer in list(ctx.peers):  # each loop re-checks its own connections
                hooks = list(peer.reload_hooks)

                def run_hooks(hooks: list[Callable[[], None]] = hooks) -> None:
                    for hook in hooks:
                        hook()

                loop = peer.loop.event_loop
                if loop is None:
                    run_hooks()
                else:
                    on_loop(loop, run_hooks)()
    if tls is not None:
        try:
            reload_tls(config, tls)
        except (ConfigurationError, OSError, ssl.SSLError) as exc:
            log.error("reload: TLS NOT reloaded, the previous certificate stays in use: %s", exc)
        else:
            log.info("reload: TLS certificate reloaded from %s", config.tls_cert)


def check_start(config: ServerConfig) -> tuple[AuthPlan, ssl.SSLContext | None]:
    """`serve`'s start-up checks that read files but write none: the credentials (token
    file, JWT keys; a first-run token is planned, not written), the TLS files, and the
    bind rule for both listeners. Raises `ConfigurationError`. tests/test_deploy.py runs
    every deploy file's effective configuration through `load_config` and this."""
    auth_plan = plan_authenticator(config)
    tls = ssl_context_from_config(config)
    check_bind(
        config.addr,
        flag="--addr",
        tls=tls is not None,
        allow_insecure_bind=config.allow_insecure_bind,
    )
    if config.resp_addr is not None:
        check_bind(
            config.resp_addr,
            flag="--resp-addr",
            tls=tls is not None,
            allow_insecure_bind=config.allow_insecure_bind,
        )
    return auth_plan, tls


async def serve(
    config: ServerConfig, *, ready: Callable[[ServerHandle], None] | None = None
) -> None:
    """Run the server until SIGTERM/SIGINT or `ServerHandle.stop()`; then stop gracefully.

    `ready` is called (on the loop) with the `ServerHandle` once every listener is open.
    Raises `ConfigurationError`, `ListenerError` or a `StoreError` when start-up fails;
    no listener stays open and no file is left behind in that case.
    """
    from epistemic_kvcache.server.http import make_http_factory
    from epistemic_kvcache.server.metrics import Metrics
    from epistemic_kvcache.server.resp import make_resp_factory

    loop = asyncio.get_running_loop()
    for warning in config.warnings:
        log.warning("%s", warning)

    # 1. Every check that reads but writes nothing.
    auth_plan, tls = check_start(config)
    if config.allow_insecure_bind and tls is None:
        for addr in (config.addr, config.resp_addr):
            if addr is not None and not addr.is_loopback:
                log.warning("plaintext listener on %s (--allow-insecure-bind)", addr)

    n_loops = config.resolved_event_loops
    shared_port = n_loops > 1
    servers: list[Serving] = []
    workers: list[LoopWorker] = []
    live: set[LiveConnection] = set()
    background: list[asyncio.Task[None]] = []
    stop = asyncio.Event()
    installed_signals: list[int] = []
    store: SharedKvBackend | None = None
    executor: CountingExecutor | None = None
    created_dir = False
    started = False
    seat: LoopSeat | None = None
    try:
        # 2. Bind (not accepting yet): a taken port fails here, before any file is written.
        #    With several event loops, each loop binds its own listeners (SO_REUSEPORT).
        backlog = max(128, min(config.limits.max_connections, 4096))
        balancer = Balancer() if shared_port else None  # each connection to the lightest loop
        seat = balancer.seat(loop) if balancer is not None else None
        http_factory, resp_factory = LateFactory("http"), LateFactory("resp")
        http_server, http_addrs = await listen(
            loop,
            "--addr",
            config.addr,
            http_factory,
            tls,
            backlog,
            reuse_port=shared_port,
            probe=shared_port,
            seat=seat,
        )
        servers.append(http_server)
        resp_addrs: tuple[Address, ...] = ()
        if config.resp_addr is not None:
            resp_server, resp_addrs = await listen(
                loop,
                "--resp-addr",
                config.resp_addr,
                resp_factory,
                tls,
                backlog,
                reuse_port=shared_port,
                probe=shared_port,
                seat=seat,
            )
            servers.append(resp_server)
        late: list[tuple[LateFactory, LateFactory]] = []
        for index in range(1, n_loops):
            factories = (LateFactory("http"), LateFactory("resp"))
            binds = [("--addr", a, factories[0]) for a in http_addrs]
            binds += [("--resp-addr", a, factories[1]) for a in resp_addrs]
            workers.append(LoopWorker(index, binds, tls, backlog, balancer))
            late.append(factories)
        for bound in [w.start() for w in workers]:
            await asyncio.wrap_future(bound)
        if shared_port:  # nobody joined the SO_REUSEPORT groups since the probe
            ours = socket_inodes(servers).union(*(w.inodes for w in workers))
            check_unshared("--addr", http_addrs, ours)
            check_unshared("--resp-addr", resp_addrs, ours)

        # 3. Files: the persist dir, the store, the first-run token.
        if (
            config.backend == "durable" and not config.cluster_mode
        ) or auth_plan.pending_token is not None:
            created_dir = _make_persist_dir(config)
        store = await loop.run_in_executor(None, build_store, config)
        auth_plan.commit()
        executor = CountingExecutor(config.store_threads)
        configure_prefault(config.limits.receive_prefault_bytes)
        ctx = ServerContext(
            store=store,
            auth=ReloadableAuthenticator(config, auth_plan.authenticator),
            limits=config.limits,
            metrics=Metrics(store),
            executor=executor,
            metrics_tenants=frozenset(config.metrics_tenants),
            settings=tuple(effective_settings(config)),
            access_log=AccessLog(config.access_log),
            live=live,
        )
        ctx.loop.event_loop = loop
        ctx.metrics.watch_loops(ctx.loop_view)

        # fleet-wide epoch notices (cluster mode): bumps made through other servers
        def on_epoch(tenant: str, scope: str, epoch: int) -> None:
            loop.call_soon_threadsafe(ctx.notify_epoch, tenant, scope, epoch)

        store.set_epoch_listener(on_epoch)
        http_factory.set(make_http_factory(ctx), ctx.lifecycle)
        first_resp = None
        if config.resp_addr is not None:
            first_resp = make_resp_factory(ctx)
            resp_factory.set(first_resp, ctx.lifecycle)
        else:
            log.info("RESP listener off")
        loop_contexts = [ctx]
        for worker, (http_late, resp_late) in zip(workers, late, strict=True):
            sibling = ctx.sibling(worker.index)
            loop_contexts.append(sibling)
            http_late.set(make_http_factory(sibling), ctx.lifecycle)
            if config.resp_addr is not None:
                resp_late.set(make_resp_factory(sibling, first_resp), ctx.lifecycle)

        def reload() -> None:
            _reload(config, ctx, tls)

        # Before the first "listening" line: a SIGTERM from anyone who saw it is graceful.
        installed_signals = install_signals(loop, stop, reload)

        # 4. Accept.
        if threading.current_thread() is threading.main_thread():
            tune_gc()  # a server process of its own (not an embedded ServerThread)
            tune_switch_interval(n_loops)
        for serving in [
            w.serve(c, executor) for w, c in zip(workers, loop_contexts[1:], strict=True)
        ]:
            await asyncio.wrap_future(serving)
        if seat is not None:
            seat.serve(live)
        for server in servers:
            await server.start_serving()
        started = True
        # Logged once every listener accepts, so a failed start logs no "listening" line.
        mode = "off"
        if tls is not None:
            mode = "mtls" if tls.verify_mode == ssl.CERT_REQUIRED else "on"
        for name, addrs in (("http", http_addrs), ("resp", resp_addrs)):
            for a in addrs:
                log.info("listening %s=%s tls=%s", name, a, mode)
        log.info(
            "store hot core: %s twin%s",
            store_core.IMPLEMENTATION,
            f" ({store_core.WHY_PURE})" if store_core.WHY_PURE else "",
        )
        log.info(
            "started epistemic-kvcache %s http=%s resp=%s tls=%s backend=%s persist_dir=%s "
            "dedup_scope=%s event_loops=%d",
            server_version(),
            ",".join(str(a) for a in http_addrs),
            ",".join(str(a) for a in resp_addrs) or "off",
            mode,
            "cluster" if config.cluster_mode else config.backend,
            config.persist_dir.resolve()
            if config.backend == "durable" and not config.cluster_mode
            else "-",
            config.store.dedup_scope,
            n_loops,
            extra={
                "event": "started",
                "version": server_version(),
                "http": ",".join(str(a) for a in http_addrs),
                "resp": ",".join(str(a) for a in resp_addrs) or "off",
                "event_loops": n_loops,
            },
        )
        background.append(asyncio.create_task(sample_loop_forever(ctx), name="kvcache-loop-sample"))
        if config.stats_log_interval_s > 0:
            background.append(
                asyncio.create_task(
                    log_stats_forever(ctx, config.stats_log_interval_s), name="kvcache-stats-log"
                )
            )
        if config.retire_interval_s > 0:
            background.append(
                asyncio.create_task(
                    retire_forever(ctx, config.retire_interval_s), name="kvcache-retire-stale"
                )
            )
        background.append(
            asyncio.create_task(watch_epochs_forever(ctx), name="kvcache-epoch-watch")
        )
        handle = ServerHandle(
            http_addrs, resp_addrs, tls is not None, loop, stop, reload, event_loops=n_loops
        )
        if ready is not None:
            ready(handle)
        await stop.wait()
        ctx.lifecycle.draining = True  # /readyz: 503 on every loop from now on
        if config.drain_delay_s > 0:
            log.info(
                "shutting down: not ready; serving %gs more before closing the listeners "
                "(drain_delay_s; the signal again skips the rest)",
                config.drain_delay_s,
            )
            stop.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), config.drain_delay_s)
        log.info("shutting down: no new connections, finishing the requests in flight")
        for server in servers:
            server.close()
        # every loop drains its own connections at once, within the one timeout
        drained = [w.stop(config.shutdown_timeout_s) for w in workers]
        await drain(live, executor, config.shutdown_timeout_s)
        for done in drained:
            await asyncio.wrap_future(done)
    finally:
        for sig in installed_signals:
            loop.remove_signal_handler(sig)
        for server in servers:
            server.close()
        for task in background:
            task.cancel()
        for task in background:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if seat is not None:
            seat.abort()  # TLS handshakes still running: no connection after the drain
        abort_all(live)
        await asyncio.sleep(0)
        for done in [w.stop(0.0) for w in workers]:  # a failed start: stop them now
            await asyncio.wrap_future(done)
        for worker in workers:
            worker.join()
        if store is not None:
            store.set_epoch_listener(None)
            await loop.run_in_executor(None, _close_store, executor, store)
        if not started and created_dir:
            shutil.rmtree(config.persist_dir, ignore_errors=True)
    log.info("stopped")


def _close_store(
    executor: concurrent.futures.ThreadPoolExecutor | None, store: SharedKvBackend
) -> None:
    if executor is not None:
        executor.shutdown(wait=True)
    store.close()


def run(config: ServerConfig) -> int:
    """Serve on uvloop until stopped; return the process exit code (0 on a clean stop)."""
    import uvloop

    tune_allocator()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve(config))
    return 0


class ServerThread:
    """`serve(config)` on a background thread with its own uvloop; for tests and embedding.

    ```
    with ServerThread(config) as handle:
        urlopen(handle.http_url + "/healthz")
    ```
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.handle: ServerHandle | None = None
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="kvcache-server", daemon=True)

    def _main(self) -> None:
        import uvloop

        def on_ready(handle: ServerHandle) -> None:
            self.handle = handle
            self._ready.set()

        try:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                runner.run(serve(self.config, ready=on_ready))
        except BaseException as exc:
            self.error = exc
        finally:
            self._ready.set()

    def start(self, timeout_s: float = 30.0) -> ServerHandle:
        """Start and wait until the listeners are open; re-raise a start-up failure."""
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"server did not start within {timeout_s}s")
        if self.handle is None:
            self._thread.join(timeout_s)
            raise self.error or RuntimeError("server stopped before it was ready")
        return self.handle

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop gracefully and wait for the thread; re-raise an error raised while serving."""
        if self.handle is not None:
            self.handle.stop()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"server did not stop within {timeout_s}s")
        if self.error is not None:
            raise self.error

    def __enter__(self) -> ServerHandle:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
