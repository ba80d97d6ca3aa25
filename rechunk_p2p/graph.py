"""The task graph of a P2P rechunk, built from a plan.

Where it runs: the client, when the user calls :func:`rechunk_p2p.rechunk` (pure graph
construction; nothing is submitted).

Per sub-shuffle (partial) that needs one: a transfer task per input chunk
(``rechunk-p2p-transfer-<token>``), one barrier (``rechunk-p2p-barrier-<token>-<partial>``)
and an unpack task per output chunk (``rechunk-p2p-<token>``, the output array's own keys).
Partials that need no shuffle (one input chunk, one output chunk, or no elements) get one plain
task per output chunk under the same output name.
"""

from __future__ import annotations

from typing import Any

import dask.array as da
import numpy as np
from dask._task_spec import Task, TaskRef
from dask.highlevelgraph import HighLevelGraph

from rechunk_p2p.planning import Partial, RechunkPlan
from rechunk_p2p.spec import OUTPUT_PREFIX, TRANSFER_PREFIX, ShuffleSpec, barrier_key
from rechunk_p2p.worker import tasks


class BarrierTask(Task):
    """**Immutable.** The barrier of one sub-shuffle; carries its spec to the scheduler.

    The spec is also passed to ``func`` as ``spec=`` (the barrier needs it when the graph is
    computed without distributed workers). Fusion with neighbouring tasks is blocked: the
    scheduler finds the barrier by its key.
    """

    spec: ShuffleSpec
    __slots__ = ("spec",)

    def __init__(self, key: Any, func: Any, /, *args: Any, spec: ShuffleSpec, **kwargs: Any):
        self.spec = spec
        super().__init__(key, func, *args, spec=spec, **kwargs)

    @property
    def block_fusion(self) -> bool:
        return True


class UnpackTask(Task):
    """**Immutable.** The task that assembles one output chunk of a sub-shuffle.

    Fusion with neighbouring tasks is blocked: the scheduler pins the task to the worker that
    holds its shards by its key, which fusion (e.g. with a downstream ``getitem``) would rename.
    """

    __slots__ = ()

    @property
    def block_fusion(self) -> bool:
        return True


def build_rechunk(x: da.Array, plan: RechunkPlan, token: str, storage: str) -> da.Array:
    """The dask array that is ``x`` rechunked to ``plan.new_chunks`` through P2P shuffles."""
    name = OUTPUT_PREFIX + token
    dsk: dict[Any, Any] = {}
    buffer_estimate = plan.per_worker_buffer_bytes
    for partial in plan.partials:
        if partial.needs_shuffle:
            spec = ShuffleSpec(
                id=f"{token}-{'.'.join(map(str, partial.index))}",
                partial=partial,
                dtype=plan.dtype,
                storage=storage,
                output_name=name,
                buffer_estimate=buffer_estimate,
            )
            dsk.update(_shuffle_tasks(x.name, token, spec))
        else:
            dsk.update(_direct_tasks(x.name, name, partial, plan.dtype))
    # An array without elements gets empty chunks that read no input: then x is no dependency.
    reads_x = any(_reads(task, x.name) for task in dsk.values())
    graph = HighLevelGraph.from_collections(name, dsk, dependencies=[x] if reads_x else [])
    return da.Array(graph, name, plan.new_chunks, meta=x._meta)


def _reads(task: Task, input_name: str) -> bool:
    return any(isinstance(k, tuple) and k[0] == input_name for k in task.dependencies)


def _shuffle_tasks(input_name: str, token: str, spec: ShuffleSpec) -> dict[Any, Any]:
    dsk: dict[Any, Any] = {}
    partial = spec.partial
    transfer_name = TRANSFER_PREFIX + token
    transfers = []
    for flat, index in enumerate(partial.input_keys()):
        key = (transfer_name, *index)
        dsk[key] = Task(key, tasks.transfer, TaskRef((input_name, *index)), spec.id, flat)
        transfers.append(TaskRef(key))
    bkey = barrier_key(spec.id)
    dsk[bkey] = BarrierTask(bkey, tasks.barrier, spec.id, *transfers, spec=spec)
    for flat in range(partial.n_outputs):
        key = spec.output_key(flat)
        dsk[key] = UnpackTask(key, tasks.unpack, spec.id, flat, TaskRef(bkey), key)
    return dsk


def _direct_tasks(input_name: str, name: str, partial: Partial, dtype: np.dtype) -> dict[Any, Any]:
    dsk: dict[Any, Any] = {}
    for flat, index in enumerate(partial.output_keys()):
        key = (name, *index)
        shape = partial.output_shape(flat)
        pieces = list(partial.inputs_of_output(flat))
        if not pieces or 0 in shape:
            dsk[key] = Task(key, tasks.empty, shape, dtype)
            continue
        placements = tuple((in_sl, out_sl) for _, in_sl, out_sl in pieces)
        refs = [TaskRef((input_name, *glob)) for glob, _, _ in pieces]
        dsk[key] = Task(key, tasks.assemble, shape, dtype, placements, *refs)
    return dsk
