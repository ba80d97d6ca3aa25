"""The public entry points: ``rechunk``, ``plan`` and ``register``.

Where it runs: the client (graph construction, plugin registration). Nothing here touches
array data.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import dask
import dask.array as da
import numpy as np
from dask.array.core import normalize_chunks
from dask.array.utils import validate_axis
from dask.base import tokenize
from dask.utils import parse_bytes

from rechunk_p2p import config
from rechunk_p2p.errors import ClusterError, RechunkInputError, RechunkTypeError
from rechunk_p2p.graph import build_rechunk
from rechunk_p2p.planning import RechunkPlan
from rechunk_p2p.planning.merge import merge_inputs

Chunks = tuple[tuple[int, ...], ...]

logger = logging.getLogger(__name__)


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
    new = normalize(x, chunks, block_size_limit=block_size_limit, balance=balance)
    if _same_chunks(new, x.chunks):
        return x
    _require_numpy_chunks(x)
    storage = _storage_setting()
    unknown = _unknown_axes(x)
    the_plan = _make_plan(x, new, block_size_limit, n_workers=1)
    _ensure_registered()
    token = tokenize(x, new, storage)
    if the_plan.merged:  # merge thin inputs first (plain tasks)
        merged = tuple(
            x.chunks[axis] if axis in unknown else c
            for axis, c in enumerate(the_plan.old_chunks)
        )
        x = x.rechunk(merged, method="tasks")
    logger.debug("rechunk_p2p: %s -> %s runs on the P2P engine (token %s)", x.name, new, token)
    if _is_expression(x):  # dask's array query planning
        from rechunk_p2p.integrations.array_expr import p2p_rechunk_expr

        return p2p_rechunk_expr(x, the_plan, token, storage, new, unknown)
    return build_rechunk(x, the_plan, token, storage, new_chunks=new, unknown_axes=unknown)


def _is_expression(x: da.Array) -> bool:
    """Whether ``x`` is an array of dask's query planning (an expression collection)."""
    return type(x).__module__.startswith("dask.array._array_expr")


def _unknown_axes(x: da.Array) -> tuple[int, ...]:
    """Axes along which ``x`` has unknown (NaN) chunk sizes."""
    return tuple(axis for axis, sizes in enumerate(x.chunks) if _has_nan(sizes))


def _planned(chunks: Chunks, unknown: tuple[int, ...]) -> Chunks:
    """``chunks`` as the plan counts them: one element per chunk along ``unknown`` axes.

    Chunks never change along those axes, so each chunk there is its own sub-shuffle and a
    shard spans it whole (see :func:`rechunk_p2p.spec.widen`).
    """
    return tuple((1,) * len(c) if axis in unknown else c for axis, c in enumerate(chunks))


def _make_plan(
    x: da.Array, new: Chunks, block_size_limit: int | None, n_workers: int
) -> RechunkPlan:
    """The plan of the shuffle, from ``x``'s chunks merged where thin inputs would make
    many tiny shards (see :mod:`rechunk_p2p.planning.merge`)."""
    itemsize = 8 if x.dtype.hasobject else x.dtype.itemsize
    unknown = _unknown_axes(x)
    old, new = _planned(x.chunks, unknown), _planned(new, unknown)
    shape = tuple(sum(c) for c in old)
    merged = old
    if math.prod(shape) * itemsize >= config.get_bytes("merge.min-array-bytes"):
        limit = block_size_limit or parse_bytes(dask.config.get("array.chunk-size"))
        shard_bytes = config.get_bytes("merge.shard-bytes")
        merged = merge_inputs(old, new, itemsize, int(limit), shard_bytes)
    return RechunkPlan(
        shape,
        x.dtype,
        merged,
        new,
        n_workers=max(int(n_workers), 1),
        source_chunks=old,
        unknown_axes=unknown,
    )


def plan(
    x: da.Array,
    chunks: Any = "auto",
    *,
    threshold: int | None = None,
    block_size_limit: int | None = None,
    balance: bool = False,
    n_workers: int | None = None,
) -> RechunkPlan:
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
    RechunkPlan
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
    new = normalize(x, chunks, block_size_limit=block_size_limit, balance=balance)
    _require_numpy_chunks(x)
    if n_workers is None:
        n_workers = _current_n_workers()
    return _make_plan(x, new, block_size_limit, n_workers)


