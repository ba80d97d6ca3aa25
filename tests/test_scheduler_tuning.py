"""The scheduler's process frozen out of full garbage collections while a rechunk is on the
scheduler: from the graph's arrival to a while after its run closed, shared with workers
of the same process, given back when the scheduler closes."""

from __future__ import annotations

import asyncio
import gc
import threading

import dask.array as da
import numpy as np
import pytest
from distributed import Client, LocalCluster
from distributed.utils_test import gen_cluster

import rechunk_p2p
from rechunk_p2p.worker.tuning import (
    FREEZE_ONLY,
    ProcessTuning,
    TuningOptions,
    _freeze_survivors,
)
from tests.conftest import assert_clean

_GATE = threading.Event()  # gen_cluster workers run in this process


def _wait_at_gate(x):
    assert _GATE.wait(20)
    return x


@pytest.fixture(autouse=True)
def _short_idle(monkeypatch):
    """One second without a rechunk counts as idle here (5 s by default)."""
    monkeypatch.setattr("rechunk_p2p.scheduler_tuning.IDLE_SECONDS", 1.0)
    monkeypatch.setattr("rechunk_p2p.worker.idle.UNFREEZE_IDLE_SECONDS", 1.0)


def _gated_rechunk(c):
    """A rechunk whose input waits at ``_GATE``: its graph is on the scheduler, no run yet."""
    _GATE.clear()
    x = da.from_array(np.arange(400).reshape(20, 20), chunks=(1, 20))
    x = x.map_blocks(_wait_at_gate, meta=x._meta)
    return c.compute(rechunk_p2p.rechunk(x, (20, 1)))


async def _until(predicate, timeout: float = 20) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_the_scheduler_holds_the_freeze_from_the_graph_until_idle(c, s, a):
    frozen_before = gc.get_freeze_count()
    await rechunk_p2p.register(c)
    tuning = s.plugins["rechunk-p2p"].tuning
    assert not tuning.held
    fut = _gated_rechunk(c)
    await _until(lambda: tuning.held)
    assert not s.plugins["rechunk-p2p"].active  # no run: the graph alone holds it
    assert gc.get_freeze_count() > frozen_before
    assert _freeze_survivors in gc.callbacks
    await asyncio.sleep(2.5)  # longer than the idle period: the pending graph keeps it
    assert tuning.held and tuning.busy()
    _GATE.set()
    np.testing.assert_array_equal(await fut, np.arange(400).reshape(20, 20))
    del fut
    await assert_clean(s, a)
    await _until(lambda: not tuning.held)  # a second after the run closed
    assert gc.get_freeze_count() == frozen_before
    assert _freeze_survivors not in gc.callbacks


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_outputs_held_after_the_rechunk_let_the_scheduler_go_idle(c, s, a):
    """A persisted rechunk's outputs stay in memory, and its barrier with them, released:
    the rechunk is over, and the scheduler gives the objects back."""
    frozen_before = gc.get_freeze_count()
    await rechunk_p2p.register(c)
    tuning = s.plugins["rechunk-p2p"].tuning
    x = da.from_array(np.arange(400).reshape(20, 20), chunks=(1, 20))
    y = c.persist(rechunk_p2p.rechunk(x, (20, 1)))
    await _until(lambda: tuning.held)
    np.testing.assert_array_equal(await c.compute(y), np.arange(400).reshape(20, 20))
    barrier = next(k for k in s.tasks if str(k).startswith("rechunk_p2p-barrier"))
    await _until(lambda: not tuning.held)
    assert s.tasks[barrier].state == "released"  # held by the outputs in memory
    assert gc.get_freeze_count() == frozen_before
    del y


@gen_cluster(
    client=True,
    nthreads=[("127.0.0.1", 1)],
    config={"rechunk-p2p.process-tuning": False},
)
async def test_the_scheduler_leaves_its_process_alone_when_told(c, s, a):
    await rechunk_p2p.register(c)
    fut = _gated_rechunk(c)
    await _until(lambda: any("rechunk_p2p-barrier" in str(k) for k in s.tasks))
    assert not s.plugins["rechunk-p2p"].tuning.held
    _GATE.set()
    await fut


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_cancelled_rechunk_graph_lets_the_scheduler_go_idle(c, s, a):
    """A graph whose rechunk never ran (cancelled while its input waited) stops counting
    once its barrier is forgotten."""
    frozen_before = gc.get_freeze_count()
    await rechunk_p2p.register(c)
    tuning = s.plugins["rechunk-p2p"].tuning
    fut = _gated_rechunk(c)
    await _until(lambda: tuning.held)
    await fut.cancel()
    _GATE.set()
    del fut
    await _until(lambda: not tuning.held)
    await _until(lambda: gc.get_freeze_count() == frozen_before)


