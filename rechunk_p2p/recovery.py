"""What a run does when a worker leaves it or an output it assembled is lost: the decision.

Where it runs: pure (no scheduler, no I/O). The scheduler plugin's collaborator
(:class:`~rechunk_p2p.scheduler_recovery.RunRecovery`) gathers the facts of a run
(:class:`RunFacts`), asks :func:`worker_left` or :func:`output_lost`, and carries the action
out (:class:`GoOn`, :class:`Continue` or :class:`Restart`).

A run whose owner (a worker that assembles outputs) left continues without it as a new run
id that moves its outputs to the others and keeps everything else; a run that only received
pieces from the worker goes on without it, running its transfers again; a run with no other
worker left restarts from scratch.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rechunk_p2p.planning import memory_weights
from rechunk_p2p.spec import RunId, RunSpec, ShuffleId, barrier_key

#: States of a barrier (or output) task that still has to run
BARRIER_PENDING = frozenset({"waiting", "queued", "no-worker", "processing"})

#: A run takes in workers that joined the cluster only while at most this share of its
#: inputs were sent in full (by any run of its lineage): their transfers run again for the
#: outputs that move, so past half of them the run would do more again than the joined
#: workers take off the others
JOIN_BEFORE_DONE = 0.5


@dataclass
class SchedulerRun:
    """**Loop-confined.** The scheduler's record of one active run: the one owner of which
    of its outputs were assembled, where its transfers' inputs were sent in full, and
    which workers left it."""

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
    joined: int = 0  # workers taken in by continuations after they joined the cluster
    moved: int = 0  # outputs continuations moved to another worker

    @property
    def changes(self) -> str:
        """How the run's workers changed, for people: ``""`` where they did not."""
        parts = [f"{self.joined} joined"] if self.joined else []
        parts += [f"{len(self.departed)} left"] if self.departed else []
        parts += [f"{self.moved} outputs moved"] if self.moved else []
        return ", ".join(parts)

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

    def output_assembled(self, run_id: RunId, flat: int) -> None:
        """An unpack task of run ``run_id`` assembled output ``flat`` (kept if the run
        accepts it: it is this run's, or one it continues)."""
        if self.run_spec.accepts(run_id):
            self.assembled.add(flat)

    def barrier_passed(self) -> None:
        """A barrier of the run finished: every input's pieces arrived."""
        self.delivered = True
        self.full_by.clear()

    def left(self, worker: str) -> None:
        """``worker`` left the run."""
        self.participants.discard(worker)
        self.departed.add(worker)

    def continue_as(self, action: Continue) -> None:
        """The run continues as ``action.new``."""
        self.joined += len(set(action.new.workers) - set(self.run_spec.workers))
        self.moved += len(action.moved)
        self.carried = dict(action.carried)
        self.full_by = dict(action.full_by)
        self.run_spec = action.new
        self.owners = action.new.owners()
        self.assembled -= action.moved
        if action.left is not None:
            self.left(action.left)


@dataclass(frozen=True)
class TransferFacts:
    """**Immutable.** One of a barrier's transfers as the scheduler sees it.

    ``keys`` are the transfer's chain (its task, and the task dask's fusion aliased it
    with): to run it again, the ones in memory (``in_memory``) are released together.
    """

    index: int  # in spec.transfers
    done: bool  # the barrier's dependency is in memory
    in_memory: tuple[Any, ...] = ()
    ran_on: tuple[str, ...] = ()  # workers that computed keys of the chain, in chain order
    cut_for: RunId | None = None  # the run it cut its inputs for (its first key that says)


@dataclass(frozen=True)
class RunFacts:
    """**Immutable.** What a decision about a run reads of the scheduler."""

    barrier: str | None  # the barrier task's state; None when it is not on the scheduler
    transfers: tuple[TransferFacts, ...] = ()  # the barrier's dependencies
    pending_outputs: frozenset[int] = frozenset()  # outputs whose tasks have to run
    present: frozenset[str] = frozenset()  # workers in the cluster with a data plane
    allowed: frozenset[str] | None = None  # the barrier's worker restrictions, if any
    # workers' memory limits (by address; where every worker concerned has one, outputs
    # that move are placed in proportion to them)
    limits: Mapping[str, float] = field(default_factory=dict)

    def weights(self, workers: Sequence[str]) -> tuple[float, ...] | None:
        """The memory limits of ``workers``, ``None`` unless each has one."""
        return memory_weights([self.limits.get(w, 0) for w in workers])


