"""A worker without a nanny (``dask worker --no-nanny``) killed while its pieces are spilled.

Where it runs: the pytest process, against ``dask scheduler`` / ``dask worker`` processes.
Nobody restarts such a worker: the rechunk finishes on the others, and the files the dead
worker spilled stay on disk until a worker starts in the same local directory, which removes
them (distributed's work-space purge of directories whose owner is gone: the engine keeps its
spill files inside the worker's own directory for that reason).
"""

from __future__ import annotations

import os
import signal
import time
from functools import partial

import dask
import dask.array as da
from distributed import Client

import rechunk_p2p
from integration.workloads import Workload, checked, expected_block
from tests.cli_processes import cli_env, start_scheduler, start_worker, stop
from tests.conftest import assert_clean_sync, spill_files

SHAPE = (1200, 1200)
DTYPE = "float64"
WORKLOAD = Workload("nannyless", "kill test", SHAPE, DTYPE, (20, SHAPE[1]), (SHAPE[0], 50))


def _slow_fill(shape, dtype, block_info=None):
    time.sleep(0.05)  # stretch the transfer phase so that the kill lands inside it
    return expected_block(shape, block_info[None]["array-location"], dtype)


def _wait(condition, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
    return result


def _spilled(directory: str) -> bool:
    return any(not path.endswith(os.sep) for path in spill_files(directory))


def _spilling(dirs: dict[str, str], future) -> str | None:
    """The first worker with spilled pieces; raises the rechunk's error if it failed."""
    if future.done():
        future.result()
    return next((address for address, d in dirs.items() if _spilled(d)), None)


def test_a_killed_nannyless_worker_leaves_a_correct_result_and_no_files(tmp_path):
    scheduler_file = str(tmp_path / "scheduler.json")
    local = str(tmp_path / "local")
    env = cli_env()
    # the workers unpickle this module's functions by its name, as pytest imported it
    env["PYTHONPATH"] += os.pathsep + os.path.dirname(os.path.abspath(__file__))
    processes = [start_scheduler(scheduler_file, env)]
    try:
        processes += [start_worker(scheduler_file, local, env) for _ in range(2)]
        with Client(scheduler_file=scheduler_file, timeout="30s") as client:
            client.wait_for_workers(2, timeout=60)
            pids = client.run(os.getpid)
            dirs = client.run(lambda dask_worker: dask_worker.local_directory)
            source = da.map_blocks(
                _slow_fill,
                SHAPE,
                DTYPE,
                dtype=DTYPE,
                chunks=da.core.normalize_chunks(WORKLOAD.source_chunks, SHAPE),
            )
            with dask.config.set({"rechunk-p2p.storage": "disk"}):
                y = rechunk_p2p.rechunk(source, WORKLOAD.target_chunks)
            future = client.compute(checked(y, WORKLOAD))
            victim = _wait(partial(_spilling, dirs, future), "a worker to spill pieces")
            os.kill(pids[victim], signal.SIGKILL)
            assert bool(future.result(timeout=120)) is True  # finished by the survivor
            del future
            assert _spilled(dirs[victim])  # nobody removed the dead worker's files yet

            processes.append(start_worker(scheduler_file, local, env))
            client.wait_for_workers(2, timeout=60)
            _wait(lambda: not os.path.exists(dirs[victim]), "the dead worker's directory to go")
            assert_clean_sync(client)
    finally:
        for process in reversed(processes):
            stop(process)
