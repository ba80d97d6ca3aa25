"""The functions the graph's tasks call.

Where it runs: task threads of the worker executing the task. Each reaches the worker's event
loop at most once (to fetch a run the worker does not know yet, or for the barrier).

Computed without distributed workers (dask's synchronous or threaded scheduler, as in
``dask.array.utils.assert_eq``), a sub-shuffle runs locally instead: each transfer passes its
input chunk on whole (:class:`LocalInput`), the barrier gathers them (:class:`LocalShuffle`) and
each unpack cuts its output chunk from them, in the caller's thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from distributed import Reschedule, get_worker

from rechunk_p2p.errors import RechunkRunError, StaleRunError
from rechunk_p2p.spec import ShuffleSpec
from rechunk_p2p.worker.plugin import get_plugin


@dataclass(frozen=True)
class LocalInput:
    """**Immutable.** Input chunk ``flat`` of a sub-shuffle computed without distributed workers."""

    flat: int
    data: Any


@dataclass(frozen=True)
class LocalShuffle:
    """**Immutable.** Every input chunk of a sub-shuffle computed without distributed workers.

    ``inputs[i]`` is the input chunk with flat index ``i``.
    """

    spec: ShuffleSpec
    inputs: tuple[Any, ...]

    def output_blocking(self, flat: int) -> np.ndarray:
        """Cut output chunk ``flat`` from the input chunks."""
        partial = self.spec.partial
        pieces = list(partial.inputs_of_output(flat))
        placements = tuple((in_sl, out_sl) for _, in_sl, out_sl in pieces)
        data = [self.inputs[partial.flat_input(glob)] for glob, _, _ in pieces]
        return assemble(partial.output_shape(flat), self.spec.dtype, placements, *data)


def _on_worker() -> bool:
    """Whether this task runs on a distributed worker (not under a local dask scheduler)."""
    try:
        get_worker()
    except ValueError:
        return False
    return True


def _gather_local(spec: ShuffleSpec | None, parts: tuple[Any, ...]) -> LocalShuffle:
    if spec is None or not all(isinstance(p, LocalInput) for p in parts):
        raise RechunkRunError(
            f"The barrier of rechunk {spec.id if spec else '?'} got a mix of local inputs and "
            "run ids: compute the whole rechunk either on a distributed cluster or without one"
        )
    inputs: list[Any] = [None] * spec.partial.n_inputs
    for part in parts:
        inputs[part.flat] = part.data
    return LocalShuffle(spec, tuple(inputs))


def transfer(data: np.ndarray, shuffle_id: str, flat: int) -> int | LocalInput:
    """Cut input chunk ``flat`` into shards and send each to the worker of its output chunk.

    Returns the run id, which the barrier checks for consistency (without distributed
    workers: the chunk itself, as a :class:`LocalInput`).
    """
    if not _on_worker():
        return LocalInput(flat, data)
    run = get_plugin().get_run_blocking(shuffle_id)
    run.add_input_blocking(flat, data)
    return run.run_id


def barrier(
    shuffle_id: str, *run_ids: int | LocalInput, spec: ShuffleSpec | None = None
) -> int | LocalShuffle:
    """Wait until every worker delivered every shard of the run; return its run id.

    Without distributed workers, gather the transfers' :class:`LocalInput` s (``spec``
    describes the sub-shuffle) into a :class:`LocalShuffle` instead.
    """
    if any(isinstance(r, LocalInput) for r in run_ids):
        return _gather_local(spec, run_ids)
    ids = set(run_ids)
    if len(ids) != 1:
        raise StaleRunError(
            f"The transfers of rechunk {shuffle_id} belong to different runs {sorted(ids)}; "
            "the rechunk was restarted while they ran"
        )
    (run_id,) = ids
    get_plugin().barrier_blocking(shuffle_id, run_id)
    return run_id


def unpack(
    shuffle_id: str, flat: int, run_id: int | LocalShuffle, key: object = None
) -> np.ndarray:
    """Assemble output chunk ``flat`` from the shards buffered on this worker.

    ``run_id`` is the barrier's result: a :class:`LocalShuffle` without distributed workers.
    """
    if isinstance(run_id, LocalShuffle):
        return run_id.output_blocking(flat)
    plugin = get_plugin()
    run = plugin.get_run_blocking(shuffle_id)
    if run.run_id != run_id:
        raise StaleRunError(
            f"Output {flat} of rechunk {shuffle_id} expected run {run_id}, "
            f"but this worker runs run {run.run_id}"
        )
    owner = run.run_spec.worker_for(flat)
    if owner != get_worker().address:
        plugin.restrict_blocking(shuffle_id, run_id, key, owner)
        raise Reschedule()
    return run.get_output_blocking(flat)


def assemble(
    shape: tuple[int, ...],
    dtype: np.dtype,
    placements: tuple[tuple[tuple[slice, ...], tuple[slice, ...]], ...],
    *inputs: np.ndarray,
) -> np.ndarray:
    """Build an output chunk directly from its input chunks (no shuffle needed).

    ``placements[i]`` is (slices of input ``i``, slices of the output) for every input.
    """
    if len(inputs) != len(placements):
        raise RechunkRunError(f"Got {len(inputs)} inputs for {len(placements)} placements")
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
