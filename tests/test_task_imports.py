"""What a worker imports when it decodes the engine's tasks: nothing of the engine's own past
what the plugin's setup imported (:mod:`rechunk_p2p.worker.imports`).

A module first imported while a task is decoded is imported on the worker's event loop, in
the middle of a rechunk: on a cluster of many workers, those that got no barrier or output
task in an earlier run imported ``rechunk_p2p.graph`` (and what it imports) there.

Where it runs: a fresh interpreter per case (``subprocess``), as a worker process starts.
"""

from __future__ import annotations

import pickle
import subprocess
import sys

import dask.array as da
import numpy as np
import pytest
from distributed.protocol.pickle import dumps

import rechunk_p2p

_DECODE = """
import pickle, sys
from rechunk_p2p.worker.imports import import_task_modules_blocking
import_task_modules_blocking()
before = {m for m in sys.modules if m.startswith("rechunk_p2p")}
for blob in pickle.load(sys.stdin.buffer):
    pickle.loads(blob)
print(sorted({m for m in sys.modules if m.startswith("rechunk_p2p")} - before))
"""


def _inputs() -> dict[str, da.Array]:
    values = np.arange(64 * 48, dtype="f8").reshape(64, 48)
    return {
        "held": da.from_array(values, chunks=(8, 48)),
        "made": da.random.default_rng(1).random((64, 48), chunks=(8, 48)),
        "derived": da.from_array(values, chunks=(8, 48)) + 1,
    }


@pytest.mark.parametrize("origin", ["held", "made", "derived"])
def test_the_setup_imports_every_module_a_task_names(origin):
    y = rechunk_p2p.rechunk(_inputs()[origin], (64, 6))
    tasks = dict(y.__dask_graph__())
    kinds = {type(t).__name__ for t in tasks.values()}
    assert {"BarrierTask", "UnpackTask"} <= kinds  # (every kind of the engine's tasks)
    blobs = [dumps(t) for t in tasks.values()]
    done = subprocess.run(
        [sys.executable, "-c", _DECODE],
        input=pickle.dumps(blobs),
        capture_output=True,
        timeout=120,
        check=True,
    )
    assert done.stdout.decode().strip() == "[]", done.stdout.decode()


def _modules() -> list[str]:
    return sorted(sys.modules)


def test_a_workers_first_rechunk_imports_nothing():
    """Nor does running the tasks import anything: a module imported in a task thread is
    compiled there when no bytecode is cached, holding the GIL, and the worker's loop stalls
    (the scheduler's modules, once pulled in by the module a task asks for its plugin, made a
    32-worker rechunk's worst loop stalls, 90-220 ms)."""
    from distributed import Client, LocalCluster, wait

    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        rechunk_p2p.register(client)
        x = da.random.default_rng(2).random((32, 64, 64), chunks=(1, 64, 64)).persist()
        wait(x)
        before = client.run(_modules)
        y = rechunk_p2p.rechunk(x, (32, 16, 16)).persist()
        wait(y)
        after = client.run(_modules)
        assert len(before) == 2
        for worker, names in after.items():
            assert sorted(set(names) - set(before[worker])) == [], worker
        assert "rechunk_p2p.scheduler" not in after.popitem()[1]  # (the scheduler's only)
        del x, y
