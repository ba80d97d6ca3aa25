"""The interpreter settings a worker runs rechunks under (GIL switch interval, the freeze
of its objects, malloc's thresholds, kept output pages): applied while runs are open or
about to be, undone when the worker is idle. In-process clusters (gen_cluster)."""

from __future__ import annotations

import asyncio
import threading

import dask
import dask.array as da
import numpy as np
import pytest
from distributed.utils_test import gen_cluster

import rechunk_p2p
from tests.conftest import assert_clean

NTHREADS_2 = [("127.0.0.1", 1), ("127.0.0.1", 1)]


@pytest.fixture(autouse=True)
def _short_idle(monkeypatch):
    """The in-process workers (and the scheduler) here count a second without tasks (or a
    rechunk) as idle (5 s by default): the tests that wait for the idle unfreeze wait
    less."""
    monkeypatch.setattr("rechunk_p2p.worker.idle.UNFREEZE_IDLE_SECONDS", 1.0)
    monkeypatch.setattr("rechunk_p2p.scheduler_tuning.IDLE_SECONDS", 1.0)


def _runs(worker) -> dict:
    plugin = worker.plugins.get("rechunk-p2p")
    return plugin.runs if plugin is not None else {}


_TUNING_GATE = threading.Event()  # gen_cluster workers run in this process


def _wait_at_gate(block):
    assert _TUNING_GATE.wait(20)
    return block


async def _open_gated_run(c, a, b):
    """Compute a rechunk whose outputs wait at ``_TUNING_GATE``; return its future once a
    run is open on ``a`` or ``b``."""
    _TUNING_GATE.clear()
    x = da.from_array(np.arange(400).reshape(20, 20), chunks=(1, 20))
    y = rechunk_p2p.rechunk(x, (20, 1)).map_blocks(_wait_at_gate, meta=x._meta)
    fut = c.compute(y)
    while not any(_runs(w) for w in (a, b)):
        await asyncio.sleep(0.005)
    return fut


@gen_cluster(client=True, nthreads=NTHREADS_2)
async def test_process_tuning_applies_only_while_a_run_is_open(c, s, a, b):
    """GIL switch interval shortened, the heap frozen and malloc's thresholds held while a
    run is open on a worker of this process; untouched before the first run and restored
    after the last one closes, the free memory given back from a thread of the offload pool."""
    import gc
    import sys

    from rechunk_p2p.worker import tuning as tuning_module

    malloc = tuning_module.PROCESS_TUNING.malloc
    trims = []
    trim = malloc.trim_blocking
    malloc.trim_blocking = lambda: (trims.append(threading.current_thread().name), trim())
    before = sys.getswitchinterval()
    frozen_before = gc.get_freeze_count()
    await rechunk_p2p.register(c)
    assert sys.getswitchinterval() == before  # plugins running, no run open
    assert gc.get_freeze_count() == frozen_before
    assert not malloc.held
    fut = await _open_gated_run(c, a, b)
    assert sys.getswitchinterval() == pytest.approx(min(0.001, before))
    assert gc.get_freeze_count() > frozen_before
    assert malloc.held == malloc.available
    made_during_run = [[] for _ in range(1000)]  # tracked objects, made while the run is open
    frozen_open = gc.get_freeze_count()
    gc.collect()
    assert gc.get_freeze_count() >= frozen_open + len(made_during_run)  # survivors froze
    _TUNING_GATE.set()
    await fut
    del fut
    await assert_clean(s, a, b)
    assert sys.getswitchinterval() == before
    await _unfrozen(frozen_before)  # once the workers were idle a while
    gc.collect()  # no longer freezes survivors
    assert gc.get_freeze_count() == frozen_before
    del malloc.trim_blocking
    assert not malloc.held
    if malloc.available:
        assert len(trims) == 1 and trims[0] != threading.current_thread().name


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_process_tuning_applies_while_the_run_is_requested(c, s, a):
    """The heap is frozen and the switch interval shortened from a worker's request for its
    run on: the reply can take long while the scheduler takes in the graph, and the worker's
    loop must not meet an unfrozen full collection in that wait. Undone after the run."""
    import gc
    import sys

    before = sys.getswitchinterval()
    frozen_before = gc.get_freeze_count()
    await rechunk_p2p.register(c)
    get_or_create = a.scheduler.rechunk_p2p_get_or_create
    asked, release = asyncio.Event(), asyncio.Event()

    async def held_reply(**kwargs):
        asked.set()
        await release.wait()
        return await get_or_create(**kwargs)

    a.scheduler.rechunk_p2p_get_or_create = held_reply  # the reply waits for the test
    x = da.from_array(np.arange(400).reshape(20, 20), chunks=(1, 20))
    fut = c.compute(rechunk_p2p.rechunk(x, (20, 1)))
    await asked.wait()
    assert not _runs(a)  # requested, not open
    assert sys.getswitchinterval() == pytest.approx(min(0.001, before))
    assert gc.get_freeze_count() > frozen_before
    release.set()
    np.testing.assert_array_equal(await fut, np.arange(400).reshape(20, 20))
    del fut
    a.scheduler.rechunk_p2p_get_or_create = get_or_create
    await assert_clean(s, a)
    assert sys.getswitchinterval() == before
    await _unfrozen(frozen_before)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_failed_request_for_a_run_gives_the_process_tuning_back(c, s, a):
    import gc
    import sys

    before = sys.getswitchinterval()
    frozen_before = gc.get_freeze_count()
    await rechunk_p2p.register(c)
    get_or_create = a.scheduler.rechunk_p2p_get_or_create

    async def failing_reply(**kwargs):
        raise RuntimeError("injected: no run for you")

    a.scheduler.rechunk_p2p_get_or_create = failing_reply
    x = da.from_array(np.arange(400).reshape(20, 20), chunks=(1, 20))
    with pytest.raises(RuntimeError, match="injected: no run for you"):
        await c.compute(rechunk_p2p.rechunk(x, (20, 1)))
    a.scheduler.rechunk_p2p_get_or_create = get_or_create
    assert not _runs(a)
    assert sys.getswitchinterval() == before
    await _unfrozen(frozen_before)


