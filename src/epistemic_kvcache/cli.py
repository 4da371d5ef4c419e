"""The `epistemic-kvcache` command: a registry of subcommands, `serve` first.

Add a subcommand by adding an entry to `SUBCOMMANDS` (or calling `register`): a help
line, a function adding its arguments to an `argparse` parser, and a function running
it that returns the exit code. Exit codes: 0 success, 1 runtime failure, 2 usage or
configuration error.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from epistemic_kvcache.errors import ConfigurationError, KvCacheError

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
    """Log to stderr, one line per record (the `listening ...` lines are parsed by tools);
    `fmt="json"`: one JSON object per line."""
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr, force=True)
    if fmt == "json":
        from epistemic_kvcache.server.oplog import JsonFormatter

        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonFormatter())


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    from epistemic_kvcache.config import add_arguments

    add_arguments(parser)


def _serve(args: argparse.Namespace) -> int:
    from epistemic_kvcache.config import load_config
    from epistemic_kvcache.server.app import run

    values = {k: v for k, v in vars(args).items() if k not in ("command", "_run")}
    config = load_config(values, os.environ)
    setup_logging(config.log_level, config.log_format)
    return run(config)


def _validate_arguments(parser: argparse.ArgumentParser) -> None:
    from epistemic_kvcache.validate import add_arguments

    add_arguments(parser)


def _validate(args: argparse.Namespace) -> int:
    from epistemic_kvcache.validate import run

    return run(args)


SUBCOMMANDS: dict[str, Subcommand] = {
    "serve": Subcommand(
        help="run the cache server (HTTP /kv and Redis RESP listeners)",
        add_arguments=_serve_arguments,
        run=_serve,
    ),
    "validate-adapter": Subcommand(
        help="check a running server through the LMCache L2 connector (put, read back, dedup)",
        add_arguments=_validate_arguments,
        run=_validate,
    ),
}


def register(name: str, subcommand: Subcommand) -> None:
    """Add a subcommand (e.g. `validate-adapter`, `bench`)."""
    if name in SUBCOMMANDS:
        raise ValueError(f"subcommand {name!r} already registered")
    SUBCOMMANDS[name] = subcommand


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser per registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="epistemic-kvcache",
        description="Shared, durable, deduplicating L2 KV-cache server for vLLM / LMCache.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(sub_parser)
        sub_parser.set_defaults(_run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `epistemic-kvcache` command; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args._run
    try:
        return run(args)
    except ConfigurationError as exc:
        _report(f"configuration error: {exc}")
        return EXIT_USAGE
    except KvCacheError as exc:
        _report(f"error: {exc}")
        return EXIT_FAILURE
    except OSError as exc:
        _report(f"error: {exc}")
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return EXIT_FAILURE


def _report(message: str) -> None:
    logger = logging.getLogger("epistemic_kvcache")
    if logging.getLogger().handlers:
        logger.error("%s", message)
    else:
        print(f"epistemic-kvcache: {message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
