"""Root transfer tasks handed to the workers in waves, not one scheduler round trip apiece.

Where it runs: the scheduler's event loop (state of :class:`RechunkSchedulerPlugin`'s
``update_graph`` and ``transition`` hooks); :func:`assign_round_robin` is pure.

A transfer task whose input is made inside it has no dependencies, so distributed queues it
as a root task and gives a worker the next one only after one finished. The scheduler plugin
restricts the first ones to the workers in turn and hands the rest out in waves
(:class:`TransferWaves`) as the workers finish theirs. A transfer whose input is held
already goes to the worker that holds it (:func:`new_transfers`).
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from typing import Any

from rechunk_p2p.spec import TRANSFER_PREFIX


class TransferWaves:
    """**Loop-confined.** Root transfers handed to the workers in waves: which are given to a
    worker and not finished, how many each worker has, and the ones still to give.

    The first ``limit`` a worker are given when the graph arrives; past that, when a worker
    has ``limit // 4`` fewer than its limit left, the next ones (in priority order, still
    queued by distributed) are given to it. A worker takes each wave's task messages in
    one step of its event loop: waves of a quarter of the limit keep that step short.

    >>> from types import SimpleNamespace as T
    >>> waves = TransferWaves()
    >>> waves.defer([T(key=k, priority=(p,)) for k, p in [("b", 2), ("a", 1)]], 8)
    >>> for k in "stuvwxyz":
    ...     waves.assigned(k, "w1")
    >>> waves.moved("s", "processing", "memory") is None  # 7 left of 8: not yet
    True
    >>> waves.moved("t", "processing", "memory")  # 6 left: a wave is due
    'w1'
    >>> waves.moved("u", "processing", "memory") is None  # the wave is already due
    True
    >>> waves.take({"a": T(state="queued"), "b": T(state="processing")}, "w1")  # b ran already
    ['a']
    """

    def __init__(self) -> None:
        self.limit = 0
        self._pending: list[tuple[Any, int, Any]] = []  # heap of (priority, sequence, key)
        self._pending_keys: set[Any] = set()
        self._sequence = itertools.count()
        self._given: dict[Any, str] = {}  # key -> worker, while given and not finished
        self._unfinished: Counter[str] = Counter()
        self._due: set[str] = set()  # workers with a wave scheduled

    def defer(self, tasks: list[Any], limit: int) -> None:
        """``tasks`` (with ``.key`` and ``.priority``) wait for a wave; ``limit`` a worker."""
        self.limit = limit
        if not tasks:
            return
        self._pending.extend((ts.priority, next(self._sequence), ts.key) for ts in tasks)
        heapq.heapify(self._pending)
        self._pending_keys.update(ts.key for ts in tasks)

    def assigned(self, key: Any, worker: str) -> None:
        """``key`` was given to ``worker``."""
        self._given[key] = worker
        self._unfinished[worker] += 1

    def moved(self, key: Any, start: str, finish: str) -> str | None:
        """A transfer's transition; returns the worker to give a wave to, if one is due."""
        if finish in ("processing", "memory", "erred", "forgotten"):
            self._pending_keys.discard(key)  # run by distributed's queue, or gone
            if not self._pending_keys:
                self._pending.clear()
        left_processing = start == "processing" and finish != "processing"
        if not left_processing and finish != "forgotten":  # forgotten: also never sent
            return None
        worker = self._given.pop(key, None)
        if worker is None or worker not in self._unfinished:
            return None
        self._unfinished[worker] -= 1
        left = self.limit - self._unfinished[worker]
        if self._pending_keys and worker not in self._due and left >= max(self.limit // 4, 1):
            self._due.add(worker)
            return worker
        return None

    def take(self, tasks: dict[Any, Any], worker: str) -> list[Any]:
        """The next keys for ``worker``: up to its limit, those distributed still queues."""
        self._due.discard(worker)
        keys: list[Any] = []
        while self._pending and len(keys) < self.limit - self._unfinished[worker]:
            _, _, key = heapq.heappop(self._pending)
            if key not in self._pending_keys:
                continue
            self._pending_keys.discard(key)
            ts = tasks.get(key)
            if ts is not None and ts.state == "queued":
                keys.append(key)
        if not self._pending_keys:
            self._pending.clear()
        return keys

    def forget_worker(self, worker: str) -> None:
        """``worker`` left: no more waves for it."""
        self._unfinished.pop(worker, None)
        self._due.discard(worker)


def _new_transfer(scheduler: Any, key: Any) -> Any:
    """The task of ``key`` if it is a transfer not yet run and without restrictions of its
    own; else ``None``."""
    if TRANSFER_PREFIX not in key_name(key):
        return None
    ts = scheduler.tasks.get(key)
    if (
        ts is None
        or ts.state != "released"
        or ts.run_spec is None
        or ts.worker_restrictions
        or ts.host_restrictions
        or ts.resource_restrictions
    ):
        return None
    return ts


def root_transfer(scheduler: Any, key: Any) -> Any:
    """The task of ``key`` if it is a new transfer with no dependencies and no restrictions
    (its input made inside it); else ``None``."""
    ts = _new_transfer(scheduler, key)
    return None if ts is None or ts.dependencies else ts


def new_transfers(scheduler: Any, keys: Any) -> tuple[dict[Any, set[str]], list[Any]]:
    """One pass over a new graph's ``keys``: the new transfers whose inputs are held
    already (a persisted chunk, or one an earlier computation left in memory), at least in
    part, each with the running worker that holds most bytes of them in memory; and the
    root transfers' tasks (:func:`root_transfer`).

    distributed places a task it has no duration for yet as half a second of work, so
    when a derived input's transfers become ready together it spreads them over the
    workers by count and moves their held inputs (through the workers' event loops) to
    where they land.
    """
    held: dict[Any, set[str]] = {}
    roots = []
    for key in keys:
        ts = _new_transfer(scheduler, key)
        if ts is None:
            continue
        if not ts.dependencies:
            roots.append(ts)
        elif (worker := _holder(scheduler, ts)) is not None:
            held[key] = {worker}
    return held, roots


def _holder(scheduler: Any, ts: Any) -> str | None:
    held: Counter[Any] = Counter()
    for dts in ts.dependencies:
        if dts.state == "memory":
            for ws in dts.who_has:
                held[ws] += dts.get_nbytes()
    if not held:
        return None
    ws, _ = held.most_common(1)[0]
    return ws.address if ws in scheduler.running else None


def assign_round_robin(
    tasks: list[Any], threads: dict[str, int], limit: int
) -> dict[Any, set[str]]:
    """Keys of ``tasks`` (with ``.key`` and ``.priority``) -> the one worker each is given:
    in priority order, the workers in turn (sorted by address), each as many tasks in a
    turn as it has threads, at most ``limit`` a worker; tasks beyond that get none.

    >>> class T:
    ...     def __init__(self, key, priority): self.key, self.priority = key, priority
    >>> assign_round_robin([T("c", 3), T("a", 1), T("b", 2)], {"w1": 1, "w2": 2}, 10)
    {'a': {'w1'}, 'b': {'w2'}, 'c': {'w2'}}
    >>> assign_round_robin([T("a", 1), T("b", 2), T("c", 3)], {"w1": 1}, 2)
    {'a': {'w1'}, 'b': {'w1'}}
    """
    turn = [w for w in sorted(threads) for _ in range(max(threads[w], 1))]
    if not turn or limit <= 0:
        return {}
    given = dict.fromkeys(threads, 0)
    pins: dict[Any, set[str]] = {}
    slots = itertools.cycle(turn)
    # the first ones only (a graph may hold millions of transfers)
    for ts in heapq.nsmallest(limit * len(threads), tasks, key=lambda ts: ts.priority):
        worker = next(w for w in slots if given[w] < limit)
        given[worker] += 1
        pins[ts.key] = {worker}
    return pins


def key_name(key: Any) -> str:
    return key[0] if isinstance(key, tuple) else str(key)