async def _unfrozen(frozen_before: int, timeout: float = 20) -> None:
    """Wait until the objects frozen for runs are unfrozen (the worker idle a while)."""
    import gc

    deadline = asyncio.get_running_loop().time() + timeout
    while gc.get_freeze_count() != frozen_before:
        assert asyncio.get_running_loop().time() < deadline, "objects stayed frozen"
        await asyncio.sleep(0.05)


_BUSY_GATE = threading.Event()


def _busy(x):
    assert _BUSY_GATE.wait(20)
    return x


async def _release_and_check(s, a, fut, blocker, frozen_before: int) -> None:
    """The end of the freeze-on-arrival tests: let the held thread go, check the 20 x 20
    grid, and that nothing is left and the freeze is undone once the worker is idle."""
    _BUSY_GATE.set()
    np.testing.assert_array_equal(await fut, np.arange(400).reshape(20, 20))
    await blocker
    del fut, blocker
    await assert_clean(s, a)
    await _unfrozen(frozen_before)


async def _hold_the_only_thread(c, a):
    """A task that holds worker ``a``'s only thread until ``_BUSY_GATE`` is set."""
    _BUSY_GATE.clear()
    blocker = c.submit(_busy, 1)
    while not a.state.executing:
        await asyncio.sleep(0.01)
    return blocker


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_objects_are_frozen_when_transfer_tasks_arrive(c, s, a):
    """A worker takes a graph's task messages in one step of its loop, and their
    allocations can set off a full collection before its first run opens: transfer tasks
    reaching the worker freeze the objects already, before any of them runs."""
    import gc

    frozen_before = gc.get_freeze_count()
    await rechunk_p2p.register(c)
    blocker = await _hold_the_only_thread(c, a)
    x = da.from_array(np.arange(400).reshape(20, 20), chunks=(1, 20))
    fut = c.compute(rechunk_p2p.rechunk(x, (20, 1)))
    while not any("transfer" in str(k) for k in a.state.tasks):
        await asyncio.sleep(0.01)
    assert gc.get_freeze_count() > frozen_before
    assert not _runs(a) and not a.plugins["rechunk-p2p"]._fetching  # no transfer ran yet
    await _release_and_check(s, a, fut, blocker, frozen_before)