def normalize(
    x: da.Array, chunks: Any, *, block_size_limit: int | None = None, balance: bool = False
) -> Chunks:
    """Normalise ``chunks`` for ``x`` exactly as dask's ``rechunk`` does, checking the input.

    Raises ``TypeError`` for a non-dask array and ``ValueError`` for chunks that do not fit,
    before anything is built. Along axes of unknown (NaN) chunk sizes the chunks must stay as
    they are (as in dask); :func:`rechunk` then returns ``x`` itself if nothing changes, and
    otherwise asks for ``compute_chunk_sizes()``.
    """
    if not isinstance(x, da.Array):
        raise RechunkTypeError(
            f"rechunk_p2p.rechunk expects a dask array, got {type(x).__module__}."
            f"{type(x).__qualname__}; wrap it with dask.array.from_array(...) first"
        )
    if x.ndim > 0 and all(s == 0 for s in x.shape):
        return x.chunks
    chunks = _fill_unspecified(x, chunks)
    _check_sizes(x, chunks)
    try:
        new = normalize_chunks(
            chunks, x.shape, limit=block_size_limit, dtype=x.dtype, previous_chunks=x.chunks
        )
    except (ValueError, TypeError) as e:
        raise _input_error(
            f"Cannot rechunk array {x.name} of shape {x.shape} to {_short(chunks)}: "
            f"{_cut(str(e), 600)}",
            e,
        ) from e
    if len(new) != x.ndim:
        raise RechunkInputError(
            f"Provided chunks are not consistent with shape: {chunks!r} has {len(new)} "
            f"dimensions, array {x.name} has {x.ndim}"
        )
    if balance:
        from dask.array.rechunk import _balance_chunksizes

        new = tuple(c if _has_nan(c) else _balance_chunksizes(c) for c in new)
    for axis, (old_axis, new_axis) in enumerate(zip(x.chunks, new)):
        if _has_nan(old_axis) or _has_nan(new_axis):
            if not _same_chunks((old_axis,), (new_axis,)):
                raise RechunkInputError(
                    f"Cannot rechunk axis {axis} of array {x.name} from {_brief(old_axis)} to "
                    f"{_brief(new_axis)}: {_UNCHANGING}"
                )
        elif sum(old_axis) != sum(new_axis):
            raise RechunkInputError(
                f"Chunks {new_axis} along axis {axis} sum to {sum(new_axis)}, "
                f"but the array has length {sum(old_axis)} there"
            )
    return new


_UNCHANGING = (  # dask's own message, word for word
    "Chunks must be unchanging along dimensions with missing values.\n\n"
    "A possible solution:\n  x.compute_chunk_sizes()"
)


def _short(value: Any, limit: int = 120) -> str:
    """``repr(value)``, cut to ``limit`` characters for a one-line error message."""
    return _cut(repr(value), limit)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 4] + " ..."


def _has_nan(sizes: tuple[float, ...]) -> bool:
    return any(math.isnan(s) for s in sizes)


def _brief(sizes: tuple[float, ...]) -> str:
    """Chunk sizes along one axis, shortened for an error message."""
    if len(sizes) <= 6:
        return str(tuple(sizes))
    return f"({', '.join(map(str, sizes[:3]))}, ... {len(sizes)} chunks)"


def _same_chunks(a: Chunks, b: Chunks) -> bool:
    """Whether two chunk specifications are equal, NaN (unknown) sizes matching each other."""
    return len(a) == len(b) and all(
        len(ca) == len(cb)
        and all(u == v or (math.isnan(u) and math.isnan(v)) for u, v in zip(ca, cb))
        for ca, cb in zip(a, b)
    )


def _require_numpy_chunks(x: da.Array) -> None:
    """Refuse chunk types the shuffle would silently turn into plain numpy arrays."""
    if type(x._meta) is not np.ndarray:
        raise RechunkTypeError(
            f"Array {x.name} has chunks of type {type(x._meta).__module__}."
            f"{type(x._meta).__qualname__}; the P2P rechunk moves plain numpy arrays only and "
            "would lose what that type adds (a mask, sparsity, device memory). Rechunk it "
            "with method='tasks'."
        )


