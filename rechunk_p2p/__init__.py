"""rechunk_p2p: peer-to-peer rechunking of Dask arrays on dask.distributed.

Importing this package changes nothing in dask: :func:`install` is the opt-in that routes
``x.rechunk(method="p2p")`` here. Started as a scheduler preload
(``dask scheduler --preload rechunk_p2p``), it registers its plugins on that cluster.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from rechunk_p2p import config  # noqa: F401  (loads the configuration defaults)
from rechunk_p2p.errors import (
    ClusterError,
    RechunkCommError,
    RechunkInputError,
    RechunkP2PError,
    RechunkRunError,
    RechunkStalledError,
    RechunkStorageError,
    RechunkTypeError,
    StaleRunError,
)

#: The rest of the API, imported on first use (PEP 562): dask.array alone pulls in xarray
#: and pandas, a second of a command's start, and every worker process of a local cluster
#: imports this package as it starts (the command's ``__main__``) before it does anything.
_LAZY = {
    "cluster_statistics": "rechunk_p2p.api",
    "plan": "rechunk_p2p.api",
    "rechunk": "rechunk_p2p.api",
    "register": "rechunk_p2p.api",
    "LoopLagReport": "rechunk_p2p.diagnostics",
    "measure_event_loops": "rechunk_p2p.diagnostics",
    "performance_report": "rechunk_p2p.diagnostics.perf_report",
    "report": "rechunk_p2p.diagnostics.run_report",
    "RechunkPlan": "rechunk_p2p.planning",
    "install": "rechunk_p2p.routing",
    "installed": "rechunk_p2p.routing",
    "uninstall": "rechunk_p2p.routing",
    "rechunk_zarr": "rechunk_p2p.integrations.zarr",
}

__version__ = "0.1.0"

__all__ = [
    "ClusterError",
    "LoopLagReport",
    "RechunkCommError",
    "RechunkInputError",
    "RechunkP2PError",
    "RechunkPlan",
    "RechunkRunError",
    "RechunkStalledError",
    "RechunkStorageError",
    "RechunkTypeError",
    "StaleRunError",
    "cluster_statistics",
    "install",
    "installed",
    "measure_event_loops",
    "performance_report",
    "plan",
    "rechunk",
    "rechunk_zarr",
    "register",
    "report",
    "uninstall",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}"):
        value = importlib.import_module(f"{__name__}.{name}")  # a submodule, as if imported
    else:
        raise AttributeError(f"module 'rechunk_p2p' has no attribute {name!r}")
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


async def dask_setup(server: Any) -> None:
    """Preload hook: ``dask scheduler --preload rechunk_p2p`` registers the plugins there."""
    from distributed import Scheduler

    if isinstance(server, Scheduler):
        from rechunk_p2p.scheduler import RechunkSchedulerPlugin

        server.add_plugin(RechunkSchedulerPlugin(), name=RechunkSchedulerPlugin.name)
