"""Rechunk tasks that wait for a worker that runs no tasks: moved where they can be, named
in the log, failed where they cannot.

Where it runs: the scheduler's event loop (a periodic callback of the scheduler plugin);
reads of the scheduler's task and worker state, no array data.

distributed runs no task on a worker that it paused (past 80 % of its memory limit,
``distributed.worker.memory.pause``) or that is retiring: the tasks it was given wait there,
and a task restricted to it waits in ``no-worker``, until it runs again. Usually it does
within seconds (distributed spills, the user's data is freed); a worker paused by memory that
nothing frees stays paused, and a rechunk would wait forever without a word. So:

- transfer tasks (loosely restricted: any worker may run them) waiting on such a worker for
  :data:`MOVE_SECONDS` are released, and distributed gives them to a running worker;
- output tasks pinned to such a worker (its pieces are there) waiting for
  :data:`LOG_SECONDS` are logged, with the tasks, the workers and their memory, and failed
  after :data:`GIVE_UP_SECONDS` with :class:`RechunkStalledError`, whose one-line message
  says the same, so that the user's computation ends with the reason rather than hangs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from time import monotonic
from typing import Any

from dask.utils import format_bytes
from distributed.protocol.pickle import dumps

from rechunk_p2p.errors import RechunkStalledError
from rechunk_p2p.spec import TRANSFER_PREFIX

logger = logging.getLogger("rechunk_p2p.scheduler")

#: How often the watch looks (a look with no task in ``no-worker`` costs nothing)
CHECK_SECONDS = 1.0
#: A run's outputs waiting this long for a worker that runs no tasks are logged. Chosen, not
#: measured: distributed looks at a worker's memory every 100 ms and resumes it as soon as a
#: spill or a finished task brings it under the threshold; no worker paused at all in the
#: deployment test's 24 runs (tests/test_deployment.py), so no pause length was measured.
LOG_SECONDS = 10.0
#: ... and failed after this long, naming the worker and why it runs no tasks. Generous:
#: a pause that ends by itself ends long before, and failing costs the user a rerun.
GIVE_UP_SECONDS = 120.0
#: Transfers given to a worker that has run no tasks this long go to a running worker (the
#: same wait as the log's: a transfer moved cuts its input again, on another worker).
MOVE_SECONDS = LOG_SECONDS


@dataclass(frozen=True)
class HeldBy:
    """**Immutable.** A worker that outputs of a run wait for, as the scheduler sees it."""

    address: str
    status: str  # distributed's status of the worker: "paused", "closing_gracefully", ...
    outputs: int  # output tasks of the run that wait for it
    memory: int  # its process memory (bytes), from its last heartbeat
    limit: int | None  # its memory limit (bytes)

    def describe(self) -> str:
        limit = f" of its {format_bytes(self.limit)} limit" if self.limit else ""
        return (
            f"{self.outputs} output tasks wait for worker {self.address}, which is "
            f"{self.status} (process memory {format_bytes(self.memory)}{limit})"
        )


@dataclass(frozen=True)
class Stall:
    """**Immutable.** A run whose outputs wait for workers that run no tasks."""

    shuffle_id: str
    run_id: int
    seconds: float  # how long the first of them has waited
    held_by: tuple[HeldBy, ...]
    keys: tuple[Any, ...]  # the waiting output tasks
    label: str = ""  # the input's name (ShuffleSpec.label)

    def describe(self) -> str:
        """One line: the rechunk, how long, and which workers hold it up and why."""
        of = f"{self.label}, " if self.label else ""
        return (
            f"Rechunk {self.shuffle_id} ({of}run {self.run_id}) has waited "
            f"{self.seconds:.0f} s: " + "; ".join(h.describe() for h in self.held_by)
        )


def find_stalls(scheduler: Any, runs: dict[str, Any], now: float) -> list[Stall]:
    """The runs of ``runs`` (shuffle id -> :class:`~rechunk_p2p.recovery.SchedulerRun`)
    with output tasks in ``no-worker`` whose workers are in the cluster but run no tasks."""
    unrunnable = scheduler.unrunnable
    if not unrunnable:
        return []
    stalls = []
    for shuffle_id, run in runs.items():
        waiting = [
            ts
            for ts in (scheduler.tasks.get(key) for key in run.restricted)
            if ts is not None and ts in unrunnable
        ]
        held = _held_by(scheduler, waiting)
        if held:
            since = min(unrunnable[ts] for ts in waiting)
            keys = tuple(ts.key for ts in waiting)
            spec = run.run_spec
            stalls.append(Stall(shuffle_id, spec.run_id, now - since, held, keys, spec.spec.label))
    return stalls


def _held_by(scheduler: Any, waiting: Iterable[Any]) -> tuple[HeldBy, ...]:
    counts: dict[str, int] = {}
    for ts in waiting:
        for address in ts.worker_restrictions or ():
            ws = scheduler.workers.get(address)
            if ws is not None and ws not in scheduler.running:
                counts[address] = counts.get(address, 0) + 1
    held = []
    for address, n in sorted(counts.items()):
        ws = scheduler.workers[address]
        status = getattr(ws.status, "name", str(ws.status))
        held.append(HeldBy(address, status, n, int(ws.memory.process), ws.memory_limit))
    return tuple(held)


class StallWatch:
    """**Loop-confined** (the scheduler's loop). Looks at the active runs every
    :data:`CHECK_SECONDS`; logs a stall once it passes :data:`LOG_SECONDS` and fails its
    waiting outputs once it passes :data:`GIVE_UP_SECONDS`.

    Parameters
    ----------
    scheduler
        The scheduler.
    runs
        The active runs (shuffle id -> run), read at each look.
    """

    def __init__(self, scheduler: Any, runs: Callable[[], dict[str, Any]]) -> None:
        self._scheduler = scheduler
        self._runs = runs
        self._logged: set[tuple[str, int]] = set()
        self._idle_since: dict[str, float] = {}  # workers seen running no tasks, since when
        self.failed = 0  # runs whose outputs the watch failed
        self.moved = 0  # transfers moved off workers that ran no tasks
        self._callback: Any = None

    def start(self) -> None:
        from tornado.ioloop import PeriodicCallback

        self._callback = PeriodicCallback(self._tick, CHECK_SECONDS * 1000)
        self._callback.start()

    def stop(self) -> None:
        if self._callback is not None:
            self._callback.stop()

    def _tick(self) -> None:
        self.check()

    def check(self, now: float | None = None) -> list[Stall]:
        """One look; the stalls seen."""
        now = monotonic() if now is None else now
        self._move_transfers(now)
        stalls = find_stalls(self._scheduler, self._runs(), now)
        current = {(s.shuffle_id, s.run_id) for s in stalls}
        self._logged &= current  # a stall that ended may be logged again if it comes back
        for stall in stalls:
            ident = (stall.shuffle_id, stall.run_id)
            if stall.seconds >= GIVE_UP_SECONDS:
                self._fail(stall)
            elif stall.seconds >= LOG_SECONDS and ident not in self._logged:
                self._logged.add(ident)
                logger.warning("%s; failing them after %.0f s", stall.describe(), GIVE_UP_SECONDS)
        return stalls

    def _move_transfers(self, now: float) -> None:
        """Release the transfers given to workers that have run no tasks for
        :data:`MOVE_SECONDS`: distributed then gives them to running workers."""
        scheduler = self._scheduler
        stopped = [ws for ws in scheduler.workers.values() if ws not in scheduler.running]
        self._idle_since = {ws.address: self._idle_since.get(ws.address, now) for ws in stopped}
        keys = [
            ts.key
            for ws in stopped
            if now - self._idle_since[ws.address] >= MOVE_SECONDS
            for ts in ws.processing
            if isinstance(ts.key, tuple) and TRANSFER_PREFIX in str(ts.key[0])
        ]
        if not keys or not scheduler.running:
            return
        logger.warning(
            "Moving %d rechunk transfer tasks off workers that run no tasks: %s",
            len(keys),
            ", ".join(f"{ws.address} ({ws.status.name})" for ws in stopped),
        )
        self.moved += len(keys)
        scheduler.transitions(
            dict.fromkeys(keys, "released"), stimulus_id=f"rechunk-p2p-move-{monotonic()}"
        )

    def _fail(self, stall: Stall) -> None:
        error = RechunkStalledError(f"{stall.describe()}; gave up")
        logger.error("%s", error)
        self.failed += 1
        exception, text = dumps(error), f"{type(error).__name__}: {error}"
        stimulus_id = f"rechunk-p2p-stalled-{monotonic()}"
        recommendations: dict = {}
        for key in stall.keys:
            ts = self._scheduler.tasks.get(key)
            if ts is None or ts.state != "no-worker":
                continue
            recommendations.update(
                self._scheduler.transition(
                    key,
                    "erred",
                    stimulus_id=stimulus_id,
                    exception=exception,
                    cause=key,
                    exception_text=text,
                    traceback_text="",
                )
            )
        self._scheduler.transitions(recommendations, stimulus_id=stimulus_id)