def _fill_unspecified(x: da.Array, chunks: Any) -> Any:
    """Resolve dict keys to axes and ``None`` entries to the current chunks, as dask does."""
    if isinstance(chunks, Mapping):
        try:
            by_axis = {validate_axis(k, x.ndim): v for k, v in chunks.items()}
        except (ValueError, TypeError, IndexError) as e:
            raise _input_error(
                f"Invalid chunks {dict(chunks)!r} for an array of {x.ndim} dimensions: {e}", e
            ) from e
        return tuple(x.chunks[i] if by_axis.get(i) is None else by_axis[i] for i in range(x.ndim))
    if isinstance(chunks, (tuple, list)):
        return tuple(rc if lc is None else lc for lc, rc in zip(chunks, x.chunks))
    return chunks


def _check_sizes(x: da.Array, chunks: Any) -> None:
    """A chunk size (one number per axis) must be positive, -1 or ``"auto"`` (dask itself
    fails on zero with a bare ZeroDivisionError, and on negatives with a puzzling message)."""
    per_axis = chunks if isinstance(chunks, tuple) else (chunks,) * x.ndim
    for axis, (size, length) in enumerate(zip(per_axis, x.shape)):
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
            continue
        if size == -1 or size > 0 or (size == 0 and length == 0):
            continue
        raise RechunkInputError(
            f"Chunk size {int(size)} along axis {axis} (length {length}) is not a positive "
            "size, -1 (the whole axis) or 'auto'"
        )


def _input_error(message: str, cause: Exception) -> RechunkInputError | RechunkTypeError:
    """The error for bad chunks: a ``TypeError`` from dask stays one (as in dask's rechunk)."""
    if isinstance(cause, TypeError):
        return RechunkTypeError(message)
    return RechunkInputError(message)


def _storage_setting() -> str:
    storage = config.get("storage")
    if storage not in config.STORAGE_CHOICES:
        raise RechunkInputError(
            f"rechunk-p2p.storage is {storage!r}; choose one of {config.STORAGE_CHOICES}"
        )
    return storage


def _is_xarray(x: Any) -> bool:
    module = type(x).__module__
    return module.startswith("xarray.") and type(x).__name__ in ("Dataset", "DataArray")


def _default_client() -> Any:
    try:
        from distributed import default_client

        return default_client()
    except (ImportError, ValueError):
        return None


def _current_n_workers() -> int:
    client = _default_client()
    if client is None or client.asynchronous:
        return 1
    try:
        return max(len(client.scheduler_info(n_workers=-1)["workers"]), 1)
    except Exception:
        return 1


def _ensure_registered() -> None:
    client = _default_client()
    if client is not None and not client.asynchronous:
        register(client)


_registered: set[str] = set()


def register(client: Any) -> Any:
    """Register rechunk_p2p's scheduler and worker plugins on ``client``'s cluster.

    Idempotent; workers that join later get the worker plugin too. :func:`rechunk` calls it
    for the default client. For an asynchronous client, await the result.

    Raises
    ------
    ClusterError
        The scheduler cannot be reached.
    """
    from rechunk_p2p.scheduler import RechunkSchedulerPlugin

    key = f"{client.id}@{client.scheduler.address}"
    if key in _registered and not client.asynchronous:
        return None
    try:
        result = client.register_plugin(RechunkSchedulerPlugin())
    except OSError as e:
        raise ClusterError(f"Cannot reach the scheduler at {client.scheduler.address}: {e}") from e
    if client.asynchronous:
        return result
    _registered.add(key)
    return None


def cluster_statistics(client: Any) -> dict[str, int]:
    """Totals over every worker since it started: runs, bytes sent, received and spilled."""

    def _totals(dask_worker: Any) -> dict[str, int]:  # runs on each worker
        from rechunk_p2p.worker.plugin import get_plugin

        try:
            totals = get_plugin(dask_worker).totals()
        except ClusterError:
            return {}
        return {
            "runs": totals.runs,
            "bytes_sent": totals.bytes_sent,
            "bytes_received": totals.bytes_received,
            "bytes_spilled": totals.bytes_spilled,
        }

    per_worker = client.run(_totals)
    keys = ("runs", "bytes_sent", "bytes_received", "bytes_spilled")
    return {k: sum(t.get(k, 0) for t in per_worker.values()) for k in keys}
