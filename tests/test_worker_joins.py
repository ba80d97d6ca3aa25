"""Workers join mid-rechunk (an adaptive cluster scaling up): while its transfers run, the run
continues with them, each taking a fair share of the outputs; after the barrier, nothing
changes for the run."""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import cloudpickle
import dask.array as da
import numpy as np
from distributed import Client, LocalCluster, Worker, futures_of
from distributed.utils_test import gen_cluster

import rechunk_p2p
from rechunk_p2p.diagnostics.live_view import live_view
from tests.conftest import assert_clean
from tests.engine_helpers import ONE, PLUGIN

_GATE = threading.Event()


_MADE = [0]  # rows made so far (the workers run in the test's process)


def _gated(block: np.ndarray) -> np.ndarray:
    """Hold the transfers (they make the rows) but the first four until the test lets them
    go: those open the run."""
    _MADE[0] += 1
    if block.size and _MADE[0] > 4:
        assert _GATE.wait(60)
    return block


def _rechunk() -> tuple[da.Array, np.ndarray]:
    """64 gated rows -> 8 column strips."""
    arr = np.arange(64 * 64, dtype="f8").reshape(64, 64)
    x = da.from_array(arr, chunks=(1, 64)).map_blocks(_gated, dtype="f8", meta=np.empty((0, 0)))
    return rechunk_p2p.rechunk(x, (64, 8)), arr


async def _until(condition, timeout: float = 30) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


@gen_cluster(client=True, nthreads=ONE, timeout=90)
async def test_workers_joining_during_the_transfers_take_a_share_of_the_outputs(c, s, a):
    await rechunk_p2p.register(c)
    _GATE.clear()
    _MADE[0] = 0
    y, arr = _rechunk()
    held = c.persist(y)
    plugin = s.plugins[PLUGIN]
    await _until(lambda: plugin.active)
    (run,) = plugin.active.values()
    assert run.run_spec.workers == (a.address,)
    limit = a.memory_manager.memory_limit  # (shares go by memory limit: the same as a's)
    async with (
        Worker(s.address, nthreads=1, memory_limit=limit) as b,
        Worker(s.address, nthreads=1, memory_limit=limit) as d,
        Worker(s.address, nthreads=1, memory_limit=limit) as e,
    ):
        await _until(lambda: plugin.recovery.counts.joined == 3)
        joined = {b.address, d.address, e.address}
        assert set(run.run_spec.workers) == {a.address} | joined
        assert plugin.recovery.counts.continuations == 1
        counts = plugin.recovery.counts
        assert counts.outputs_moved == 6  # a keeps 2 of 8, each other 2
        # a transfer that finished before the joins (an alias dask's fusion left of the task
        # that cut) runs again for the moved outputs only; every other input sends all
        assert counts.transfers_rerun + counts.inputs_resent == 64, counts
        (row,) = live_view(s, plugin).runs  # what the dashboard shows of the run
        assert row.changes == "3 joined, 6 outputs moved" and row.workers == 4, row
        _GATE.set()
        out = await c.compute(held)
        np.testing.assert_array_equal(out, arr)
        where = await c.who_has(held)
        holders = {w for ws in where.values() for w in ws}
        assert holders == {a.address} | joined, where
        assert plugin.recovery.counts.restarts == 0
        del held
        await assert_clean(s, a, b, d, e)


@gen_cluster(client=True, nthreads=ONE)
async def test_a_worker_joining_after_the_barrier_changes_nothing(c, s, a):
    await rechunk_p2p.register(c)
    _GATE.set()
    y, arr = _rechunk()
    held = c.persist(y)
    np.testing.assert_array_equal(await c.compute(held), arr)
    async with Worker(s.address, nthreads=1) as b:
        await asyncio.sleep(1.5)  # past the batching of joins
        assert plugin_counts(s) == (0, 0)
        assert b.address not in {w for ws in (await c.who_has(held)).values() for w in ws}
        del held
        await assert_clean(s, a, b)


def plugin_counts(s) -> tuple[int, int]:
    counts = s.plugins[PLUGIN].recovery.counts
    return counts.joined, counts.continuations


def _held_for_joins(block: np.ndarray, workers: int = 4) -> np.ndarray:
    """Make a row, but once the run is open wait until it has ``workers`` workers (the
    first transfers open the run: it is made when a transfer first asks for it): the joins
    come during the transfers however long the workers take to start."""
    from distributed import get_client

    client = get_client()
    deadline = time.monotonic() + 60
    while client.run_on_scheduler(_waiting_for_joins, workers):
        assert time.monotonic() < deadline, f"the run never had {workers} workers"
        time.sleep(0.1)
    return block


def _waiting_for_joins(workers: int, dask_scheduler) -> bool:
    plugin = dask_scheduler.plugins[PLUGIN]
    runs = plugin.active.values()
    return any(len(run.run_spec.workers) < workers for run in runs)


def test_a_local_cluster_scaling_from_one_to_four_workers_spreads_the_outputs():
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    arr = np.arange(256 * 64, dtype="f4").reshape(256, 64)
    x = da.from_array(arr, chunks=(1, 64)).map_blocks(_held_for_joins, dtype="f4")
    y = rechunk_p2p.rechunk(x, (256, 8))
    with (
        LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        rechunk_p2p.register(client)
        held = client.persist(y)
        deadline = time.monotonic() + 60
        while not client.run_on_scheduler(_runs_open):
            assert time.monotonic() < deadline, "the run never opened"
            time.sleep(0.05)
        cluster.scale(4)
        np.testing.assert_array_equal(client.compute(held).result(timeout=120), arr)
        holders = {w for ws in client.who_has(futures_of(held)).values() for w in ws}
        counts = client.run_on_scheduler(_counts)
        assert counts["joined"] == 3, counts
        assert len(holders) == 4, holders
        assert counts["restarts"] == 0, counts


def _runs_open(dask_scheduler) -> bool:
    return bool(dask_scheduler.plugins[PLUGIN].active)


def _counts(dask_scheduler) -> dict:
    return dict(vars(dask_scheduler.plugins[PLUGIN].recovery.counts))


def test_an_adaptive_cluster_spreads_the_outputs_over_the_workers_it_adds():
    """``adapt(minimum=1, maximum=4)`` on a 1-worker cluster: the rechunk's queued transfers
    make the cluster add workers, which the run takes in where they come after it opened
    (or has from the start where they came before), and adaptive scale-down leaves the
    run's workers alone until it ends (no worker leaves it). The transfers wait for a second
    worker in the run, as above."""
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    arr = np.arange(256 * 64, dtype="f4").reshape(256, 64)
    x = da.from_array(arr, chunks=(1, 64)).map_blocks(_held_for_joins, 2, dtype="f4")
    y = rechunk_p2p.rechunk(x, (256, 8))
    with (
        LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        rechunk_p2p.register(client)
        cluster.adapt(minimum=1, maximum=4, interval="200ms")
        held = client.persist(y)
        np.testing.assert_array_equal(client.compute(held).result(timeout=120), arr)
        holders = {w for ws in client.who_has(futures_of(held)).values() for w in ws}
        counts = client.run_on_scheduler(_counts)
        assert counts["restarts"] == 0 and counts["left"] == 0, counts
        assert len(holders) >= 2, (holders, counts)
