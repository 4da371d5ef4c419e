"""The group committer: one thread that makes queued writes durable, in batches.

How it works
------------
Writers queue an operation with a `concurrent.futures.Future` and wait on it (or await
it through `asyncio.wrap_future`). The committer thread takes every queued operation up
to `max_batch_bytes`, hands the batch to the backend's `commit` (which writes the log
and syncs once), and the backend resolves the futures.

Callers cannot disturb it:
- Before a batch is committed, each future is moved to RUNNING with
  `set_running_or_notify_cancel()`. A future its caller cancelled (client gone, task
  cancelled, shutdown) is dropped from the batch, so nothing is written for it; once
  RUNNING it can no longer be cancelled, and resolving it can never raise
  `InvalidStateError` in this thread.
- An unexpected exception from `commit` or from the idle work is a *store fault*, not
  a crash of the thread: every waiting and every later write fails at once with
  `StoreFaultError` (the store turns read-only), `fault` says why, and it is logged once.
- `stop(timeout_s)` never hangs: what is still queued fails with `StoreClosedError`.
Between batches, `idle` runs maintenance (compaction) in small steps.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from epistemic_kvcache.errors import StoreClosedError, StoreFaultError

log = logging.getLogger(__name__)


class Queued(Protocol):
    """What the committer needs of a queued operation."""

    future: concurrent.futures.Future[Any]

    @property
    def nbytes(self) -> int: ...


def settle(future: concurrent.futures.Future[Any], result: Any) -> None:
    """Resolve `future` with a result or an exception, unless it is settled already."""
    if future.done():
        return
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)


class Committer:
    """Runs `commit(batch)` on its own thread for every batch of queued operations."""

    def __init__(
        self,
        *,
        commit: Callable[[list[Any]], None],
        idle: Callable[[], bool],
        release: Callable[[list[Any]], None],
        max_batch_bytes: int,
        idle_interval_s: float = 1.0,
        name: str = "kvcache-committer",
    ) -> None:
        self._commit = commit
        self._idle = idle
        self._release = release
        self._max_batch_bytes = max_batch_bytes
        self._idle_interval_s = idle_interval_s
        self._queue: deque[Any] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._busy = False
        self.fault: str | None = None
        self.wants_idle_work = False
        self.max_gather_s = 0.001
        self._last_batch = 0
        self._last_commit_s = 0.0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.fault is None

    def queued(self) -> int:
        return len(self._queue)

    def submit(self, op: Any) -> None:
        """Queue `op`. Raises `StoreFaultError` after a fault, `StoreClosedError` after stop."""
        with self._cv:
            if self.fault is not None:
                raise StoreFaultError(f"the store is read-only after a fault: {self.fault}")
            if self._stopping:
                raise StoreClosedError("the store is closed")
            self._queue.append(op)
            self._cv.notify()

    def submit_many(self, ops: list[Any]) -> None:
        """Queue all of `ops` at once (so they land in one batch)."""
        with self._cv:
            if self.fault is not None:
                raise StoreFaultError(f"the store is read-only after a fault: {self.fault}")
            if self._stopping:
                raise StoreClosedError("the store is closed")
            self._queue.extend(ops)
            self._cv.notify()

    def kick(self) -> None:
        """Wake the thread for idle work (e.g. compaction became due)."""
        with self._cv:
            self.wants_idle_work = True
            self._cv.notify()

    def _take(self) -> list[Any] | None:
        """The next batch; [] when there is only idle work; None when stopping."""
        with self._cv:
            while not self._queue and not self._stopping and not self.wants_idle_work:
                if not self._cv.wait(timeout=self._idle_interval_s):
                    self.wants_idle_work = True  # periodic maintenance
            if not self._queue:
                if self._stopping:
                    return None
                self.wants_idle_work = False
                return []
            self._gather()
            batch = [self._queue.popleft()]
            size = batch[0].nbytes
            while self._queue and size < self._max_batch_bytes:
                op = self._queue.popleft()
                size += op.nbytes
                batch.append(op)
            self._busy = True
            return batch

    def _gather(self) -> None:
        """Group commit under steady concurrency (lock held): when fewer operations are
        queued than the last batch had, their writers are most likely just getting their
        previous answers and about to send again, so wait a fraction of a sync for them.
        One sync for eight writes beats two syncs for four each (PostgreSQL's
        `commit_delay`, adaptive). Never waits for a lone writer, never more than
        `max_gather_s`."""
        want = self._last_batch
        if want <= 1 or len(self._queue) >= want or self._stopping:
            return
        deadline = time.monotonic() + min(self.max_gather_s, 0.5 * self._last_commit_s)
        while len(self._queue) < want and not self._stopping:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cv.wait(left)

    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            try:
                if not batch:
                    if self._idle():
                        self.wants_idle_work = True  # more to do: come back soon
                    continue
                live = [op for op in batch if op.future.set_running_or_notify_cancel()]
                dropped = [op for op in batch if op.future.cancelled()]
                if dropped:
                    self._release(dropped)
                if live:
                    t0 = time.monotonic()
                    self._commit(live)
                    self._last_commit_s = time.monotonic() - t0
                    self._last_batch = len(live)
            except BaseException as exc:  # a store fault: loud, read-only, never a hang
                self._fail(batch, exc)
                return
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _fail(self, batch: list[Any], exc: BaseException) -> None:
        reason = f"{type(exc).__name__}: {exc}"
        log.critical(
            "store fault in the committer; the store is read-only until restarted: %s",
            reason,
            exc_info=exc,
        )
        with self._cv:
            self.fault = reason
            rest = list(self._queue)
            self._queue.clear()
        err = StoreFaultError(f"the store is read-only after a fault: {reason}")
        for op in [*batch, *rest]:
            settle(op.future, err)
        with contextlib.suppress(Exception):
            self._release([*batch, *rest])

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Finish the batch in progress (and what is queued, within `timeout_s`), then stop.

        Returns False when the thread did not finish in time; whatever was still queued
        then fails with `StoreClosedError`."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(timeout_s)
        done = not self._thread.is_alive()
        with self._cv:
            rest = list(self._queue)
            self._queue.clear()
        if rest:
            err = StoreClosedError("the store closed before this write was committed")
            for op in rest:
                settle(op.future, err)
            with contextlib.suppress(Exception):
                self._release(rest)
        return done
