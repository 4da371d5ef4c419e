"""A real server SIGKILLed under concurrent RESP and HTTP writes and deletes, restarted, and
checked byte for byte (see tests/server_crash.py). A few cycles here; `make crash-test`
runs 200."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import server_crash


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_under_load_loses_no_acknowledged_write(tmp_path: Path, rand) -> None:  # type: ignore[no-untyped-def]
    cycles = int(os.environ.get("KVCACHE_CRASH_CYCLES_CI", "6"))
    totals = server_crash.run(tmp_path / "store", cycles, rand.randrange(1 << 30), tmp_path / "log")
    assert totals["cycles"] == cycles
    assert totals["acked_puts"] > 0
    assert totals["acked_deletes"] > 0
