"""`epistemic-kvcache serve` as a child process: the one harness for tests and benchmarks
that need the server in a process of its own (to signal or SIGKILL it, to run it from
another source tree, to measure its CPU). `ServerThread` (server/app.py) is the
in-process one.

How it works:
- `ServerProcess(persist_dir, *flags, ...)` runs `python -m epistemic_kvcache serve`
  with its listeners on loopback port 0: the kernel picks the ports and they are read
  back from the server's `listening http=HOST:PORT` / `listening resp=HOST:PORT` lines,
  so no port released earlier is ever used. It returns once the server logs its
  `started epistemic-kvcache ...` line (every listener accepts by then); a server that
  exits first, or says nothing for `start_timeout_s`, raises `ServerStartError` with
  its output.
- Keyword options name the usual flags (`backend`, `token`, `token_file`,
  `event_loops`, RESP on/off); one left `None` is not passed, so the server's default
  or its environment applies. `flags` go last and win (argparse keeps the last value),
  which is how JWT, TLS and every other setting are passed.
- The environment is this process's without the server's own variables
  (`EPISTEMIC_GRAPH_*`, `GRAPH_SERVICE_PERSIST_DIR`), unless `keep_env`; `env` then sets
  variables (None removes one) and `pythonpath` is put first on `PYTHONPATH` (a source
  tree to run the server from).
- A thread pumps the output (stdout and stderr as one stream) into `output` for the
  process's whole life, so a chatty log never fills the pipe and stalls the server;
  `wait_for(pattern)` waits for a line; `log_path` also appends every line to a file.
- `stop()` sends SIGTERM (the graceful stop; a SIGSTOPped server is continued so it
  can act on it) and SIGKILL after `timeout_s`; `kill()` sends SIGKILL; `wait()` waits.
  Each returns the exit status once the process is gone, and closes the pipe and the
  log file. As a context manager the process is `stop()`ped at the end.
"""

from __future__ import annotations

import os
import re
import signal as signals
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Final, TypeAlias

from epistemic_kvcache.config import PERSIST_DIR_ENV_ALIAS, Address

LOOPBACK_ANY_PORT: Final = "127.0.0.1:0"
LISTENING_RE: Final = re.compile(r"listening (http|resp)=(\S+):(\d+)")
"""The line the server logs for each address it accepts on (after the bind)."""
STARTED: Final = "started epistemic-kvcache "
"""The line the server logs once every listener accepts."""
SERVER_ENV_PREFIX: Final = "EPISTEMIC_GRAPH_"
"""Variables of the server and its client (`EPISTEMIC_GRAPH_KVCACHE_*`) start so."""
StrPath: TypeAlias = str | os.PathLike[str]


class ServerStartError(RuntimeError):
    """The server exited, or logged no `started` line in time: `returncode` (negative:
    killed by that signal, here after the timeout) and everything it printed."""

    def __init__(self, message: str, returncode: int | None, output: str) -> None:
        super().__init__(f"{message}; its output:\n{output}")
        self.returncode = returncode
        self.output = output


def write_token_file(path: StrPath, tokens: Mapping[str, str]) -> Path:
    """Write `tokens` (token -> tenant) as a token file the server accepts: one
    `<token> <tenant>` line each, mode 0600 (it refuses a file others may read)."""
    path = Path(path)
    path.write_text("".join(f"{token} {tenant}\n" for token, tenant in tokens.items()))
    path.chmod(0o600)
    return path


def child_env(
    env: Mapping[str, str | None] | None = None,
    *,
    keep_env: bool = False,
    pythonpath: StrPath | None = None,
) -> dict[str, str]:
    """The environment `ServerProcess` gives the server (see the module docstring)."""
    out = {
        name: value
        for name, value in os.environ.items()
        if keep_env or not (name.startswith(SERVER_ENV_PREFIX) or name == PERSIST_DIR_ENV_ALIAS)
    }
    for name, value in (env or {}).items():
        if value is None:
            out.pop(name, None)
        else:
            out[name] = value
    if pythonpath is not None:
        rest = out.get("PYTHONPATH")
        out["PYTHONPATH"] = os.fspath(pythonpath) + (os.pathsep + rest if rest else "")
    return out


