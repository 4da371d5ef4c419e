"""The abuse suite (issue 10): each attack runs against a real server process while a
well-behaved client of another tenant keeps working.

Every scenario of `bench/abuse.py` runs here on a fresh server with small budgets (so the
memory bound is tight enough to mean something), bounded in time: about 1 s unloaded,
3 s under attack. Asserted, per scenario: the server is alive; the other tenant's 4 KiB
GETs over RESP and HTTP all succeed with a p99 under a generous bound (250 ms; on a
loaded machine 5x the unloaded p99 of the same run, or 1 s while it is oversubscribed:
the machine is shared and small; bench/bench_abuse.py reports the real figures); its
side checks (a 1 MiB SET, a paged SCAN, a new epoch scope) never fail; and the server's RSS, sampled
from /proc every 20 ms, stays under the bound docs/security.md gives for the settings.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import abuse

MiB = 1024 * 1024
INFLIGHT = 256 * MiB
TENANT_SHARE = 160 * MiB
OPTIONS = (
    "--max-inflight-body-bytes", "256MiB",
    "--max-tenant-inflight-bytes", "160MiB",
    "--max-block-bytes", "64MiB",
    "--max-batch-bytes", "128MiB",
    "--client-output-buffer-limit-bytes", "128MiB",
    "--resp-max-query-buffer-bytes", "16MiB",
)  # fmt: skip
P99_BOUND_MS = 250.0
"""Generous on purpose: CI machines are shared; the benchmark reports real figures."""
SLOWDOWN = 5.0
OVERSUBSCRIBED_BOUND_MS = 1000.0
"""On a loaded machine the 250 ms bound measures the machine, not the server: with
`stress-ng --cpu 2` and another suite on 2 cores, the unloaded p99 alone was 73-112 ms
and an attack run saw 355-426 ms with no probe failure. There the bound is the larger of
5x the same run's worse unloaded p99 (both wires) and, while the machine runs more than
2 runnable tasks per CPU (1-minute load average), 1 s. An attack that starves the other
tenant still shows: probe failures (timeouts) and seconds of latency."""


def p99_bound_ms(outcome: abuse.Outcome) -> float:
    bound = max(P99_BOUND_MS, SLOWDOWN * max(outcome.unloaded_p99_ms, outcome.unloaded_http_p99_ms))
    if os.getloadavg()[0] / (os.cpu_count() or 1) > 2:
        bound = max(bound, OVERSUBSCRIBED_BOUND_MS)
    return bound


SLOT_OPTIONS = (
    "--max-connections", "128",
    "--max-unauthenticated-connections", "32",
    "--max-unauthenticated-connections-per-peer", "8",
    "--max-connections-per-peer", "96",
    "--max-connections-per-tenant", "64",
)  # fmt: skip
"""The slot-holding scenarios run at a smaller scale here (the attack holds 160
connections per listener against 128 slots): the same limits at work, without a
storm of thousands of connects that loads the kernel of a shared CI machine (the
full-scale figures are in docs/benchmarks.md)."""
PER_CONNECTION_BYTES = 32 * 1024
"""What one open connection may cost beyond the in-flight budget (objects, timers)."""
SLACK = 96 * MiB
"""Allocator slack: freed memory the allocator keeps for reuse, thread stacks touched."""


def rss_bound_mib(before_mib: float) -> float:
    """docs/security.md's bound for these settings, from the RSS measured before the
    attack (set-up data already resident): + the in-flight budget + per connection."""
    connections = 2 * 1100  # both listeners, at most the attack's 1100 each
    return before_mib + INFLIGHT / MiB + connections * PER_CONNECTION_BYTES / MiB + SLACK / MiB


@pytest.fixture(scope="module")
def tmp_root() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="abuse-suite-") as tmp:
        yield Path(tmp)


@pytest.mark.slow
@pytest.mark.parametrize("name", [s.name for s in abuse.SCENARIOS])
def test_attack_leaves_other_tenants_served(name: str, tmp_root: Path) -> None:
    scenario = abuse.SCENARIOS_BY_NAME[name]
    options = [*scenario.options, *OPTIONS]
    params: dict[str, int] = {}
    if name == "header_only_puts":
        params["length"] = 60 * MiB  # under max_block_bytes
    if name.endswith("_slots"):
        options += SLOT_OPTIONS
        params["conns"] = 160
    workdir = tmp_root / name
    workdir.mkdir()
    with abuse.start_server(workdir, options=options) as server:
        outcome = abuse.run_scenario(
            server, scenario, unloaded_s=1.0, loaded_s=3.0, attack_params=params
        )
        lines = list(server.output)
    print(abuse.HEADER)
    print(outcome.row())
    assert outcome.server_alive, "".join(lines[-30:])
    assert outcome.samples >= 10, outcome
    assert outcome.probe_failures == 0, outcome.errors
    assert outcome.side_failures == 0, outcome.errors
    assert outcome.loaded_p99_ms < p99_bound_ms(outcome), outcome
    assert outcome.loaded_http_p99_ms < p99_bound_ms(outcome), outcome
    bound = rss_bound_mib(outcome.baseline_rss_mib)
    assert outcome.peak_rss_mib < bound, (outcome.peak_rss_mib, bound)
