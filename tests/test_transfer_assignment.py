"""Root transfer tasks are handed to the workers when the graph arrives, and in waves after
that, not a few at a time.

The scheduler plugin restricts each transfer task whose input is made inside it to one
worker (loosely), so distributed's root-task queuing does not hold them back; see
:meth:`rechunk_p2p.scheduler.RechunkSchedulerPlugin.update_graph` and
:class:`rechunk_p2p.waves.TransferWaves`.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import dask.array as da
import numpy as np
from distributed import SchedulerPlugin, wait
from distributed.utils_test import gen_cluster

import rechunk_p2p
from rechunk_p2p.spec import TRANSFER_PREFIX
from rechunk_p2p.waves import assign_round_robin, key_name, root_transfer


def _cluster(limit: int | None = None):
    """gen_cluster of one worker of one thread and one of two, without work stealing (so
    each task runs where it was put), ``scheduler.assign-transfers`` at ``limit``."""
    config: dict = {"distributed.scheduler.work-stealing": False}
    if limit is not None:
        config["rechunk-p2p.scheduler.assign-transfers"] = limit
    return gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 2)], config=config)


def _fill(block_info=None):
    """A block made inside its task (no dependencies): row index x 1000 + column index."""
    (r0, r1), (c0, c1) = block_info[None]["array-location"]
    return np.add.outer(np.arange(r0, r1) * 1000.0, np.arange(c0, c1))


def _source() -> da.Array:
    """32 row blocks made by their own tasks, which dask fuses into the transfers."""
    return da.map_blocks(_fill, chunks=((2,) * 32, (40,)), dtype=float)


def _expected() -> np.ndarray:
    return np.add.outer(np.arange(64) * 1000.0, np.arange(40))


class TransferLog(SchedulerPlugin):
    """Each transfer task's state before processing, restrictions and worker."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.seen: dict = {}
        self.most_at_once: Counter = Counter()  # worker -> most transfers processing there

    def transition(self, key, start, finish, *args, **kwargs):
        if finish != "processing" or TRANSFER_PREFIX not in key_name(key):
            return
        ts = self.scheduler.tasks[key]
        restricted = frozenset(ts.worker_restrictions or ())
        where = ts.processing_on.address
        self.seen.setdefault(key, (start, restricted, ts.loose_restrictions, where))
        now = sum(TRANSFER_PREFIX in key_name(t.key) for t in ts.processing_on.processing)
        self.most_at_once[where] = max(self.most_at_once[where], now)


async def _rechunk_logged(c, s) -> TransferLog:
    await rechunk_p2p.register(c)  # before the graph: an asynchronous client must
    log = TransferLog(s)
    s.add_plugin(log, name="transfer-log")
    y = rechunk_p2p.rechunk(_source(), (64, 4))
    np.testing.assert_array_equal(await c.compute(y), _expected())
    assert len(log.seen) == 32, "every input is one transfer task"
    return log


@_cluster()
async def test_root_transfers_go_to_the_workers_in_turn_by_threads(c, s, a, b):
    log = await _rechunk_logged(c, s)
    for start, restricted, loose, where in log.seen.values():
        assert start != "queued"  # not held back by root-task queuing
        assert len(restricted) == 1 and loose, (restricted, loose)
        assert where in restricted
    per_worker = Counter(where for *_, where in log.seen.values())
    # turns by address, a worker's share of a turn is its threads: a, b, b or b, b, a
    expected = (
        {a.address: 11, b.address: 21}
        if a.address < b.address
        else {
            a.address: 10,
            b.address: 22,
        }
    )
    assert per_worker == expected


@_cluster(limit=3)
async def test_beyond_the_limit_transfers_go_to_the_workers_in_waves(c, s, a, b):
    log = await _rechunk_logged(c, s)
    restricted = [v for v in log.seen.values() if v[1]]
    # 3 a worker when the graph arrived, then one more each time one of them finished
    assert len(restricted) > 6
    assert {where for *_, where in restricted} == {a.address, b.address}
    for start, pinned, loose, where in restricted:
        assert start != "queued" and loose and pinned == {where}
    # the others are distributed's: from its queue (a worker with a free slot between a
    # finished transfer and its next wave), or at most the slots free when the graph
    # arrived (2 and 3 for 1 and 2 threads)
    others = [start for start, pinned, *_ in log.seen.values() if not pinned]
    assert sum(start != "queued" for start in others) <= 5
    # never more at once than the limit plus the slots the queue fills (2 and 3)
    assert log.most_at_once[a.address] <= 3 + 2
    assert log.most_at_once[b.address] <= 3 + 3