@dataclass(frozen=True)
class GoOn:
    """**Immutable.** A worker that assembles none of the run's outputs left: the run goes
    on; the transfers that ran there run again (``release``: their keys, and the barrier)."""

    worker: str
    release: tuple[Any, ...]
    reruns: int


@dataclass(frozen=True)
class Continue:
    """**Immutable.** The run continues as ``new``: ``moved`` outputs change worker, the
    other workers keep ``keep`` (their outputs whose tasks have to run), ``release`` runs
    the transfers (and the barrier) again."""

    new: RunSpec
    why: str
    left: str | None  # the worker that left, if one did
    keep: dict[str, list[int]]
    finished: int  # outputs finished, kept as they are
    moved: frozenset[int]
    release: tuple[Any, ...]
    reruns: int  # transfers that had finished and run again
    carried: dict[RunId, frozenset[int]]
    full_by: dict[int, str]
    remade: int  # outputs assembled before that are assembled again


@dataclass(frozen=True)
class Restart:
    """**Immutable.** The run cannot go on: it restarts from scratch."""

    reason: str


Action = GoOn | Continue | Restart


def worker_left(run: SchedulerRun, worker: str, facts: RunFacts, run_id: RunId) -> Action | None:
    """What ``run`` does now that ``worker`` left the cluster (``None``: it was not in the
    run). ``run_id`` is the id a continuation takes.

    An owner's outputs move to the other workers where all of them are still there and the
    barrier has not failed (:class:`Continue`), else the run restarts; a worker that owns
    no output leaves the run going on (:class:`GoOn`), but for inputs it had cut in full
    for an earlier run of the lineage (see :func:`_go_on_without`).
    """
    if worker not in run.workers:
        return None
    if worker not in run.owners:
        return _go_on_without(run, worker, facts, run_id)
    if _can_continue(run, worker, facts):
        return _continue_without(run, worker, facts, run_id)
    return Restart(f"worker {worker} left")


def workers_joined(
    run: SchedulerRun, dataplanes: Mapping[str, str], facts: RunFacts, run_id: RunId
) -> Continue | None:
    """What ``run`` does now that the workers of ``dataplanes`` (worker -> its data plane)
    joined the cluster: while its transfers run (the barrier waits for them, no barrier of
    the run passed) and at most :data:`JOIN_BEFORE_DONE` of its inputs were sent in full, it
    continues with them, each taking a fair share of the outputs
    (:meth:`~rechunk_p2p.spec.RunSpec.continued_with`): the finished
    transfers run again for the moved outputs, the others send every piece. ``None``: the
    run goes on as it is (no transfer left to speak of, the barrier running or passed, or no
    output to give).
    """
    joined = [
        w
        for w in dataplanes
        if w in facts.present
        and (facts.allowed is None or w in facts.allowed)  # a rechunk restricted to some
        and w not in run.workers
        and w not in run.departed
    ]
    if not joined or run.delivered or facts.barrier != "waiting" or not facts.transfers:
        return None
    resend_all, full_by = _resend_all(run, None, facts)
    if len(full_by) > JOIN_BEFORE_DONE * len(run.run_spec.spec.inputs):
        return None  # (a continuation's transfers send the moved outputs' pieces only)
    new = run.run_spec.continued_with(
        tuple(joined),
        tuple(dataplanes[w] for w in joined),
        run_id,
        resend_all,
        fixed=frozenset(run.assembled),
        weights=facts.weights((*run.run_spec.workers, *joined)),
    )
    if not new.reassigned(run.run_spec):
        return None
    why = f"Worker{'s' if len(joined) > 1 else ''} {', '.join(joined)} joined"
    return _continuation(run, new, facts, why, None, full_by, 0)


