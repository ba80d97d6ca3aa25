"""What the scheduler plugin does when a worker leaves a run: continue, go on, or restart.

Where it runs: the scheduler's event loop (the plugin's ``remove_worker`` hook). Small
messages and task transitions only; no array data.

A run whose owner (a worker that assembles outputs) left continues without it as a new run
id that moves its outputs to the others and keeps everything else; a run that only received
pieces from the worker goes on without it, running its transfers again; a run with no other
worker left restarts from scratch.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from distributed.protocol.serialize import ToPickle

from rechunk_p2p.spec import (
    METADATA_KEY,
    TRANSFER_PREFIX,
    RunId,
    RunSpec,
    ShuffleId,
    barrier_key,
)
from rechunk_p2p.waves import TransferWaves, key_name

logger = logging.getLogger("rechunk_p2p.scheduler")

#: Stimulus of the transitions that re-run stale transfers (the run stays open through them)
STALE_STIMULUS = "rechunk-p2p-stale-"

#: States of a barrier task whose transfers may still need a run
BARRIER_PENDING = frozenset({"waiting", "queued", "no-worker", "processing"})


@dataclass
class SchedulerRun:
    """**Loop-confined.** The scheduler's record of one active run."""

    run_spec: RunSpec
    participants: set[str] = field(default_factory=set)
    restricted: dict[Any, Any] = field(default_factory=dict)
    owners: frozenset[str] = frozenset()  # the workers that assemble outputs
    departed: set[str] = field(default_factory=set)  # workers that left the run on its way
    delivered: bool = False  # a barrier of the run finished: every input's pieces arrived
    # inputs whose every piece was queued for sending by the worker named (a continued run
    # sends only the moved outputs' pieces of them, while that worker is there)
    full_by: dict[int, str] = field(default_factory=dict)
    # runs this one continued after a bystander left (no output moved): their transfers'
    # results count for this run too, but for inputs it sends in full that they did not
    # (run id -> that run's resend_all)
    carried: dict[RunId, frozenset[int]] = field(default_factory=dict)
    started: float = field(default_factory=time.time)  # when the run was created
    # outputs assembled where they are now (their pieces consumed there): one whose task is
    # wanted again must be assembled again elsewhere
    assembled: set[int] = field(default_factory=set)

    @property
    def shuffle_id(self) -> ShuffleId:
        return self.run_spec.shuffle_id

    @property
    def workers(self) -> set[str]:
        return set(self.run_spec.workers) | self.participants

    def takes(self, transfer: int, run_id: RunId) -> bool:
        """Whether a result of transfer ``transfer`` (its index in ``spec.transfers``) made
        for run ``run_id`` counts for this run: it is this run's, or a carried run's that sent
        every piece this run's would."""
        if run_id == self.run_spec.run_id:
            return True
        if run_id not in self.carried:
            return False
        resend_all, sent_all = self.run_spec.resend_all, self.carried[run_id]
        inputs = self.run_spec.spec.transfers[transfer]
        return not any(i in resend_all and i not in sent_all for i in inputs)


