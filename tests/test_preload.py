"""``--preload rechunk_p2p`` on the scheduler registers the plugins: no ``register`` call needed.

Two ways: an in-process scheduler started with ``preload=["rechunk_p2p"]`` (gen_cluster), and
``dask scheduler --preload rechunk_p2p`` with ``dask worker`` processes from the command line.
"""

from __future__ import annotations

import dask.array as da
import numpy as np
import pytest
from distributed import Client
from distributed.utils_test import gen_cluster

import rechunk_p2p
from tests.cli_processes import cli_env, start_scheduler, start_worker, stop
from tests.conftest import assert_clean, assert_clean_sync
from tests.engine_helpers import PLUGIN, TWO, check_result


@gen_cluster(
    client=True,
    nthreads=TWO,
    scheduler_kwargs={"preload": ["rechunk_p2p"]},
    allow_unclosed=False,
)
async def test_preloaded_scheduler_in_process(c, s, a, b):
    # an asynchronous client never registers by itself, and this test does not call register
    assert PLUGIN in s.plugins
    assert "rechunk_p2p_get_or_create" in s.handlers
    assert PLUGIN in a.plugins and PLUGIN in b.plugins
    arr = np.arange(30 * 20).reshape(30, 20)
    y = rechunk_p2p.rechunk(da.from_array(arr, chunks=(1, 20)), (30, 2))
    check_result(await c.compute(y), arr)
    assert s.plugins[PLUGIN].runs_created == 1
    await assert_clean(s, a, b)


@pytest.fixture
def preloaded_cluster(tmp_path):
    """``dask scheduler --preload rechunk_p2p`` and two ``dask worker`` processes."""
    scheduler_file = str(tmp_path / "scheduler.json")
    env = cli_env()
    processes = [start_scheduler(scheduler_file, env)]
    try:
        for _ in range(2):
            processes.append(start_worker(scheduler_file, str(tmp_path), env))
        with Client(scheduler_file=scheduler_file, timeout="30s") as client:
            client.wait_for_workers(2, timeout=60)
            yield client
    finally:
        for process in reversed(processes):
            stop(process)


def test_preloaded_scheduler_from_the_command_line(preloaded_cluster):
    client = preloaded_cluster
    # before this client did anything rechunk_p2p-related, the cluster has the plugins
    assert client.run_on_scheduler(lambda dask_scheduler: PLUGIN in dask_scheduler.plugins)
    assert all(client.run(lambda dask_worker: PLUGIN in dask_worker.plugins).values())
    arr = np.arange(40 * 30, dtype="f4").reshape(40, 30)
    y = rechunk_p2p.rechunk(da.from_array(arr, chunks=(2, 30)), (40, 3))
    check_result(y.compute(), arr)
    runs = client.run_on_scheduler(
        lambda dask_scheduler: dask_scheduler.plugins[PLUGIN].runs_created
    )
    assert runs == 1
    assert_clean_sync(client)
