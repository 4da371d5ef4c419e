"""`epistemic-kvcache validate-adapter`: the operator's check before touching vLLM.

Checks every LMCache path against a running server, driven by LMCache itself when it
is installed (`integrations/lmcache/checks.py`):

- `native`: MP mode's native plugin: LMCache's `NativeConnectorL2Adapter` over
  `EpistemicGraphL2Connector` (store, stats rose, identical re-store is a dedup hit with
  `resident_bytes` flat, lookup, load and compare, delete). Without LMCache the
  connector is driven the way that adapter drives it.
- `resp`: LMCache's C++ RESP client (MP `resp` adapter, v1 `resp://`) against the
  RESP listener: SET, EXISTS, GET, DEL.
- `path-a`: the v1 storage plugin, loaded by LMCache's `storage_plugin_launcher`.
- `redis-url`: LMCache's v1 redis-py connector (`remote_url: redis://...`).

A path that cannot be checked is reported as SKIP with the reason (LMCache not
installed, `--resp-addr off`, no RESP listener at the default address, TLS on a path
whose LMCache client has none). Every key written is deleted at the end, whatever
happened (keys live under a per-run model name, `epistemic-kvcache-validate-<hex>`),
also when the run is stopped by SIGTERM, SIGHUP or Ctrl-C: those signals end the
checks, the cleanup runs to its end, and the exit status is 128 + the signal.
Exit status 0 when every checked path passed and at least one was checked, 1 otherwise
(2 for a configuration error, e.g. a missing or rejected token). Other clients writing
to the same namespace at the same time can move the `native` path's stats counters.
"""

from __future__ import annotations

import argparse
import secrets
import signal
import socket
import sys
import threading
import urllib.parse
from dataclasses import dataclass, field
from types import FrameType
from typing import TextIO

from epistemic_kvcache.client.backend import EpistemicGraphKVBackend, KvCacheUnavailableError
from epistemic_kvcache.errors import ConfigurationError, KvCacheError
from epistemic_kvcache.integrations.lmcache.checks import (
    PathReport,
    check_native,
    check_path_a,
    check_redis_url,
    check_resp,
    lmcache_missing,
)
from epistemic_kvcache.integrations.lmcache.l2_native_connector import EpistemicGraphL2Connector

DEFAULT_BLOCK_BYTES = 4 * 1024 * 1024
"""A 16-token chunk of Llama-3-8B KV is 2 MiB; 4 MiB exercises the large-body path."""
DEFAULT_RESP_PORT = 6379
PATHS = ("native", "resp", "path-a", "redis-url")
_STAT_FIELDS = ("unique_blocks", "logical_bytes", "resident_bytes", "dedup_hits", "put_new")


@dataclass(slots=True)
class ValidationReport:
    """Every path's report; `ok` when each checked path passed and one was checked."""

    paths: list[PathReport] = field(default_factory=list)
    cleanup: tuple[int, str] = (0, "")
    stopped: int | None = None
    """The signal number that ended the run early (SIGTERM, SIGHUP), if one did."""

    @property
    def ok(self) -> bool:
        checked = [p for p in self.paths if p.skipped is None]
        return self.stopped is None and bool(checked) and all(p.ok for p in checked)


@dataclass(frozen=True, slots=True)
class RespTarget:
    """Where the RESP paths connect, and whether the user named it."""

    host: str
    port: int
    explicit: bool


def resp_target(value: str | None, base_url: str) -> RespTarget | str:
    """`--resp-addr` resolved: a target, or the reason the RESP paths are skipped."""
    host = urllib.parse.urlsplit(base_url).hostname or "127.0.0.1"
    if value is not None and value.strip().lower() == "off":
        return "--resp-addr off"
    if value is None:
        return RespTarget(host, DEFAULT_RESP_PORT, explicit=False)
    parsed = urllib.parse.urlsplit(f"//{value.strip()}")
    try:
        port = parsed.port
    except ValueError:
        port = None
    if port is None or not parsed.hostname:
        raise ConfigurationError(f"invalid --resp-addr: expected HOST:PORT or off (got {value!r})")
    return RespTarget(parsed.hostname, port, explicit=True)


