"""The scheduler plugin: creates runs, pins outputs to workers, runs the barrier, cleans up.

Where it runs: the scheduler's event loop. Everything here is coordination over small
messages; no array data ever reaches the scheduler.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter, deque
from time import time
from typing import Any

from distributed import SchedulerPlugin
from distributed.core import ErrorMessage, Status, error_message
from distributed.protocol.pickle import dumps
from distributed.protocol.serialize import ToPickle

from rechunk_p2p.diagnostics import dashboard, metrics
from rechunk_p2p.diagnostics.live_view import FINISHED_KEPT, FinishedRun, finished_run
from rechunk_p2p.diagnostics.metrics import error_type
from rechunk_p2p.errors import BROKEN_CONNECTION, ClusterError, StaleRunError
from rechunk_p2p.planning import memory_weights
from rechunk_p2p.recovery import BARRIER_PENDING, SchedulerRun
from rechunk_p2p.scheduler_recovery import STALE_STIMULUS, RunIds, RunRecovery
from rechunk_p2p.scheduler_tuning import SchedulerTuning
from rechunk_p2p.settings import SchedulerSettings
from rechunk_p2p.spec import (
    BARRIER_PREFIX,
    METADATA_KEY,
    OUTPUT_METADATA,
    PLUGIN_NAME,
    RUN_METADATA,
    TRANSFER_PREFIX,
    RunId,
    RunSpec,
    ShuffleId,
    ShuffleSpec,
    barrier_key,
    id_from_key,
)
from rechunk_p2p.stalls import StallWatch
from rechunk_p2p.waves import (
    TransferWaves,
    assign_round_robin,
    new_transfers,
)

logger = logging.getLogger(__name__)

#: Attempts of a barrier's request to one worker whose connection broke meanwhile.
BARRIER_ATTEMPTS = 5

#: Seconds between a worker joining the cluster and the open runs taking it in: the joins of
#: one scale-up (an adaptive cluster starts its workers together) are taken in at once, and
#: a joined worker has its data plane up by then (else it is looked at again as long)
JOIN_BATCH_SECONDS = 1.0


class RechunkSchedulerPlugin(SchedulerPlugin):
    """**Loop-confined.** rechunk_p2p's state on the scheduler.

    On start it registers its RPC handlers and the worker plugin (on every current and future
    worker). A run is created when the first transfer task of a sub-shuffle asks for it, and
    forgotten (on every worker too) when its barrier task is released, errs or is forgotten,
    or continued or restarted with a new run id when one of its workers leaves (decided and
    done by its :class:`~rechunk_p2p.scheduler_recovery.RunRecovery`, ``recovery``).
    """

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self) -> None:
        self.scheduler: Any = None
        self.active: dict[str, SchedulerRun] = {}
        self._run_ids = RunIds()
        self._shifts = itertools.count()
        self.runs_created = 0
        self.recovery = RunRecovery(None, self._close, self._run_ids)
        self.waves = TransferWaves()
        self.finished: deque[FinishedRun] = deque(maxlen=FINISHED_KEPT)  # for the dashboard
        self.errors: Counter[str] = Counter()  # transfers and barriers that erred, by type
        self.tuning: SchedulerTuning | None = None
        self.stalls: StallWatch | None = None  # outputs waiting for a worker that runs none
        self._joining: set[str] = set()  # workers that joined, not yet taken in by the runs
        self._joins: asyncio.TimerHandle | None = None  # the next look at them

    def __reduce__(self) -> tuple:
        return (type(self), ())  # a fresh plugin on the other side: state is per process

    async def start(self, scheduler: Any) -> None:
        """Install the handlers and the worker plugin, unless another instance runs already.

        Two registrations can race (several workers installing the engine at once): the first
        claims the plugin's name before it awaits anything, the others then do nothing.
        """
        current = scheduler.plugins.get(self.name)
        if current is not None and current is not self:
            return
        scheduler.add_plugin(self, name=self.name, idempotent=True)
        self.scheduler = scheduler
        self.recovery.scheduler = scheduler
        self.tuning = SchedulerTuning(lambda: scheduler.tasks, lambda: bool(self.active))
        self.stalls = StallWatch(scheduler, lambda: self.active)
        self.stalls.start()
        metrics.register_scheduler(self)  # on /metrics, where prometheus_client is installed
        dashboard.install(scheduler)  # the /rechunk-p2p page, where bokeh is installed
        scheduler.handlers.update(
            {
                "rechunk_p2p_get_or_create": self.get_or_create,
                "rechunk_p2p_barrier": self.barrier,
                "rechunk_p2p_restrict": self.restrict,
                "rechunk_p2p_restart": self.restart_run,
            }
        )
        from rechunk_p2p.worker.plugin import RechunkWorkerPlugin  # the workers' code

        await scheduler.register_worker_plugin(
            None, dumps(RechunkWorkerPlugin()), name=PLUGIN_NAME, idempotent=True
        )

    # --- graph submission -----------------------------------------------------------------

    def update_graph(self, scheduler: Any, *, tasks: Any = None, **kwargs: Any) -> None:
        """Hand a new graph's root transfer tasks to the workers at once.

        A transfer task whose input is made inside it (dask fused the input's own task into
        it) has no dependencies, so distributed treats it as a root task and, with its
        root-task queuing, gives each worker only ``worker-saturation`` times its threads of
        them at a time, the next one a scheduler round trip after one finished. Queuing
        keeps root tasks from making data faster than it is used; a transfer's result is a
        run id and its pieces wait under the engine's own send buffer limit, so queuing only
        adds the round trips. Each such task is therefore restricted to one running worker,
        in priority order, one worker after the other (weighted by threads), up to
        ``scheduler.assign-transfers`` a worker; the restriction is loose (another worker
        takes the task when its worker leaves, and work stealing may move it). The ones
        beyond the limit wait in distributed's queue, and are handed out in waves as the
        workers finish theirs (:meth:`_refill`). Called by the scheduler before it
        transitions the new tasks; tasks with restrictions of their own are left to
        distributed.

        A graph with a rechunk in it also tells every worker to freeze its objects now
        (:meth:`ProcessTuning.freeze_early`), ahead of the graph's first task message on the
        same stream: the tasks before the rechunk's own (a reduction of the input, say) come
        in thousands, and their allocations set off full collections of the whole heap. The
        scheduler's own process is frozen likewise (:class:`SchedulerTuning`).

        A transfer task whose input is held already, at least in part (a persisted chunk,
        or one a derived input reads), is restricted loosely to the worker that holds most
        of it (:func:`~rechunk_p2p.waves.new_transfers`), so that distributed does not move
        it there.
        """
        if not tasks:
            return
        settings = SchedulerSettings.read()
        barriers = [k for k in tasks if isinstance(k, str) and k.startswith(BARRIER_PREFIX)]
        if barriers:
            if settings.process_tuning and self.tuning is not None:
                self.tuning.graph(barriers)
            msg = {"op": "rechunk_p2p_expect"}
            workers = [ws.address for ws in scheduler.running]
            scheduler.send_all({}, {w: [msg] for w in workers if w in scheduler.stream_comms})
        held, roots = new_transfers(scheduler, tasks)
        for key in held:  # transfers of inputs held already run where the inputs are
            scheduler.tasks[key].loose_restrictions = True
        scheduler.set_restrictions(held)
        limit = settings.assign_transfers
        if limit <= 0 or not roots:
            return
        pins = assign_round_robin(
            roots, {ws.address: ws.nthreads for ws in scheduler.running}, limit
        )
        self._restrict(pins)
        self.waves.defer([ts for ts in roots if ts.key not in pins], limit)

    def _restrict(self, pins: dict[Any, set[str]]) -> None:
        """Restrict each key of ``pins`` loosely to its one worker, and count it there."""
        for key, (worker,) in pins.items():
            self.scheduler.tasks[key].loose_restrictions = True
            self.waves.assigned(key, worker)
        self.scheduler.set_restrictions(pins)

    def _refill(self, worker: str) -> None:
        """The next wave of waiting transfers to ``worker``, which finished part of its own:
        as many of the first queued ones as bring it back to its limit. Released from the
        queue, each goes on (waiting, then processing) to the worker it is restricted to."""
        ws = self.scheduler.workers.get(worker)
        if ws is None or ws not in self.scheduler.running:
            self.waves.forget_worker(worker)
            return
        keys = self.waves.take(self.scheduler.tasks, worker)
        if not keys:
            return
        self._restrict({key: {worker} for key in keys})
        self.scheduler.transitions(
            dict.fromkeys(keys, "released"), stimulus_id=f"rechunk-p2p-wave-{time()}"
        )

    # --- handlers -------------------------------------------------------------------------

    def get_or_create(self, shuffle_id: ShuffleId, worker: str) -> dict | ErrorMessage:
        """The current run of ``shuffle_id``, created on first request."""
        try:
            run = self.active.get(shuffle_id) or self._create(shuffle_id)
        except (ClusterError, StaleRunError) as e:
            return error_message(e)
        run.participants.add(worker)
        return {"status": "OK", "run_spec": ToPickle(run.run_spec)}

    def _create(self, shuffle_id: ShuffleId) -> SchedulerRun:
        spec = self._spec(shuffle_id)
        workers = self._eligible_workers(shuffle_id)
        dataplanes = self.scheduler.get_metadata([METADATA_KEY], default={})
        limits = memory_weights([self.scheduler.workers[w].memory_limit for w in workers])
        run_spec = RunSpec.first(
            spec,
            self._run_ids.take(),
            tuple(workers),
            tuple(dataplanes[w] for w in workers),
            shift=next(self._shifts) % len(workers),
            weights=limits,
        )
        run = SchedulerRun(run_spec, owners=run_spec.owners())
        self._pin_outputs(run)
        self.active[shuffle_id] = run
        self.runs_created += 1
        # workers of the cluster not in the run (their plugin or data plane not up yet, still
        # starting, paused) are taken in as joined workers once they run with a data plane
        self._joining.update(w for w in self.scheduler.workers if w not in workers)
        self._look_at_joins_later()
        logger.debug(
            "Created run %d of rechunk %s on %d workers", run_spec.run_id, shuffle_id, len(workers)
        )
        return run

    def _spec(self, shuffle_id: ShuffleId) -> ShuffleSpec:
        ts = self.scheduler.tasks.get(barrier_key(shuffle_id))
        spec = getattr(getattr(ts, "run_spec", None), "spec", None)
        if not isinstance(spec, ShuffleSpec):
            raise StaleRunError(
                f"The barrier task of rechunk {shuffle_id} is not on the scheduler (it was "
                "released, or an optimisation renamed it); cannot start the rechunk"
            )
        if ts.state not in BARRIER_PENDING:
            # a transfer still running after the barrier erred or was released: a run created
            # now would never be closed (until the barrier is forgotten)
            raise StaleRunError(
                f"The barrier task of rechunk {shuffle_id} is {ts.state}; not starting a run"
            )
        return spec

    def _eligible_workers(self, shuffle_id: ShuffleId) -> list[str]:
        dataplanes = self.scheduler.get_metadata([METADATA_KEY], default={})
        workers = [
            addr
            for addr, ws in self.scheduler.workers.items()
            if addr in dataplanes and getattr(ws.status, "name", "running") == "running"
        ]
        barrier = self.scheduler.tasks[barrier_key(shuffle_id)]
        if barrier.worker_restrictions:
            workers = [w for w in workers if w in barrier.worker_restrictions]
        if not workers:
            raise ClusterError(
                f"No running worker has the rechunk_p2p plugin; cannot run rechunk {shuffle_id}"
            )
        return sorted(workers)

    def _pin_outputs(self, run: SchedulerRun) -> None:
        """Restrict each unpack task to the worker that will hold its pieces."""
        spec = run.run_spec.spec
        tasks = self.scheduler.tasks
        pins = {}
        for flat in spec.outputs:
            key = spec.output_key(flat)
            ts = tasks.get(key)
            if ts is None or ts.state not in ("released", "waiting", "no-worker", "queued"):
                continue
            run.restricted[key] = ts.worker_restrictions
            pins[key] = {run.run_spec.worker_for(flat)}
        self.scheduler.set_restrictions(pins)

    def _unpin_outputs(self, run: SchedulerRun) -> None:
        tasks = self.scheduler.tasks
        originals = {k: r for k, r in run.restricted.items() if k in tasks}
        self.scheduler.set_restrictions(originals)
        run.restricted.clear()

    async def barrier(self, shuffle_id: ShuffleId, run_ids: list[RunId]) -> dict | ErrorMessage:
        """Every input of the run was cut: make every participant flush its sends.

        ``run_ids`` are the transfers' results in the order of ``spec.transfers``. Transfers
        that ran for an older run (they finished while the run was restarted or continued)
        sent their pieces to a run that is gone, or sent fewer than the current run needs:
        they are run again for the current run, and the barrier with them (see
        :meth:`SchedulerRun.takes`). Replies ``{"run_id": ...}``, or ``{"restarted": True}``
        when the barrier must be rescheduled.
        """
        run = self.active.get(shuffle_id)
        stale = [t for t, r in enumerate(run_ids) if run is None or not run.takes(t, r)]
        if run is None or stale:
            self.recovery.rerun_stale(shuffle_id, run, stale)
            return {"status": "OK", "restarted": True}
        current = run.run_spec.run_id
        msg = {"op": "rechunk_p2p_worker_barrier", "shuffle_id": shuffle_id, "run_id": current}
        targets = [w for w in run.participants if w in self.scheduler.workers]
        results = await self._broadcast_retrying(msg, targets, run, current)
        if self.active.get(shuffle_id) is not run or run.run_spec.run_id != current:
            return {"status": "OK", "restarted": True}  # continued or replaced meanwhile
        if any(self._closing(worker) for worker in results):
            # a worker closing now drops what it queued, whatever it replied (a barrier
            # asked again after its runs closed found none): remove_worker re-runs what it
            # owed the run, and the barrier runs again after that
            return {"status": "OK", "restarted": True}
        for worker, result in results.items():
            replied_error = isinstance(result, dict) and result.get("status") == "error"
            failed = replied_error or isinstance(result, Exception)
            if failed and worker in run.departed:
                # the worker left the run: remove_worker re-ran what it owed the run (or
                # restarted it); the barrier runs again after that
                return {"status": "OK", "restarted": True}
            if replied_error:  # the worker's error reply, passed on unopened
                logger.warning("Rechunk %s (run %s) failed on %s", shuffle_id, current, worker)
                return result
            if isinstance(result, Exception):
                logger.warning(
                    "Rechunk %s (run %s) failed to flush its pieces on %s: %r",
                    shuffle_id,
                    current,
                    worker,
                    result,
                )
                return error_message(result)  # the worker's error, with its own type
        return {"status": "OK", "run_id": current}

    def _closing(self, worker: str) -> bool:
        """Whether ``worker`` is closing, or gone from the cluster."""
        ws = self.scheduler.workers.get(worker)
        return ws is None or ws.status in (Status.closing, Status.closed)

    async def _broadcast_retrying(
        self, msg: dict, targets: list[str], run: SchedulerRun, run_id: RunId
    ) -> dict[str, Any]:
        """``scheduler.broadcast`` of a barrier, sent again to a worker whose connection
        broke (:data:`BROKEN_CONNECTION`: closed or aborted under it) while it is still in the
        cluster and the run unchanged; a worker's part of the barrier (flushing its sends)
        can be asked for twice. Up to :data:`BARRIER_ATTEMPTS` attempts."""
        results: dict[str, Any] = {}
        for attempt in range(BARRIER_ATTEMPTS):
            results |= await self.scheduler.broadcast(msg=msg, workers=targets, on_error="return")
            targets = [
                w
                for w, r in results.items()
                if isinstance(r, BROKEN_CONNECTION) and w in self.scheduler.workers
            ]
            unchanged = self.active.get(run.run_spec.shuffle_id) is run
            if not targets or not unchanged or run.run_spec.run_id != run_id:
                break
            logger.info(
                "Barrier of rechunk %s (run %s): connection to %s broke; asking again",
                run.run_spec.shuffle_id,
                run_id,
                targets,
            )
            await asyncio.sleep(0.05 * 2**attempt)
        return results

    def restrict(
        self, shuffle_id: ShuffleId, run_id: RunId, key: Any, worker: str
    ) -> dict | ErrorMessage:
        """Pin one unpack task to ``worker`` (used when it first ran elsewhere)."""
        run = self.active.get(shuffle_id)
        if run is None or run.run_spec.run_id != run_id:
            return error_message(
                StaleRunError(f"Run {run_id} of rechunk {shuffle_id} is not active")
            )
        ts = self.scheduler.tasks.get(key)
        if ts is not None:
            run.restricted.setdefault(key, ts.worker_restrictions)
            self.scheduler.set_restrictions({key: {worker}})
        return {"status": "OK"}

    def restart_run(
        self,
        shuffle_id: ShuffleId,
        run_id: RunId,
        reason: str = "",
        output: int | None = None,
        worker: str | None = None,
    ) -> dict:
        """A worker lost a result it cannot rebuild: ``output``, assembled on ``worker``
        before, whose pieces are gone. Run ``run_id`` continues to assemble it again
        elsewhere where it can, else restarts from scratch
        (:meth:`~rechunk_p2p.scheduler_recovery.RunRecovery.output_lost`); nothing if it was
        replaced already."""
        run = self.active.get(shuffle_id)
        if run is not None and run.run_spec.run_id == run_id:
            self.recovery.output_lost(run, output, worker, reason)
        return {"status": "OK"}

    def add_worker(self, scheduler: Any, worker: str) -> None:
        """A worker joined: the open runs whose transfers are running take it in, with the
        others of the same burst, :data:`JOIN_BATCH_SECONDS` later (:meth:`_take_in_joined`)."""
        if not self.active:
            return
        self._joining.add(worker)
        self._look_at_joins_later()

    def _look_at_joins_later(self) -> None:
        """Take the joined workers in :data:`JOIN_BATCH_SECONDS` from now, unless a look is
        due already (the joins of one burst are taken in together)."""
        if self._joining and self._joins is None:
            loop = asyncio.get_running_loop()
            self._joins = loop.call_later(JOIN_BATCH_SECONDS, self._take_in_joined)

    def _take_in_joined(self) -> None:
        """Each open run continues with the joined workers that run and have their data
        plane up (:meth:`~rechunk_p2p.scheduler_recovery.RunRecovery.workers_joined`); the
        others are looked at again later, while they are still there."""
        self._joins = None
        dataplanes = self.scheduler.get_metadata([METADATA_KEY], default={})
        running = {ws.address for ws in self.scheduler.running}
        self._joining &= set(self.scheduler.workers)
        ready = {
            w: dataplanes[w] for w in sorted(self._joining) if w in running and w in dataplanes
        }
        self._joining -= set(ready)
        if ready:
            for run in list(self.active.values()):
                self.recovery.workers_joined(run, ready)
        if self.active:
            self._look_at_joins_later()
        else:
            self._joining.clear()

    def remove_worker(
        self, scheduler: Any, worker: str, *, stimulus_id: str, **kwargs: Any
    ) -> None:
        """A worker left: each run it was in continues, goes on or restarts without it
        (:meth:`~rechunk_p2p.scheduler_recovery.RunRecovery.worker_left`)."""
        self.scheduler.get_metadata([METADATA_KEY], default={}).pop(worker, None)
        self.waves.forget_worker(worker)
        for run in list(self.active.values()):
            self.recovery.worker_left(run, worker, stimulus_id)

    def valid_workers_downscaling(self, scheduler: Any, workers: list[Any]) -> list[Any]:
        """Adaptive scale-down (``Scheduler.workers_to_close``) passes over the workers of
        open runs: the pieces they hold and queue are not dask keys that a retirement would
        copy elsewhere, so retiring one would send them again. The run's end frees them."""
        busy = set().union(*(run.workers for run in self.active.values()))
        return [ws for ws in workers if ws.address not in busy]

    # --- lifecycle ------------------------------------------------------------------------

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        """Count failed transfers and barriers by type, then pass the transition to the
        transfer's, output's or barrier's handler."""
        transfer = isinstance(key, tuple) and TRANSFER_PREFIX in key[0]
        if finish == "erred" and start == "processing" and (transfer or id_from_key(key)):
            self.errors[error_type(kwargs.get("exception_text", ""))] += 1
        if transfer:
            self._transfer_moved(key, start, finish, kwargs)
        elif finish == "memory" and OUTPUT_METADATA in (kwargs.get("metadata") or {}):
            self._output_assembled(*kwargs["metadata"][OUTPUT_METADATA])
        elif finish in ("memory", "released", "erred", "forgotten"):
            self._barrier_moved(key, start, finish, kwargs.get("stimulus_id", ""))

    def _transfer_moved(self, key: Any, start: str, finish: str, kwargs: dict) -> None:
        """Note where a transfer ran and for which run while its result is in memory; hand
        the next wave of transfers to a worker that finished one of its own."""
        if finish == "memory" and "worker" in kwargs:
            run_id = (kwargs.get("metadata") or {}).get(RUN_METADATA)
            self.recovery.transfer_done(key, kwargs["worker"], run_id)
        elif finish in ("released", "erred", "forgotten"):
            self.recovery.transfer_gone(key)
        if (worker := self.waves.moved(key, start, finish)) is not None:
            asyncio.get_running_loop().call_soon(self._refill, worker)

    def _output_assembled(self, shuffle_id: ShuffleId, run_id: RunId, flat: int) -> None:
        run = self.active.get(shuffle_id)
        if run is not None:
            run.output_assembled(run_id, flat)

    def _barrier_moved(self, key: Any, start: str, finish: str, stimulus_id: str) -> None:
        """A barrier (or another task of a rechunk) reached ``finish``: in memory, every
        piece of the run arrived; released, erred or forgotten, the run closes, but for a
        release that runs it again (stale transfers), or one after which ``remove_worker``
        may continue the run."""
        shuffle_id = id_from_key(key)
        run = self.active.get(shuffle_id) if shuffle_id is not None else None
        if run is None or shuffle_id is None:
            return
        if finish == "memory":
            run.barrier_passed()
        elif finish == "released" and stimulus_id.startswith(STALE_STIMULUS):
            pass  # released to run again, with the stale transfers: the run goes on
        elif finish == "released" and start in ("memory", "processing"):
            # released at the end, or lost with a worker (its result, or the worker running
            # it): then remove_worker, called right after this, may continue the run; decide
            # once it has
            loop = asyncio.get_running_loop()
            loop.call_soon(self._close_if_done, shuffle_id, run, run.run_spec.run_id)
        else:
            self._close(shuffle_id, reason=f"barrier {finish}")

    def _close_if_done(self, shuffle_id: ShuffleId, run: SchedulerRun, run_id: RunId) -> None:
        """Close ``run`` after its barrier left memory, unless it was continued (or closed)
        meanwhile, or its barrier is needed again."""
        if self.active.get(shuffle_id) is not run or run.run_spec.run_id != run_id:
            return
        barrier = self.scheduler.tasks.get(barrier_key(shuffle_id))
        if barrier is None or barrier.state not in BARRIER_PENDING:
            self._close(shuffle_id, reason="barrier released")

    def _close(self, shuffle_id: ShuffleId, reason: str) -> SchedulerRun:
        run = self.active.pop(shuffle_id)
        self._unpin_outputs(run)
        self.finished.append(finished_run(self.scheduler, run, reason))
        msg = {
            "op": "rechunk_p2p_close",
            "shuffle_id": shuffle_id,
            "run_id": run.run_spec.run_id,
            "reason": reason,
        }
        streams = self.scheduler.stream_comms
        self.scheduler.send_all({}, {w: [msg] for w in run.workers if w in streams})
        return run

    async def close(self) -> None:
        if self._joins is not None:
            self._joins.cancel()
        if self.tuning is not None:
            self.tuning.stop()
        if self.stalls is not None:
            self.stalls.stop()

    def restart(self, scheduler: Any) -> None:
        self.active.clear()
        self.recovery.forget()
        self._joining.clear()
        if self._joins is not None:
            self._joins.cancel()
            self._joins = None
        self.waves = TransferWaves()
