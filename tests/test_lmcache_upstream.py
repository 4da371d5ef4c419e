"""LMCache's own tests against our server, with redis-server as the control.

Four upstream test files are taken from the sdist of the installed lmcache version
(downloaded with pip at test time and cached in the virtualenv, never vendored), patched
with the smallest changes that point them at a real server with a password
(tests/lmcache_upstream/*.patch, each change explained at the top of its patch), and run
in a subprocess, one test per file and target (each with its own time budget): against
our server (its RESP listener, and its HTTP API for the
native plugin) and against a password-protected redis-server (LMCache's own
LMCacheRedisClient for the native-adapter file). Target: every test that passes against
redis-server passes against us.

Tests that fail against redis-server too are LMCache 0.5.6's own problems, listed in
`UPSTREAM_FAILURES` (and in docs/lmcache.md) so a new one is noticed rather than ignored:
its C++ RESP client waits forever for a missing key's GET reply (it expects the block's
size header and reads 2 more bytes than `$-1\\r\\n` sends), so any load of an absent key
hangs until the test's own deadline.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("lmcache")
pytest.importorskip("torch")
redis = pytest.importorskip("redis")

from helpers import eventually, reserve_port  # noqa: E402
from servers import TOKEN, ServeProcess  # noqa: E402

pytestmark = [pytest.mark.lmcache, pytest.mark.redis, pytest.mark.slow]

PATCHES = Path(__file__).resolve().parent / "lmcache_upstream"
FILES = {
    "test_resp_connector": "tests/v1/storage_backend/test_resp_connector.py",
    "test_resp_l2_adapter_integration": "tests/v1/distributed/test_resp_l2_adapter_integration.py",
    "test_native_connector_l2_adapter": "tests/v1/distributed/test_native_connector_l2_adapter.py",
    "test_connector": "tests/v1/test_connector.py::test_redis_connector",
}
UPSTREAM_FAILURES = {
    # LMCacheRedisClient (C++) hangs on the GET of a missing key, against redis-server too.
    "test_resp_connector::test_resp_connector_nonexistent_key",
    "test_native_connector_l2_adapter::TestLoadInterface::test_load_signals_event_fd",
    "test_native_connector_l2_adapter::TestLoadInterface::test_load_nonexistent_key_fails",
    "test_native_connector_l2_adapter::TestLoadInterface::test_query_load_is_one_shot",
}
"""Upstream tests that fail against redis-server as well (see the module docstring)."""
NOT_RUN_AGAINST_US = {"test_resp_connector::test_resp_connector_nonexistent_key"}
"""Known failures that cannot pass against any server (LMCache's C++ client reads past
the missing key's reply and waits out the test's 30 s deadline): run against
redis-server only, where they must still fail, and not against us."""


def sdist_tests(cache: Path) -> Path:
    """The installed lmcache version's sdist `tests/` tree (downloaded once, cached)."""
    version = importlib.metadata.version("lmcache")
    root = cache / f"lmcache-{version}"
    if (root / "tests").is_dir():
        return root
    cache.mkdir(parents=True, exist_ok=True)
    archive = cache / f"lmcache-{version}.tar.gz"
    if not archive.exists():
        # NO_NATIVE_EXT: only the metadata is built (no CUDA/C++ toolchain needed).
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
             "--no-build-isolation", f"lmcache=={version}", "-d", str(cache)],
            env={**os.environ, "NO_NATIVE_EXT": "1"},
            capture_output=True,
            text=True,
            timeout=600,
        )  # fmt: skip
        if done.returncode != 0 or not archive.exists():
            pytest.fail(f"could not download the lmcache {version} sdist:\n{done.stderr[-3000:]}")
    tmp = cache / f"extract-{os.getpid()}"
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(f"lmcache-{version}/tests/")]
        members.append(tar.getmember(f"lmcache-{version}/pytest.ini"))
        tar.extractall(tmp, members=members, filter="data")
    (tmp / f"lmcache-{version}").rename(root)
    shutil.rmtree(tmp, ignore_errors=True)
    return root


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A patched copy of the upstream tests (only `tests/` and `pytest.ini`, so the
    installed lmcache is imported, not the sdist's sources)."""
    cache = Path(os.environ.get("LMCACHE_SDIST_CACHE", Path(sys.prefix) / "lmcache-sdist"))
    src = sdist_tests(cache)
    dst = tmp_path_factory.mktemp("upstream")
    shutil.copytree(src / "tests", dst / "tests")
    shutil.copy(src / "pytest.ini", dst / "pytest.ini")
    for patch in sorted(PATCHES.glob("*.patch")):
        subprocess.run(
            ["patch", "-p1", "--quiet", "--batch", "-i", str(patch)], cwd=dst, check=True
        )
    return dst


@pytest.fixture(scope="module")
def ours(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """Our server as shipped (durable backend), token = the RESP password."""
    s = ServeProcess(tmp_path_factory.mktemp("ours"), "--backend", "durable")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def control(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """redis-server with the same password, no persistence."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (make sysdeps)")
    held = reserve_port()  # held until the end: nobody else can take it meanwhile
    port = held.port
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--requirepass", TOKEN,
         "--save", "", "--appendonly", "no", "--dir", str(tmp_path_factory.mktemp("redis"))],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip

    def pong() -> bool:
        with redis.Redis(port=port, password=TOKEN) as client:
            try:
                return bool(client.ping())
            except redis.exceptions.ConnectionError:
                return False

    eventually(pong, timeout=30, what="redis-server answers PING")
    yield port
    proc.terminate()
    proc.wait(10)
    held.close()


def run_upstream(
    tree: Path, short: str, target: str, resp_port: int, http_url: str
) -> dict[str, str]:
    """Run one upstream file (`short`, a key of FILES) against one target in a
    subprocess; {test id: passed|failed|skipped}. One at a time: a run of
    test_resp_connector.py alone peaks at 7.6 GB RSS, two at once were OOM-killed."""
    report = tree / f"junit-{short}-{target}.xml"
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("EPISTEMIC_GRAPH_", "LMCACHE_"))
    }
    env.update(
        REDIS_HOST="127.0.0.1",
        REDIS_PORT=str(resp_port),
        REDIS_PASSWORD=TOKEN,
        LMCACHE_RESP_PASSWORD=TOKEN,
        LMCACHE_UPSTREAM_TARGET=target,
        LMCACHE_UPSTREAM_HTTP_URL=http_url,
        LMCACHE_UPSTREAM_REDIS_URL=f"redis://:{TOKEN}@127.0.0.1:{resp_port}",
        LMCACHE_TRACK_USAGE="false",
        PYTHONWARNINGS="ignore",
    )
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-o", "log_cli=false",
           "-o", "timeout=180", f"--junitxml={report}", FILES[short]]  # fmt: skip
    if target == "ours":
        path = FILES[short].split("::")[0]
        cmd += [f"--deselect={path}::{t.split('::', 1)[1]}" for t in sorted(NOT_RUN_AGAINST_US)
                if t.split("::")[0] == short]  # fmt: skip
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=3000)
    if not report.exists():
        pytest.fail(
            f"upstream run against {target} produced no report (exit {done.returncode}):\n"
            f"{done.stdout[-4000:]}"
        )
    return junit_outcomes(report)


def junit_outcomes(report: Path) -> dict[str, str]:
    """{test id: passed|failed|skipped} from an upstream run's JUnit report."""
    results: dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        name = case.get("name", "")
        if name.startswith("test_redis_connector["):
            name = "test_redis_connector[url]"  # the parameter is the target's URL
        # classname: tests.v1.distributed.test_x[.TestClass]
        file_idx = next(i for i, part in enumerate(module) if part.startswith("test_"))
        test_id = "::".join([module[file_idx], *module[file_idx + 1 :], name])
        outcome = "passed"
        if case.find("skipped") is not None:
            outcome = "skipped"
        elif case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        results[test_id] = outcome
    return results


# Budgets: one file against one target took, on the shared 2-core dev machine under load
# (load average 9 to 14, other engineers' suites running): test_resp_connector 139 s
# (redis-server) and 128 s (ours), test_native_connector_l2_adapter 74 s and 50 s,
# test_resp_l2_adapter_integration 38 s and 44 s, test_connector 33 s and 31 s
# (`pytest --durations=0 tests/test_lmcache_upstream.py`, 2026-12-02); rounded up, times
# 3 for a machine loaded worse. The module's first test also pays the sdist extraction
# and the servers' start (~5 s).
BUDGET_S = {
    "test_resp_connector": 3 * 150,
    "test_resp_l2_adapter_integration": 3 * 65,
    "test_native_connector_l2_adapter": 3 * 75,
    "test_connector": 3 * 50,
}
REDIS_RESULTS: dict[str, dict[str, str]] = {}
"""Each file's results against redis-server, for the test against us that follows it."""


@pytest.mark.parametrize(
    ("short", "target"),
    [
        pytest.param(s, t, marks=pytest.mark.timeout(BUDGET_S[s]), id=f"{s}-{t}")
        for s in FILES
        for t in ("redis", "ours")
    ],
)
def test_upstream_file(
    upstream: Path, request: pytest.FixtureRequest, short: str, target: str
) -> None:
    """One upstream file against one target (each its own test, with its own budget).

    Against redis-server: every failure is a known LMCache problem (UPSTREAM_FAILURES);
    another one is run once more (the whole file), and fails the test if it fails again.
    Against us: every upstream test passes but those known ones, nothing is skipped, and
    (when the redis-server run came first, as it does in a full run) the same tests ran
    and every one that passed against redis-server passes against us."""
    if target == "redis":
        port: int = request.getfixturevalue("control")
        results = run_upstream(upstream, short, "redis", port, "")
        odd = [t for t, o in results.items() if o == "failed" and t not in UPSTREAM_FAILURES]
        if odd:
            # LMCache's own client against redis-server, none of our code: a failure that
            # does not come back on a second run is an intermittent upstream one (seen
            # once in ~20 CI runs: "socket writev failed" in test_resp_connector_thread_
            # scaling[8]). It is reported; one that comes back fails below.
            again = run_upstream(upstream, short, "redis", port, "")
            print(f"\n{short}.py against redis: failed once, rerun: "
                  f"{ {t: again.get(t) for t in odd} }")  # fmt: skip
            for t in odd:
                if again.get(t) == "passed":
                    results[t] = "passed"
        REDIS_RESULTS[short] = results
    else:
        ours: ServeProcess = request.getfixturevalue("ours")
        results = run_upstream(upstream, short, "ours", ours.ports["resp"], ours.url())
    failed = sorted(t for t, o in results.items() if o == "failed")
    print(f"\n{short}.py against {target}: {sum(o == 'passed' for o in results.values())}"
          f"/{len(results)} passed; failed: {failed}")  # fmt: skip

    assert results, "no upstream test ran"
    assert all(t.split("::")[0] == short for t in results), sorted(results)
    if target == "redis":
        unexplained = sorted(set(failed) - UPSTREAM_FAILURES)
        assert not unexplained, f"new upstream failures against redis-server: {unexplained}"
        return
    assert not any(o == "skipped" for o in results.values()), "an upstream test skipped"
    unexplained = sorted(set(failed) - UPSTREAM_FAILURES)
    assert not unexplained, f"fail against us, not a known LMCache problem: {unexplained}"
    on_redis = REDIS_RESULTS.get(short)
    if on_redis is not None:
        assert results.keys() == on_redis.keys() - NOT_RUN_AGAINST_US
        assert all(on_redis[t] == "failed" for t in NOT_RUN_AGAINST_US if t in on_redis)
        regressions = sorted(
            t for t, o in on_redis.items() if o == "passed" and results[t] != "passed"
        )
        assert not regressions, f"pass against redis-server, fail against us: {regressions}"
        print(
            "passing only against us:",
            sorted(t for t in on_redis if on_redis[t] == "failed" and results.get(t) == "passed"),
        )
