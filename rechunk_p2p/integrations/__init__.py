"""Workflows on top of the engine: zarr stores, xarray objects, the command line.

Where it runs: client (the caller's thread). Nothing here runs on an event loop or in a
task. The submodules import zarr and xarray, so they are imported lazily: importing
:mod:`rechunk_p2p` does not import this package's submodules.

This module holds the few calls into the engine that the workflows share, so that each
workflow reaches the engine through one place.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def rechunk_array(x: Any, chunks: Any, **kwargs: Any) -> Any:
    """Rechunk the dask array ``x`` with the P2P engine (:func:`rechunk_p2p.api.rechunk`).

    Parameters
    ----------
    x : dask.array.Array
        The array to rechunk.
    chunks
        Anything :meth:`dask.array.Array.rechunk` accepts.
    **kwargs
        ``threshold``, ``block_size_limit``, ``balance``.

    Returns
    -------
    dask.array.Array
    """
    from rechunk_p2p import api

    return api.rechunk(x, chunks, **kwargs)


def plan_array(x: Any, chunks: Any, *, n_workers: int | None = None) -> Any:
    """Return the engine's :class:`RechunkPlan` for rechunking ``x`` to ``chunks``."""
    from rechunk_p2p import api

    return api.plan(x, chunks, n_workers=n_workers)


def cluster_statistics(client: Any) -> dict[str, int]:
    """Totals over all workers since they started (spilled, sent, received bytes, runs)."""
    from rechunk_p2p import api

    return dict(api.cluster_statistics(client))


@contextlib.contextmanager
def event_loop_probe(client: Any) -> Iterator[Any]:
    """Measure event-loop lag on every server while the block runs.

    Yields the monitor; after the block, ``monitor.report.overall`` has ``p99_ms`` and
    ``max_ms``.
    """
    from rechunk_p2p.diagnostics.loop_monitor import measure_event_loops

    with measure_event_loops(client, interval="5ms") as probe:
        yield probe