class ServerProcess:
    """`python -m epistemic_kvcache serve` in a child process (see the module docstring).

    `persist_dir`: `--persist-dir` (relative to `cwd`; None: not passed). `resp`: True
    listens on loopback port 0, False passes `off`, a string is the address. `program`
    replaces `-m epistemic_kvcache` (a script taking the same arguments). `keep_lines`
    keeps only the last lines of the output (a long run). `start_timeout_s` bounds the
    wait for the `started` line."""

    def __init__(
        self,
        persist_dir: StrPath | None,
        *flags: str,
        backend: str | None = None,
        token: str | None = None,
        token_file: StrPath | None = None,
        addr: str | None = LOOPBACK_ANY_PORT,
        resp: bool | str | None = True,
        event_loops: int | None = None,
        cwd: StrPath | None = None,
        env: Mapping[str, str | None] | None = None,
        keep_env: bool = False,
        pythonpath: StrPath | None = None,
        program: Sequence[str] = ("-m", "epistemic_kvcache"),
        python: str = sys.executable,
        log_path: StrPath | None = None,
        keep_lines: int | None = None,
        start_timeout_s: float = 60.0,
    ) -> None:
        named: list[tuple[str, str | None]] = [
            ("--addr", addr),
            (
                "--resp-addr",
                LOOPBACK_ANY_PORT if resp is True else "off" if resp is False else resp,
            ),
            ("--persist-dir", None if persist_dir is None else os.fspath(persist_dir)),
            ("--backend", backend),
            ("--token", token),
            ("--token-file", None if token_file is None else os.fspath(token_file)),
            ("--event-loops", None if event_loops is None else str(event_loops)),
        ]
        self.command: list[str] = [python, *program, "serve"]
        self.command += [
            part for flag, value in named if value is not None for part in (flag, value)
        ]
        self.command += flags
        self.output: list[str] = []
        """Every line printed so far, with its newline (the last `keep_lines` only)."""
        self.addresses: dict[str, list[Address]] = {}
        """wire ("http", "resp") -> the addresses it accepts on."""
        self._keep_lines = keep_lines
        self._lines_seen = 0
        self._started = False
        self._eof = False
        self._finished = False
        self._cond = threading.Condition()
        self.proc = subprocess.Popen(
            self.command,
            cwd=cwd,
            env=child_env(env, keep_env=keep_env, pythonpath=pythonpath),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            encoding="utf-8",
            errors="backslashreplace",
        )
        self._log: IO[str] | None = None if log_path is None else open(log_path, "a")  # noqa: SIM115
        self._pump = threading.Thread(
            target=self._read, name=f"serve-{self.proc.pid}-output", daemon=True
        )
        self._pump.start()
        with self._cond:
            self._cond.wait_for(lambda: self._started or self._eof, start_timeout_s)
            started = self._started
        if not started:
            exited = self.proc.poll() is not None
            returncode = self.kill()
            why = f"exited with {returncode}" if exited else f"not started in {start_timeout_s} s"
            raise ServerStartError(f"{' '.join(self.command)}: {why}", returncode, self.text)

    def _read(self) -> None:
        stream = self.proc.stdout
        assert stream is not None
        try:
            for line in stream:
                with self._cond:
                    if self._log is not None:
                        self._log.write(line)
                        self._log.flush()
                    self.output.append(line)
                    self._lines_seen += 1
                    if self._keep_lines is not None and len(self.output) > self._keep_lines:
                        del self.output[: -self._keep_lines]
                    if m := LISTENING_RE.search(line):
                        address = Address(m.group(2).strip("[]"), int(m.group(3)))
                        self.addresses.setdefault(m.group(1), []).append(address)
                    self._started = self._started or STARTED in line
                    self._cond.notify_all()
        except (OSError, ValueError):
            pass  # the pipe was closed under it (`_finish` gave up waiting for the end)
        finally:
            with self._cond:
                self._eof = True
                self._cond.notify_all()

    # -- where it listens, what it said ---------------------------------------------------

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def ports(self) -> dict[str, int]:
        """wire -> the port of its first address."""
        return {wire: addrs[0].port for wire, addrs in self.addresses.items()}

    @property
    def http(self) -> Address:
        return self.addresses["http"][0]

    @property
    def resp(self) -> Address | None:
        """The RESP listener's first address (None: RESP is off)."""
        addrs = self.addresses.get("resp")
        return addrs[0] if addrs else None

    @property
    def http_port(self) -> int:
        return self.http.port

    @property
    def resp_port(self) -> int:
        if self.resp is None:
            raise LookupError("the RESP listener is off")
        return self.resp.port

    def url(self, scheme: str = "http", host: str | None = None) -> str:
        """The HTTP listener's base URL (`https` with TLS; `host` instead of its own)."""
        address = self.http if host is None else Address(host, self.http.port)
        return f"{scheme}://{address}"

    @property
    def text(self) -> str:
        """The output so far as one string."""
        with self._cond:
            return "".join(self.output)

    @property
    def returncode(self) -> int | None:
        """The exit status; None while it runs."""
        return self.proc.poll()

    def wait_for(self, pattern: str, timeout_s: float = 30.0, *, since: int = 0) -> re.Match[str]:
        """The first match of `pattern` in a line of the output (from its line `since`,
        counted from the start), waiting up to `timeout_s` for one to be printed."""
        regex = re.compile(pattern)
        found: list[re.Match[str]] = []

        def match() -> bool:
            first = max(0, since - (self._lines_seen - len(self.output)))
            found.extend(m for line in self.output[first:] if (m := regex.search(line)))
            return bool(found) or self._eof

        with self._cond:
            self._cond.wait_for(match, timeout_s)
        if not found:
            why = "exited" if self._eof else f"no such line in {timeout_s} s"
            raise TimeoutError(f"{pattern!r} not printed ({why}); output:\n{self.text}")
        return found[0]

    @property
    def lines_seen(self) -> int:
        """How many lines it printed so far (for `wait_for(..., since=)`)."""
        return self._lines_seen

    # -- stopping -----------------------------------------------------------------------

    def signal(self, sig: int) -> None:
        """Send `sig` (nothing once the process has exited)."""
        self.proc.send_signal(sig)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (and SIGCONT), SIGKILL if still running after `timeout_s`: the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signals.SIGTERM)
            self.proc.send_signal(signals.SIGCONT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.wait()

    def kill(self) -> int:
        """SIGKILL: the exit status."""
        self.proc.kill()
        return self.wait()

    def wait(self, timeout_s: float | None = None) -> int:
        """Wait for the process to exit (`subprocess.TimeoutExpired` after `timeout_s`),
        then for the rest of its output: the exit status."""
        returncode = self.proc.wait(timeout_s)
        self._finish()
        return returncode

    def _finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        self._pump.join(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        with self._cond:
            if self._log is not None:
                self._log.close()
                self._log = None

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.returncode is None else f"exited {self.returncode}"
        return f"<ServerProcess pid={self.pid} {state} {self.ports}>"
