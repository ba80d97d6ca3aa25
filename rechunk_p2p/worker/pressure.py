"""When distributed pauses a worker, the runs open there move the pieces they hold in memory
to disk, and the runs it opens or continues while paused keep none in memory.

Where it runs: the worker's event loop (a watching task); the moves in the offload pool.

distributed pauses a worker whose process memory passes ``distributed.worker.memory.pause``
(80 % of its limit): it starts no task until its memory falls back. The engine's pieces
are within the worker's memory budget (:mod:`.memory_shares`), but the rest of the process
(the data distributed holds, the tasks before the rechunk, a heap that kept what it once
held) can bring it there all the same; the outputs waiting on a paused worker then wait
for its memory to fall, and the pieces in memory are what the engine can give back. The
stall watch on the scheduler (:mod:`rechunk_p2p.stalls`) moves transfers off a paused
worker, and fails a run that waits on one for too long.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from dask.utils import format_bytes

if TYPE_CHECKING:
    from rechunk_p2p.worker.plugin import RechunkWorkerPlugin

logger = logging.getLogger(__name__)

#: How often the watch looks at the worker's status (a pause lasts seconds at least: the
#: memory monitor looks every 100 ms, and unpauses only below the pause fraction)
PRESSURE_INTERVAL = 0.5


def is_paused(worker: Any) -> bool:
    """Whether distributed paused ``worker`` (it runs no task, short of memory)."""
    return getattr(getattr(worker, "status", None), "name", "") == "paused"


class PressureWatch:
    """**Loop-confined** (the worker's loop). Spills the open runs' pieces when the worker
    is paused, once a pause; :attr:`MemoryShares.pressed
    <rechunk_p2p.worker.memory_shares.MemoryShares.pressed>` while it stays paused."""

    def __init__(self, plugin: RechunkWorkerPlugin) -> None:
        self._plugin = plugin
        self._task: asyncio.Future[None] | None = None
        self.moved = 0  # bytes moved to disk, in all

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._watch())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(PRESSURE_INTERVAL)
            try:
                await self.check()
            except Exception:  # the next look tries again
                logger.exception("Moving the pieces of a paused worker to disk failed")

    async def check(self) -> int:
        """Look at the worker once: spill the open runs if it was just paused; the bytes
        moved to disk."""
        plugin = self._plugin
        paused = is_paused(plugin.worker)
        if paused == plugin.shares.pressed:
            return 0
        plugin.shares.pressed = paused
        if not paused or plugin.offload is None:
            return 0
        moved = 0
        for run in plugin.open_runs():
            moved += await plugin.offload.to_thread(run.spill_blocking)
            run.release_memory()
        self.moved += moved
        if moved:
            logger.warning(
                "%s is paused (short of memory): moved %s of rechunk pieces to disk; "
                "its runs keep none in memory until it resumes",
                plugin.worker.address,
                format_bytes(moved),
            )
        return moved
