"""The modules a worker's tasks need, imported in a thread before the first task comes.

Where it runs: an offload thread, awaited by the worker plugin's setup.

distributed decodes a task message on the worker's event loop, importing what the task's
pickle names; the first rechunk task would import dask.array (which pulls in xarray and
pandas where they are installed) and zarr there: 0.4-0.6 s of a stalled loop, once per
worker process (a local cluster's workers, started light, import them on their first
task).
"""

from __future__ import annotations

import importlib

#: What transfer, output and zarr write tasks unpickle into.
TASK_MODULES = (
    "dask.array",
    "zarr",
    "rechunk_p2p.tasks",
    "rechunk_p2p.sources",
    "rechunk_p2p.integrations.zarr_writes",
)


def import_task_modules_blocking() -> None:
    """Import :data:`TASK_MODULES` (each once per process; later calls cost nothing)."""
    for name in TASK_MODULES:
        importlib.import_module(name)
