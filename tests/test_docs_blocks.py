"""Every fenced code block in README.md and docs/*.md runs (or parses) here.

How it works
- Blocks are found by their fence; the fence's language says what to do:
  `sh`/`console` run with bash (`set -euo pipefail`), `python` with this interpreter,
  `json`/`yaml` are parsed, `toml` is parsed and every key checked against the server's
  settings. `text` marks a block that is not code (output samples, formats, diagrams);
  a block without a language is an error, so nothing slips through unlabelled.
- Blocks run against a real server started for this module (memory backend, free
  ports) in a scratch directory holding `kvcache-data/token` (its token) and links to
  the repository's files; the documented ports (9130 HTTP, 6379 RESP, LMCache's 5555
  and 8080) are rewritten to free ones, and the client variables point at the server.
  Python blocks get `block`, `key`, `keys`, `buffer`, `buffers` predefined, so API
  overviews can name them without boilerplate.
- An HTML comment on the line before a fence annotates it:
  `<!-- docs-test: skip: <reason> -->` (not run; the reason is required and the list is
  printed and bounded by MAX_SKIPPED) or `<!-- docs-test: background -->` (a server
  command: it must still be running after BACKGROUND_S seconds, then it is stopped).

Adding docs: write the block with a language; if it cannot run here, say why in a skip.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from epistemic_kvcache.config import SETTINGS_BY_NAME, load_config
from epistemic_kvcache.server.app import ServerHandle, ServerThread
from helpers import held_port

ROOT = Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOKEN = "docs-token-0123456789abcdef0123456789"
MAX_SKIPPED = 12
BACKGROUND_S = 20.0
RUNNABLE = {"sh", "console", "python", "json", "yaml", "toml", "text"}
FENCE = re.compile(r"(?ms)^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$")
NOTE = re.compile(r"<!--\s*docs-test:\s*(skip|background)\s*(?::\s*(.*?))?\s*-->\s*$")

PRELUDE = """\
block = bytes(range(256)) * 16
key = "docs/example-key"
keys = [key, "docs/other-key"]
buffer = bytearray(len(block))
buffers = [bytearray(len(block)) for _ in keys]
"""


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    code: str
    note: str | None
    reason: str | None

    @property
    def id(self) -> str:
        return f"{self.path.name}:{self.line}"


def blocks() -> list[Block]:
    out = []
    for path in FILES:
        text = path.read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            note = NOTE.search(before)
            out.append(
                Block(
                    path,
                    line,
                    m.group(1),
                    m.group(2),
                    note.group(1) if note else None,
                    note.group(2) if note else None,
                )
            )
    return out


ALL = blocks()


def _free_port() -> int:
    return held_port()  # held for the rest of the run: never a released port


@dataclass
class Env:
    server: ServerHandle
    cwd: Path
    ports: dict[str, int]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    cwd = tmp_path_factory.mktemp("docs")
    for name in ("README.md", "LICENSE", "deploy", "docs", "scripts", "bench"):
        (cwd / name).symlink_to(ROOT / name)
    (cwd / "kvcache-data").mkdir()
    (cwd / "kvcache-data" / "token").write_text(TOKEN + "\n")
    config = load_config(
        {
            "addr": "127.0.0.1:0",
            "resp_addr": "127.0.0.1:0",
            "backend": "memory",
            "token": [TOKEN],
            "stats_log_interval_s": "0",
        },
        {},
    )
    with ServerThread(config) as handle:
        assert handle.resp is not None
        ports = {
            "9130": handle.http.port,
            "6379": handle.resp.port,
            "5555": _free_port(),
            "8080": _free_port(),
        }
        yield Env(handle, cwd, ports)


def _rewrite(code: str, ports: dict[str, int]) -> str:
    for old, new in ports.items():
        code = re.sub(rf"(?<![\d.]){old}(?!\d)", str(new), code)
    return code


def _environ(e: Env) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("EPISTEMIC_GRAPH_KVCACHE_", "LMCACHE_"))
        and k != "GRAPH_SERVICE_PERSIST_DIR"
    }
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["EPISTEMIC_GRAPH_KVCACHE_URL"] = e.server.http_url
    env["EPISTEMIC_GRAPH_KVCACHE_TOKEN"] = TOKEN
    env["LMCACHE_DISABLE_BANNER"] = "1"
    env["PYTHONWARNINGS"] = "ignore"
    return env


def _command(block: Block, code: str) -> list[str]:
    if block.lang == "python":
        return [sys.executable, "-c", PRELUDE + textwrap.dedent(code)]
    if block.lang == "console":  # run the `$ ` lines, ignore the output lines
        code = "\n".join(line[2:] for line in code.splitlines() if line.startswith("$ "))
    return ["bash", "-euo", "pipefail", "-c", code]


def test_every_block_is_labelled() -> None:
    unlabelled = [b.id for b in ALL if b.lang not in RUNNABLE]
    assert not unlabelled, f"label these blocks (sh, python, json, text, ...): {unlabelled}"
    assert all(b.reason for b in ALL if b.note == "skip"), "a skip needs a reason"


def test_skips_are_few(capsys: pytest.CaptureFixture[str]) -> None:
    skipped = [b for b in ALL if b.note == "skip"]
    with capsys.disabled():
        print(f"\ndocs blocks: {len(ALL)}, not run ({len(skipped)}):")
        for b in skipped:
            print(f"  {b.id} [{b.lang}]: {b.reason}")
    assert len(skipped) <= MAX_SKIPPED


RUN = [b for b in ALL if b.note != "skip" and b.lang in RUNNABLE - {"text"}]


@pytest.mark.redis
@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_block(block: Block, env: Env) -> None:
    code = _rewrite(block.code, env.ports)
    if block.lang == "json":
        json.loads(code)
        return
    if block.lang == "yaml":
        list(yaml.safe_load_all(code))
        return
    if block.lang == "toml":
        for name, value in tomllib.loads(code).items():
            SETTINGS_BY_NAME[name].parse(value)
        return
    if block.note == "background":
        if "lmcache" in code:
            pytest.importorskip("lmcache")
        with (env.cwd / f"{block.id}.log").open("wb") as log:
            proc = subprocess.Popen(
                _command(block, code),
                cwd=env.cwd,
                env=_environ(env),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                deadline = time.monotonic() + BACKGROUND_S
                while time.monotonic() < deadline and proc.poll() is None:
                    time.sleep(0.5)
                out = (env.cwd / f"{block.id}.log").read_text(errors="replace")
                assert proc.poll() is None, f"{block.id} exited {proc.returncode}:\n{out[-3000:]}"
                assert "Traceback" not in out, out[-3000:]
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait(timeout=30)
        return
    proc = subprocess.run(
        _command(block, code),
        cwd=env.cwd,
        env=_environ(env),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, (
        f"{block.id} failed ({proc.returncode}):\n{code}\n--- stdout\n{proc.stdout[-3000:]}"
        f"\n--- stderr\n{proc.stderr[-3000:]}"
    )
