"""The test harness's servers: one family of real servers for every test that needs one.

Three shapes, all real (no mock of our own code), all on ports they bind themselves
(port 0, see tests/conftest.py):

- `running_server(dir, backend=..., tokens=..., resp=True, **settings)` (a `with`
  block) or `start_server(...)` (closed by the caller): the whole server (`serve(config)`:
  both listeners, the store `build_store` makes, auth, timers) on a thread with its own
  uvloop (`ServerThread`), configured as `serve` would be from settings (`load_config`);
  gives a `RunningServer` (its `ServerHandle`, tokens, the config, the thread).
  Settings are the server's setting names (`hot_capacity_bytes="64MiB"`, ...).
- `ServeProcess(dir, *flags)`: `python -m epistemic_kvcache serve` as a child process
  (the package's `server/process.py` `ServerProcess` with memory backend, one token,
  both listeners) for tests that kill the server (SIGKILL) or need it in another
  process; ports are read from its `listening` lines. Any backend, token file, working
  directory, environment: `ServeProcess(dir, backend=None, token=None, ...)`.
- `running_listener(wire, store=..., limits=..., tokens=...)`: one listener alone ("http"
  or "resp") over a `ServerContext` the test holds, with the store the test passes
  (`SharedKvIndex`, durable, ...), for tests that look inside the store or the
  connections; yields a `Listener` (port, ctx with its open connections in `ctx.live`,
  store, and client connections `pool()`/`conn()`/`raw()` closed with it).
  `start_listener` is the same for a caller that closes it.

Tenants: `tokens` maps token -> tenant; `running_server` passes tokens of tenant
"default" alone as `--token`, others in a 0600 token file; `running_listener` makes the
real token table of them (or takes `auth=`).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import socket
import ssl as ssl_module
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import urllib3
import uvloop

from epistemic_kvcache.config import Address, ServerConfig, load_config
from epistemic_kvcache.server.app import ServerHandle, ServerThread
from epistemic_kvcache.server.auth import CredentialAuthenticator, TokenTable
from epistemic_kvcache.server.context import Authenticator, ServerContext, ServerLimits
from epistemic_kvcache.server.http.connection import make_http_factory
from epistemic_kvcache.server.metrics import Metrics
from epistemic_kvcache.server.process import ServerProcess, write_token_file
from epistemic_kvcache.server.resp.listener import make_resp_factory
from epistemic_kvcache.store import SharedKvBackend, SharedKvIndex

TOKEN = "client-test-token-0123456789"
"""The token `ServeProcess` serves (tenant "default")."""


# -- the whole server, in-process ---------------------------------------------------------


@dataclass
class RunningServer:
    """A server started by `start_server` / `running_server`: where it listens, who may
    call it. `handle` is the server's own `ServerHandle` (fixtures that hand tests a
    `ServerHandle` yield it); `close()` stops the server and waits for it."""

    handle: ServerHandle
    thread: ServerThread
    config: ServerConfig
    tokens: dict[str, str]
    """token -> tenant."""
    dir: Path

    @property
    def http(self) -> Address:
        return self.handle.http

    @property
    def resp(self) -> Address | None:
        return self.handle.resp

    @property
    def url(self) -> str:
        """Base URL of the HTTP listener."""
        return self.handle.http_url

    def token(self, tenant: str = "default") -> str:
        """A token of `tenant`."""
        return next(t for t, name in self.tokens.items() if name == tenant)

    def close(self) -> None:
        self.thread.stop()


def server_config(
    dir: Path,
    *,
    backend: str = "memory",
    tokens: Mapping[str, str] | None = None,
    resp: bool = True,
    **settings: Any,
) -> ServerConfig:
    """The `ServerConfig` `running_server` serves: loopback port 0 for HTTP (and RESP
    unless `resp=False`), data under `dir/data`, no periodic stats log; one "default"
    token goes on the command line, other tenants in a 0600 token file under `dir`.
    `settings` (setting names, string values as on the command line) come last."""
    values: dict[str, Any] = {
        "addr": "127.0.0.1:0",
        "resp_addr": "127.0.0.1:0" if resp else "off",
        "backend": backend,
        "persist_dir": str(dir / "data"),
        "stats_log_interval_s": "0",
    }
    tokens = dict(tokens or {TOKEN: "default"})
    if set(tokens.values()) == {"default"}:
        values["token"] = list(tokens)
    else:
        values["token_file"] = str(write_token_file(dir / "tokens", tokens))
    values.update(settings)
    return load_config(values, {})


def start_server(dir: Path, **kw: Any) -> RunningServer:
    """Start the whole server on a thread (`kw` as for `server_config`); the caller
    `close()`s it."""
    dir.mkdir(parents=True, exist_ok=True)
    kw["tokens"] = dict(kw.get("tokens") or {TOKEN: "default"})
    config = server_config(dir, **kw)
    thread = ServerThread(config)
    handle = thread.start()
    return RunningServer(handle, thread, config, kw["tokens"], dir)


@contextlib.contextmanager
def running_server(dir: Path, **kw: Any) -> Iterator[RunningServer]:
    """`start_server` for a `with` block: stopped (and waited for) at its end."""
    srv = start_server(dir, **kw)
    try:
        yield srv
    finally:
        srv.close()


# -- the whole server, as a child process -------------------------------------------------


class ServeProcess(ServerProcess):
    """`python -m epistemic_kvcache serve` (the package's `ServerProcess`) with the tests'
    defaults: persist dir `tmp`, memory backend, TOKEN, RESP on unless `resp=False`;
    `extra` flags go last; `options` as for `ServerProcess` (`env`, `cwd`, `program`:
    what runs instead of `-m epistemic_kvcache`, a script taking the same arguments...)."""

    def __init__(
        self,
        tmp: Path,
        *extra: str,
        backend: str | None = "memory",
        token: str | None = TOKEN,
        resp: bool | str = True,
        **options: Any,
    ) -> None:
        super().__init__(tmp, *extra, backend=backend, token=token, resp=resp, **options)


# -- one listener over a context the test holds -------------------------------------------


@dataclass
class Listener:
    """One listener (`running_listener`): its port, context, store, live protocols."""

    wire: str
    ctx: ServerContext
    loop: asyncio.AbstractEventLoop
    server: asyncio.AbstractServer
    thread: threading.Thread
    port: int
    pools: list[Any] = field(default_factory=list)
    """Client connections made through `pool`/`conn`/`raw`: closed with the listener."""

    @property
    def store(self) -> SharedKvBackend:
        return self.ctx.store

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def pool(self, **kw: Any) -> urllib3.HTTPConnectionPool:
        """A urllib3 pool to the listener (no retries, 4 connections unless told)."""
        kw.setdefault("maxsize", 4)
        p = urllib3.HTTPConnectionPool("127.0.0.1", self.port, retries=False, **kw)
        self.pools.append(p)
        return p

    def conn(self, timeout: float = 10.0) -> http.client.HTTPConnection:
        """A stdlib HTTP connection to the listener."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        self.pools.append(c)
        return c

    def raw(self, timeout: float = 10.0) -> socket.socket:
        """A plain TCP connection to the listener."""
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=timeout)
        self.pools.append(sock)
        return sock

    def call(self, fn: Any, *args: Any) -> Any:
        """Run `fn(*args)` on the listener's loop and return its result."""

        async def run() -> Any:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    def close(self) -> None:
        """Close the clients, the listener, its connections and tasks, the store."""
        for p in self.pools:
            p.close()

        async def stop() -> None:
            self.server.close()
            for conn in list(self.ctx.live):  # the connections still open
                transport = getattr(conn, "transport", None)
                if transport is not None:
                    transport.abort()
            await asyncio.sleep(0.05)  # teardown: a moment for closing handlers to run
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
        self.ctx.executor.shutdown(wait=True)
        self.ctx.store.close()

    stop = close


