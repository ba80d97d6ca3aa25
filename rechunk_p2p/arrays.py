"""The engine's entry for dask arrays: normalise the chunks as dask does, plan, build.

Where it runs: the client (graph construction). Pure apart from reading the configuration
and, for ``plan_array``, asking the current client how many workers it has. The public
:mod:`rechunk_p2p.api` hands dask arrays here and xarray objects to
:mod:`rechunk_p2p.integrations.xarray`, which comes back here variable by variable.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import dask.array as da
import numpy as np
from dask.array.core import normalize_chunks
from dask.array.utils import validate_axis
from dask.base import tokenize

from rechunk_p2p.chunk_sizes import check_chunk_sizes
from rechunk_p2p.cluster import current_n_workers, ensure_registered
from rechunk_p2p.errors import RechunkInputError, RechunkTypeError
from rechunk_p2p.graph import build_rechunk
from rechunk_p2p.holders import (
    HeldChunks,
    find_held,
    group_holders,
    held_groups,
    partial_transfers,
)
from rechunk_p2p.planning import RechunkPlan
from rechunk_p2p.planning.axes import Chunks, element_bytes
from rechunk_p2p.planning.groups import transfer_groups
from rechunk_p2p.settings import ClientSettings
from rechunk_p2p.sources import InputSources, find_sources, not_made

logger = logging.getLogger(__name__)

#: Most output chunks of one partial: when a run's barrier passes, the scheduler sends all
#: its output tasks at once, and each worker takes its share in one step of its event loop
PARTIAL_OUTPUTS = 128


def rechunk_array(
    x: da.Array,
    chunks: Any = "auto",
    *,
    block_size_limit: int | None = None,
    balance: bool = False,
) -> da.Array:
    """Rechunk the dask array ``x`` with the P2P engine (see :func:`rechunk_p2p.rechunk`)."""
    new = normalize(x, chunks, block_size_limit=block_size_limit, balance=balance)
    if _same_chunks(new, x.chunks):
        return x
    _require_numpy_chunks(x)
    settings = ClientSettings.read()
    storage = settings.storage
    unknown = _unknown_axes(x)
    sources = _joinable(x, settings)
    held = _held(x, settings) if sources is None else None
    the_plan = _make_plan(
        x, new, block_size_limit, settings, n_workers=1, joinable=sources is not None, held=held
    )
    token = tokenize(x, new, storage, the_plan)  # the plan: settings that shape the graph
    logger.debug("rechunk_p2p: %s -> %s runs on the P2P engine (token %s)", x.name, new, token)
    if _is_expression(x):  # dask's array query planning
        from rechunk_p2p.integrations.array_expr import p2p_rechunk_expr

        result = p2p_rechunk_expr(x, the_plan, token, storage, new, unknown)
    else:
        result = build_rechunk(
            x,
            the_plan,
            token,
            storage,
            new_chunks=new,
            unknown_axes=unknown,
            sources=sources,
            held=held,
            group_bytes=settings.transfer_group_bytes,
        )
    # last: a registration still under way (register_in_background) had the graph's
    # construction to finish in
    ensure_registered()
    return result


def plan_array(
    x: da.Array,
    chunks: Any = "auto",
    *,
    block_size_limit: int | None = None,
    balance: bool = False,
    n_workers: int | None = None,
) -> RechunkPlan:
    """The plan of rechunking the dask array ``x`` (see :func:`rechunk_p2p.plan`)."""
    new = normalize(x, chunks, block_size_limit=block_size_limit, balance=balance)
    _require_numpy_chunks(x)
    if n_workers is None:
        n_workers = current_n_workers()
    settings = ClientSettings.read()
    sources = _joinable(x, settings)
    held = _held(x, settings) if sources is None else None
    plan = _make_plan(
        x, new, block_size_limit, settings, n_workers, joinable=sources is not None, held=held
    )
    return replace(plan, origin=_origin(x, settings, sources, held))


def _origin(
    x: da.Array, settings: ClientSettings, sources: InputSources | None, held: HeldChunks | None
) -> str:
    """Where the plan's input chunks come from: made by the transfer tasks, held on the
    workers, or computed first, and why."""
    if sources is not None:
        return "made inside the transfer tasks"
    if held is not None:
        return "held on the workers (persisted)"
    if settings.transfer_group_bytes <= 0:
        why = "transfer-group-bytes is 0"
    elif _is_expression(x):
        why = "dask's query planning builds the graph"
    elif _unknown_axes(x):
        why = "some chunk sizes are unknown"
    else:
        why = not_made(x) or "its chunks are not made by tasks of their own"
    return f"its own task a chunk, before the transfers: {why}"


def _is_expression(x: da.Array) -> bool:
    """Whether ``x`` is an array of dask's query planning (an expression collection)."""
    return type(x).__module__.startswith("dask.array._array_expr")


