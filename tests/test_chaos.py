"""Chaos: a rechunk on twelve worker processes while one of them is killed every few seconds.

Where it runs: the pytest process, against a multi-process ``LocalCluster`` with nannies (a
killed worker is restarted by its nanny, and may be killed again). The data is made and
checked on the workers (every element's value is a hash of its index, see
:mod:`integration.workloads`), so a misplaced, missing or duplicated element fails the check.
Marked slow: ten runs take several minutes on two cores (``-m slow``).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import dask
import dask.array as da
import pytest
from distributed import Client, LocalCluster

import rechunk_p2p
from integration.workloads import Workload, checked, expected_block

SHAPE = (2400, 2400)
DTYPE = "float64"
ROWS, COLUMNS = 20, 20  # 120 row blocks into 120 column strips, one all-to-all shuffle
WORKERS = 12
#: A worker is killed this often while the rechunk runs, as long as more than half are up.
KILL_EVERY = 4.0
#: Seconds one input chunk takes to make: the transfer phase spans several kills.
FILL_SECONDS = 0.5


def _slow_fill(shape, dtype, block_info=None):
    time.sleep(FILL_SECONDS)
    return expected_block(shape, block_info[None]["array-location"], dtype)


def _kill_until(client: Client, stop: threading.Event, seed: int, kills: list[str]) -> None:
    """Kill a random running worker every :data:`KILL_EVERY` seconds until ``stop``."""
    rng = random.Random(seed)
    while not stop.wait(KILL_EVERY):
        try:
            pids = client.run(os.getpid)
        except Exception:  # a worker died during the request: ask again next round
            continue
        if len(pids) <= WORKERS // 2:
            continue
        victim = rng.choice(sorted(pids))
        try:
            os.kill(pids[victim], signal.SIGKILL)
        except ProcessLookupError:
            continue
        kills.append(victim)


@pytest.mark.slow
@pytest.mark.xdist_group("twelve-workers")  # one at a time: each wants the whole machine
@pytest.mark.timeout(900)
@pytest.mark.parametrize("seed", range(10))
def test_a_rechunk_on_twelve_workers_survives_a_kill_every_few_seconds(seed):
    # a task whose workers die under it 4 times is given up by distributed's default; with a
    # kill every 4 s that is chance, not the engine (distributed's own chaos test does so)
    with (
        dask.config.set({"distributed.scheduler.allowed-failures": 1000}),
        LocalCluster(
            n_workers=WORKERS,
            threads_per_worker=1,
            processes=True,
            dashboard_address=":0",
            memory_limit="1GiB",
        ) as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(WORKERS, timeout=180)
        chunks = da.core.normalize_chunks((ROWS, SHAPE[1]), SHAPE)
        x = da.map_blocks(_slow_fill, SHAPE, DTYPE, dtype=DTYPE, chunks=chunks, name=f"s{seed}")
        y = rechunk_p2p.rechunk(x, (SHAPE[0], COLUMNS))
        workload = Workload("chaos", "chaos", SHAPE, DTYPE, (ROWS, SHAPE[1]), (SHAPE[0], COLUMNS))
        future = client.compute(checked(y, workload))
        stop, kills = threading.Event(), []
        killer = threading.Thread(target=_kill_until, args=(client, stop, seed, kills))
        killer.start()
        try:
            result = future.result(timeout=840)
        finally:
            stop.set()
            killer.join()
        assert bool(result) is True  # every element where it belongs, once
        assert kills, "no worker was killed while the rechunk ran"