def output_lost(
    run: SchedulerRun, output: int, worker: str, reason: str, facts: RunFacts, run_id: RunId
) -> Continue | Restart | None:
    """Output ``output``, assembled on ``worker`` before, was lost after its pieces were
    consumed (its consumers' results went with a worker that left, say) and is wanted
    again: the run continues to assemble it on the next worker, every input sending its
    pieces again, and with it every other output assembled before and wanted again
    (:func:`_wanted_again`); nothing else of the run is done again. ``None``: nothing to do
    (the output has another worker by now). Restarts when the run has no other worker, a
    worker of the run is gone, or the barrier failed.
    """
    if run.run_spec.worker_for(output) != worker:  # moved since: its task runs there
        return None
    if len(run.run_spec.workers) < 2 or not _can_continue(run, None, facts):
        return Restart(reason)
    again = _wanted_again(run, facts) | {output}
    new = run.run_spec.remaking(again, run_id)
    index = run.run_spec.spec.partial.output_index(output)
    others = f" and {len(again) - 1} more" if len(again) > 1 else ""
    why = f"Output {index}{others} was lost ({reason})"
    return _continuation(run, new, facts, why, None, dict(run.full_by), len(again))


def _can_continue(run: SchedulerRun, worker: str | None, facts: RunFacts) -> bool:
    """Whether the run can go on without ``worker``, an owner (``None``: with all its
    workers): another worker of the run is still there to take outputs over, every other
    one is there too, and the barrier task has not failed."""
    if facts.barrier is None or facts.barrier == "erred":
        return False
    others = [w for w in run.run_spec.workers if w != worker]
    return bool(others) and all(w in facts.present for w in others)


def _continue_without(run: SchedulerRun, worker: str, facts: RunFacts, run_id: RunId) -> Continue:
    """An owner left: the continued run moves its outputs to the others and keeps
    everything else (the pieces on the other workers, and the outputs they assembled).

    The barrier runs again, and with it every transfer, but a transfer sends only the
    moved outputs' pieces, unless its input's pieces may have been lost with the worker
    (:func:`_resend_all`). The other workers' outputs assembled before and wanted again
    (their consumers' results went with the worker, say) are assembled again by the same
    continuation (:func:`_wanted_again`).
    """
    resend_all, full_by = _resend_all(run, worker, facts)
    again = frozenset(f for f in _wanted_again(run, facts) if run.run_spec.worker_for(f) != worker)
    survivors = [w for w in run.run_spec.workers if w != worker]
    new = run.run_spec.continued_without(
        worker, run_id, resend_all, remake=again, weights=facts.weights(survivors)
    )
    return _continuation(run, new, facts, f"Worker {worker} left", worker, full_by, len(again))


def _go_on_without(run: SchedulerRun, worker: str, facts: RunFacts, run_id: RunId) -> Action:
    """A worker that assembles no output of the run left (killed, or retired).

    Before the barrier passed, pieces of the transfers it ran may not have been delivered:
    those transfers run again on other workers (receivers drop pieces they already hold)
    and the barrier waits for them. In a continued run, inputs it had cut in full for an
    earlier run may still wait in its send queues: a run that continues this one sends
    them in full again (a :class:`Continue`). After the barrier passed, every piece was
    delivered and the run needs nothing of the worker.
    """
    pending = facts.barrier in BARRIER_PENDING
    if pending and worker in run.full_by.values():
        resend_all, full_by = _resend_all(run, worker, facts)
        new = run.run_spec.continued(run_id, resend_all)
        return _continuation(run, new, facts, f"Worker {worker} left", worker, full_by, 0)
    if not pending:
        return GoOn(worker, (), 0)
    ran_there = [t for t in facts.transfers if worker in t.ran_on]
    release = [key for t in ran_there for key in t.in_memory]
    if facts.barrier == "processing":  # it may have flushed before the worker left
        release.append(barrier_key(run.shuffle_id))
    return GoOn(worker, tuple(release), len(ran_there))


