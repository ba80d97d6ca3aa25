"""The functions the graph's tasks call.

Where it runs: task threads of the worker executing the task. Each reaches the worker's event
loop at most once (to fetch a run the worker does not know yet, or for the barrier). The
client imports this module to build graphs; the worker stack is imported inside the functions,
on the worker, the first time a task runs there.

Computed without distributed workers (dask's synchronous or threaded scheduler, as in
``dask.array.utils.assert_eq``), a sub-shuffle runs locally instead: each transfer passes its
input chunk on whole (:class:`LocalInput`), the barrier gathers them (:class:`LocalShuffle`) and
each unpack cuts its output chunk from them, in the caller's thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from rechunk_p2p.errors import RechunkRunError
from rechunk_p2p.spec import RunId, ShuffleId, ShuffleSpec, widen

Placements = tuple[tuple[tuple[slice, ...], tuple[slice, ...]], ...]


@dataclass(frozen=True)
class LocalInput:
    """**Immutable.** Input chunk ``flat`` of a sub-shuffle computed without distributed workers."""

    flat: int
    data: Any


@dataclass(frozen=True)
class LocalShuffle:
    """**Immutable.** The input chunks of a sub-shuffle computed without distributed workers.

    ``inputs[i]`` is the input chunk with flat index ``i`` (``None`` for inputs culled away).
    """

    spec: ShuffleSpec
    inputs: tuple[Any, ...]

    def output_blocking(self, flat: int) -> np.ndarray:
        """Cut output chunk ``flat`` from the input chunks."""
        partial, axes = self.spec.partial, self.spec.unknown_axes
        pieces = list(partial.inputs_of_output(flat))
        placements = tuple((widen(i, axes), widen(o, axes)) for _, i, o in pieces)
        data = [self.inputs[partial.flat_input(glob)] for glob, _, _ in pieces]
        return assemble(
            partial.output_shape(flat), self.spec.dtype, placements, *data, unknown=axes
        )


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


def _gather_local(spec: ShuffleSpec | None, parts: tuple[Any, ...]) -> LocalShuffle:
    if spec is None or not all(isinstance(p, LocalInput) for p in parts):
        raise RechunkRunError(
            f"The barrier of rechunk {spec.shuffle_id if spec else '?'} got a mix of local "
            "inputs and run ids: compute the whole rechunk either on a distributed cluster or "
            "without one"
        )
    inputs: list[Any] = [None] * spec.partial.n_inputs
    for part in parts:
        inputs[part.flat] = part.data
    return LocalShuffle(spec, tuple(inputs))


def transfer(data: np.ndarray, shuffle_id: ShuffleId, flat: int) -> int | LocalInput:
    """Cut input chunk ``flat`` into shards and send each to the worker of its output chunk.

    Returns the run id, which the barrier checks for consistency (without distributed
    workers: the chunk itself, as a :class:`LocalInput`).
    """
    worker = _worker()
    if worker is None:
        return LocalInput(flat, data)
    return _plugin(worker).transfer_blocking(shuffle_id, flat, data)


def barrier(
    shuffle_id: ShuffleId, *run_ids: int | LocalInput, spec: ShuffleSpec | None = None
) -> int | LocalShuffle:
    """Wait until every worker delivered every shard of the run; return its run id.

    Without distributed workers, gather the transfers' :class:`LocalInput` s (``spec``
    describes the sub-shuffle) into a :class:`LocalShuffle` instead.
    """
    if any(isinstance(r, LocalInput) for r in run_ids):
        return _gather_local(spec, run_ids)
    return _plugin(_worker()).barrier_blocking(shuffle_id, run_ids)


def unpack(
    shuffle_id: ShuffleId, flat: int, run_id: RunId | LocalShuffle, key: object = None
) -> np.ndarray:
    """Assemble output chunk ``flat`` from the shards buffered on this worker.

    ``run_id`` is the barrier's result: a :class:`LocalShuffle` without distributed workers.
    """
    if isinstance(run_id, LocalShuffle):
        return run_id.output_blocking(flat)
    return _plugin(_worker()).unpack_blocking(shuffle_id, flat, run_id, key)


def assemble(
    shape: tuple[int, ...],
    dtype: np.dtype,
    placements: Placements,
    *inputs: np.ndarray,
    unknown: tuple[int, ...] = (),
) -> np.ndarray:
    """Build an output chunk directly from its input chunks (no shuffle needed).

    ``placements[i]`` is (slices of input ``i``, slices of the output) for every input.
    Along ``unknown`` axes (unknown chunk sizes) the output takes the inputs' extent.
    """
    if len(inputs) != len(placements):
        raise RechunkRunError(f"Got {len(inputs)} inputs for {len(placements)} placements")
    if unknown and inputs:
        first = np.asarray(inputs[0])
        shape = tuple(first.shape[a] if a in unknown else n for a, n in enumerate(shape))
    if len(inputs) == 1:
        in_slices, _ = placements[0]
        piece = np.asarray(inputs[0])[in_slices]
        if piece.shape == shape:
            return np.array(piece, dtype=dtype, order="C")
    out = np.empty(shape, dtype=dtype)
    for data, (in_slices, out_slices) in zip(inputs, placements):
        out[out_slices] = np.asarray(data)[in_slices]
    return out


def empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An output chunk without elements."""
    return np.empty(shape, dtype=dtype)
