"""The scheduler process's objects frozen out of full garbage collections while a rechunk is
on the scheduler, and given back once it is idle.

Where it runs: the scheduler's event loop (the scheduler plugin's graph and run hooks, and the
watching task).
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rechunk_p2p.settings import SchedulerSettings

if TYPE_CHECKING:
    from rechunk_p2p.worker.tuning import TuningHold

#: How long the scheduler holds no run and no rechunk graph before the objects frozen for
#: rechunks are given back: longer than the pauses between a pipeline's rechunks
IDLE_SECONDS = 5.0

#: Barrier states in which a rechunk graph keeps the scheduler busy only through its run:
#: done, failed, or released (its outputs are done, or no longer wanted; a new graph's
#: barrier is released only until the scheduler transitions it, in the same step)
_SETTLED = frozenset({"memory", "erred", "released", "forgotten"})


class SchedulerTuning:
    """**Loop-confined** (the scheduler's loop; :func:`materializing` reaches it from any
    thread). While the scheduler builds or holds a rechunk's graph, or holds its run, the
    objects of its process are frozen out of full garbage collections, and so are the
    survivors of each full collection (a hold of
    :data:`~rechunk_p2p.worker.tuning.FREEZE_ONLY`).

    A full collection walks every tracked object of the process and stops its threads,
    the event loop included. The scheduler's process holds distributed's state of every
    task, worker and client, and on a ``LocalCluster`` the user's own objects too: at 32
    workers it took 120-210 ms, in most runs once during the rechunk. Frozen, a
    collection walks only what was made since. Once no graph with a rechunk is pending and
    no run is open for :data:`IDLE_SECONDS`, the objects are unfrozen and what the runs left
    is collected (one full collection, when the scheduler has no rechunk; when it closes,
    the objects are unfrozen without it).

    ``tasks`` gives the scheduler's tasks by key; ``runs_open`` whether its plugin holds an
    open run.
    """

    def __init__(self, tasks: Callable[[], dict], runs_open: Callable[[], bool]) -> None:
        self._tasks = tasks
        self._runs_open = runs_open
        self._hold: TuningHold | None = None
        self._barriers: set[Any] = set()  # barrier keys of graphs not settled yet
        self._task: asyncio.Future[None] | None = None
        self._loop = asyncio.get_running_loop()
        with _LIVE_LOCK:
            _LIVE.add(self)

    @property
    def held(self) -> bool:
        """Whether this scheduler holds the freeze."""
        return self._hold is not None

    def graph(self, barriers: list[Any]) -> None:
        """A graph with the rechunks of ``barriers`` arrived: freeze now (O(1)), before the
        scheduler transitions its tasks, and watch for the scheduler to be idle."""
        self._barriers.update(barriers)
        if self._hold is None:
            self._adopt(_hold_freeze())

    def _adopt(self, hold: TuningHold) -> None:
        """Keep a hold of the freeze taken (here, or by :func:`materializing`) as this
        scheduler's, and watch for it to be idle; a hold beyond the one kept is given back."""
        if self._hold is not None:
            hold.release()
            return
        self._hold = hold
        self._task = asyncio.ensure_future(self._watch())

    def stop(self) -> None:
        """The plugin's scheduler closes: give the objects back now."""
        with _LIVE_LOCK:
            _LIVE.discard(self)
        if self._task is not None:
            self._task.cancel()
        self._release(collect=False)

    def busy(self) -> bool:
        """A run is open, or a rechunk graph's barrier has not settled (it waits for its
        transfers, or their inputs)."""
        if self._runs_open():
            return True
        tasks = self._tasks()
        for key in list(self._barriers):
            ts = tasks.get(key)
            if ts is None or ts.state in _SETTLED:
                self._barriers.discard(key)
        return bool(self._barriers)

    def _release(self, collect: bool) -> None:
        if self._hold is None:
            return
        hold, self._hold = self._hold, None
        self._task = None
        self._barriers.clear()
        hold.release()
        hold.tuning.unfreeze_unused(collect=collect)

    async def _watch(self) -> None:
        """Release once the scheduler has not been busy for :data:`IDLE_SECONDS`."""
        loop = asyncio.get_running_loop()
        idle_since = None
        while self.held:
            await asyncio.sleep(IDLE_SECONDS / 4)
            if self.busy():
                idle_since = None
            elif idle_since is None:
                idle_since = loop.time()
            elif loop.time() - idle_since >= IDLE_SECONDS:
                self._release(collect=True)


def _hold_freeze() -> TuningHold:
    """A hold of the process's freeze, imported with the first rechunk graph: the client
    side (which also unpickles the scheduler plugin) loads no worker code."""
    from rechunk_p2p.worker.tuning import FREEZE_ONLY, PROCESS_TUNING

    return PROCESS_TUNING.acquire(FREEZE_ONLY)


_LIVE: weakref.WeakSet[SchedulerTuning] = weakref.WeakSet()  # this process's schedulers
_LIVE_LOCK = threading.Lock()


def materializing() -> None:
    """A rechunk's layer is made, or its tasks built, in this process (any thread): where a
    scheduler of the engine runs here, freeze now, and let it count the hold as its own.

    The scheduler builds a submitted graph (materialization, then ``dask.order``) in a thread
    of its own, before its plugins see the graph; with thousands of tasks the allocations
    set off full collections of the process there, stops of its loop of 170-410 ms. The
    client of a ``LocalCluster`` shares the scheduler's process: the layer made there
    freezes it before the graph is serialized and submitted (full collections of 113-137 ms
    in that step before). A hold nothing submits lasts until the scheduler has been idle
    for :data:`IDLE_SECONDS`.
    """
    with _LIVE_LOCK:
        live = list(_LIVE)
    if not live or not SchedulerSettings.read().process_tuning:
        return
    for tuning in live:
        hold = _hold_freeze()
        try:
            tuning._loop.call_soon_threadsafe(tuning._adopt, hold)
        except RuntimeError:  # its loop closed
            hold.release()