def test_a_freeze_held_outlives_the_runs_of_the_same_process():
    """A scheduler's hold and a worker's runs in one process (an in-process cluster): the
    freeze, and the freezing of survivors, last until neither holds them; the worker's
    other settings follow its runs alone."""
    import sys

    tuning = ProcessTuning()
    before, interval = gc.get_freeze_count(), sys.getswitchinterval()
    try:
        held = tuning.acquire(FREEZE_ONLY)
        assert gc.get_freeze_count() > before and not tuning.frozen_unused
        run = tuning.acquire(TuningOptions.for_run(True))
        assert gc.callbacks.count(_freeze_survivors) == 1
        assert sys.getswitchinterval() == min(interval, 0.001)
        assert run.release() is False  # nothing to tidy: no malloc, no outputs' pages kept
        assert sys.getswitchinterval() == interval  # the run's interval is undone
        assert _freeze_survivors in gc.callbacks  # the hold goes on freezing survivors
        assert not tuning.unfreeze_unused(collect=False)
        assert gc.get_freeze_count() > before
        held.release()
        assert held.release() is False and tuning.frozen_unused  # (once only)
        assert _freeze_survivors not in gc.callbacks
        assert tuning.frozen_unused
        assert tuning.unfreeze_unused(collect=False)
    finally:
        while _freeze_survivors in gc.callbacks:
            gc.callbacks.remove(_freeze_survivors)
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


def _is_frozen() -> int:
    return gc.get_freeze_count()


def test_a_local_cluster_scheduler_gives_the_freeze_back_when_it_closes(monkeypatch):
    """A ``LocalCluster`` of processes: its scheduler runs in this process, which a rechunk
    freezes (the workers in theirs); closing the cluster within the idle period gives the
    objects back."""
    monkeypatch.setattr("rechunk_p2p.scheduler_tuning.IDLE_SECONDS", 600.0)
    if gc.get_freeze_count():
        gc.unfreeze()
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        x = da.random.RandomState(0).random((400, 400), chunks=(10, 400))
        y = rechunk_p2p.rechunk(x, (400, 10))
        np.testing.assert_array_equal(y.compute(), x.compute())
        tuning = cluster.scheduler.plugins["rechunk-p2p"].tuning
        assert tuning.held  # less than the idle period after the rechunk
        assert gc.get_freeze_count() > 0
        assert all(client.run(_is_frozen).values())  # the workers froze their own
    assert not tuning.held
    assert gc.get_freeze_count() == 0


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_the_scheduler_freezes_while_it_builds_a_rechunk_graph(c, s, a, monkeypatch):
    """The scheduler builds a submitted graph in its offload thread before any plugin sees
    it: building a rechunk there freezes the process at once, and the scheduler's watch
    takes the hold over."""
    from rechunk_p2p import scheduler_tuning

    frozen_before = gc.get_freeze_count()
    await rechunk_p2p.register(c)
    tuning = s.plugins["rechunk-p2p"].tuning
    calls = []
    materializing = scheduler_tuning.materializing

    def recorded():
        materializing()
        calls.append((threading.current_thread().name, gc.get_freeze_count()))

    monkeypatch.setattr(scheduler_tuning, "materializing", recorded)
    x = da.from_array(np.arange(400).reshape(20, 20), chunks=(1, 20))
    result = await c.compute(rechunk_p2p.rechunk(x, (20, 1)))
    np.testing.assert_array_equal(result, np.arange(400).reshape(20, 20))
    built = [frozen for name, frozen in calls if name.startswith("Dask-Offload")]
    assert built and all(frozen > frozen_before for frozen in built), calls
    await _until(lambda: not tuning.held)
    assert gc.get_freeze_count() == frozen_before


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_graph_built_outside_a_rechunk_is_given_back_when_idle(c, s, a):
    """Built in a process that hosts a scheduler but never submitted (the client of a
    ``LocalCluster`` looking at a graph): the hold ends once the scheduler is idle."""
    frozen_before = gc.get_freeze_count()
    await rechunk_p2p.register(c)
    tuning = s.plugins["rechunk-p2p"].tuning
    x = da.from_array(np.arange(400).reshape(20, 20), chunks=(1, 20))
    y = rechunk_p2p.rechunk(x, (20, 1))
    frozen = await asyncio.to_thread(lambda: (dict(y.dask), gc.get_freeze_count())[1])
    assert frozen > frozen_before  # at once, in the building thread
    await _until(lambda: tuning.held)
    await _until(lambda: not tuning.held)
    assert gc.get_freeze_count() == frozen_before


def test_building_a_graph_without_a_scheduler_here_leaves_the_process_alone():
    before = gc.get_freeze_count()
    x = da.from_array(np.arange(400).reshape(20, 20), chunks=(1, 20))
    assert len(dict(rechunk_p2p.rechunk(x, (20, 1)).dask)) > 0
    assert gc.get_freeze_count() == before


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_rechunk_layer_made_next_to_a_scheduler_freezes_before_its_submission(c, s, a):
    """The client of a ``LocalCluster`` shares the scheduler's process: serializing and
    submitting a graph of thousands of tasks there set off full collections before the
    scheduler built it. The rechunk's layer, made before any of that, freezes already."""
    from rechunk_p2p.graph import RechunkLayer

    frozen_before = gc.get_freeze_count()
    await rechunk_p2p.register(c)
    tuning = s.plugins["rechunk-p2p"].tuning
    x = da.from_array(np.arange(400).reshape(20, 20), chunks=(1, 20))
    y = rechunk_p2p.rechunk(x, (20, 1))
    graph = y.__dask_graph__()
    layers = [layer for layer in graph.layers.values() if isinstance(layer, RechunkLayer)]
    assert layers and all(layer._graph is None for layer in layers)  # made, not built
    assert gc.get_freeze_count() > frozen_before
    await _until(lambda: tuning.held)
    await _until(lambda: not tuning.held)  # never submitted: given back once idle
    assert gc.get_freeze_count() == frozen_before
