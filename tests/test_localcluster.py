"""Rechunks on a real multi-process ``LocalCluster`` (2 workers, 1 thread each) with a sync client.

One cluster serves the whole module. The synchronous client registers the plugins by itself
(``rechunk_p2p.rechunk`` calls ``register`` for the default client). Every test ends with
:func:`tests.conftest.assert_clean_sync`.
"""

from __future__ import annotations

import time

import dask.array as da
import numpy as np
import pytest
from distributed import Client, LocalCluster, wait

import rechunk_p2p
from tests.conftest import assert_clean_sync
from tests.engine_helpers import PLUGIN, check_graph, check_result, sample_arrays


@pytest.fixture(scope="module")
def client():
    with (
        LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            dashboard_address=":0",
            memory_limit="1GiB",
        ) as cluster,
        Client(cluster) as client,
    ):
        yield client


def _runs_created(client) -> int:
    return client.run_on_scheduler(
        lambda dask_scheduler: dask_scheduler.plugins[PLUGIN].runs_created
    )


def _bytes_spilled(client) -> int:
    def spilled(dask_worker):
        plugin = dask_worker.plugins.get(PLUGIN)
        return plugin.totals().bytes_spilled if plugin else 0

    return sum(client.run(spilled).values())


def _active_runs(client) -> dict:
    return client.run_on_scheduler(
        lambda dask_scheduler: dict(dask_scheduler.plugins[PLUGIN].active)
    )


def _check(client, x, expected, chunks):
    y = rechunk_p2p.rechunk(x, chunks)
    check_graph(x, y, chunks)
    before = _runs_created(client)
    check_result(y.compute(), expected)
    assert _runs_created(client) - before == rechunk_p2p.plan(x, chunks).n_shuffles > 0
    return y


def test_2d_and_3d(client, storage):
    spilled = _bytes_spilled(client)
    arr = np.random.default_rng(0).random((60, 50))
    _check(client, da.from_array(arr, chunks=(6, 50)), arr, (60, 5))
    _check(client, da.from_array(arr, chunks=((7, 23, 30), (11, 39))), arr, (9, 8))
    cube = np.arange(12 * 10 * 8, dtype="i4").reshape(12, 10, 8)
    _check(client, da.from_array(cube, chunks=(1, 10, 8)), cube, (12, 3, 4))
    _check(client, da.from_array(cube, chunks=(4, 5, 2)), cube, {0: -1, 2: 3})
    assert_clean_sync(client)
    assert (_bytes_spilled(client) > spilled) == (storage == "disk")


def test_object_and_structured_dtypes(client, storage):
    arrays = sample_arrays()
    for name in ("object", "structured", "U7", "M8[ns]"):
        expected = arrays[name]
        _check(client, da.from_array(expected, chunks=(1, 8)), expected, (6, 2))
    assert_clean_sync(client)


def test_chained_graph(client):
    arr = np.random.default_rng(1).random((24, 18))
    x = da.from_array(arr, chunks=(2, 18))
    y = rechunk_p2p.rechunk(x, (24, 3))
    z = rechunk_p2p.rechunk(y.map_blocks(np.sqrt) * 2 + 1, (5, 9))
    np.testing.assert_allclose(z.sum(axis=0).compute(), (np.sqrt(arr) * 2 + 1).sum(axis=0))
    check_result(y[:10].compute(), arr[:10])
    assert_clean_sync(client)


def test_persist_then_use(client):
    arr = np.arange(24 * 18, dtype="f8").reshape(24, 18)
    y = rechunk_p2p.rechunk(da.from_array(arr, chunks=(2, 18)), (24, 3)).persist()
    wait(y)
    assert_clean_sync(client)  # runs are gone, the persisted output is not
    np.testing.assert_allclose((y + 1).sum().compute(), (arr + 1).sum())
    del y
    assert_clean_sync(client)


def _slow(block):
    time.sleep(0.02)
    return block


def test_cancelled_mid_way(client, storage):
    arr = np.arange(60 * 40).reshape(60, 40)
    x = da.from_array(arr, chunks=(1, 40)).map_blocks(_slow, dtype=arr.dtype)
    y = rechunk_p2p.rechunk(x, (60, 1))
    fut = client.compute(y)
    deadline = time.monotonic() + 30
    while not _active_runs(client):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not fut.done()
    fut.cancel()
    del fut
    assert_clean_sync(client)
    check_result(y.compute(), arr)
    assert_clean_sync(client)
