"""`epistemic-kvcache validate-adapter` end to end: every LMCache path, skips, cleanup.

The command runs as a subprocess against a real server (HTTP and RESP listeners). With
lmcache installed it drives LMCache's own objects; the run "without LMCache" blocks the
import, so the fallback (the connector driven directly) is exercised too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from epistemic_kvcache.client import EpistemicGraphKVBackend
from helpers import held_port as free_port
from helpers import sigstop
from servers import TOKEN, ServeProcess

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

ENV = {k: v for k, v in os.environ.items() if not k.startswith("EPISTEMIC_GRAPH_")}
ENV["PYTHONWARNINGS"] = "ignore"
ENV["LMCACHE_TRACK_USAGE"] = "false"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    s = ServeProcess(tmp_path_factory.mktemp("kv"))
    yield s
    s.stop()


def validate(*args: str, prelude: str = "") -> subprocess.CompletedProcess[str]:
    code = f"{prelude}\nimport sys\nfrom epistemic_kvcache.cli import main\nsys.exit(main())"
    return subprocess.run(
        [sys.executable, "-c", code, "validate-adapter", *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )


def leftover(server: ServeProcess) -> list[str]:
    with EpistemicGraphKVBackend(base_url=server.url(), token=TOKEN) as c:
        return c.list_keys(prefix="epistemic-kvcache-validate-")


@pytest.mark.lmcache
def test_every_path_through_lmcache_and_nothing_left_behind(server: ServeProcess) -> None:
    pytest.importorskip("lmcache")
    resp = f"127.0.0.1:{server.ports['resp']}"
    done = validate(
        "--url", server.url(), "--token", TOKEN, "--resp-addr", resp, "--block-bytes", "100000"
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-3000:]
    assert (
        "[PASS] native (LMCache's NativeConnectorL2Adapter over EpistemicGraphL2Connector)" in out
    )
    assert f"[PASS] resp (LMCache's LMCacheRedisClient -> {resp})" in out
    assert (
        "[PASS] path-a (EpistemicGraphExternalBackend via LMCache's storage_plugin_launcher)" in out
    )
    assert f"[PASS] redis-url (LMCache's redis-py RedisConnector -> redis://{resp})" in out
    for check in ("dedup_hits rose", "resident_bytes flat", "delete: gone afterwards",
                  "gone after DEL", "gone after remove", "bytes identical"):  # fmt: skip
        assert f"[PASS] {check}" in out
    assert "FAIL" not in out
    assert "cleanup: deleted" in out
    assert leftover(server) == []
    assert "validate-adapter: PASS" in out


@pytest.mark.lmcache
def test_skipped_paths_say_why(server: ServeProcess) -> None:
    done = validate("--url", server.url(), "--token", TOKEN, "--resp-addr", "off",
                    "--block-bytes", "1000")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert "[SKIP] resp: --resp-addr off" in done.stdout
    assert "[SKIP] redis-url: --resp-addr off" in done.stdout
    assert "[PASS] native" in done.stdout
    assert "[PASS] path-a" in done.stdout
    assert leftover(server) == []


def test_without_lmcache_the_connector_is_driven_directly(server: ServeProcess) -> None:
    done = validate(
        "--url", server.url(), "--token", TOKEN, "--resp-addr", f"127.0.0.1:{server.ports['resp']}",
        "--block-bytes", "50000",
        prelude="import sys; sys.modules['lmcache'] = None",
    )  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-2000:]
    assert (
        "[PASS] native (LMCache not installed: drove the connector the way its adapter does)" in out
    )
    assert "[PASS] delete (submit_batch_delete)" in out
    for path in ("resp", "path-a", "redis-url"):
        assert f"[SKIP] {path}: lmcache is not installed" in out
    assert leftover(server) == []


def test_configuration_mistakes_exit_2_with_one_message(server: ServeProcess) -> None:
    bad = validate("--url", server.url(), "--token", "wrong-token-wrong-token", "--paths", "native")
    assert bad.returncode == 2
    assert "refused the token (401)" in bad.stderr
    assert "Traceback" not in bad.stderr
    down = validate("--url", f"http://127.0.0.1:{free_port()}", "--token", TOKEN)
    assert down.returncode == 2
    assert "cannot use the kv-cache server" in down.stderr
    none = validate("--url", server.url())
    assert none.returncode == 2
    assert "no token" in none.stderr
    paths = validate("--url", server.url(), "--token", TOKEN, "--paths", "native,bogus")
    assert paths.returncode == 2
    assert "invalid --paths: bogus" in paths.stderr


def test_standalone_module_entry_point(server: ServeProcess, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    done = subprocess.run(
        [sys.executable, "-m", "epistemic_kvcache.validate", "--url", server.url(),
         "--token-file", str(token_file), "--paths", "native", "--block-bytes", "1000"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert "validate-adapter: PASS" in done.stdout


@pytest.mark.lmcache
def test_sigterm_still_deletes_what_it_wrote(server: ServeProcess) -> None:
    """A run stopped by SIGTERM deletes its keys and says so (it used to leave them).

    The run is frozen (SIGSTOP) at a moment one of its keys is stored, SIGTERM is queued,
    and the run resumes: the signal lands while the checks are mid-way, never after."""
    pytest.importorskip("lmcache")
    code = "import sys\nfrom epistemic_kvcache.cli import main\nsys.exit(main())"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "validate-adapter", "--url", server.url(), "--token", TOKEN,
         "--resp-addr", f"127.0.0.1:{server.ports['resp']}", "--block-bytes", str(32 << 20)],
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        frozen = False
        while not frozen and proc.poll() is None:
            if leftover(server):
                sigstop(proc.pid)  # every thread of it stopped
                frozen = bool(leftover(server))  # still there once it cannot move
                if not frozen:
                    proc.send_signal(signal.SIGCONT)
        assert frozen, "the run ended before one of its keys was seen"
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGCONT)
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, out + err[-3000:]
    assert "stopped by SIGTERM before every check had run" in out
    assert "cleanup: deleted" in out
    assert "Traceback" not in err
    assert leftover(server) == []
