"""The command as an operator meets it (issue 28): no abbreviated flags, help without a
subcommand, choices in --help, `cluster --help` narrowed to what the check reads,
`config show` with the source of every value, an unwritable persist dir named, and the
MCP command checking its token and server at start."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from epistemic_kvcache.config import SETTINGS

TOKEN = "t" * 32


def _env(**extra: str) -> dict[str, str]:
    drop = ("EPISTEMIC_GRAPH_KVCACHE_", "GRAPH_SERVICE_PERSIST_DIR")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    return env | {"PYTHONUNBUFFERED": "1"} | extra


def cli(
    cwd: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "epistemic_kvcache", *args],
        cwd=cwd,
        env=env if env is not None else _env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        stdin=subprocess.DEVNULL,
    )


def test_no_subcommand_prints_the_help(tmp_path: Path) -> None:
    proc = cli(tmp_path)
    assert proc.returncode == 2  # like `git` alone: help, and nothing done
    assert proc.stdout.startswith("usage: epistemic-kvcache ")
    for name in ("serve", "config", "store", "cluster", "mcp", "healthcheck"):
        assert f"    {name} " in proc.stdout or f"    {name}\n" in proc.stdout


@pytest.mark.parametrize(
    "args",
    [
        ("serve", "--hot-capacity", "4GiB"),
        ("serve", "--hot-capacity=4GiB"),
        ("serve", "--back", "memory"),
        ("config", "show", "--hot-cap", "4GiB"),
        ("store", "check", "--persist", "x"),
    ],
)
def test_abbreviated_flags_are_refused(tmp_path: Path, args: tuple[str, ...]) -> None:
    proc = cli(tmp_path, *args)
    assert proc.returncode == 2, proc.stderr
    assert "unrecognized arguments: " in proc.stderr
    assert list(tmp_path.iterdir()) == []  # no server started, nothing created


def test_choices_are_listed_in_help(tmp_path: Path) -> None:
    out = cli(tmp_path, "serve", "--help").stdout
    assert "--backend durable|memory" in out
    assert "--dedup-scope namespace|global" in out
    assert "--log-format text|json" in out


def test_cluster_help_lists_only_what_the_check_reads(tmp_path: Path) -> None:
    out = cli(tmp_path, "cluster", "--help").stdout
    assert "--cluster-url URL" in out
    assert "--cluster-key-prefix" in out
    assert "--config FILE" in out
    assert "--deep" in out
    for unrelated in ("--tls-cert", "--jwt-secret", "--hot-capacity-bytes", "--addr", "--token"):
        assert unrelated not in out
    proc = cli(tmp_path, "cluster", "check", "--hot-capacity-bytes", "1GiB")
    assert proc.returncode == 2
    assert "unrecognized arguments" in proc.stderr


def test_config_show_names_every_source(tmp_path: Path) -> None:
    toml = tmp_path / "kv.toml"
    toml.write_text('warm_capacity_bytes = "3GiB"\nlog_level = "warning"\n')
    env = _env(
        EPISTEMIC_GRAPH_KVCACHE_HOT_CAPACITY_BYTES="2GiB",
        EPISTEMIC_GRAPH_KVCACHE_LOG_LEVEL="error",  # beats the file, loses to the flag
    )
    proc = cli(
        tmp_path, "config", "show", "--config", str(toml), "--log-level", "debug",
        "--token", TOKEN, "--format", "json", env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert list(doc) == [s.name for s in SETTINGS]
    assert doc["hot_capacity_bytes"] == {
        "value": "2GiB",
        "source": "env EPISTEMIC_GRAPH_KVCACHE_HOT_CAPACITY_BYTES",
    }
    assert doc["warm_capacity_bytes"] == {"value": "3GiB", "source": f"file {toml}"}
    assert doc["log_level"] == {"value": "debug", "source": "flag --log-level"}
    assert doc["cold_capacity_bytes"] == {"value": "100GiB", "source": "default"}
    assert doc["resp_addr"] == {"value": "127.0.0.1:6379", "source": "default"}
    assert doc["token"] == {"value": "(hidden)", "source": "flag --token"}
    assert TOKEN not in proc.stdout + proc.stderr
    text = cli(tmp_path, "config", "show", env=env).stdout
    assert any(
        line.split()
        == ["hot_capacity_bytes", "2GiB", "env", "EPISTEMIC_GRAPH_KVCACHE_HOT_CAPACITY_BYTES"]
        for line in text.splitlines()
    )
    assert list(tmp_path.iterdir()) == [toml]  # showing creates nothing


def test_config_show_reports_a_bad_value_like_serve(tmp_path: Path) -> None:
    proc = cli(tmp_path, "config", "show", "--hot-capacity-bytes", "lots")
    assert proc.returncode == 2
    assert "invalid hot_capacity_bytes" in proc.stderr
    assert "set by --hot-capacity-bytes" in proc.stderr


@contextlib.contextmanager
def _read_only_dir(parent: Path) -> Iterator[Path]:
    """An existing directory nobody may write, root included: a read-only tmpfs mount,
    else an immutable directory; skips when neither is possible here."""
    d = parent / "ro"
    d.mkdir()
    if os.getuid() != 0:
        d.chmod(0o555)
        try:
            yield d
        finally:
            d.chmod(0o755)
        return
    mount, umount = shutil.which("mount"), shutil.which("umount")
    if mount and umount:
        done = subprocess.run(
            [mount, "-t", "tmpfs", "-o", "ro", "tmpfs", str(d)], check=False, capture_output=True
        )
        if done.returncode == 0:
            try:
                yield d
            finally:
                subprocess.run([umount, str(d)], check=True)
            return
    chattr = shutil.which("chattr")
    if (
        chattr
        and subprocess.run([chattr, "+i", str(d)], check=False, capture_output=True).returncode == 0
    ):
        try:
            yield d
        finally:
            subprocess.run([chattr, "-i", str(d)], check=True)
        return
    pytest.skip("root here can neither mount a read-only tmpfs nor chattr +i a directory")


def test_unwritable_persist_dir_says_not_writable(tmp_path: Path) -> None:
    with _read_only_dir(tmp_path) as ro:
        assert not os.access(ro, os.W_OK)
        proc = cli(
            tmp_path,
            "serve",
            "--addr",
            "127.0.0.1:0",
            "--resp-addr",
            "off",
            "--persist-dir",
            str(ro),
        )
    assert proc.returncode == 2, proc.stderr
    assert "epistemic-kvcache serve: error: invalid persist_dir: not writable" in proc.stderr
    assert str(ro) in proc.stderr
    assert "Traceback" not in proc.stderr


def test_mcp_says_missing_vs_invalid_token(tmp_path: Path) -> None:
    pytest.importorskip("mcp")
    from servers import running_server

    with running_server(tmp_path / "kv", tokens={TOKEN: "default"}, resp=False) as srv:
        url = srv.url
        missing = cli(tmp_path, "mcp", env=_env(EPISTEMIC_GRAPH_KVCACHE_URL=url))
        wrong = cli(
            tmp_path, "mcp",
            env=_env(EPISTEMIC_GRAPH_KVCACHE_URL=url, EPISTEMIC_GRAPH_KVCACHE_TOKEN="w" * 32),
        )  # fmt: skip
    assert missing.returncode == 2
    assert "epistemic-kvcache mcp: error: missing EPISTEMIC_GRAPH_KVCACHE_TOKEN" in missing.stderr
    assert wrong.returncode == 2
    assert "epistemic-kvcache mcp: error: invalid EPISTEMIC_GRAPH_KVCACHE_TOKEN" in wrong.stderr
    assert "w" * 32 not in wrong.stderr


def test_mcp_says_when_the_server_is_not_answering(tmp_path: Path) -> None:
    pytest.importorskip("mcp")
    url = "http://127.0.0.1:9"  # discard port: nothing listens on it here
    for transport, env in (
        ("stdio", _env(EPISTEMIC_GRAPH_KVCACHE_URL=url, EPISTEMIC_GRAPH_KVCACHE_TOKEN=TOKEN)),
        ("http", _env(EPISTEMIC_GRAPH_KVCACHE_URL=url)),
    ):
        proc = cli(tmp_path, "mcp", "--transport", transport, "--listen", "127.0.0.1:0", env=env)
        assert proc.returncode == 1, (transport, proc.stderr)
        assert (
            f"epistemic-kvcache mcp: error: kv-cache server at {url} is not answering"
            in proc.stderr
        )


def test_configuration_md_quotes_the_real_size_error(tmp_path: Path) -> None:
    doc = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    quoted = doc.split("`epistemic-kvcache serve --hot-capacity-bytes -1`):\n\n```text\n", 1)[1]
    quoted = quoted.split("\n```", 1)[0]
    proc = cli(tmp_path, "serve", "--hot-capacity-bytes", "-1")
    assert proc.returncode == 2
    assert proc.stderr.strip() == quoted


def _troubleshooting_block(number: int) -> str:
    doc = (Path(__file__).resolve().parent.parent / "docs" / "troubleshooting.md").read_text()
    section = doc.split(f"\n## {number}. ", 1)[1]
    return section.split("```text\n", 1)[1].split("\n```", 1)[0]


def test_troubleshooting_quotes_the_real_start_up_errors(tmp_path: Path) -> None:
    """docs/troubleshooting.md sections 1-3 quote what `serve` really prints."""
    import socket

    with socket.socket() as held:  # held for the whole run: the port stays taken
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        taken = cli(tmp_path, "serve", "--addr", "127.0.0.1:0", "--resp-addr", f"127.0.0.1:{port}",
                    "--backend", "memory", "--token", TOKEN)  # fmt: skip
    assert taken.returncode == 1
    line = taken.stderr.strip().splitlines()[-1]
    hint = re.search(r"the next free port is (\d+) ", line)
    assert hint, line  # issue 28: a taken port names the flag and suggests a free one
    free = int(hint.group(1))
    assert port < free <= port + 20
    expected = _troubleshooting_block(1).replace("6380", "{free}").replace("6379", "{port}")
    expected = expected.format(free=free, port=port)
    assert line == expected

    bad = cli(tmp_path, "serve", "--hot-capacity-bytes", "-1")
    assert bad.stderr.strip() == _troubleshooting_block(2)

    with _read_only_dir(tmp_path) as ro:
        unwritable = cli(tmp_path, "serve", "--persist-dir", str(ro), "--resp-addr", "off")
    expected = _troubleshooting_block(3).replace("/var/lib/epistemic-kvcache", str(ro))
    assert unwritable.stderr.strip() == expected.replace("uid 998", f"uid {os.getuid()}")