@pytest.mark.parametrize("name", ["rechunk_p2p-held-0a1b-0", "add-rechunk_p2p-transfer-0a1b-0"])
def test_a_held_or_transfer_task_arriving_freezes_the_objects(name):
    """The task that reads a held input's chunks runs before any transfer task reaches its
    worker: its arrival freezes the objects too, and the worker is busy until it is done."""
    import gc

    from rechunk_p2p.worker.plugin import RechunkWorkerPlugin
    from rechunk_p2p.worker.tuning import PROCESS_TUNING

    plugin = RechunkWorkerPlugin()
    plugin.idle.freeze_early = True
    before = gc.get_freeze_count()
    try:
        plugin.transition(("other-0a1b", 0), "released", "waiting")
        assert gc.get_freeze_count() == before and not plugin.idle.unfinished_transfers
        plugin.transition((name, 0), "released", "waiting")
        assert gc.get_freeze_count() > before
        assert plugin.idle.unfinished_transfers == {(name, 0)}
        plugin.transition((name, 0), "executing", "memory")
        assert not plugin.idle.unfinished_transfers
    finally:
        assert PROCESS_TUNING.unfreeze_unused()
    assert gc.get_freeze_count() <= before


def _zero():
    return 0


def _grid_row(i, zero):
    return np.arange(20 * i, 20 * (i + 1)).reshape(1, 20) + zero


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_graph_with_a_rechunk_freezes_the_objects_before_its_first_task(c, s, a):
    """The tasks a rechunk's input waits for (a reduction, say) reach the worker before any
    of the rechunk's own: the objects are frozen when the graph reaches the scheduler."""
    import gc

    frozen_before = gc.get_freeze_count()
    await rechunk_p2p.register(c)
    blocker = await _hold_the_only_thread(c, a)
    zero = dask.delayed(_zero)()  # every input chunk waits for it, as for a reduction
    rows = [dask.delayed(_grid_row)(i, zero) for i in range(20)]
    x = da.concatenate([da.from_delayed(r, shape=(1, 20), dtype=int) for r in rows])
    fut = c.compute(rechunk_p2p.rechunk(x, (20, 1)))
    while zero.key not in a.state.tasks:  # it came; the rechunk's tasks wait for it
        await asyncio.sleep(0.01)
    assert gc.get_freeze_count() > frozen_before
    assert not any("rechunk_p2p" in str(k) for k in a.state.tasks)
    await _release_and_check(s, a, fut, blocker, frozen_before)


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def _make_garbage_cycle(block):
    """A task that leaves a reference cycle behind, with a weak reference to find it."""
    import weakref

    global _GARBAGE
    _GARBAGE = weakref.ref(_Cycle())
    return block


_GARBAGE = None


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_garbage_frozen_during_a_run_is_collected_once_the_worker_is_idle(c, s, a):
    import gc

    frozen_before = gc.get_freeze_count()
    await rechunk_p2p.register(c)
    x = da.from_array(np.arange(400).reshape(20, 20), chunks=(1, 20))
    y = rechunk_p2p.rechunk(x, (20, 1)).map_blocks(_make_garbage_cycle, meta=x._meta)
    await c.compute(y)
    await assert_clean(s, a)
    await _unfrozen(frozen_before)
    assert _GARBAGE is not None and _GARBAGE() is None  # the cycle was collected


@gen_cluster(client=True, nthreads=NTHREADS_2, config={"rechunk-p2p.storage": "disk"})
async def test_a_run_on_disk_leaves_malloc_alone(c, s, a, b):
    from rechunk_p2p.worker import tuning as tuning_module

    malloc = tuning_module.PROCESS_TUNING.malloc
    await rechunk_p2p.register(c)
    fut = await _open_gated_run(c, a, b)
    assert {r.storage for w in (a, b) for r in _runs(w).values()} == {"disk"}
    assert not malloc.held
    _TUNING_GATE.set()
    await fut
    del fut
    await assert_clean(s, a, b)