def _joinable(x: da.Array, settings: ClientSettings) -> InputSources | None:
    """The tasks that make ``x``'s chunks, when transfer tasks may make and join them
    (``transfer-group-bytes`` above 0, no query planning, chunk sizes known)."""
    if settings.transfer_group_bytes <= 0 or _is_expression(x) or _unknown_axes(x):
        return None
    return find_sources(x)


def _held(x: da.Array, settings: ClientSettings) -> HeldChunks | None:
    """Where a held input's chunks sit, when transfer tasks may cut several of them
    (``transfer-group-bytes`` above 0, no query planning, chunk sizes known)."""
    if settings.transfer_group_bytes <= 0 or _is_expression(x) or _unknown_axes(x):
        return None
    return find_held(x)


def _unknown_axes(x: da.Array) -> tuple[int, ...]:
    """Axes along which ``x`` has unknown (NaN) chunk sizes."""
    return tuple(axis for axis, sizes in enumerate(x.chunks) if _has_nan(sizes))


def _planned(chunks: Chunks, unknown: tuple[int, ...]) -> Chunks:
    """``chunks`` as the plan counts them: one element per chunk along ``unknown`` axes.

    Chunks never change along those axes, so each chunk there is its own sub-shuffle and a
    piece spans it whole (see :func:`rechunk_p2p.spec.widen`).
    """
    return tuple((1,) * len(c) if axis in unknown else c for axis, c in enumerate(chunks))


def _make_plan(
    x: da.Array,
    new: Chunks,
    block_size_limit: int | None,
    settings: ClientSettings,
    n_workers: int,
    joinable: bool = False,
    held: HeldChunks | None = None,
) -> RechunkPlan:
    """The plan of the shuffle of ``x``'s chunks (nothing moves them before it); with
    ``joinable``, transfer tasks make and join neighbouring chunks where that pays; with
    ``held``, transfer tasks cut the held chunks of one worker together."""
    unknown = _unknown_axes(x)
    old, new = _planned(x.chunks, unknown), _planned(new, unknown)
    groups = None
    limit = settings.transfer_group_bytes
    if joinable:
        groups = transfer_groups(old, new, element_bytes(x.dtype), limit, fixed_axes=unknown)
    elif held is not None and not unknown:
        groups = held_groups(old, new, element_bytes(x.dtype), limit, held)
    plan = RechunkPlan(
        tuple(sum(c) for c in old),
        x.dtype,
        old,
        new,
        n_workers=max(int(n_workers), 1),
        unknown_axes=unknown,
        send_buffer_bytes=settings.run_buffer_bytes,
        partial_bytes=settings.partial_bytes,
        partial_outputs=PARTIAL_OUTPUTS,
        groups=groups,
    )
    if held is None:
        return plan
    chunk = plan.largest_cut_bytes
    where = held if groups is None else held.joined(groups)
    transfers, marked = 0, 0
    for p in plan.partials:
        if not p.needs_shuffle:
            continue
        shared = partial_transfers(p, range(p.n_inputs), where, limit, chunk)
        transfers += len(shared)
        # transfers that cut several chunks, or joined ones, have a held task per worker
        if groups is not None or len(shared) < p.n_inputs:
            marked += len(set(group_holders(p, shared, where)))
    return replace(plan, held_transfers=transfers, held_tasks=marked)


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
    per_axis = chunks if isinstance(chunks, tuple) else (chunks,) * x.ndim
    check_chunk_sizes(per_axis, x.shape, f"array {x.name}")
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


def _input_error(message: str, cause: Exception) -> RechunkInputError | RechunkTypeError:
    """The error for bad chunks: a ``TypeError`` from dask stays one (as in dask's rechunk)."""
    if isinstance(cause, TypeError):
        return RechunkTypeError(message)
    return RechunkInputError(message)
