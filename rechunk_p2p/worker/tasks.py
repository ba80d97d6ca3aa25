"""The functions the graph's tasks call.

Where it runs: task threads of the worker executing the task. Each reaches the worker's event
loop at most once (to fetch a run the worker does not know yet, or for the barrier).
"""

from __future__ import annotations

import numpy as np
from distributed import Reschedule, get_worker

from rechunk_p2p.errors import RechunkRunError, StaleRunError
from rechunk_p2p.worker.plugin import get_plugin


def transfer(data: np.ndarray, shuffle_id: str, flat: int) -> int:
    """Cut input chunk ``flat`` into shards and send each to the worker of its output chunk.

    Returns the run id, which the barrier checks for consistency.
    """
    run = get_plugin().get_run_blocking(shuffle_id)
    run.add_input_blocking(flat, data)
    return run.run_id


def barrier(shuffle_id: str, *run_ids: int) -> int:
    """Wait until every worker delivered every shard of the run; return its run id."""
    ids = set(run_ids)
    if len(ids) != 1:
        raise StaleRunError(
            f"The transfers of rechunk {shuffle_id} belong to different runs {sorted(ids)}; "
            "the rechunk was restarted while they ran"
        )
    (run_id,) = ids
    get_plugin().barrier_blocking(shuffle_id, run_id)
    return run_id


def unpack(shuffle_id: str, flat: int, run_id: int, key: object = None) -> np.ndarray:
    """Assemble output chunk ``flat`` from the shards buffered on this worker."""
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
