"""When a worker is idle, and what it does then: give back the objects frozen for runs (and
collect them), and close the data plane's connections no send uses.

Where it runs: the worker's event loop (the plugin's transition hook, the scheduler's
"expect" message, and the watching task).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from rechunk_p2p.offload import on_loop
from rechunk_p2p.spec import HELD_PREFIX, TRANSFER_PREFIX
from rechunk_p2p.worker.tuning import PROCESS_TUNING as _tuning

if TYPE_CHECKING:
    from rechunk_p2p.worker.plugin import RechunkWorkerPlugin

#: How long a worker runs no task and holds no run before the objects frozen for runs are
#: unfrozen and collected: the collection walks the whole heap holding the GIL, so it
#: waits for idleness longer than the pauses between the phases of a rechunk (a
#: reduction's, say)
UNFREEZE_IDLE_SECONDS = 5.0

#: How long a worker runs no task and holds no run before it closes the data plane's
#: connections no send uses: a rechunk opens one to each peer it sends to (W - 1 at W
#: workers, about 0.4 ms of CPU at each end), and the next rechunk of a session finds them
#: open (an idle connection costs a file descriptor, nothing else)
CONNECTIONS_IDLE_SECONDS = 60.0
#: Longest a worker told that a graph with a rechunk reached the scheduler waits for a task
#: before it may count as idle
UNFREEZE_EXPECT_SECONDS = 60.0

#: Worker task states after which a task neither runs nor waits to run here.
_FINISHED = frozenset({"memory", "error", "released", "forgotten"})


class IdleWatch:
    """**Loop-confined** (the worker's loop). Whether the worker is busy with a rechunk
    beyond its open runs: the transfer tasks (and the tasks that read held inputs for them)
    that have not finished here, and a graph with a rechunk announced by the scheduler
    whose tasks have not come yet; and, once the worker has been idle for
    :data:`UNFREEZE_IDLE_SECONDS`, the unfreeze and the letting go of free receive buffers,
    and after :data:`CONNECTIONS_IDLE_SECONDS` the closing of idle connections.

    ``freeze_early``: the process's objects are frozen when a graph with a rechunk is
    announced or one of its transfer tasks arrives (``process-tuning``).
    """

    def __init__(self, plugin: RechunkWorkerPlugin, freeze_early: bool) -> None:
        self._plugin = plugin
        self.freeze_early = freeze_early
        self.unfinished_transfers: set[Any] = set()
        self.expected_until: float | None = None  # loop time
        self._moved = False  # a task changed state since the watch last looked
        self._task: asyncio.Future[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._watch())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def transition(self, key: Any, start: str, finish: str) -> None:
        """A task's transition on this worker. A transfer task, or the task that reads a
        held input's chunks for them (it runs before any transfer reaches the worker, and
        gathering thousands of chunks can set off a full collection), arriving freezes the
        process's objects (:meth:`ProcessTuning.freeze_early`); those here that have not
        finished are counted (the worker is not idle while one waits, for its inputs, say).
        """
        self._moved = True
        if self.expected_until is not None and start == "released" and finish != "forgotten":
            self.expected_until = None  # a task came: the graph's tasks keep the worker busy
        if not (
            isinstance(key, tuple) and (TRANSFER_PREFIX in key[0] or key[0].startswith(HELD_PREFIX))
        ):
            return
        if finish in _FINISHED:
            self.unfinished_transfers.discard(key)
            return
        if start == "released" and self.freeze_early:
            _tuning.freeze_early()
        self.unfinished_transfers.add(key)

    def expect(self) -> None:
        """A graph with a rechunk reached the scheduler: freeze before its first task, and
        count the worker busy until a task comes (at most :data:`UNFREEZE_EXPECT_SECONDS`):
        its first tasks of the graph may wait for results of other workers (a
        reduction's, say), and the collection would fall just before them."""
        if self.freeze_early:
            _tuning.freeze_early()
            self.expected_until = asyncio.get_running_loop().time() + UNFREEZE_EXPECT_SECONDS

    async def _watch(self) -> None:
        """Once no run is open or asked for, nothing above keeps the worker busy and no task
        has run for :data:`UNFREEZE_IDLE_SECONDS`: unfreeze and collect (a full collection,
        which stops the loop too, so it must not fall between the phases of a rechunk), and
        let the data plane's free receive buffers go; after
        :data:`CONNECTIONS_IDLE_SECONDS`, close its idle connections (a worker keeps one or
        more to every peer it sent to)."""
        plugin = self._plugin
        state = getattr(plugin.worker, "state", None)
        loop = asyncio.get_running_loop()
        idle_since = None
        while True:
            await asyncio.sleep(UNFREEZE_IDLE_SECONDS / 4)
            now = loop.time()
            # a request for a run holds the tuning, so frozen_unused is false meanwhile
            busy = (
                (state is not None and state.executing)
                or self.unfinished_transfers
                or (self.expected_until is not None and now < self.expected_until)
            )
            if busy or plugin.runs or self._moved:  # (a run may start and end between looks)
                self._moved = False
                idle_since = None
                continue
            if idle_since is None:
                idle_since = now
                continue
            dataplane = plugin.dataplane
            if now - idle_since >= UNFREEZE_IDLE_SECONDS:
                if _tuning.frozen_unused:
                    _tuning.unfreeze_unused()
                if dataplane is not None and dataplane.free_buffer_bytes():
                    await on_loop(dataplane.loop, dataplane.let_buffers_go)
            if (
                now - idle_since >= CONNECTIONS_IDLE_SECONDS
                and dataplane is not None
                and dataplane.idle_connections()
            ):
                await on_loop(dataplane.loop, dataplane.close_idle)
