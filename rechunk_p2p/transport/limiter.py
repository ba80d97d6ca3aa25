"""Back-pressure on bytes held in a buffer.

Where it runs: task threads wait in :meth:`ByteLimiter.acquire_blocking`; the data plane's
event loop gives bytes back with :meth:`ByteLimiter.release`, which never blocks (one short
critical section). Nothing here awaits: a task thread that has room queues its pieces without
a round trip to the loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from rechunk_p2p.errors import RechunkRunError

#: Longest a waiting thread sleeps before it asks its ``stop`` predicate again (seconds)
_STOP_POLL = 0.1


@dataclass(frozen=True, slots=True)
class LimiterStatistics:
    """**Immutable.** A snapshot of a :class:`ByteLimiter`."""

    limit: int
    used: int
    max_used: int
    waits: int


class ByteLimiter:
    """**Thread-safe (guarded by ``_lock``).** Hold callers back while the bytes they hold
    exceed a limit.

    A single request larger than the limit is admitted when nothing else is held, so the
    limiter can never deadlock on one oversized piece batch.

    Parameters
    ----------
    limit
        Bytes that may be held at once.
    """

    def __init__(self, limit: int) -> None:
        self.limit = int(limit)
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self._used = 0
        self._max_used = 0
        self._waits = 0
        self._before_wait: list[Callable[[], None]] = []

    def add_before_wait(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` (from the waiting thread, without the lock) whenever a caller is
        about to wait for room: a holder of bytes that are not on their way to being
        released (pieces staged until more come) hands them on, so waiting cannot
        deadlock on them."""
        with self._lock:
            self._before_wait.append(hook)

    def remove_before_wait(self, hook: Callable[[], None]) -> None:
        """Stop calling ``hook``; a hook not added is ignored."""
        with self._lock:
            if hook in self._before_wait:
                self._before_wait.remove(hook)

    @property
    def used(self) -> int:
        with self._lock:
            return self._used

    def _fits(self, nbytes: int) -> bool:
        return self._used == 0 or self._used + nbytes <= self.limit

    def acquire_blocking(self, nbytes: int, stop: Callable[[], bool] | None = None) -> bool:
        """From a thread: wait until ``nbytes`` fit under the limit, then hold them.

        Returns ``False``, holding nothing, as soon as ``stop()`` is true while waiting
        (checked at least every 0.1 s, and whenever bytes are released).
        """
        with self._lock:
            if self._fits(nbytes):
                self._hold(nbytes)
                return True
            self._waits += 1
        while True:
            with self._lock:
                hooks = list(self._before_wait)
            for hook in hooks:  # again after every wake-up: bytes staged meanwhile too
                hook()
            with self._lock:
                if not self._fits(nbytes):
                    if stop is not None and stop():
                        return False
                    self._freed.wait(_STOP_POLL)
                if self._fits(nbytes):
                    self._hold(nbytes)
                    return True

    def _hold(self, nbytes: int) -> None:
        self._used += nbytes
        self._max_used = max(self._max_used, self._used)

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` and wake waiters. Never blocks beyond the lock."""
        with self._lock:
            if nbytes > self._used:
                raise RechunkRunError(f"Released {nbytes} bytes, {self._used} were held")
            self._used -= nbytes
            self._freed.notify_all()

    def wake(self) -> None:
        """Make waiters ask their ``stop`` predicate now (e.g. their run was closed)."""
        with self._lock:
            self._freed.notify_all()

    def statistics(self) -> LimiterStatistics:
        with self._lock:
            return LimiterStatistics(self.limit, self._used, self._max_used, self._waits)
