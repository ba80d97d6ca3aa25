"""Back-pressure on bytes held in a buffer.

Where it runs: the data plane's event loop (loop-confined asyncio primitives).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from rechunk_p2p.errors import RechunkRunError


@dataclass(frozen=True, slots=True)
class LimiterStatistics:
    """**Immutable.** A snapshot of a :class:`ByteLimiter`."""

    limit: int
    used: int
    max_used: int
    waits: int


class ByteLimiter:
    """**Loop-confined.** Hold callers back while the bytes they hold exceed a limit.

    A single request larger than the limit is admitted when nothing else is held, so the
    limiter can never deadlock on one oversized shard batch.

    Parameters
    ----------
    limit
        Bytes that may be held at once.
    """

    def __init__(self, limit: int) -> None:
        self.limit = int(limit)
        self.used = 0
        self.max_used = 0
        self.waits = 0
        self._condition: asyncio.Condition | None = None

    def _cond(self) -> asyncio.Condition:
        if self._condition is None:
            self._condition = asyncio.Condition()
        return self._condition

    def _fits(self, nbytes: int) -> bool:
        return self.used == 0 or self.used + nbytes <= self.limit

    async def acquire(self, nbytes: int) -> None:
        """Wait until ``nbytes`` fit under the limit, then hold them."""
        if not self._fits(nbytes):
            self.waits += 1
            async with self._cond():
                await self._cond().wait_for(lambda: self._fits(nbytes))
        self.used += nbytes
        self.max_used = max(self.max_used, self.used)

    async def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` and wake waiters."""
        self.used -= nbytes
        if self.used < 0:
            raise RechunkRunError(f"Released more bytes than were held ({self.used})")
        async with self._cond():
            self._cond().notify_all()

    def statistics(self) -> LimiterStatistics:
        return LimiterStatistics(self.limit, self.used, self.max_used, self.waits)
