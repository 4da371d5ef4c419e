"""The `epistemic-kvcache` command: a registry of subcommands, `serve` first.

Add a subcommand by adding an entry to `SUBCOMMANDS` (or calling `register`): a help
line, a function adding its arguments to an `argparse` parser, and a function running
it that returns the exit code. Exit codes: 0 success, 1 runtime failure, 2 usage or
configuration error. Every error is one line on stderr in argparse's format,
`epistemic-kvcache <command>: error: <message>` (a usage error also prints the usage
of the command it is about).

The command itself needs only the client's dependencies (`--version`, `validate-adapter`
with the lmcache extra); `serve` needs the `server` extra and says so when it is missing.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from epistemic_kvcache._version import __version__
from epistemic_kvcache.errors import ConfigurationError, KvCacheError
from epistemic_kvcache.install import MissingExtraError as MissingExtraError  # noqa: PLC0414
from epistemic_kvcache.install import require_extra

if TYPE_CHECKING:
    from epistemic_kvcache.config import ServerConfig

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@dataclass(frozen=True, slots=True)
class Subcommand:
    """One `epistemic-kvcache <name>` command."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Log to stderr, one line per record (the `listening ...` lines are parsed by tools;
    control characters that clients sent are escaped, see `server/oplog.py`);
    `fmt="json"`: one JSON object per line."""
    from epistemic_kvcache.server.oplog import JsonFormatter, TextFormatter

    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr, force=True)
    formatter = JsonFormatter() if fmt == "json" else TextFormatter(LOG_FORMAT)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(formatter)


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    from epistemic_kvcache.config import add_arguments

    add_arguments(parser)


SERVER_MODULES = ("lmdb", "blosc2", "uvloop", "httptools", "jwt", "prometheus_client", "numpy")


def serve_config(args: argparse.Namespace, env: Mapping[str, str]) -> ServerConfig:
    """`serve`'s configuration from its parsed arguments and `env` (flag > environment >
    TOML), with the bind rule checked; raises `ConfigurationError`."""
    from epistemic_kvcache.config import check_listeners, load_config

    values = {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "command"}
    config = load_config(values, env)
    check_listeners(config)  # before anything (data dir, generated token) is created
    return config


def _serve(args: argparse.Namespace) -> int:
    from epistemic_kvcache.config import check_persist_dir

    config = serve_config(args, os.environ)
    check_persist_dir(config)
    require_extra("server", *SERVER_MODULES)
    from epistemic_kvcache.server.app import run

    setup_logging(config.log_level, config.log_format)
    return run(config)


def _cluster_arguments(parser: argparse.ArgumentParser) -> None:
    from epistemic_kvcache.config import add_arguments

    parser.add_argument(
        "cluster_action",
        choices=["check", "scrub"],
        help="check: report leaked references, orphan blocks and dangling keys; scrub: "
        "also repair them (what every front-end does on its own every "
        "cluster_scrub_interval_s)",
    )
    parser.add_argument("--deep", action="store_true", help="also re-hash every block")
    # only what the check reads; the other settings may still come from env or --config
    add_arguments(parser, only=_cluster_setting)


def _cluster_setting(name: str) -> bool:
    return name.startswith("cluster_") or name in ("dedup_scope", "max_block_bytes", "log_level")


def _cluster(args: argparse.Namespace) -> int:
    from epistemic_kvcache.config import load_config

    skip = {"command", "cluster_action", "deep"}
    values = {k: v for k, v in vars(args).items() if not k.startswith("_") and k not in skip}
    config = load_config(values, os.environ)
    require_extra("server", *SERVER_MODULES)
    from epistemic_kvcache.store.cluster import run_check

    setup_logging("WARNING")
    return run_check(config, fix=args.cluster_action == "scrub", deep=args.deep)


def _config_arguments(parser: argparse.ArgumentParser) -> None:
    from epistemic_kvcache.config import add_arguments

    actions = parser.add_subparsers(dest="config_action", metavar="ACTION", required=True)
    show = actions.add_parser(
        "show",
        help="print every setting's effective value and where it came from",
        description="Resolve the configuration exactly as `serve` would (flags > "
        "environment > TOML file > default) and print one line per setting: name, value, "
        "source (default, flag --x, env NAME, file PATH). Secrets print as (hidden).",
        allow_abbrev=False,
    )
    show.add_argument(
        "--format", choices=["text", "json"], default="text", help="text (default) or json"
    )
    show.add_argument(
        "--no-file-checks",
        action="store_true",
        help="check nothing against this machine: not that the files the settings name "
        "exist (token file, TLS pair, ...), nor its memory and disk; to preview a "
        "configuration meant for another machine (a Kubernetes manifest's) anywhere",
    )
    add_arguments(show)


def _config(args: argparse.Namespace) -> int:
    import json

    from epistemic_kvcache.config import effective_settings, load_config

    skip = {"command", "config_action", "format", "no_file_checks"}
    values = {k: v for k, v in vars(args).items() if not k.startswith("_") and k not in skip}
    config = load_config(values, os.environ, file_checks=not args.no_file_checks)
    rows = effective_settings(config)
    if args.format == "json":
        doc = {name: {"value": value, "source": source} for name, value, source in rows}
        print(json.dumps(doc, indent=2))
    else:
        width = max(len(name) for name, _, _ in rows)
        vwidth = min(40, max(len(value) for _, value, _ in rows))
        for name, value, source in rows:
            print(f"{name:<{width}}  {value or '-':<{vwidth}}  {source}")
    for warning in config.warnings:
        print(f"{PROG} config: warning: {warning}", file=sys.stderr)
    return EXIT_OK


def _validate_arguments(parser: argparse.ArgumentParser) -> None:
    from epistemic_kvcache.validate import add_arguments

    add_arguments(parser)


def _validate(args: argparse.Namespace) -> int:
    from epistemic_kvcache.validate import run

    return run(args)


def _healthcheck_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        default=None,
        help="base URL to probe (default: this machine's server from its settings: "
        "--addr / EPISTEMIC_GRAPH_KVCACHE_ADDR, https when TLS is configured)",
    )
    parser.add_argument(
        "--ready", action="store_true", help="probe /readyz (serving and writable), not /healthz"
    )
    parser.add_argument("--timeout-s", type=float, default=3.0, help="default 3")


def _healthcheck(args: argparse.Namespace) -> int:
    """Exit 0 when the server answers 200 (container HEALTHCHECK, systemd, scripts)."""
    import ssl
    import urllib.error
    import urllib.request

    url = args.url
    context = None
    if url is None:
        from epistemic_kvcache.config import load_config

        config = load_config({}, os.environ)
        host = config.addr.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1" if host != "::" else "::1"
        scheme = "https" if config.tls_enabled else "http"
        netloc = f"[{host}]:{config.addr.port}" if ":" in host else f"{host}:{config.addr.port}"
        url = f"{scheme}://{netloc}"
        if config.tls_enabled:  # our own listener on loopback: the name will not match
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
    path = "/readyz" if args.ready else "/healthz"
    try:
        with urllib.request.urlopen(  # noqa: S310 - http(s) URL built above or given
            url.rstrip("/") + path, timeout=args.timeout_s, context=context
        ) as resp:
            ok = resp.status == 200
    except (urllib.error.URLError, OSError) as exc:
        print(f"{PROG} healthcheck: {url}{path}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK if ok else EXIT_FAILURE


def _does_it_pay_arguments(parser: argparse.ArgumentParser) -> None:
    from epistemic_kvcache.integrations.lmcache.does_it_pay import add_arguments

    add_arguments(parser)


def _does_it_pay(args: argparse.Namespace) -> int:
    require_extra("lmcache", "torch")  # lmcache itself only for the paths through it
    from epistemic_kvcache.integrations.lmcache.does_it_pay import run

    return run(args)


def _mcp_arguments(parser: argparse.ArgumentParser) -> None:
    from epistemic_kvcache.mcp_tools import add_arguments

    add_arguments(parser)


def _mcp(args: argparse.Namespace) -> int:
    from epistemic_kvcache.mcp_tools import run

    setup_logging("INFO")
    return run(args)


def _store_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="store_action", metavar="ACTION", required=True)
    check = actions.add_parser(
        "check",
        allow_abbrev=False,
        help="replay the whole log, verify every block, compare the index with the log",
        description="Check a durable store offline (the server must be stopped). Exit 0 "
        "when nothing is damaged, lost or inconsistent, 1 otherwise.",
    )
    rebuild = actions.add_parser(
        "rebuild-index",
        allow_abbrev=False,
        help="set the index aside and build a new one from the log",
        description="Rebuild the durable store's index from its log (the server must be "
        "stopped). The old index is moved aside, never deleted.",
    )
    for sub in (check, rebuild):
        sub.add_argument(
            "--persist-dir",
            default=None,
            help="the store (default: the server's persist_dir, found as serve finds it: "
            "EPISTEMIC_GRAPH_KVCACHE_PERSIST_DIR, else the file named by "
            "EPISTEMIC_GRAPH_KVCACHE_CONFIG, else ./kvcache-data; the legacy "
            "GRAPH_SERVICE_PERSIST_DIR is still read)",
        )
    check.add_argument(
        "--quick", action="store_true", help="do not re-hash blocks (headers and index only)"
    )


def _store(args: argparse.Namespace) -> int:
    require_extra("server", "lmdb", "blosc2")
    from pathlib import Path

    from epistemic_kvcache.store import tools

    if args.persist_dir is not None:
        path = Path(args.persist_dir)
    else:
        from epistemic_kvcache.config import load_config

        path = load_config({}, os.environ).persist_dir
    if not (path / "segments").is_dir() and not (path / "index").is_dir():
        raise ConfigurationError(f"invalid persist_dir: no store in {str(path)!r}")

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.store_action == "check":
        summary = tools.check(path, deep=not args.quick, progress=progress)
        for line in summary.lines():
            print(line)
        return EXIT_OK if summary.ok else EXIT_FAILURE
    setup_logging("WARNING")
    rebuilt = tools.rebuild_index(path, progress=progress)
    for line in rebuilt.lines():
        print(line)
    return EXIT_OK


SUBCOMMANDS: dict[str, Subcommand] = {
    "serve": Subcommand(
        help="run the cache server (HTTP /kv and Redis RESP listeners)",
        add_arguments=_serve_arguments,
        run=_serve,
    ),
    "config": Subcommand(
        help="config show: the effective configuration and the source of each value",
        add_arguments=_config_arguments,
        run=_config,
    ),
    "validate-adapter": Subcommand(
        help="check a running server through every LMCache path, driven by LMCache "
        "(native L2 adapter, resp, path-a plugin, redis://); writes and deletes test keys",
        add_arguments=_validate_arguments,
        run=_validate,
    ),
    "healthcheck": Subcommand(
        help="exit 0 if the local server answers /healthz (or /readyz with --ready)",
        add_arguments=_healthcheck_arguments,
        run=_healthcheck,
    ),
    "store": Subcommand(
        help="offline tools on a durable store: check, rebuild-index (server stopped)",
        add_arguments=_store_arguments,
        run=_store,
    ),
    "cluster": Subcommand(
        help="cluster mode: check (or scrub) the block references in the cluster",
        add_arguments=_cluster_arguments,
        run=_cluster,
    ),
    "does-it-pay": Subcommand(
        help="measure here, for a model's shape, the prefill time and the time to fetch its "
        "KV from a server through each LMCache path: the prompt length from which a hit "
        "pays (needs the lmcache extra)",
        add_arguments=_does_it_pay_arguments,
        run=_does_it_pay,
    ),
    "mcp": Subcommand(
        help="serve the MCP tools graph_kvcache, graph_fork, graph_kv_checkpoint (needs [mcp])",
        add_arguments=_mcp_arguments,
        run=_mcp,
    ),
}


def register(name: str, subcommand: Subcommand) -> None:
    """Add a subcommand (e.g. `validate-adapter`, `bench`)."""
    if name in SUBCOMMANDS:
        raise ValueError(f"subcommand {name!r} already registered")
    SUBCOMMANDS[name] = subcommand


PROG = "epistemic-kvcache"


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser per registered subcommand."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Shared, durable, deduplicating L2 KV-cache server for vLLM / LMCache.",
        allow_abbrev=False,  # `--hot-capacity 4GiB` must not pass for --hot-capacity-bytes
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(
            name, help=command.help, description=command.help, allow_abbrev=False
        )
        command.add_arguments(sub_parser)
        sub_parser.set_defaults(_run=command.run, _parser=sub_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `epistemic-kvcache` command; returns the exit code."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        # like `git` alone: the help, and a non-zero exit (nothing was done)
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        parser.print_help()
        return EXIT_USAGE
    sub_parser: argparse.ArgumentParser = args._parser
    if extra:
        # Unknown flags after a subcommand: that subcommand's usage, not the top level's.
        sub_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    run: Callable[[argparse.Namespace], int] = args._run
    try:
        return run(args)
    except ConfigurationError as exc:
        _report(sub_parser.prog, str(exc))
        return EXIT_USAGE
    except (KvCacheError, OSError) as exc:
        _report(sub_parser.prog, str(exc))
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return EXIT_FAILURE


def _report(prog: str, message: str) -> None:
    """One error format for every failure: argparse's `prog: error: message`."""
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