@_cluster(limit=3)
async def test_waves_have_nothing_to_give_when_distributed_does_not_queue(c, s, a, b):
    s.WORKER_SATURATION = float("inf")  # read from the config only when the scheduler starts
    log = await _rechunk_logged(c, s)
    restricted = [v for v in log.seen.values() if v[1]]
    assert Counter(where for *_, where in restricted) == {a.address: 3, b.address: 3}
    assert not any(start == "queued" for start, *_ in log.seen.values())


@_cluster(limit=0)
async def test_zero_leaves_every_transfer_to_distributed(c, s, a, b):
    log = await _rechunk_logged(c, s)
    assert not any(restricted for _, restricted, *_ in log.seen.values())


def _task(key, priority):
    return SimpleNamespace(key=key, priority=priority)


def test_round_robin_weights_workers_by_threads_and_stops_at_the_limit():
    tasks = [_task(f"t{i}", (0, i)) for i in range(10)]
    pins = assign_round_robin(tasks[::-1], {"w2": 2, "w1": 1}, limit=3)
    assert pins == {
        "t0": {"w1"},
        "t1": {"w2"},
        "t2": {"w2"},
        "t3": {"w1"},
        "t4": {"w2"},  # w2 has its 3
        "t5": {"w1"},  # w1 has its 3
    }
    assert assign_round_robin(tasks, {}, limit=3) == {}
    assert assign_round_robin(tasks, {"w1": 0}, limit=2) == {"t0": {"w1"}, "t1": {"w1"}}


def test_only_new_unrestricted_transfers_without_dependencies_are_assigned():
    def state(**changes):
        fields = {
            "state": "released",
            "run_spec": object(),
            "dependencies": set(),
            "worker_restrictions": None,
            "host_restrictions": None,
            "resource_restrictions": None,
        }
        return SimpleNamespace(**{**fields, **changes})

    key = (f"input-{TRANSFER_PREFIX}abc", 0)
    cases = {
        "a root transfer": (key, state(), True),
        "another task": (("input-abc", 0), state(), False),
        "with a dependency": (key, state(dependencies={object()}), False),
        "already running": (key, state(state="processing"), False),
        "restricted by the user": (key, state(worker_restrictions={"w"}), False),
        "on a host": (key, state(host_restrictions={"h"}), False),
        "needing a resource": (key, state(resource_restrictions={"GPU": 1}), False),
        "no task yet": (key, state(run_spec=None), False),
    }
    for case, (k, ts, assigned) in cases.items():
        scheduler = SimpleNamespace(tasks={k: ts})
        assert (root_transfer(scheduler, k) is ts) is assigned, case
    assert root_transfer(SimpleNamespace(tasks={}), key) is None


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_transfers_of_a_derived_input_run_where_its_held_chunks_are(c, s, a, b):
    """``x - m + m`` of a persisted ``x``: distributed counts a transfer it has no duration
    for as half a second of work and would spread them over the workers by count, moving
    held chunks through the workers' loops; each runs where its chunk is instead."""
    await rechunk_p2p.register(c)
    log = TransferLog(s)
    s.add_plugin(log, name="transfer-log")
    arr = np.arange(64 * 64, dtype="f8").reshape(64, 64)
    x = c.persist(da.from_array(arr, chunks=(4, 64), name="held-source"))
    await wait(x)
    holders = {k: set(ws) for k, ws in (await c.who_has(x)).items()}
    assert {w for ws in holders.values() for w in ws} == {a.address, b.address}
    m = x.min(axis=0, keepdims=True)
    y = rechunk_p2p.rechunk(x - m + m, (64, 4))
    np.testing.assert_array_equal(await c.compute(y), arr)
    assert len(log.seen) == 16  # a transfer a chunk
    for key, (_, restricted, loose, where) in log.seen.items():
        assert holders[("held-source", *key[1:])] == restricted == {where} and loose
