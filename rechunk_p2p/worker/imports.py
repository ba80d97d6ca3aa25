"""The modules a worker's tasks need, imported when the engine is set up on the worker.

Where it runs: the worker's event loop, in the worker plugin's setup (once per process;
later calls cost nothing).

distributed decodes a task message on the worker's event loop, importing what the task's
pickle names; the first rechunk task would import dask.array (which pulls in xarray and
pandas where they are installed) and zarr there, in the middle of a rechunk: 0.4-0.6 s of a
stalled loop, once per worker process (a local cluster's workers, started light, import
them on their first task). Imported at the setup instead, the stall falls before the first
rechunk, usually while the client still builds its graph.

Not in a thread beside the loop: importing a package in two threads at once can deadlock
inside Python's import system when the package imports itself circularly (zarr does), and
Python then hands one of them a half-initialised module. A worker that imported zarr in a
thread while its loop decoded the first tasks, which name ``zarr.core.array``, failed both
("cannot import name ... from partially initialized module 'zarr.core.array'"): the setup
failed and the worker's stream to the scheduler closed (seen once in the demo on a fresh
machine, 2 workers: the run went on with one).
"""

from __future__ import annotations

import importlib

#: What transfer, barrier, output and zarr write tasks unpickle into (the barrier and output
#: tasks are classes of ``rechunk_p2p.graph``: a worker given none in its first runs, as most
#: of a large cluster's are in a small one, imported it inside a later rechunk)
TASK_MODULES = (
    "dask.array",
    "zarr",
    "rechunk_p2p.graph",
    "rechunk_p2p.tasks",
    "rechunk_p2p.worker.install",  # (every task asks it for the plugin)
    "rechunk_p2p.sources",
    "rechunk_p2p.integrations.zarr_writes",
)


def import_task_modules_blocking() -> None:
    """Import :data:`TASK_MODULES` (each once per process; later calls cost nothing)."""
    for name in TASK_MODULES:
        importlib.import_module(name)
