"""`CircuitBreaker`: answer at once while the server is known not to be answering.

A KV tier that is slower to fail than to recompute makes inference slower, so once one
request has timed out or could not connect, the client stops waiting on the server:

- CLOSED (normal): requests go to the server. A failure that means "the server is not
  answering" (connect refused or timed out, read timed out, connection reset or cut
  mid-body) calls `record_failure`, which OPENS the breaker. Answers from the server,
  even errors (5xx, 429), do not: the server is there.
- OPEN: `allow()` is False; the client answers a miss / False immediately, touching no
  socket. One background thread probes the server (`probe()`, a cheap request with the
  short lookup timeout): at once, then after `backoff_s`, doubling up to
  `max_backoff_s`. The first successful probe CLOSES the breaker. A real request that
  was already in flight and succeeds closes it too.

So a stalled server costs one timeout, then nothing, and a restarted server is used
again within `max_backoff_s` (plus one probe) of answering; a false alarm (a slow but
live server) is cleared by the first probe, which answers at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

DEFAULT_BACKOFF_S = 0.5
"""First pause between failed probes; doubled after each failure."""
DEFAULT_MAX_BACKOFF_S = 5.0
"""Longest pause between probes: a restarted server is used again within this."""


class CircuitBreaker:
    """Thread-safe two-state breaker with a background prober.

    `probe` is called from the prober thread and returns True when the server answered;
    it must bound its own duration (a short timeout) and must not raise.
    """

    def __init__(
        self,
        probe: Callable[[], bool],
        *,
        backoff_s: float = DEFAULT_BACKOFF_S,
        max_backoff_s: float = DEFAULT_MAX_BACKOFF_S,
        name: str = "kv-cache",
    ) -> None:
        if not backoff_s > 0 or not max_backoff_s >= backoff_s:
            raise ValueError(
                f"invalid back-off: need 0 < backoff_s <= max_backoff_s "
                f"(got {backoff_s!r}, {max_backoff_s!r})"
            )
        self._probe = probe
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._name = name
        self._lock = threading.Lock()
        self._open = False
        self._opened_at = 0.0
        self._reason = ""
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self.trips = 0
        """How many times the breaker opened."""

    # -- the fast path -----------------------------------------------------------------
    def allow(self) -> bool:
        """True when requests may go to the server (one attribute read)."""
        return not self._open

    @property
    def is_open(self) -> bool:
        """True while requests are answered without the server."""
        return self._open

    @property
    def reason(self) -> str:
        """Why the breaker last opened ('' if it never did)."""
        return self._reason

    def open_for_s(self) -> float:
        """Seconds since the breaker opened (0.0 when closed)."""
        return time.monotonic() - self._opened_at if self._open else 0.0

    # -- transitions -------------------------------------------------------------------
    def record_failure(self, detail: object) -> None:
        """The server did not answer: open (if closed) and start probing."""
        if self._stopped.is_set():
            return
        with self._lock:
            if self._open:
                return
            self._open = True
            self._opened_at = time.monotonic()
            self._reason = str(detail)
            self.trips += 1
            if self._thread is None:  # the prober clears this, under the lock, as it exits
                self._thread = threading.Thread(
                    target=self._run, name=f"{self._name}-probe", daemon=True
                )
                self._thread.start()
        log.warning(
            "%s: server not answering (%s); failing fast until it answers again",
            self._name,
            detail,
        )

    def record_success(self) -> None:
        """The server answered a request: close (if open)."""
        if not self._open:
            return
        self._close("a request succeeded")

    def _close(self, why: str, *, prober: bool = False) -> None:
        with self._lock:
            if prober:
                self._thread = None
            if not self._open:
                return
            self._open = False
            down_s = time.monotonic() - self._opened_at
        log.warning("%s: server answering again after %.1f s (%s)", self._name, down_s, why)

    def shutdown(self, timeout_s: float) -> None:
        """Stop probing; wait up to `timeout_s` for the prober to exit. Idempotent."""
        self._stopped.set()
        with self._lock:  # a prober seen under the lock has started (it starts under it)
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    # -- the prober --------------------------------------------------------------------
    def _run(self) -> None:
        pause = self._backoff_s
        while True:
            with self._lock:  # decide to exit under the lock: no failure is left unprobed
                if self._stopped.is_set() or not self._open:
                    self._thread = None
                    return
            try:
                ok = self._probe()
            except Exception:  # a probe must not raise; never let the thread die on it
                log.debug("%s: probe raised", self._name, exc_info=True)
                ok = False
            if ok:
                self._close("probe answered", prober=True)
                return
            if self._stopped.wait(pause):
                return
            pause = min(pause * 2, self._max_backoff_s)