@gen_cluster(client=True, nthreads=NTHREADS_2, config={"rechunk-p2p.process-tuning": False})
async def test_freed_outputs_are_kept_only_while_a_run_is_open_and_reuse_is_on(c, s, a, b):
    from rechunk_p2p.store.pages import OUTPUT_PAGES

    await rechunk_p2p.register(c)
    assert not OUTPUT_PAGES.keeping
    fut = await _open_gated_run(c, a, b)
    assert not OUTPUT_PAGES.keeping  # process-tuning: false
    _TUNING_GATE.set()
    await fut
    del fut
    await assert_clean(s, a, b)
    with dask.config.set({"rechunk-p2p.process-tuning": True}):
        fut = await _open_gated_run(c, a, b)
        assert OUTPUT_PAGES.keeping
        _TUNING_GATE.set()
        await fut
    del fut
    await assert_clean(s, a, b)
    assert not OUTPUT_PAGES.keeping and OUTPUT_PAGES.held_bytes == 0


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_worker_expecting_a_rechunk_keeps_its_objects_frozen_until_the_graph_comes(
    c, s, a, monkeypatch
):
    """A worker told a rechunk is coming may get no task of its graph for a while (they
    wait for other workers' results); it must not take that wait for idleness and unfreeze
    (a full collection of the whole heap, 150-270 ms seen, just before the graph's tasks).
    The hold ends when any task arrives, or after UNFREEZE_EXPECT_SECONDS without one."""
    import gc

    frozen_before = gc.get_freeze_count()
    await rechunk_p2p.register(c)
    plugin = a.plugins["rechunk-p2p"]
    plugin.idle.expect()  # as the scheduler's message does
    assert gc.get_freeze_count() > frozen_before
    plugin.idle.transition(("gone-0a1b", 0), "released", "forgotten")  # not an arrival
    assert plugin.idle.expected_until is not None
    await asyncio.sleep(3.0)  # three idle periods (1 s here), no task
    assert gc.get_freeze_count() > frozen_before, "unfroze while a graph was expected"
    assert await c.submit(_zero) == 0  # a task came: idle again after it
    await _unfrozen(frozen_before)

    monkeypatch.setattr("rechunk_p2p.worker.idle.UNFREEZE_EXPECT_SECONDS", 1.0)
    plugin.idle.expect()  # a graph that never sends this worker a task
    assert gc.get_freeze_count() > frozen_before
    await _unfrozen(frozen_before)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_task_between_two_looks_of_the_idle_watch_starts_the_idle_period_again(c, s, a):
    """The watch looks every quarter of UNFREEZE_IDLE_SECONDS (1 s here). A rechunk's tasks
    may come and go between two looks, on a worker idle long before: the unfreeze (a full
    collection) still waits a whole idle period after them, not the next look."""
    import gc

    from rechunk_p2p.worker.tuning import PROCESS_TUNING

    frozen_before = gc.get_freeze_count()
    await rechunk_p2p.register(c)
    plugin = a.plugins["rechunk-p2p"]
    await asyncio.sleep(2.5)  # idle for over an idle period, nothing to let go
    assert gc.get_freeze_count() == frozen_before
    PROCESS_TUNING.freeze_early()  # as a transfer task's arrival does ...
    key = ("inc-0a1b", 0)
    for start, finish in [("released", "waiting"), ("waiting", "memory"), ("memory", "released")]:
        plugin.idle.transition(key, start, finish)  # ... and it ran and went, between looks
    await asyncio.sleep(0.6)  # (the next look is within 0.25 s)
    assert gc.get_freeze_count() > frozen_before, "unfroze at the next look after a task"
    await _unfrozen(frozen_before)


def test_a_worker_whose_process_exits_freezes_its_heap_for_the_exit():
    """Python's exit collects the whole heap; frozen objects are left out of it. Only where
    the process ends with the worker: a closing worker under a nanny."""
    import gc
    from types import SimpleNamespace

    from distributed.core import Status

    from rechunk_p2p.worker.plugin import process_exits
    from rechunk_p2p.worker.tuning import PROCESS_TUNING

    nanny = "tcp://127.0.0.1:1"
    assert process_exits(SimpleNamespace(status=Status.closing, nanny=nanny))
    assert not process_exits(SimpleNamespace(status=Status.closing, nanny=None))
    assert not process_exits(SimpleNamespace(status=Status.running, nanny=nanny))
    before = gc.get_freeze_count()
    PROCESS_TUNING.freeze_for_exit()
    try:
        assert gc.get_freeze_count() > before
    finally:
        assert PROCESS_TUNING.unfreeze_unused(collect=False)
    assert gc.get_freeze_count() <= before
