"""The worker plugin: runs of this worker, RPC handlers, and the hooks tasks call into.

Where it runs: ``setup``/``teardown`` and the handlers (``_worker_barrier``, ``_close``,
``_fetch_run``) on the worker's event loop; ``receive`` on the data plane's loop;
``get_run_blocking``/``barrier_blocking``/``restrict_blocking`` in task threads (one hop to the
worker's loop each, and only when the run is not known here yet).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from distributed import Reschedule, WorkerPlugin
from distributed.protocol.serialize import ToPickle

from rechunk_p2p.config import warn_removed_settings
from rechunk_p2p.diagnostics import live, metrics
from rechunk_p2p.errors import (
    ClusterError,
    OutputConsumedError,
    RechunkP2PError,
    StaleRunError,
)
from rechunk_p2p.offload import OffloadPool, from_thread, on_loop
from rechunk_p2p.settings import WorkerSettings
from rechunk_p2p.spec import (
    METADATA_KEY,
    OUTPUT_METADATA,
    PLUGIN_NAME,
    RUN_METADATA,
    RunId,
    RunSpec,
    ShuffleId,
)
from rechunk_p2p.store.disk import STORE_IO_THREADS
from rechunk_p2p.transport.dataplane import DataPlane
from rechunk_p2p.transport.wire import Packed
from rechunk_p2p.worker.idle import IdleWatch
from rechunk_p2p.worker.imports import import_task_modules_blocking
from rechunk_p2p.worker.memory_shares import MemoryShares
from rechunk_p2p.worker.pressure import PressureWatch
from rechunk_p2p.worker.run import PhaseSeconds, RunStatistics, WorkerRun
from rechunk_p2p.worker.run_factory import make_run
from rechunk_p2p.worker.scheduler_rpc import checked as _checked
from rechunk_p2p.worker.scheduler_rpc import error_reply, scheduler_rpc, worker_closing
from rechunk_p2p.worker.tuning import PROCESS_TUNING as _tuning
from rechunk_p2p.worker.tuning import TuningOptions

logger = logging.getLogger(__name__)

#: Threads of a worker's offload pool, which unpack, serialise and store received pieces: the
#: count every benchmark ran with (it was a setting no measurement asked to change)
OFFLOAD_THREADS = 2

#: Closed run ids remembered (oldest forgotten first): enough for every rechunk a long-lived
#: worker has in flight or may still hear stale messages about; ~1 MB at most.
_CLOSED_IDS_KEPT = 10_000
#: No run yet: at or below every run's id
_NO_RUN = RunId(0)
#: How long a task waits for the plugins to arrive when it installs them itself.
INSTALL_TIMEOUT = 60.0


#: Closed runs a worker remembers for :func:`rechunk_p2p.report`
RECENT_RUNS = 64


@dataclass(frozen=True, slots=True)
class WorkerTotals:
    """**Immutable.** Totals of every run this worker closed, plus the ones still open."""

    runs: int
    bytes_sent: int
    bytes_received: int
    bytes_spilled: int
    max_bytes_queued: int = 0  # the most any one run had queued for sending at once
    phases: PhaseSeconds = field(default_factory=PhaseSeconds)
    max_bytes_stored_in_memory: int = 0  # the most any one run's store held in memory
    messages_sent: int = 0

    def plus(self, run: RunStatistics) -> WorkerTotals:
        """These totals with one more run counted."""
        return WorkerTotals(
            self.runs + 1,
            self.bytes_sent + run.bytes_sent,
            self.bytes_received + run.bytes_received,
            self.bytes_spilled + run.bytes_spilled,
            max(self.max_bytes_queued, run.max_bytes_queued),
            self.phases + run.phases,
            max(self.max_bytes_stored_in_memory, run.max_bytes_stored_in_memory),
            self.messages_sent + run.messages_sent,
        )


class RechunkWorkerPlugin(WorkerPlugin):
    """rechunk_p2p's state on one worker; mixed, labelled per attribute.

    Registered by :func:`rechunk_p2p.register` (or the scheduler plugin) under the name
    ``"rechunk-p2p"``; reach it from a task with :func:`get_plugin`. Used from the worker's
    loop (RPC and stream handlers, setup), the data plane's loop (``receive``) and task
    threads (``*_blocking``):

    - ``runs``, ``_closed_totals``, ``_closed_run_ids``: **thread-safe (guarded by `_lock`)**;
    - ``_fetching``, ``_background``, ``idle`` (:class:`IdleWatch`), ``shares`` (the memory
      budget its runs share, :class:`MemoryShares`), ``pressure`` (:class:`PressureWatch`):
      **loop-confined** (the worker's loop);
    - ``worker``, ``dataplane``, ``offload``, ``store_io`` (the disk stores' background
      writes and parallel reads, for every run): written once in :meth:`setup`, on the
      worker's loop, before ``_ready`` is set; read-only afterwards (tasks wait for
      ``_ready``);
    - ``_ready``: a ``threading.Event`` (thread-safe).
    """

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.runs: dict[ShuffleId, WorkerRun] = {}
        self.worker: Any = None
        self._recent: deque[RunStatistics] = deque(maxlen=RECENT_RUNS)  # closed, newest last
        self.dataplane: DataPlane | None = None
        self.offload: OffloadPool | None = None
        self.store_io: OffloadPool | None = None
        self.shares = MemoryShares()  # what the runs keep in memory, within one budget
        self._fetching: dict[ShuffleId, asyncio.Future[WorkerRun]] = {}
        self._closed_totals = WorkerTotals(0, 0, 0, 0)
        # highest run id the scheduler closed, per shuffle id (bounded, oldest dropped first)
        self._closed_run_ids: OrderedDict[ShuffleId, RunId] = OrderedDict()
        self._background: set[asyncio.Future[None]] = set()
        self._ready = threading.Event()
        self._tearing_down = False  # loop-confined
        self.idle = IdleWatch(self, freeze_early=False)
        self.pressure = PressureWatch(self)  # spills the runs' pieces while paused
        self.heartbeat = live.Heartbeat(self)  # the dashboard's numbers, with every heartbeat

    def __reduce__(self) -> tuple:
        return (type(self), ())  # a fresh plugin on the other side: state is per process

    # --- lifecycle (worker loop) ----------------------------------------------------------

    async def setup(self, worker: Any) -> None:
        self.worker = worker
        warn_removed_settings()
        settings = WorkerSettings.read()
        self.offload = OffloadPool(OFFLOAD_THREADS)
        self.store_io = OffloadPool(STORE_IO_THREADS, "rechunk-p2p-store-io")
        self.dataplane = DataPlane(
            worker.address,
            worker.security,
            self.receive,
            buffer_bytes=settings.send_buffer_bytes(_memory_limit(worker)),
            concurrency=settings.concurrency,
            ports=settings.ports,
            connections=settings.connections,
        )
        address = await self.offload.to_thread(self.dataplane.start_blocking)
        # on the loop, where distributed decodes tasks: see rechunk_p2p.worker.imports
        import_task_modules_blocking()
        worker.handlers["rechunk_p2p_worker_barrier"] = self._worker_barrier
        worker.stream_handlers["rechunk_p2p_close"] = self._close_handler
        worker.stream_handlers["rechunk_p2p_continue"] = self._continue_handler
        worker.stream_handlers["rechunk_p2p_expect"] = self.idle.expect
        await worker.scheduler.set_metadata(keys=[METADATA_KEY, worker.address], value=address)
        self.idle.freeze_early = settings.process_tuning
        self.idle.start()
        self.pressure.start()
        metrics.register_worker(self)  # on /metrics, where prometheus_client is installed
        self.heartbeat.install(worker)
        self._ready.set()
        logger.debug("rechunk_p2p data plane of %s listens on %s", worker.address, address)

    async def teardown(self, worker: Any) -> None:
        self._tearing_down = True  # a run fetched from now on is closed as it arrives
        metrics.unregister_worker(self)
        self.heartbeat.uninstall(worker)
        self.idle.stop()
        self.pressure.stop()
        with self._lock:
            runs = list(self.runs.values())
        await asyncio.gather(*(self._close_run(run) for run in runs), return_exceptions=True)
        await asyncio.gather(*self._background, return_exceptions=True)
        if process_exits(worker):
            _tuning.freeze_for_exit()
        else:  # no idle wait for a worker that closes, and no full collection on its way
            _tuning.unfreeze_unused(collect=False)  # out (0.1-0.2 s of its close)
        worker.handlers.pop("rechunk_p2p_worker_barrier", None)
        worker.stream_handlers.pop("rechunk_p2p_close", None)
        worker.stream_handlers.pop("rechunk_p2p_continue", None)
        if self.dataplane is not None:
            assert self.offload is not None  # (made before the data plane, at setup)
            await self.offload.to_thread(self.dataplane.stop_blocking)
        if self.offload is not None:
            self.offload.shutdown(wait=False)
        if self.store_io is not None:  # the runs' stores are closed: nothing is in flight
            self.store_io.shutdown(wait=False)

    def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
        """On the worker loop, for every task's transition (see :class:`IdleWatch`)."""
        self.idle.transition(key, start, finish)

    # --- runs -----------------------------------------------------------------------------

    def get_run_blocking(self, shuffle_id: ShuffleId) -> WorkerRun:
        """From a task thread: the open run of ``shuffle_id``, fetched once from the scheduler."""
        with self._lock:
            run = self.runs.get(shuffle_id)
        if run is not None:
            return run
        return from_thread(self.worker.loop.asyncio_loop, self._fetch_run, shuffle_id)

    async def _fetch_run(self, shuffle_id: ShuffleId, min_run_id: RunId = _NO_RUN) -> WorkerRun:
        """On the worker loop: ask the scheduler for the current run (deduplicated)."""
        with self._lock:
            run = self.runs.get(shuffle_id)
        if run is not None and run.run_id >= min_run_id:
            return run
        if shuffle_id not in self._fetching:
            self._fetching[shuffle_id] = asyncio.ensure_future(self._fetch(shuffle_id))
            self._fetching[shuffle_id].add_done_callback(
                lambda _: self._fetching.pop(shuffle_id, None)
            )
        return await asyncio.shield(self._fetching[shuffle_id])

    async def _fetch(self, shuffle_id: ShuffleId) -> WorkerRun:
        # The process tuning is held from the request on, not only once the run is made: a
        # run's first tasks ask for it while the scheduler is busy with the graph, and a full
        # collection of an unfrozen heap in that wait stopped the worker's loop
        hold = _tuning.acquire(TuningOptions.for_request(WorkerSettings.read().process_tuning))
        try:
            return await self._fetch_held(shuffle_id)
        finally:
            await hold.release_and_tidy(self.offload)  # the run, if one opened, holds its own

    async def _fetch_held(self, shuffle_id: ShuffleId) -> WorkerRun:
        response = await scheduler_rpc(
            self.worker,
            "rechunk_p2p_get_or_create",
            shuffle_id=shuffle_id,
            worker=self.worker.address,
        )
        run_spec: RunSpec = _checked(response)["run_spec"]
        with self._lock:
            old = self.runs.get(shuffle_id)
        if old is not None:
            if old.run_id >= run_spec.run_id or old.continue_as(run_spec):
                return old
            await self._close_run(old)
        run = self._new_run(run_spec)
        with self._lock:
            # the scheduler's close message may have overtaken its reply (it is recorded
            # under the same lock): then the run is over before it started here
            closed = run_spec.run_id <= self._closed_run_ids.get(shuffle_id, 0)
            if not closed and not self._tearing_down:
                self.runs[shuffle_id] = run
        if closed or self._tearing_down:
            await self._close_run(run)
            why = "is closing" if self._tearing_down else "joined it"
            raise StaleRunError(
                f"Run {run_spec.run_id} of rechunk {shuffle_id} was closed before "
                f"{self.worker.address} {why}"
            )
        return run

    def _new_run(self, run_spec: RunSpec) -> WorkerRun:
        assert self.dataplane is not None and self.offload is not None
        self.heartbeat.lag.open_run(run_spec.shuffle_id)
        return make_run(
            run_spec,
            self.worker,
            self.dataplane,
            self.offload,
            self._closing,
            self.shares,
            self.store_io,
        )

    def _closing(self) -> bool:
        """Whether the worker is closing (read from any thread)."""
        return worker_closing(self.worker)

    async def _close_run(self, run: WorkerRun) -> None:
        """Forget ``run`` here and close it. Its figures move to the totals in the same step
        as it leaves :attr:`runs`, so :meth:`totals` never misses a closing run."""
        stats = run.statistics()
        with self._lock:
            if self.runs.get(run.shuffle_id) is run:
                del self.runs[run.shuffle_id]
                self._closed_totals = self._closed_totals.plus(stats)
                self._recent.append(replace(stats, phase="closed"))
            replaced = run.shuffle_id in self.runs  # (by a newer run, which goes on)
        if not replaced:
            self.heartbeat.lag.close_run(run.shuffle_id)
        await run.close()

    # --- handlers -------------------------------------------------------------------------

    async def receive(self, shuffle_id: ShuffleId, run_id: RunId, batch: list[Packed]) -> bool:
        """On the data plane loop: store pieces that another worker sent; whether they were
        copied out of their payload (see :meth:`WorkerRun.receive`)."""
        with self._lock:
            run = self.runs.get(shuffle_id)
        if run is None or run.run_id < run_id:
            run = await on_loop(self.worker.loop.asyncio_loop, self._fetch_run, shuffle_id, run_id)
        if not run.run_spec.accepts(run_id):
            raise StaleRunError(
                f"Pieces for run {run_id} of rechunk {shuffle_id} reached "
                f"{self.worker.address}, which runs run {run.run_id}"
            )
        return await run.receive(batch)

    async def _worker_barrier(self, shuffle_id: ShuffleId, run_id: RunId) -> dict:
        """This worker's part of the barrier: every input was cut; deliver what it sends.

        A failure to deliver is replied as an error reply (:func:`error_reply`), which the
        scheduler passes on to the barrier task, where it is raised with its own type.
        """
        try:
            await self._pass_barrier(shuffle_id, run_id)
        except RechunkP2PError as e:
            return error_reply(e)
        return {"status": "OK"}

    async def _pass_barrier(self, shuffle_id: ShuffleId, run_id: RunId) -> None:
        with self._lock:
            run = self.runs.get(shuffle_id)
        if run is None and self._tearing_down:  # its runs closed, their sends dropped
            raise StaleRunError(
                f"Barrier of run {run_id} of rechunk {shuffle_id} reached "
                f"{self.worker.address}, which is closing"
            )
        if run is None:
            return  # this worker sent nothing for this run
        if run.run_id < run_id:  # continued: the scheduler's message is still on its way
            run = await self._fetch_run(shuffle_id, run_id)
        if run.run_id != run_id:
            raise StaleRunError(
                f"Barrier of run {run_id} of rechunk {shuffle_id} reached "
                f"{self.worker.address}, which runs run {run.run_id}"
            )
        await run.pass_barrier()

    def _continue_handler(
        self, shuffle_id: ShuffleId, run_spec: RunSpec, keep: Sequence[int] = ()
    ) -> None:
        """The scheduler continues a run after an output owner left (see
        :func:`rechunk_p2p.recovery.worker_left`).

        Sent before the scheduler releases the barrier: ``keep`` are outputs of this worker
        whose tasks that release cancels; their results are kept for the continued run (their
        pieces are gone). A worker without the run fetches the continued one when it needs it.
        """
        with self._lock:
            run = self.runs.get(shuffle_id)
        if run is None or not (run.continue_as(run_spec) or run.run_id == run_spec.run_id):
            return
        held = self._held_outputs(run_spec, keep)
        kept = run.keep_outputs(list(keep), held)
        logger.debug("%r continues; kept %d of %d outputs", run, kept, len(keep))

    def _held_outputs(self, run_spec: RunSpec, outputs: Sequence[int]) -> dict:
        """The results of ``outputs`` this worker holds in memory (not spilled)."""
        data = getattr(self.worker, "data", {})
        fast = getattr(data, "fast", data)  # a SpillBuffer's in-memory part, or a dict
        held = {flat: fast.get(run_spec.spec.output_key(flat)) for flat in outputs}
        return {flat: value for flat, value in held.items() if value is not None}

    def _close_handler(self, shuffle_id: ShuffleId, run_id: RunId, reason: str = "") -> None:
        with self._lock:
            run = self.runs.get(shuffle_id)
            closed = self._closed_run_ids.pop(shuffle_id, _NO_RUN)
            self._closed_run_ids[shuffle_id] = max(closed, run_id)
            if len(self._closed_run_ids) > _CLOSED_IDS_KEPT:
                self._closed_run_ids.popitem(last=False)
        if run is not None and run.run_id <= run_id:
            logger.debug("Closing %r: %s", run, reason)
            task = asyncio.ensure_future(self._close_run(run))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    # --- task threads ---------------------------------------------------------------------

    def transfer_blocking(self, shuffle_id: ShuffleId, flat: int, data: Any) -> int:
        """From a transfer task: cut input ``flat`` into pieces and send them; its run id."""
        return self._noted(self.get_run_blocking(shuffle_id).add_input_blocking(flat, data))

    def transfer_group_blocking(
        self, shuffle_id: ShuffleId, flats: tuple[int, ...], chunks: tuple[Any, ...]
    ) -> int:
        """From a transfer task of several held inputs: cut each in turn; the oldest run id
        any of them was cut for (the barrier runs the task again if that run was replaced)."""
        run = self.get_run_blocking(shuffle_id)
        return self._noted(
            min(run.add_input_blocking(flat, data) for flat, data in zip(flats, chunks))
        )

    def _noted(self, run_id: RunId) -> RunId:
        """``run_id``, also put in the running task's metadata: the scheduler learns with the
        result which run a transfer cut for (when a run was continued while it ran)."""
        self._note(RUN_METADATA, run_id)
        return run_id

    def _note(self, name: str, value: Any) -> None:
        """Put ``value`` in the running task's metadata, sent with its result."""
        ts = self.worker.state.tasks.get(self.worker.get_current_task())
        if ts is not None:  # (read from the task thread: the task stays while it runs)
            ts.metadata[name] = value

    def barrier_blocking(self, shuffle_id: ShuffleId, run_ids: tuple[RunId, ...]) -> int:
        """From the barrier task: make every worker flush its sends; the run id.

        ``run_ids`` are the transfers' results, in the order of ``spec.transfers``. When some
        belong to an older run (a transfer that ran while the run was restarted), the scheduler
        re-runs those transfers (or restarts the rechunk) and this task is rescheduled.
        """
        response = from_thread(
            self.worker.loop.asyncio_loop, self._barrier, shuffle_id, list(run_ids)
        )
        if response.get("restarted"):
            raise Reschedule()
        return response["run_id"]

    async def _barrier(self, shuffle_id: ShuffleId, run_ids: list[RunId]) -> dict:
        response = await scheduler_rpc(
            self.worker, "rechunk_p2p_barrier", shuffle_id=shuffle_id, run_ids=run_ids
        )
        return _checked(response)

    def unpack_blocking(self, shuffle_id: ShuffleId, flat: int, run_id: RunId, key: Any) -> Any:
        """From an unpack task: output ``flat`` of run ``run_id``, assembled from its pieces.

        A task that runs on the wrong worker is pinned to the right one and rescheduled; a
        task of a run that was replaced is rescheduled (the scheduler released it already).
        """
        run = self.get_run_blocking(shuffle_id)
        if run.run_id != run_id:
            raise Reschedule()
        owner = run.run_spec.worker_for(flat)
        if owner != self.worker.address:
            from_thread(
                self.worker.loop.asyncio_loop, self._restrict, shuffle_id, run_id, key, owner
            )
            raise Reschedule()
        try:
            output = run.get_output_blocking(flat)
        except OutputConsumedError as e:
            # its pieces are gone with a result the worker dropped: the run goes on to
            # assemble it again elsewhere (or restarts)
            loop = self.worker.loop.asyncio_loop
            from_thread(loop, self._restart, shuffle_id, run_id, str(e), flat)
            raise Reschedule() from None
        self._note(OUTPUT_METADATA, [shuffle_id, run_id, flat])
        return output

    async def _restart(
        self, shuffle_id: ShuffleId, run_id: RunId, reason: str, output: int
    ) -> None:
        response = await self.worker.scheduler.rechunk_p2p_restart(
            shuffle_id=shuffle_id,
            run_id=run_id,
            reason=reason,
            output=output,
            worker=self.worker.address,
        )
        _checked(response)

    async def _restrict(self, shuffle_id: ShuffleId, run_id: RunId, key: Any, worker: str) -> None:
        response = await self.worker.scheduler.rechunk_p2p_restrict(
            shuffle_id=shuffle_id, run_id=run_id, key=ToPickle(key), worker=worker
        )
        _checked(response)

    def wait_ready_blocking(self, timeout: float = INSTALL_TIMEOUT) -> None:
        """Wait until :meth:`setup` finished (a task may find the plugin while it starts)."""
        if not self._ready.wait(timeout):
            raise ClusterError(
                f"The rechunk_p2p worker plugin on {self.worker.address} did not start "
                f"within {timeout:g} s"
            )

    # --- diagnostics ----------------------------------------------------------------------

    def open_runs(self) -> list[WorkerRun]:
        """The runs open on this worker now."""
        with self._lock:
            return list(self.runs.values())

    def run_statistics(self) -> list[RunStatistics]:
        with self._lock:
            runs = list(self.runs.values())
        return [run.statistics() for run in runs]

    def closed_runs(self) -> list[RunStatistics]:
        """The last :data:`RECENT_RUNS` runs closed here, oldest first."""
        with self._lock:
            return list(self._recent)

    def recent_runs(self) -> list[RunStatistics]:
        """The last :data:`RECENT_RUNS` runs closed here, then the open ones."""
        return self.closed_runs() + self.run_statistics()

    def totals(self) -> WorkerTotals:
        open_stats = self.run_statistics()
        with self._lock:
            totals = self._closed_totals
        for stats in open_stats:
            totals = totals.plus(stats)
        return totals


def _memory_limit(worker: Any) -> int | None:
    """``worker``'s memory limit (``None``: none)."""
    return getattr(getattr(worker, "memory_manager", None), "memory_limit", None) or None


def get_plugin(worker: Any = None) -> RechunkWorkerPlugin:
    """The rechunk_p2p plugin of ``worker`` (default: the worker running this task)."""
    if worker is None:
        from distributed import get_worker

        worker = get_worker()
    try:
        return worker.plugins[PLUGIN_NAME]
    except KeyError:
        raise ClusterError(
            f"The rechunk_p2p worker plugin is not installed on {worker.address}. Call "
            "rechunk_p2p.register(client) (rechunk_p2p.rechunk does so when a client "
            "exists), or start the scheduler with --preload rechunk_p2p."
        ) from None


def process_exits(worker: Any) -> bool:
    """Whether ``worker``'s process ends with it: it is closing (not just dropping the
    plugin) and runs under a nanny, whose worker process exits once its worker closed."""
    status = getattr(worker, "status", None)
    closing = getattr(status, "name", "") in ("closing", "closed", "failed")
    return closing and getattr(worker, "nanny", None) is not None
