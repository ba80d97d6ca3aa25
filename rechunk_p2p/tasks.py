"""The functions the graph's tasks call.

Where it runs: task threads of the worker executing the task. Each reaches the worker's event
loop at most once (to fetch a run the worker does not know yet, or for the barrier). The
client imports this module to build graphs; the worker stack is imported inside the functions,
on the worker, the first time a task runs there.

Computed without distributed workers (dask's synchronous or threaded scheduler, as in
``dask.array.utils.assert_eq``), each task hands over to :mod:`rechunk_p2p.local` instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from rechunk_p2p.local import LocalInput, LocalShuffle, assemble, gather_local
from rechunk_p2p.spec import RunId, ShuffleId, ShuffleSpec

if TYPE_CHECKING:
    from rechunk_p2p.cutting.joined import JoinedBlocks

__all__ = [
    "assemble",
    "barrier",
    "empty",
    "held",
    "join",
    "made",
    "transfer",
    "transfer_group",
    "unpack",
]


def _worker() -> Any:
    """The distributed worker running this task, or None under a local dask scheduler."""
    try:
        from distributed import get_worker

        return get_worker()
    except (ImportError, ValueError):
        return None


def _plugin(worker: Any) -> Any:
    from rechunk_p2p.worker.install import plugin_for_task

    return plugin_for_task(worker)


def transfer(
    data: np.ndarray | JoinedBlocks, shuffle_id: ShuffleId, flat: int
) -> RunId | LocalInput:
    """Cut input chunk ``flat`` into pieces and send each to the worker of its output chunk.

    Returns the run id, which the barrier checks for consistency (without distributed
    workers: the chunk itself, as a :class:`LocalInput`).
    """
    worker = _worker()
    if worker is None:
        return LocalInput(flat, np.asarray(data))
    return _plugin(worker).transfer_blocking(shuffle_id, flat, data)


def held(*chunks: Any) -> None:
    """Nothing: the task that gives each held chunk of the transfer groups of one worker a
    second dependent.

    dask's ordering walks, for every root of a graph, every output it reaches: through a
    barrier that is held chunks x output chunks steps (seconds for a million pairs). A graph
    input with more than one dependent is no root there, so with this task it is the root
    instead, one per worker. The worker's transfer tasks run after it: were they roots, each
    would be walked so. One such task per worker rather than per group spares a task and a
    round trip to the scheduler before each transfer.
    """


def transfer_group(
    shuffle_id: ShuffleId, flats: tuple[int, ...], *chunks: np.ndarray, after: None = None
) -> RunId | tuple[LocalInput, ...]:
    """Cut held input chunks ``flats`` (``chunks``, in that order), which sit on one worker,
    as :func:`transfer` cuts one; the oldest run id any was cut for (without distributed
    workers: the chunks, as :class:`LocalInput` s). ``after`` is the result of its
    worker's :func:`held` task."""
    worker = _worker()
    if worker is None:
        return tuple(LocalInput(f, np.asarray(c)) for f, c in zip(flats, chunks))
    return _plugin(worker).transfer_group_blocking(shuffle_id, flats, chunks)


def barrier(
    shuffle_id: ShuffleId, *run_ids: RunId | LocalInput, spec: ShuffleSpec | None = None
) -> RunId | LocalShuffle:
    """Wait until every worker delivered every piece of the run; return its run id.

    Without distributed workers, gather the transfers' :class:`LocalInput` s (``spec``
    describes the sub-shuffle) into a :class:`LocalShuffle` instead.
    """
    if any(isinstance(r, (LocalInput, tuple)) for r in run_ids):
        parts = [p for r in run_ids for p in (r if isinstance(r, tuple) else (r,))]
        return gather_local(spec, tuple(parts))
    return _plugin(_worker()).barrier_blocking(shuffle_id, run_ids)


def unpack(
    shuffle_id: ShuffleId, flat: int, run: RunId | LocalShuffle, key: object = None
) -> np.ndarray:
    """Assemble output chunk ``flat`` from the pieces buffered on this worker.

    ``run`` is the barrier's result: the run id, or a :class:`LocalShuffle` without
    distributed workers.
    """
    if isinstance(run, LocalShuffle):
        return run.output_blocking(flat)
    return _plugin(_worker()).unpack_blocking(shuffle_id, flat, run, key)


def join(grid: tuple[int, ...], *blocks: np.ndarray) -> np.ndarray:
    """Neighbouring input chunks, given in C order over ``grid``, as one block.

    For a partial without a shuffle, in a task of its own that made the chunks itself.
    """
    from rechunk_p2p.cutting.joined import join_blocks

    return join_blocks(grid, blocks)


def made(grid: tuple[int, ...], *blocks: np.ndarray) -> JoinedBlocks:
    """Neighbouring input chunks that a transfer task made, handed to its cut unjoined (the
    cut copies each to its place; see :mod:`rechunk_p2p.cutting.joined`)."""
    from rechunk_p2p.cutting.joined import JoinedBlocks

    return JoinedBlocks(grid, blocks)


def empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An output chunk without elements."""
    return np.empty(shape, dtype=dtype)
