"""The public entry points: ``rechunk``, ``plan`` and ``register``.

Where it runs: the client (graph construction, plugin registration). Nothing here touches
array data. Dask arrays go to :mod:`rechunk_p2p.arrays`, xarray objects to
:mod:`rechunk_p2p.integrations.xarray` (imported only for them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rechunk_p2p.arrays import plan_array, rechunk_array
from rechunk_p2p.cluster import cluster_statistics, register
from rechunk_p2p.planning import RechunkPlan

if TYPE_CHECKING:
    from rechunk_p2p.integrations.xarray import DatasetRechunkPlan

__all__ = ["cluster_statistics", "plan", "rechunk", "register"]


def rechunk(
    x: Any,
    chunks: Any = "auto",
    *,
    threshold: int | None = None,
    block_size_limit: int | None = None,
    balance: bool = False,
) -> Any:
    """Rechunk a dask array through a peer-to-peer shuffle.

    Accepts the same chunk specifications and returns the same result as dask's
    ``x.rechunk(chunks, ...)``, but moves the data in one all-to-all exchange between
    workers instead of a tree of intermediate tasks, and keeps every worker's event loop
    free of bulk work.

    Parameters
    ----------
    x
        The dask array (or an xarray Dataset/DataArray, rechunked variable by variable with
        ``chunks`` keyed by dimension name).
    chunks
        Target chunks: an int, a tuple (``-1`` for a whole axis, ``None`` to keep an axis,
        ``"auto"``), a dict keyed by axis, explicit tuples of tuples, or ``"auto"``.
    threshold
        Accepted for compatibility with dask's ``rechunk``; the P2P engine needs no
        intermediate steps, so it is not used.
    block_size_limit
        Largest chunk in bytes when ``"auto"`` chunk sizes are chosen
        (default: ``array.chunk-size``).
    balance
        Make chunks along each axis as equal as possible.

    Returns
    -------
    dask.array.Array
        ``x`` itself when its chunks already match, else the rechunked array.

    Raises
    ------
    TypeError
        ``x`` is not a dask array.
    ValueError
        The chunks do not fit the array, or change along an axis of unknown (NaN) chunk
        sizes (as in dask).

    Examples
    --------
    >>> import dask.array as da
    >>> x = da.ones((1000, 1000), chunks=(1000, 10))
    >>> rechunk(x, (10, 1000)).chunks[0][:3]
    (10, 10, 10)
    """
    if _is_xarray(x):
        from rechunk_p2p.integrations.xarray import rechunk_xarray

        return rechunk_xarray(
            x, chunks, threshold=threshold, block_size_limit=block_size_limit, balance=balance
        )
    return rechunk_array(x, chunks, block_size_limit=block_size_limit, balance=balance)


def plan(
    x: Any,
    chunks: Any = "auto",
    *,
    threshold: int | None = None,
    block_size_limit: int | None = None,
    balance: bool = False,
    n_workers: int | None = None,
) -> RechunkPlan | DatasetRechunkPlan:
    """Describe what ``rechunk(x, chunks, ...)`` would do, without building or running it.

    Parameters
    ----------
    x, chunks, threshold, block_size_limit, balance
        As for :func:`rechunk`.
    n_workers
        Workers to estimate cross-worker traffic and buffers for (default: the workers of
        the current client, else 1).

    Returns
    -------
    RechunkPlan or DatasetRechunkPlan
        Immutable; its repr is a readable summary (an HTML table in notebooks). For an
        xarray object, a ``DatasetRechunkPlan``: one plan per variable that changes, and
        totals.
    """
    if _is_xarray(x):
        from rechunk_p2p.integrations.xarray import plan_xarray

        return plan_xarray(
            x,
            chunks,
            threshold=threshold,
            block_size_limit=block_size_limit,
            balance=balance,
            n_workers=n_workers,
        )
    return plan_array(
        x, chunks, block_size_limit=block_size_limit, balance=balance, n_workers=n_workers
    )


def _is_xarray(x: Any) -> bool:
    module = type(x).__module__
    return module.startswith("xarray.") and type(x).__name__ in ("Dataset", "DataArray")