def _listening(host: str, port: int, timeout_s: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


class Stopped(BaseException):
    """A stop signal arrived: unwinds the checks (which catch `Exception`) to the cleanup."""


class _StopGuard:
    """SIGTERM, SIGHUP and SIGINT end the checks, never the cleanup.

    Python's default for SIGTERM ends the process without running `finally` blocks, so a
    stopped run left its (up to `--block-bytes` large) keys behind. While `armed`, the
    first stop signal raises `Stopped` in the main thread; once disarmed (the cleanup
    runs), a signal is only recorded. Off the main thread (a library caller) handlers
    cannot be set: the caller owns the signals.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)

    def __init__(self) -> None:
        self.signum: int | None = None
        self.armed = True
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
        if self.armed:
            self.armed = False
            raise Stopped(signal.Signals(signum).name)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]


def validate_adapter(
    client: EpistemicGraphKVBackend,
    connector: EpistemicGraphL2Connector,
    *,
    paths: tuple[str, ...] = PATHS,
    resp: RespTarget | str,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    timeout_s: float = 30.0,
) -> ValidationReport:
    """Run the checks of each path in `paths`; never raises for a failed check.

    `connector` is consumed (closed). Keys written are deleted through `client`, also
    when SIGTERM, SIGHUP or SIGINT (Ctrl-C) ends the checks: the report then says
    which, in `stopped`.
    """
    model = f"epistemic-kvcache-validate-{secrets.token_hex(6)}"
    report = ValidationReport()
    no_lmcache = lmcache_missing()
    https = client.config.scheme == "https"
    guard = _StopGuard()
    try:
        try:
            for name in paths:
                path = PathReport(name)
                report.paths.append(path)
                try:
                    _run_path(
                        name, path, client, connector, resp, no_lmcache, https, model,
                        block_bytes, timeout_s,
                    )  # fmt: skip
                except KvCacheError as exc:
                    path.check("completed", False, f"{type(exc).__name__}: {exc}")
                except Exception as exc:  # an LMCache internals change: report, go on
                    path.check("completed", False, f"unexpected {type(exc).__name__}: {exc}")
        finally:
            guard.armed = False  # a signal before this line lands in `except Stopped`
    except Stopped:
        pass
    finally:
        try:
            connector.close()
            report.cleanup = _cleanup(client, model)
        finally:
            guard.uninstall()
            report.stopped = guard.signum
    return report


def _run_path(
    name: str,
    path: PathReport,
    client: EpistemicGraphKVBackend,
    connector: EpistemicGraphL2Connector,
    resp: RespTarget | str,
    no_lmcache: str | None,
    https: bool,
    model: str,
    block_bytes: int,
    timeout_s: float,
) -> None:
    if name == "native":
        check_native(
            connector, client, path, model=model, block_bytes=block_bytes, timeout_s=timeout_s
        )
        return
    if no_lmcache is not None:
        path.skipped = no_lmcache
        return
    if name == "path-a":
        check_path_a(client, path, model=model, timeout_s=timeout_s)
        return
    # The RESP paths.
    if isinstance(resp, str):
        path.skipped = resp
        return
    if https:
        path.skipped = (
            "the server uses TLS and LMCache 0.5.6's RESP clients have no TLS "
            "(use the native plugin or Path A)"
        )
        return
    if not resp.explicit and not _listening(resp.host, resp.port):
        path.skipped = (
            f"no RESP listener at {resp.host}:{resp.port} (the default); "
            "pass --resp-addr HOST:PORT, or --resp-addr off"
        )
        return
    token = client.config.token
    if name == "resp":
        check_resp(
            resp.host,
            resp.port,
            token,
            path,
            model=model,
            block_bytes=block_bytes,
            timeout_s=timeout_s,
        )
    else:
        check_redis_url(resp.host, resp.port, token, path, model=model, timeout_s=timeout_s)


def _cleanup(client: EpistemicGraphKVBackend, model: str) -> tuple[int, str]:
    """Delete every key of this run (all start with its model name)."""
    try:
        keys = client.list_keys(prefix=model)
    except (KvCacheUnavailableError, KvCacheError) as exc:
        return 0, f"could not list this run's keys: {exc}"
    deleted = sum(client.delete_many(keys))
    left = client.list_keys(prefix=model) if keys else []
    if left:
        return deleted, f"{len(left)} keys of this run could not be deleted: {left[:3]}"
    return deleted, ""


def print_report(report: ValidationReport, out: TextIO = sys.stdout) -> None:
    """Each path's checks (or why it was skipped), the stats table, the verdict."""
    for path in report.paths:
        if path.skipped is not None:
            print(f"[SKIP] {path.name}: {path.skipped}", file=out)
            continue
        verdict = "PASS" if path.ok else "FAIL"
        print(f"[{verdict}] {path.name}" + (f" ({path.note})" if path.note else ""), file=out)
        for name, passed, detail in path.checks:
            mark = "PASS" if passed else "FAIL"
            print(f"    [{mark}] {name}" + (f": {detail}" if detail else ""), file=out)
    stats = [s for p in report.paths for s in p.stats]
    if stats:
        width = max(len(label) for label, _ in stats)
        print("", file=out)
        print(f"{'':{width}}  " + "  ".join(f"{f:>16}" for f in _STAT_FIELDS), file=out)
        for label, st in stats:
            values = "  ".join(f"{getattr(st, f):>16}" for f in _STAT_FIELDS)
            print(f"{label:{width}}  {values}", file=out)
    deleted, problem = report.cleanup
    print("", file=out)
    if report.stopped is not None:
        name = signal.Signals(report.stopped).name
        print(f"stopped by {name} before every check had run", file=out)
    print(
        f"cleanup: deleted {deleted} keys written by this run"
        + (f"; {problem}" if problem else ""),
        file=out,
    )
    print("validate-adapter: " + ("PASS" if report.ok else "FAIL"), file=out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `epistemic-kvcache validate-adapter`."""
    parser.add_argument(
        "--url",
        help="server base URL (default: EPISTEMIC_GRAPH_KVCACHE_URL / _ADDR, else "
        "http://127.0.0.1:9130)",
    )
    parser.add_argument("--token", help="bearer token (default: EPISTEMIC_GRAPH_KVCACHE_TOKEN)")
    parser.add_argument("--token-file", help="read the bearer token from this file")
    parser.add_argument(
        "--resp-addr",
        help=f"the server's RESP listener, HOST:PORT, or 'off' (default: the URL's host, "
        f"port {DEFAULT_RESP_PORT}; skipped when nothing listens there)",
    )
    parser.add_argument(
        "--paths",
        default=",".join(PATHS),
        help=f"comma-separated paths to check (default: {','.join(PATHS)})",
    )
    parser.add_argument(
        "--block-bytes",
        type=int,
        default=DEFAULT_BLOCK_BYTES,
        help=f"size of the random test block (default {DEFAULT_BLOCK_BYTES})",
    )
    parser.add_argument(
        "--timeout-s", type=float, default=30.0, help="per-operation deadline (default 30)"
    )


def run(args: argparse.Namespace, *, out: TextIO = sys.stdout) -> int:
    """Run the checks from parsed arguments; 0 on pass, 1 on fail, 128 + N when signal N
    (SIGTERM, SIGHUP, SIGINT) stopped it (after deleting what it wrote).

    Raises `ConfigurationError` (exit 2) for bad flags, a missing or rejected token, or a
    server that does not answer."""
    if args.block_bytes < 1:
        raise ConfigurationError(f"invalid --block-bytes: expected >= 1 (got {args.block_bytes})")
    paths = tuple(p.strip() for p in args.paths.split(",") if p.strip())
    unknown = [p for p in paths if p not in PATHS]
    if unknown or not paths:
        raise ConfigurationError(
            f"invalid --paths: {','.join(unknown) or 'empty'} (known: {', '.join(PATHS)})"
        )
    connector = EpistemicGraphL2Connector(
        base_url=args.url,
        token=args.token,
        token_file=args.token_file,
        num_workers=2,
    )
    client = EpistemicGraphKVBackend(connector.config)
    try:
        resp = resp_target(args.resp_addr, client.config.base_url)
        print(f"validate-adapter: {client.config.base_url}", file=out)
        report = validate_adapter(
            client,
            connector,
            paths=paths,
            resp=resp,
            block_bytes=args.block_bytes,
            timeout_s=args.timeout_s,
        )
    finally:
        connector.close()
        client.close()
    print_report(report, out)
    if report.stopped is not None:
        return 128 + report.stopped
    return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point (`python -m epistemic_kvcache.validate`)."""
    parser = argparse.ArgumentParser(prog="epistemic-kvcache validate-adapter", allow_abbrev=False)
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except ConfigurationError as exc:
        print(f"validate-adapter: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
