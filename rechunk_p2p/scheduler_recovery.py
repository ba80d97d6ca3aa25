"""The scheduler plugin's collaborator for runs that lose a worker or an output: it gathers
a run's facts, asks :mod:`rechunk_p2p.recovery` what to do, and does it.

Where it runs: the scheduler's event loop (the plugin's ``remove_worker`` hook, its restart
handler and its ``transition`` hook). Small messages and task transitions only; no array
data.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from distributed.protocol.serialize import ToPickle

from rechunk_p2p.recovery import (
    BARRIER_PENDING,
    Action,
    Continue,
    GoOn,
    Restart,
    RunFacts,
    SchedulerRun,
    TransferFacts,
    output_lost,
    worker_left,
    workers_joined,
)
from rechunk_p2p.spec import METADATA_KEY, TRANSFER_PREFIX, RunId, ShuffleId, barrier_key
from rechunk_p2p.waves import key_name

logger = logging.getLogger("rechunk_p2p.scheduler")

#: Stimulus of the transitions that re-run stale transfers (the run stays open through them)
STALE_STIMULUS = "rechunk-p2p-stale-"


@dataclass
class RecoveryCounts:
    """**Loop-confined.** What recovery did on this scheduler, for tests and ``/metrics``."""

    restarts: int = 0  # runs restarted from scratch (no other worker left, a result lost)
    restarts_saved: int = 0  # workers that left a run without restarting it
    continuations: int = 0  # runs continued after an owner left, or to remake outputs
    remade: int = 0  # outputs lost after assembly that continuations assembled again
    outputs_kept: int = 0  # finished outputs of other workers that continuations kept
    outputs_moved: int = 0  # outputs continuations moved to another worker
    transfers_rerun: int = 0  # finished transfers continuations ran again
    inputs_resent: int = 0  # inputs whose every piece continuations sent again
    joined: int = 0  # workers that joined a run while its transfers ran
    left: int = 0  # workers that left a run while it was open


def release(scheduler: Any, keys: Iterable[Any], stimulus_id: str) -> None:
    """Release ``keys`` (to run again) and let distributed fill the queue slots they open."""
    scheduler.transitions(dict.fromkeys(keys, "released"), stimulus_id=stimulus_id)
    scheduler.stimulus_queue_slots_maybe_opened(stimulus_id=stimulus_id)


def transfer_chain(dependency: Any) -> list[Any]:
    """A barrier's dependency and, when it is an alias dask's fusion left (the input's
    chain fused into a task of another name), the transfer task it points to: to run a
    transfer again, both are released (releasing the alias alone would return the old
    result)."""
    return [dependency] + [
        ts for ts in dependency.dependencies if TRANSFER_PREFIX in key_name(ts.key)
    ]


class RunIds:
    """**Loop-confined.** The scheduler's run ids, increasing from 1: new runs and
    continuations take the next one."""

    def __init__(self) -> None:
        self.last = 0

    def peek(self) -> RunId:
        """The id the next run takes."""
        return RunId(self.last + 1)

    def take(self) -> RunId:
        self.last += 1
        return RunId(self.last)


class RunRecovery:
    """**Loop-confined.** Carries out :mod:`rechunk_p2p.recovery`'s decisions on the
    scheduler, and keeps the facts they need that the scheduler forgets: where each
    transfer ran and which run it cut for, while its result is in memory.

    ``close`` closes a run (the plugin's: it unpins its outputs and tells its workers);
    ``run_ids`` gives the ids of continuations (the plugin's, shared with new runs).
    """

    def __init__(
        self,
        scheduler: Any,
        close: Callable[[ShuffleId, str], SchedulerRun],
        run_ids: RunIds,
    ) -> None:
        self.scheduler = scheduler
        self._close = close
        self._run_ids = run_ids
        self._rounds = itertools.count()
        self.counts = RecoveryCounts()
        # transfer key -> the worker that computed it, while its result is in memory
        self.computed_on: dict[Any, str] = {}
        # transfer key -> the run it cut its inputs for (its metadata), while in memory
        self.cut_for: dict[Any, RunId] = {}

    # --- facts ----------------------------------------------------------------------------

    def transfer_done(self, key: Any, worker: str, run_id: RunId | None) -> None:
        """Transfer ``key`` is in memory on ``worker``, cut for ``run_id`` (if it says).

        An alias dask's fusion left (it cut nothing: it says no run) takes the worker and run
        of the transfer it points to, which is in memory now and may be released before the
        facts are read: the pieces were cut and queued there, for that run.
        """
        ts = self.scheduler.tasks.get(key)
        if run_id is None and ts is not None:
            for dts in transfer_chain(ts)[1:]:
                if dts.key in self.cut_for:
                    worker, run_id = self.computed_on[dts.key], self.cut_for[dts.key]
                    break
        self.computed_on[key] = worker
        if run_id is not None:
            self.cut_for[key] = run_id

    def transfer_gone(self, key: Any) -> None:
        """Transfer ``key``'s result left memory."""
        self.computed_on.pop(key, None)
        self.cut_for.pop(key, None)

    def forget(self) -> None:
        """The scheduler restarted: nothing is in memory."""
        self.computed_on.clear()
        self.cut_for.clear()

    def facts(self, run: SchedulerRun) -> RunFacts:
        """The scheduler's state of ``run``: its barrier, transfers, outputs and workers."""
        tasks = self.scheduler.tasks
        barrier = tasks.get(barrier_key(run.shuffle_id))
        dataplanes = self.scheduler.get_metadata([METADATA_KEY], default={})
        present = frozenset(w for w in self.scheduler.workers if w in dataplanes)
        spec = run.run_spec.spec
        pending = frozenset(
            flat
            for flat in spec.outputs
            if (ts := tasks.get(spec.output_key(flat))) is not None and ts.state in BARRIER_PENDING
        )
        if barrier is None:
            return RunFacts(None, (), pending, present)
        transfers = tuple(
            self._transfer(spec.transfer_of(dt.key), dt) for dt in barrier.dependencies
        )
        allowed = frozenset(barrier.worker_restrictions) if barrier.worker_restrictions else None
        limits = {w: ws.memory_limit for w, ws in self.scheduler.workers.items()}
        return RunFacts(barrier.state, transfers, pending, present, allowed, limits)

    def _transfer(self, index: int, dependency: Any) -> TransferFacts:
        chain = transfer_chain(dependency)
        cut_for = (self.cut_for[ts.key] for ts in chain if ts.key in self.cut_for)
        return TransferFacts(
            index=index,
            done=dependency.state == "memory",
            in_memory=tuple(ts.key for ts in chain if ts.state == "memory"),
            ran_on=tuple(self.computed_on[ts.key] for ts in chain if ts.key in self.computed_on),
            cut_for=next(cut_for, None),
        )

    # --- decisions, carried out -----------------------------------------------------------

    def worker_left(self, run: SchedulerRun, worker: str, stimulus_id: str) -> Action | None:
        """``worker`` left the cluster: continue ``run``, go on or restart it
        (:func:`rechunk_p2p.recovery.worker_left`); the action taken, if any."""
        if worker not in run.workers:
            return None
        self.counts.left += 1
        action = worker_left(run, worker, self.facts(run), self._run_ids.peek())
        if isinstance(action, Restart):
            logger.warning(
                "Worker %s left during rechunk %s (run %d); restarting it",
                worker,
                run.shuffle_id,
                run.run_spec.run_id,
            )
        self._do(run, action, stimulus_id)
        return action

    def workers_joined(self, run: SchedulerRun, dataplanes: dict[str, str]) -> Continue | None:
        """Workers joined the cluster (``dataplanes``: worker -> its data plane): ``run``
        continues with them taking a share of its outputs, while its transfers run
        (:func:`rechunk_p2p.recovery.workers_joined`); the continuation, if any."""
        action = workers_joined(run, dataplanes, self.facts(run), self._run_ids.peek())
        if action is not None:
            self.counts.joined += len(action.new.workers) - len(run.run_spec.workers)
            self._continue(run, action)
        return action

    def output_lost(
        self, run: SchedulerRun, output: int | None, worker: str | None, reason: str
    ) -> Action | None:
        """A worker lost ``output`` (assembled on ``worker`` before; ``None``: a result it
        cannot rebuild): assemble it again elsewhere, or restart the run
        (:func:`rechunk_p2p.recovery.output_lost`); the action taken, if any."""
        if output is None or worker is None:
            action: Action | None = Restart(reason)
        else:
            action = output_lost(run, output, worker, reason, self.facts(run), self._run_ids.peek())
        if isinstance(action, Restart):
            logger.warning(
                "Restarting rechunk %s (run %d): %s", run.shuffle_id, run.run_spec.run_id, reason
            )
        stimulus_id = f"rechunk-p2p-restart-{run.shuffle_id}-{run.run_spec.run_id}"
        self._do(run, action, stimulus_id)
        return action

    def _do(self, run: SchedulerRun, action: Action | None, stimulus_id: str) -> None:
        if isinstance(action, GoOn):
            self._go_on(run, action)
        elif isinstance(action, Continue):
            self._continue(run, action)
        elif isinstance(action, Restart):
            self.counts.restarts += 1
            self._close(run.shuffle_id, action.reason)
            self.restart(run.shuffle_id, stimulus_id)

    def _go_on(self, run: SchedulerRun, action: GoOn) -> None:
        run.left(action.worker)
        self.counts.restarts_saved += 1
        if action.release:
            logger.info(
                "Worker %s (no outputs) left rechunk %s (run %d): running its %d transfers again",
                action.worker,
                run.shuffle_id,
                run.run_spec.run_id,
                action.reruns,
            )
            release(self.scheduler, action.release, self._stale_stimulus(run.shuffle_id))

    def _continue(self, run: SchedulerRun, action: Continue) -> None:
        """Tell the run's workers that ``action.new`` continues the run, with the outputs
        each keeps, then release the barrier and the transfers: the other workers hear of
        the continuation before the barrier is released (the same stream, in order), so
        that outputs the release cancels are kept for the continued run's tasks."""
        self._run_ids.take()  # (a decision only peeks: one not to continue takes none)
        old_id = run.run_spec.run_id
        run.continue_as(action)
        self._pin(run, action.moved)
        new, shuffle_id = action.new, run.shuffle_id
        msgs = {
            w: [
                {
                    "op": "rechunk_p2p_continue",
                    "shuffle_id": shuffle_id,
                    "run_spec": ToPickle(new),
                    "keep": action.keep.get(w, []),
                }
            ]
            for w in run.workers
            if w in self.scheduler.stream_comms
        }
        self.scheduler.send_all({}, msgs)
        counts = self.counts
        counts.continuations += 1
        counts.remade += action.remade
        counts.outputs_kept += action.finished
        counts.outputs_moved += len(action.moved)
        counts.transfers_rerun += action.reruns
        counts.inputs_resent += len(new.resend_all)
        logger.warning(
            "%s in rechunk %s: run %d continues as run %d, %d outputs moved, %d finished "
            "outputs kept, %d of %d inputs send all their pieces again, %d finished transfers "
            "run again",
            action.why,
            shuffle_id,
            old_id,
            new.run_id,
            len(action.moved),
            action.finished,
            len(new.resend_all),
            len(new.spec.inputs),
            action.reruns,
        )
        release(self.scheduler, action.release, self._stale_stimulus(shuffle_id))

    def _pin(self, run: SchedulerRun, outputs: frozenset[int]) -> None:
        """Restrict the unpack tasks of ``outputs`` to their (new) workers."""
        spec, tasks = run.run_spec.spec, self.scheduler.tasks
        pins = {}
        for flat in sorted(outputs):
            key = spec.output_key(flat)
            if key in tasks:
                run.restricted.setdefault(key, tasks[key].worker_restrictions)
                pins[key] = {run.run_spec.worker_for(flat)}
        self.scheduler.set_restrictions(pins)

    def _stale_stimulus(self, shuffle_id: ShuffleId) -> str:
        return f"{STALE_STIMULUS}{shuffle_id}-{next(self._rounds)}"

    def rerun_stale(
        self, shuffle_id: ShuffleId, run: SchedulerRun | None, stale: list[int]
    ) -> None:
        """Release the barrier and the ``stale`` transfers (their indices in
        ``spec.transfers``: they ran for an older run), which then run (again) for the
        current run; with no run active, restart the whole sub-shuffle."""
        barrier = self.scheduler.tasks.get(barrier_key(shuffle_id))
        if barrier is None or barrier.state != "processing":
            return  # released or forgotten meanwhile: its own transitions handle it
        stimulus_id = self._stale_stimulus(shuffle_id)
        if run is None:
            self.restart(shuffle_id, stimulus_id)
            return
        spec = run.run_spec.spec
        deps = {spec.transfer_of(dt.key): dt for dt in barrier.dependencies}
        keys = [ts.key for i in stale if i in deps for ts in transfer_chain(deps[i])]
        logger.info(
            "Rechunk %s: %d transfers ran for an older run; running them for run %d",
            shuffle_id,
            len(stale),
            run.run_spec.run_id,
        )
        release(self.scheduler, [*keys, barrier.key], stimulus_id)

    def restart(self, shuffle_id: ShuffleId, stimulus_id: str) -> None:
        """Run the sub-shuffle again from scratch (its run closed): release its barrier,
        the transfers and the outputs, unless one of them failed."""
        barrier = self.scheduler.tasks.get(barrier_key(shuffle_id))
        if barrier is None:
            return
        if any(dt.state == "erred" for dt in barrier.dependents) or barrier.state == "erred":
            return
        keys = [dt.key for dt in barrier.dependents]
        keys += [barrier.key, *(dt.key for dt in barrier.dependencies)]
        release(self.scheduler, keys, stimulus_id)
