"""Shared fixtures and cleanup assertions for rechunk_p2p's tests."""

from __future__ import annotations

import asyncio
import os

import dask
import pytest

pytest_plugins = ["distributed.utils_test"]

PLUGIN = "rechunk-p2p"


def spill_files(local_directory: str) -> list[str]:
    """Every file and directory rechunk_p2p left under a worker's local directory (its own
    directory too, even empty)."""
    root = os.path.join(local_directory, "rechunk-p2p")
    found = []
    for dirpath, _, filenames in os.walk(root):
        found.append(dirpath + os.sep)
        found.extend(os.path.join(dirpath, f) for f in filenames)
    return found


async def assert_clean(scheduler, *workers, timeout: float = 5.0) -> None:
    """No run left on the scheduler or any worker, none still closing (a worker forgets a
    run before it frees its buffers and gives back the process tuning), and no spill files
    on disk."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        active = dict(scheduler.plugins[PLUGIN].active) if PLUGIN in scheduler.plugins else {}
        plugins = {w.address: w.plugins[PLUGIN] for w in workers if PLUGIN in w.plugins}
        runs = {addr: dict(p.runs) for addr, p in plugins.items()}
        closing = {addr: len(p._background) for addr, p in plugins.items() if p._background}
        files = {w.address: spill_files(w.local_directory) for w in workers}
        if not active and not any(runs.values()) and not closing and not any(files.values()):
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(
                f"Left behind: scheduler runs {active}, worker runs {runs}, "
                f"runs closing {closing}, files {files}"
            )
        await asyncio.sleep(0.05)


def assert_clean_sync(client, timeout: float = 10.0) -> None:
    """``assert_clean`` for a synchronous client of a (multi-process) cluster."""
    import time

    def worker_state(dask_worker):
        plugin = dask_worker.plugins.get(PLUGIN)
        return {
            "runs": sorted(plugin.runs) if plugin else [],
            "files": spill_files(dask_worker.local_directory),
        }

    def scheduler_state(dask_scheduler):
        plugin = dask_scheduler.plugins.get(PLUGIN)
        return sorted(plugin.active) if plugin else []

    deadline = time.monotonic() + timeout
    while True:
        active = client.run_on_scheduler(scheduler_state)
        workers = client.run(worker_state)
        if not active and not any(s["runs"] or s["files"] for s in workers.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"Left behind: scheduler {active}, workers {workers}")
        time.sleep(0.1)


@pytest.fixture(autouse=True, scope="module")
def _workers_forked_from_a_server():
    """The worker processes of this suite's LocalClusters fork from a server that imported
    distributed, numpy and the rest once (as distributed's own suite runs), rather than each
    importing them afresh: a 3-worker cluster starts in 0.4 s rather than 2 s. Still separate
    processes, killed and restarted for real. Not for ``integration/``: its benchmark cluster
    passes the tick limit to its workers through their environment, which a fork server
    started earlier would not see."""
    with dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"}):
        yield


@pytest.fixture(params=["disk", "memory"])
def storage(request, monkeypatch):
    """Run a test with each storage kind.

    gen_cluster resets ``dask.config`` to ``distributed.utils_test.original_config`` when the
    cluster starts, so the setting goes there too (else it would silently be "auto"). With
    disk storage the write buffer is small (256 bytes), so that these small arrays reach the disk
    while the run goes on, as large ones do, rather than only when they are read.
    """
    import copy

    import dask
    import distributed.utils_test

    settings = {"storage": request.param, "disk-write-buffer-bytes": "256B"}
    original = copy.deepcopy(distributed.utils_test.original_config)
    dask.config.update(original, {"rechunk-p2p": settings})
    monkeypatch.setattr(distributed.utils_test, "original_config", original)
    with dask.config.set({f"rechunk-p2p.{k}": v for k, v in settings.items()}):
        yield request.param
