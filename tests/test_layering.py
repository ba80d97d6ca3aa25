"""The client side imports no worker code: building, planning and routing a rechunk, and the
scheduler plugin that ``register`` pickles, load neither the worker plugin, its run state, the
data plane nor the shard buffers (they load on the workers, where tasks need them)."""

from __future__ import annotations

import ast
import subprocess
import sys

_CLIENT = """
import sys
import dask.array as da
import rechunk_p2p
import rechunk_p2p.scheduler  # what register() sends to the scheduler

x = da.ones((20, 20), chunks=(1, 20))
y = rechunk_p2p.rechunk(x, (20, 1))
rechunk_p2p.plan(x, (20, 1))
rechunk_p2p.install()
x.rechunk((20, 1), method="p2p")
rechunk_p2p.uninstall()
y.compute(scheduler="sync")  # the tasks without a cluster
print(sorted(m for m in sys.modules if m.startswith("rechunk_p2p.")))
"""


def test_client_side_imports_no_worker_code():
    out = subprocess.run(
        [sys.executable, "-c", _CLIENT], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert {"rechunk_p2p.api", "rechunk_p2p.graph", "rechunk_p2p.tasks"} <= set(loaded)
    worker_side = [m for m in loaded if m.startswith(("rechunk_p2p.worker", "rechunk_p2p.buffers"))]
    assert not worker_side, worker_side
