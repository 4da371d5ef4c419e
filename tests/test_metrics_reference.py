"""docs/metrics.md lists exactly what a real server exports, with the right types, and the
request labels use one vocabulary on both wires."""

from __future__ import annotations

import bisect
import http.client
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from epistemic_kvcache import __version__
from epistemic_kvcache.server.app import ServerHandle
from epistemic_kvcache.server.metrics import LATENCY_BUCKETS_S, RequestSeries, status_label
from epistemic_kvcache.shared import STATS_FIELDS, TIER_FIELDS
from servers import running_server

DOC = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"
TOKEN = "m" * 32
HEALTH = {
    "kvcache_store_ready",
    "kvcache_store_writable",
    "kvcache_store_committer_alive",
    "kvcache_store_disk_full",
    "kvcache_store_recovering",
}
"""Exported by stores with a health report (documented ahead of it)."""


def documented() -> dict[str, tuple[str, str]]:
    text = DOC.read_text()
    table = text.split("<!-- metrics-table", 1)[1].split("<!-- /metrics-table -->")[0]
    rows = re.findall(r"^\| `([a-z_]+)` \| (\w+) \| ([^|]*) \|", table, flags=re.M)
    return {name: (kind, labels.strip()) for name, kind, labels in rows}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    tmp = tmp_path_factory.mktemp("m")
    with running_server(tmp, backend="durable", tokens={TOKEN: "default"}) as srv:
        yield srv.handle


def scrape(server: ServerHandle) -> str:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    put = urllib.request.Request(server.http_url + "/kv/a", data=b"x", method="PUT", headers=auth)
    urllib.request.urlopen(put, timeout=10).read()
    req = urllib.request.Request(server.http_url + "/metrics", headers=auth)
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read().decode()


def test_reference_matches_a_real_server(server: ServerHandle) -> None:
    assert server.resp is not None
    r = redis.Redis(host=server.resp.host, port=server.resp.port, password=TOKEN)
    r.get("missing")
    r.close()
    families = {
        f.name: f
        for f in text_string_to_metric_families(scrape(server))
        if f.name[-8:] != "_created"
    }
    docs = documented()
    exported = {}
    for name, fam in families.items():
        wire_name = name + "_total" if fam.type == "counter" else name
        exported[wire_name] = fam.type
    assert set(exported) <= set(docs), f"undocumented: {set(exported) - set(docs)}"
    missing = set(docs) - set(exported) - HEALTH - {"kvcache_store_internal"}
    assert not missing, f"documented but not exported: {missing}"
    for name, kind in exported.items():
        expected = "gauge" if kind == "info" else kind
        assert docs[name][0] == expected, name
    for name, fam in families.items():
        if not name.startswith("kvcache_") or fam.type == "info":
            continue
        labels = {k for s in fam.samples for k in s.labels if k != "le"}
        wire_name = name + "_total" if fam.type == "counter" else name
        doc_labels = docs[wire_name][1]
        want = set() if doc_labels == "—" else {x.strip() for x in doc_labels.split(",")}
        assert labels == want, f"{wire_name}: exported labels {labels}, documented {want}"


def test_stats_rows_follow_the_one_definition() -> None:
    """Every `/kv/stats` field (`shared.StatCounts`, `shared.TierCounts`: defined once) has
    its metrics row with its kind, and its place in the `/kv/stats` example of
    docs/http-api.md: a field added there and not here fails."""
    docs = documented()
    for f in STATS_FIELDS:
        name = f"kvcache_{f.name}" + ("_total" if f.kind == "counter" else "")
        assert docs.get(name, ("missing",))[0] == f.kind, name
    for f in TIER_FIELDS:
        assert docs.get(f"kvcache_tier_{f.name}") == ("gauge", "tier"), f.name
    example = (DOC.parent / "http-api.md").read_text()
    for f in (*STATS_FIELDS, *TIER_FIELDS):
        assert f'"{f.name}":' in example, f.name


DATA_LOSS = (
    "lost_keys",
    "damaged_log_regions",
    "quarantined_blocks",
    "missing_segments",
    "checkpoint_lag_bytes",
)


def test_data_loss_internals_are_first_class_metrics(server: ServerHandle) -> None:
    """Issue 28: they were `kvcache_store_internal{name=...}` without a help text."""
    text = scrape(server)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in DATA_LOSS:
        fam = families[f"kvcache_store_{name}"]
        assert fam.type == "gauge"
        assert len(fam.documentation) > 30, name
        (value,) = (s.value for s in fam.samples)
        assert value == 0.0 or name == "checkpoint_lag_bytes"  # nothing lost here
    internal = {s.labels["name"] for s in families["kvcache_store_internal"].samples}
    assert internal == {"store_fault", "disk_full"}  # what docs/metrics.md names
    assert not internal & set(DATA_LOSS)
    row = next(
        line
        for line in DOC.read_text().splitlines()
        if line.startswith("| `kvcache_store_internal`")
    )
    assert all(f"`{name}`" in row for name in internal)