def start_listener(
    wire: str,
    *,
    store: SharedKvBackend | None = None,
    limits: ServerLimits | None = None,
    tokens: Mapping[str, str] | None = None,
    auth: Authenticator | None = None,
    ssl: ssl_module.SSLContext | None = None,
    **context: Any,
) -> Listener:
    """Start one listener (see `running_listener`); the caller closes it. `auth` replaces
    the real token table made of `tokens`; `context` goes to `ServerContext`."""
    store = store if store is not None else SharedKvIndex()
    ctx = ServerContext(
        store=store,
        auth=auth or CredentialAuthenticator(TokenTable((tokens or {}).items())),
        limits=limits or ServerLimits(),
        metrics=Metrics(store),
        **context,
    )
    loop = uvloop.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> asyncio.AbstractServer:
        factory = make_http_factory(ctx) if wire == "http" else make_resp_factory(ctx)
        return await loop.create_server(factory, "127.0.0.1", 0, ssl=ssl)

    server = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    port = int(server.sockets[0].getsockname()[1])
    return Listener(wire, ctx, loop, server, thread, port)


@contextlib.contextmanager
def running_listener(wire: str, **kw: Any) -> Iterator[Listener]:
    """One listener ("http" or "resp") on 127.0.0.1:<free port> (`kw` as for
    `start_listener`); closed at the end."""
    listener = start_listener(wire, **kw)
    try:
        yield listener
    finally:
        listener.close()


# -- one connection's context, no listener ------------------------------------------------


def run_in_context(
    scenario: Callable[[ServerContext], Awaitable[None]],
    *,
    tokens: Mapping[str, str],
    store: SharedKvBackend | None = None,
    **limits: Any,
) -> None:
    """Run `scenario(ctx)` in a fresh event loop over a `ServerContext` (the real token
    table of `tokens`, `store` or a new `SharedKvIndex`, `ServerLimits(**limits)`), as
    the connection tests do with `helpers.FakeTransport`; then abort what is still open
    and close the store."""

    async def main() -> None:
        backend = store if store is not None else SharedKvIndex()
        ctx = ServerContext(
            store=backend,
            auth=CredentialAuthenticator(TokenTable(tokens.items())),
            limits=ServerLimits(**limits),
            metrics=Metrics(backend),
        )
        try:
            await scenario(ctx)
        finally:
            for conn in list(ctx.live):
                transport = getattr(conn, "transport", None)
                if transport is not None:
                    transport.abort()
            await asyncio.sleep(0)  # teardown: connection_lost runs on the next turn
            ctx.executor.shutdown(wait=True)
            backend.close()

    asyncio.run(main())
