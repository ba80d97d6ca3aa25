"""rechunk_p2p: peer-to-peer rechunking of Dask arrays on dask.distributed.

Importing this package changes nothing in dask: :func:`install` is the opt-in that routes
``x.rechunk(method="p2p")`` here. Started as a scheduler preload
(``dask scheduler --preload rechunk_p2p``), it registers its plugins on that cluster.
"""

from __future__ import annotations

from typing import Any

from rechunk_p2p import config  # noqa: F401  (loads the configuration defaults)
from rechunk_p2p.api import cluster_statistics, plan, rechunk, register
from rechunk_p2p.diagnostics import LoopLagReport, measure_event_loops
from rechunk_p2p.diagnostics.perf_report import performance_report
from rechunk_p2p.diagnostics.run_report import report
from rechunk_p2p.errors import (
    ClusterError,
    RechunkCommError,
    RechunkInputError,
    RechunkP2PError,
    RechunkRunError,
    RechunkStorageError,
    RechunkTypeError,
    StaleRunError,
)
from rechunk_p2p.planning import RechunkPlan
from rechunk_p2p.routing import install, installed, uninstall

__version__ = "0.1.0"

__all__ = [
    "ClusterError",
    "LoopLagReport",
    "RechunkCommError",
    "RechunkInputError",
    "RechunkP2PError",
    "RechunkPlan",
    "RechunkRunError",
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
    if name == "rechunk_zarr":  # imported lazily: zarr is only needed for zarr workflows
        from rechunk_p2p.integrations.zarr import rechunk_zarr

        return rechunk_zarr
    raise AttributeError(f"module 'rechunk_p2p' has no attribute {name!r}")


async def dask_setup(server: Any) -> None:
    """Preload hook: ``dask scheduler --preload rechunk_p2p`` registers the plugins there."""
    from distributed import Scheduler

    if isinstance(server, Scheduler):
        from rechunk_p2p.scheduler import RechunkSchedulerPlugin

        server.add_plugin(RechunkSchedulerPlugin(), name=RechunkSchedulerPlugin.name)