class RunRecovery:
    """**Loop-confined.** The worker-loss half of :class:`RechunkSchedulerPlugin` (which
    holds the state named below and closes and restarts runs)."""

    scheduler: Any
    active: dict[str, SchedulerRun]
    waves: TransferWaves
    _run_ids: itertools.count
    _stale_rounds: itertools.count
    _computed_on: dict[Any, str]
    _cut_for: dict[Any, RunId]
    restarts: int
    restarts_saved: int
    continuations: int
    outputs_kept: int
    outputs_moved: int
    transfers_rerun: int
    remade: int
    _close: Callable[[ShuffleId, str], SchedulerRun]

    def remove_worker(
        self, scheduler: Any, worker: str, *, stimulus_id: str, **kwargs: Any
    ) -> None:
        """A worker left. A run it assembles outputs for continues without it, its outputs
        moved to the others (see :meth:`_continue_without`), or restarts with a new run id
        when no other worker of the run is left; a run it only sent pieces for goes on
        without it (see :meth:`_go_on_without`)."""
        dataplanes = self.scheduler.get_metadata([METADATA_KEY], default={})
        dataplanes.pop(worker, None)
        self.waves.forget_worker(worker)
        for shuffle_id, run in list(self.active.items()):
            if worker in run.workers and worker not in run.owners:
                self._go_on_without(shuffle_id, run, worker)
            elif worker in run.workers and self._can_continue(shuffle_id, run, worker):
                self._continue_without(shuffle_id, run, worker)
            elif worker in run.workers:
                logger.warning(
                    "Worker %s left during rechunk %s (run %d); restarting it",
                    worker,
                    shuffle_id,
                    run.run_spec.run_id,
                )
                self.restarts += 1
                self._close(shuffle_id, reason=f"worker {worker} left")
                self._restart(shuffle_id, stimulus_id)

    def _can_continue(self, shuffle_id: ShuffleId, run: SchedulerRun, worker: str | None) -> bool:
        """Whether the run can go on without ``worker``, an owner (``None``: with all its
        workers): another worker of the run is still there to take outputs over, every other
        one is there too, and the barrier task has not failed."""
        barrier = self.scheduler.tasks.get(barrier_key(shuffle_id))
        if barrier is None or barrier.state == "erred":
            return False
        dataplanes = self.scheduler.get_metadata([METADATA_KEY], default={})
        others = [w for w in run.run_spec.workers if w != worker]
        return bool(others) and all(w in self.scheduler.workers and w in dataplanes for w in others)

    def _continue_without(self, shuffle_id: ShuffleId, run: SchedulerRun, worker: str) -> None:
        """An owner left: continue the run without restarting it.

        The continued run (a new run id) moves the worker's outputs to the others and keeps
        everything else: the pieces on the other workers, and the outputs they assembled.
        The barrier runs again, and with it every transfer, but a transfer sends only the
        moved outputs' pieces, unless its input's pieces may have been lost with the worker
        (see :meth:`_resend_all`). After the barrier passed, dask released the transfers'
        results: they all run again, computing their inputs again. (The barrier itself may
        have been lost with the worker: then it was released already, and the run was left
        open for this.)

        The other workers hear of the continuation before the barrier is released, with
        their outputs that are not finished on the scheduler: outputs among them that the
        worker assembled already, or is assembling (tasks that the release cancels), are kept
        for the continued run's tasks (their pieces are gone). The other workers' outputs
        assembled before and wanted again (their consumers' results went with the worker,
        say) are assembled again by the same continuation (:meth:`_wanted_again`).
        """
        barrier = self.scheduler.tasks[barrier_key(shuffle_id)]
        resend_all = self._resend_all(run, worker, barrier)
        again = frozenset(
            f for f in self._wanted_again(run) if run.run_spec.worker_for(f) != worker
        )
        new = run.run_spec.continued_without(
            worker, RunId(next(self._run_ids)), resend_all, remake=again
        )
        self.remade += len(again)
        self._continue_as(shuffle_id, run, new, barrier, f"Worker {worker} left", worker)

    def remake(
        self, shuffle_id: ShuffleId, run: SchedulerRun, output: int, worker: str, reason: str
    ) -> bool:
        """Output ``output``, assembled on ``worker`` before, was lost after its pieces were
        consumed (its consumers' results went with a worker that left, say) and is wanted
        again: the run continues to assemble it on the next worker, every input sending its
        pieces again, and with it every other output assembled before and wanted again
        (:meth:`_wanted_again`); nothing else of the run is done again. Whether it did, or
        has nothing to do (the output has another worker by now); not when the run has no
        other worker, a worker of the run is gone, or the barrier failed (then the run
        restarts).
        """
        if run.run_spec.worker_for(output) != worker:  # moved since: its task runs there
            return True
        if len(run.run_spec.workers) < 2 or not self._can_continue(shuffle_id, run, None):
            return False
        barrier = self.scheduler.tasks[barrier_key(shuffle_id)]
        again = self._wanted_again(run) | {output}
        new = run.run_spec.remaking(again, RunId(next(self._run_ids)))
        self.remade += len(again)
        index = run.run_spec.spec.partial.output_index(output)
        others = f" and {len(again) - 1} more" if len(again) > 1 else ""
        why = f"Output {index}{others} was lost ({reason})"
        self._continue_as(shuffle_id, run, new, barrier, why)
        return True

    def _wanted_again(self, run: SchedulerRun) -> frozenset[int]:
        """Outputs of ``run`` assembled before whose results are gone and whose tasks are
        to run again: each would find its pieces consumed, so one continuation assembles
        them all again (rather than one each, every transfer running again each time)."""
        spec, tasks = run.run_spec.spec, self.scheduler.tasks
        return frozenset(
            flat
            for flat in run.assembled
            if (ts := tasks.get(spec.output_key(flat))) is not None and ts.state in BARRIER_PENDING
        )

    def _continue_as(
        self,
        shuffle_id: ShuffleId,
        run: SchedulerRun,
        new: RunSpec,
        barrier: Any,
        why: str,
        worker: str | None = None,
    ) -> None:
        """Tell the run's workers that ``new`` continues the run (``worker`` left it, if
        given), then release the barrier and the transfers (see :meth:`_continue_without`).

        When no output moved (a bystander left, see :meth:`_go_on_without`), only the
        transfers that ran on the worker or send in full in ``new`` run again: every other
        transfer's result counts for ``new`` as it is (:meth:`SchedulerRun.takes`).
        """
        old = run.run_spec
        moved = new.reassigned(old)
        keep, finished = self._unfinished_outputs(new, moved)
        carry = not moved and new.workers == old.workers  # a bystander left
        run.carried = {**run.carried, old.run_id: old.resend_all} if carry else {}
        run.run_spec = new
        run.owners = new.owners()
        run.assembled -= moved
        if worker is not None:
            run.participants.discard(worker)
            run.departed.add(worker)
        self._pin(run, moved)
        msgs = {
            w: [
                {
                    "op": "rechunk_p2p_continue",
                    "shuffle_id": shuffle_id,
                    "run_spec": ToPickle(new),
                    "keep": keep.get(w, []),
                }
            ]
            for w in run.workers
            if w in self.scheduler.stream_comms
        }
        self.scheduler.send_all({}, msgs)  # before the releases below (same stream, in order)
        recs = {}
        for chain in map(transfer_chain, barrier.dependencies):
            if not carry or self._reruns(chain, new, worker):
                # (a transfer still running finishes with the run it cut for, which its
                # metadata names: the barrier runs it again if that does not count)
                recs.update({ts.key: "released" for ts in chain if ts.state == "memory"})
        rerun_count = sum(1 for dt in barrier.dependencies if dt.key in recs)
        if barrier.state in ("memory", "processing"):  # (released already if it was lost)
            recs[barrier.key] = "released"
        self.continuations += 1
        self.outputs_kept += finished
        self.outputs_moved += len(moved)
        self.transfers_rerun += rerun_count
        logger.warning(
            "%s in rechunk %s: run %d continues as run %d, %d outputs moved, %d finished "
            "outputs kept, %d of %d inputs send all their pieces again, %d finished transfers "
            "run again",
            why,
            shuffle_id,
            new.lineage[-1],
            new.run_id,
            len(moved),
            finished,
            len(new.resend_all),
            len(new.spec.inputs),
            rerun_count,
        )
        stimulus_id = f"{STALE_STIMULUS}{shuffle_id}-{next(self._stale_rounds)}"
        self.scheduler.transitions(recs, stimulus_id=stimulus_id)
        self.scheduler.stimulus_queue_slots_maybe_opened(stimulus_id=stimulus_id)

    def _reruns(self, chain: list[Any], new: RunSpec, worker: str) -> bool:
        """Whether a transfer must run again when a bystander left: it ran on ``worker`` (its
        queued pieces may be gone with it), or one of its inputs sends in full in ``new``."""
        if any(self._computed_on.get(ts.key) == worker for ts in chain):
            return True
        inputs = new.spec.transfers[new.spec.transfer_of(chain[0].key)]
        return any(i in new.resend_all for i in inputs)

    def _unfinished_outputs(
        self, run_spec: RunSpec, moved: frozenset[int]
    ) -> tuple[dict[str, list[int]], int]:
        """Per worker, its outputs (not ``moved`` to it now) whose tasks are not finished on
        the scheduler (running, or done on the worker and not reported yet); and how many are
        finished (in memory, or consumed already). An output moved by an earlier
        continuation is kept as any other: its pieces were consumed where it is."""
        spec = run_spec.spec
        keep: dict[str, list[int]] = {w: [] for w in run_spec.workers}
        finished = 0
        for flat in spec.outputs:
            if flat in moved:
                continue
            ts = self.scheduler.tasks.get(spec.output_key(flat))
            if ts is not None and ts.state in BARRIER_PENDING:
                keep[run_spec.worker_for(flat)].append(flat)
            else:
                finished += 1
        return keep, finished

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

    def _resend_all(self, run: SchedulerRun, worker: str, barrier: Any) -> frozenset[int]:
        """The inputs whose pieces may have been lost with ``worker``: their transfers send
        every piece again in the continued run.

        None once a barrier of the run passed (every piece arrived). Before, an input's
        pieces are safe if a transfer that sent all of them finished on a worker that is
        still there (queued sends are delivered by it); every other input's transfer ran on
        the worker that left, or has not finished.
        """
        if run.delivered:
            return frozenset()
        spec = run.run_spec
        chains = {
            i: transfer_chain(dt)
            for dt in barrier.dependencies
            for i in spec.spec.transfers[spec.spec.transfer_of(dt.key)]
        }
        lost = set()
        for i in spec.spec.inputs:
            if run.full_by.get(i, worker) != worker:
                continue  # every piece queued by a worker still there
            run.full_by.pop(i, None)
            chain = chains.get(i)
            if chain is None:
                lost.add(i)
                continue
            where = next(
                (self._computed_on[t.key] for t in chain if t.key in self._computed_on), None
            )
            cut_for = next((self._cut_for[t.key] for t in chain if t.key in self._cut_for), None)
            if cut_for is None or not run.takes(spec.spec.transfer_of(chain[0].key), cut_for):
                where = None  # (cut for a run that does not count: maybe moved pieces only)
            sent_all = not spec.lineage or i in spec.resend_all
            if chain[0].state == "memory" and where not in (None, worker) and sent_all:
                run.full_by[i] = where
            else:
                lost.add(i)
        return frozenset(lost)

    def _go_on_without(self, shuffle_id: ShuffleId, run: SchedulerRun, worker: str) -> None:
        """A worker that assembles no output of the run left (killed, or retired).

        Before the barrier passed, pieces of the transfers it ran may not have been
        delivered: those transfers run again on other workers (receivers drop pieces they
        already hold) and the barrier waits for them; transfers whose results were lost with
        the worker are recomputed by the scheduler anyway. In a continued run, inputs it had
        cut in full for an earlier run may still wait in its send queues (a queue goes when
        it makes a message, or at the barrier): a run that continues this one sends them in
        full again (see :meth:`_resend_all`). After the barrier passed, every piece was
        delivered and the run needs nothing of the worker.
        """
        barrier = self.scheduler.tasks.get(barrier_key(shuffle_id))
        pending = barrier is not None and barrier.state in BARRIER_PENDING
        if pending and worker in run.full_by.values():
            # inputs it had cut in full in an earlier run of the lineage, their pieces maybe
            # still in its send queues: a continued run's transfers send only the moved
            # outputs' pieces, so a run that continues this one sends theirs in full
            resend_all = self._resend_all(run, worker, barrier)
            new = run.run_spec.continued(RunId(next(self._run_ids)), resend_all)
            self._continue_as(shuffle_id, run, new, barrier, f"Worker {worker} left", worker)
            return
        run.participants.discard(worker)
        run.departed.add(worker)
        self.restarts_saved += 1
        if not pending:
            return
        ran_there = [
            chain
            for chain in map(transfer_chain, barrier.dependencies)
            if any(self._computed_on.get(ts.key) == worker for ts in chain)
        ]
        recs = {ts.key: "released" for chain in ran_there for ts in chain if ts.state == "memory"}
        if barrier.state == "processing":  # it may have flushed before the worker left
            recs[barrier.key] = "released"
        logger.info(
            "Worker %s (no outputs) left rechunk %s (run %d): running its %d transfers again",
            worker,
            shuffle_id,
            run.run_spec.run_id,
            len(ran_there),
        )
        if recs:
            stimulus_id = f"{STALE_STIMULUS}{shuffle_id}-{next(self._stale_rounds)}"
            self.scheduler.transitions(recs, stimulus_id=stimulus_id)
            self.scheduler.stimulus_queue_slots_maybe_opened(stimulus_id=stimulus_id)

    def _restart(self, shuffle_id: ShuffleId, stimulus_id: str) -> None:
        barrier = self.scheduler.tasks.get(barrier_key(shuffle_id))
        if barrier is None:
            return
        if any(dt.state == "erred" for dt in barrier.dependents) or barrier.state == "erred":
            return
        recs = {dt.key: "released" for dt in barrier.dependents}
        recs[barrier.key] = "released"
        recs.update({dt.key: "released" for dt in barrier.dependencies})
        self.scheduler.transitions(recs, stimulus_id=stimulus_id)
        self.scheduler.stimulus_queue_slots_maybe_opened(stimulus_id=stimulus_id)


def transfer_chain(dependency: Any) -> list[Any]:
    """A barrier's dependency and, when it is an alias dask's fusion left (the input's
    chain fused into a task of another name), the transfer task it points to: to run a
    transfer again, both are released (releasing the alias alone would return the old
    result)."""
    return [dependency] + [
        ts for ts in dependency.dependencies if TRANSFER_PREFIX in key_name(ts.key)
    ]
