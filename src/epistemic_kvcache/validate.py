"""`epistemic-kvcache validate-adapter`: the operator's check before touching vLLM.

Drives `EpistemicGraphL2Connector` exactly as LMCache's `NativeConnectorL2Adapter` does
(submit, poll the eventfd, drain completions) against a running server:

1. read `/kv/stats`;
2. put one random block, then check `unique_blocks` and `logical_bytes` rose;
3. ask whether it exists, read it back into a fresh buffer and compare the bytes;
4. put the same block again, then check `dedup_hits` rose while `resident_bytes`
   stayed flat (stored once).

Prints each step and the stats before/after; exit status 0 when every check passed.
Other clients writing to the same namespace at the same time can move the counters.
"""

from __future__ import annotations

import argparse
import os
import secrets
import select
import sys
from dataclasses import dataclass, field
from typing import TextIO

from epistemic_kvcache.client.stats import KvCacheStats
from epistemic_kvcache.errors import AuthError, ConfigurationError
from epistemic_kvcache.integrations.lmcache.l2_native_connector import EpistemicGraphL2Connector

DEFAULT_BLOCK_BYTES = 4 * 1024 * 1024
"""A 16-token chunk of Llama-3-8B KV is 2 MiB; 4 MiB exercises the large-body path."""
_STAT_FIELDS = ("unique_blocks", "logical_bytes", "resident_bytes", "dedup_hits", "put_new")


@dataclass(slots=True)
class ValidationReport:
    """What `validate_adapter` checked. `ok` when every check passed."""

    checks: list[tuple[str, bool, str]] = field(default_factory=list)
    stats: list[tuple[str, KvCacheStats]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(passed for _, passed, _ in self.checks)

    def check(self, name: str, passed: bool, detail: str = "") -> bool:
        self.checks.append((name, passed, detail))
        return passed


def _wait(
    conn: EpistemicGraphL2Connector, fid: int, timeout_s: float
) -> tuple[bool, str, list[bool]]:
    """Wait for one future's completion the way LMCache's demux thread does."""
    poller = select.poll()
    poller.register(conn.event_fd(), select.POLLIN)
    remaining_ms = int(timeout_s * 1000)
    while remaining_ms > 0:
        if poller.poll(min(remaining_ms, 500)):
            for cfid, ok, err, results in conn.drain_completions():
                if cfid == fid:
                    return ok, err, list(results or [])
        remaining_ms -= 500
    return False, f"no completion within {timeout_s} s", []


def validate_adapter(
    connector: EpistemicGraphL2Connector,
    *,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    timeout_s: float = 60.0,
) -> ValidationReport:
    """Run the checks through `connector`; never raises for a failed check."""
    report = ValidationReport()
    try:
        _run_checks(connector, report, block_bytes, timeout_s)
    except AuthError as exc:
        report.check("authenticated", False, str(exc))
    return report


def _run_checks(
    connector: EpistemicGraphL2Connector,
    report: ValidationReport,
    block_bytes: int,
    timeout_s: float,
) -> ValidationReport:
    client = connector.client
    key = f"epistemic-kvcache/validate-adapter@00000000@0@{secrets.token_hex(16)}"
    block = os.urandom(block_bytes)

    before = client.stats()
    if not report.check("stats reachable", before is not None, client.config.base_url):
        return report
    assert before is not None
    report.stats.append(("before", before))

    ok, err, _ = _wait(connector, connector.submit_batch_set([key], [memoryview(block)]), timeout_s)
    if not report.check("first put stored", ok, err):
        return report
    first = client.stats()
    if not report.check("stats after first put", first is not None):
        return report
    assert first is not None
    report.stats.append(("after first put", first))
    report.check(
        "unique_blocks rose",
        first.unique_blocks > before.unique_blocks,
        f"{before.unique_blocks} -> {first.unique_blocks}",
    )
    report.check(
        "logical_bytes rose by the block",
        first.logical_bytes >= before.logical_bytes + block_bytes,
        f"{before.logical_bytes} -> {first.logical_bytes}",
    )

    ok, err, found = _wait(connector, connector.submit_batch_exists([key]), timeout_s)
    report.check("exists", ok and found == [True], err or str(found))
    buf = bytearray(block_bytes)
    ok, err, loaded = _wait(
        connector, connector.submit_batch_get([key], [memoryview(buf)]), timeout_s
    )
    report.check("read back", ok and loaded == [True], err)
    report.check("bytes identical", buf == block, f"{block_bytes} bytes")

    ok, err, _ = _wait(connector, connector.submit_batch_set([key], [memoryview(block)]), timeout_s)
    report.check("second put accepted", ok, err)
    second = client.stats()
    if not report.check("stats after second put", second is not None):
        return report
    assert second is not None
    report.stats.append(("after second put", second))
    report.check(
        "dedup_hits rose",
        second.dedup_hits > first.dedup_hits,
        f"{first.dedup_hits} -> {second.dedup_hits}",
    )
    report.check(
        "resident_bytes flat (stored once)",
        second.resident_bytes == first.resident_bytes,
        f"{first.resident_bytes} -> {second.resident_bytes}",
    )
    return report


def print_report(report: ValidationReport, out: TextIO = sys.stdout) -> None:
    """Human-readable checks and a stats table."""
    for name, passed, detail in report.checks:
        mark = "PASS" if passed else "FAIL"
        print(f"[{mark}] {name}" + (f": {detail}" if detail else ""), file=out)
    if report.stats:
        width = max(len(label) for label, _ in report.stats)
        print("", file=out)
        print(f"{'':{width}}  " + "  ".join(f"{f:>16}" for f in _STAT_FIELDS), file=out)
        for label, st in report.stats:
            values = "  ".join(f"{getattr(st, f):>16}" for f in _STAT_FIELDS)
            print(f"{label:{width}}  {values}", file=out)
    print("", file=out)
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
        "--block-bytes",
        type=int,
        default=DEFAULT_BLOCK_BYTES,
        help=f"size of the random test block (default {DEFAULT_BLOCK_BYTES})",
    )
    parser.add_argument(
        "--timeout-s", type=float, default=60.0, help="per-operation deadline (default 60)"
    )


def run(args: argparse.Namespace, *, out: TextIO = sys.stdout) -> int:
    """Run the check from parsed arguments; 0 on pass, 1 on fail."""
    if args.block_bytes < 1:
        raise ConfigurationError(f"invalid --block-bytes: expected >= 1 (got {args.block_bytes})")
    connector = EpistemicGraphL2Connector(
        base_url=args.url,
        token=args.token,
        token_file=args.token_file,
        timeout_s=args.timeout_s,
        num_workers=2,
    )
    try:
        print(f"validate-adapter: {connector.config.base_url}", file=out)
        report = validate_adapter(connector, block_bytes=args.block_bytes, timeout_s=args.timeout_s)
    finally:
        connector.close()
    print_report(report, out)
    return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point (`python -m epistemic_kvcache.validate`)."""
    parser = argparse.ArgumentParser(prog="epistemic-kvcache validate-adapter")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