def _continuation(
    run: SchedulerRun,
    new: RunSpec,
    facts: RunFacts,
    why: str,
    left: str | None,
    full_by: dict[int, str],
    remade: int,
) -> Continue:
    """``run`` continues as ``new``: which outputs move, which the other workers keep, and
    which transfers run again.

    When no output moved (a bystander left), only the transfers that ran on the worker or
    send in full in ``new`` run again: every other transfer's result counts for ``new`` as
    it is (:meth:`SchedulerRun.takes`). After the barrier passed, dask released the
    transfers' results: they all run again, computing their inputs again.
    """
    old = run.run_spec
    moved = new.reassigned(old)
    keep, finished = _unfinished_outputs(new, moved, facts)
    carry = not moved and new.workers == old.workers  # a bystander left
    again = [t for t in facts.transfers if not carry or _reruns(t, new, left)]
    release = [key for t in again for key in t.in_memory]
    if facts.barrier in ("memory", "processing"):  # (released already if it was lost)
        release.append(barrier_key(run.shuffle_id))
    return Continue(
        new=new,
        why=why,
        left=left,
        keep=keep,
        finished=finished,
        moved=moved,
        release=tuple(release),
        reruns=sum(1 for t in again if t.done),
        carried={**run.carried, old.run_id: old.resend_all} if carry else {},
        full_by=full_by,
        remade=remade,
    )


def _reruns(transfer: TransferFacts, new: RunSpec, left: str | None) -> bool:
    """Whether a transfer must run again when a bystander left: it ran on the worker that
    left (its queued pieces may be gone with it), or one of its inputs sends in full in
    ``new``."""
    if left is not None and left in transfer.ran_on:
        return True
    return any(i in new.resend_all for i in new.spec.transfers[transfer.index])


def _wanted_again(run: SchedulerRun, facts: RunFacts) -> frozenset[int]:
    """Outputs of ``run`` assembled before whose tasks are to run again: each would find its
    pieces consumed, so one continuation assembles them all again (rather than one each,
    every transfer running again each time)."""
    return frozenset(run.assembled & facts.pending_outputs)


def _unfinished_outputs(
    run_spec: RunSpec, moved: frozenset[int], facts: RunFacts
) -> tuple[dict[str, list[int]], int]:
    """Per worker, its outputs (not ``moved`` to it now) whose tasks have to run (running,
    or done on the worker and not reported yet); and how many are finished (in memory, or
    consumed already). An output moved by an earlier continuation is kept as any other: its
    pieces were consumed where it is."""
    keep: dict[str, list[int]] = {w: [] for w in run_spec.workers}
    finished = 0
    for flat in run_spec.spec.outputs:
        if flat in moved:
            continue
        if flat in facts.pending_outputs:
            keep[run_spec.worker_for(flat)].append(flat)
        else:
            finished += 1
    return keep, finished


def _resend_all(
    run: SchedulerRun, worker: str | None, facts: RunFacts
) -> tuple[frozenset[int], dict[int, str]]:
    """The inputs whose pieces may have been lost with ``worker`` (``None``: no worker left;
    the inputs not sent in full yet), whose transfers send every piece again in the continued
    run, and the run's inputs sent in full after it.

    None once a barrier of the run passed (every piece arrived). Before, an input's pieces
    are safe if a transfer that sent all of them finished on a worker that is still there
    (queued sends are delivered by it); every other input's transfer ran on the worker
    that left, or has not finished.
    """
    full_by = dict(run.full_by)
    if run.delivered:
        return frozenset(), full_by
    spec = run.run_spec
    transfers = {i: t for t in facts.transfers for i in spec.spec.transfers[t.index]}
    lost = set()
    for i in spec.spec.inputs:
        if full_by.get(i, worker) != worker:
            continue  # every piece queued by a worker still there
        full_by.pop(i, None)
        transfer = transfers.get(i)
        if transfer is None:
            lost.add(i)
            continue
        where = transfer.ran_on[0] if transfer.ran_on else None
        cut_for = transfer.cut_for
        if cut_for is None or not run.takes(transfer.index, cut_for):
            where = None  # (cut for a run that does not count: maybe moved pieces only)
        sent_all = not spec.lineage or i in spec.resend_all
        if transfer.done and where not in (None, worker) and sent_all:
            full_by[i] = where
        else:
            lost.add(i)
    return frozenset(lost), full_by