def test_created_series_are_as_documented(server: ServerHandle) -> None:
    created = {
        f.name
        for f in text_string_to_metric_families(scrape(server))
        if f.name.endswith("_created")
    }
    assert created == {"kvcache_requests_created"}
    assert "`kvcache_requests_created{...}`" in DOC.read_text()


def test_labels_and_build_info(server: ServerHandle) -> None:
    text = scrape(server)
    statuses = set(re.findall(r'kvcache_requests_total\{[^}]*status="(\w+)"', text))
    assert statuses <= {"ok", "error"}
    assert re.search(r'kvcache_requests_total\{[^}]*code="201"[^}]*wire="http"', text) or re.search(
        r'code="201"', text
    )
    assert 'kvcache_build_info{python="' in text
    assert f'version="{__version__}"' in text
    assert "process_resident_memory_bytes" in text
    assert "# TYPE kvcache_store_fsyncs_total counter" in text
    assert "# TYPE kvcache_get_hits_total counter" in text


CASES = [("200", "ok"), ("201", "ok"), ("404", "ok"), ("409", "ok"), ("401", "error")]
CASES += [("413", "error"), ("503", "error"), ("507", "error"), ("ok", "ok"), ("error", "error")]


@pytest.mark.parametrize(("status", "label"), CASES)
def test_status_label(status: str, label: str) -> None:
    assert status_label(status) == label


def _latency(text: str, wire: str, route: str) -> tuple[float, float, float]:
    """(count, sum, observations at or under 1 ms) of one latency series."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name != "kvcache_request_duration_seconds":
            continue
        for s in fam.samples:
            if s.labels.get("wire") != wire or s.labels.get("route") != route:
                continue
            assert "code" not in s.labels, s  # the histogram has no per-code series
            if s.name.endswith("_bucket"):
                if s.labels["le"] == "0.001":
                    out["fast"] = out.get("fast", 0.0) + s.value
            else:
                suffix = s.name.rsplit("_", 1)[1]
                out[suffix] = out.get(suffix, 0.0) + s.value
    return out["count"], out["sum"], out["fast"]


def test_latencies_resolve_below_a_millisecond(server: ServerHandle) -> None:
    """Issue 22: HTTP durations came from `loop.time()` (1 ms steps under uvloop): every
    HTTP sum was a whole number of milliseconds and a request either cost 0 or >= 1 ms.
    200 cheap requests on each wire (`/healthz`, `PING`): sub-millisecond observations,
    and a sum that is no whole number of milliseconds (odds of that by chance: ~1e-6)."""
    assert server.resp is not None
    conn = http.client.HTTPConnection(server.http.host, server.http.port, timeout=10)
    try:
        for _ in range(200):
            conn.request("GET", "/healthz")
            r = conn.getresponse()
            r.read()
            assert r.status == 200
    finally:
        conn.close()
    r = redis.Redis(host=server.resp.host, port=server.resp.port, password=TOKEN)
    try:
        for _ in range(200):
            assert r.ping()
    finally:
        r.close()
    text = scrape(server)
    for wire, route in (("http", "/healthz"), ("resp", "ping")):
        count, total, fast = _latency(text, wire, route)
        assert count >= 200, (wire, count)
        assert fast >= 1, (wire, fast)
        millis = total * 1000
        assert total > 0, (wire, total)
        assert abs(millis - round(millis)) > 1e-6, (wire, total)


@given(
    st.lists(
        st.one_of(
            st.floats(min_value=-1.0, max_value=60.0, allow_nan=False),
            st.floats(min_value=0.0, max_value=0.001),  # (around the first bounds)
            st.sampled_from([0.0, *LATENCY_BUCKETS_S]),  # (on each bound: that bucket)
        ),
        max_size=50,
    )
)
def test_observe_places_each_latency_in_its_bucket(latencies: list[float]) -> None:
    """`RequestSeries.observe` (its shortcut for the first bucket included) counts each
    latency in the first bucket whose bound is at or above it (Prometheus `le`), the rest
    in +Inf; a latency at or below 0 counts in the first bucket and adds nothing."""
    series = RequestSeries(("resp", "get", "ok", ""))
    want = [0] * (len(LATENCY_BUCKETS_S) + 1)
    for s in latencies:
        series.observe(s)
        want[0 if s <= 0 else bisect.bisect_left(LATENCY_BUCKETS_S, s)] += 1
    assert series.buckets == want
    assert series.count == len(latencies)
    assert series.total_s == pytest.approx(sum(s for s in latencies if s > 0))
