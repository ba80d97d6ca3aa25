"""Input chunks that transfer tasks can make themselves.

Where it runs: the client, while a rechunk's graph is built (pure graph inspection; nothing is
computed or submitted).

dask fuses the task that makes an input chunk into its transfer task when nothing else reads
the chunk, so a chunk made from nothing (generated data) or from a few shared values (the array
object of a zarr store) is made where it is cut and never travels. The engine can then go one
step further: a transfer task may make several neighbouring chunks and cut them together (see
:mod:`rechunk_p2p.planning.groups`). :func:`find_sources` says whether an array's chunks are
made that way and hands over the tasks that make them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import dask.array as da
from dask._task_spec import Task
from dask.blockwise import Blockwise, optimize_blockwise
from dask.core import flatten
from dask.highlevelgraph import HighLevelGraph, Layer, MaterializedLayer

from rechunk_p2p.errors import RechunkTypeError

#: At most this many shared values (keys outside the chunks' own tasks) may feed the chunks.
MAX_SHARED_KEYS = 8


@dataclass(frozen=True)
class InputSources:
    """**Immutable.** How an array's chunks are made, for transfer tasks to make them.

    ``layer`` maps each chunk key of the array to the task that makes it (dask's blockwise
    fusion already applied; materialised on first use). ``shared`` are the graph layers of
    the values those tasks read: each has a few keys and no dependencies of its own.
    """

    layer: Layer
    shared: Mapping[str, Layer]

    def task(self, key: Any) -> Task:
        """The task that makes chunk ``key`` (a :class:`~dask._task_spec.Task`)."""
        node = self.layer[key]
        if not isinstance(node, Task):  # checked for materialised layers by find_sources
            raise RechunkTypeError(
                f"Input chunk {key!r} is not made by a task but given as {type(node).__name__}"
            )
        return node


def find_sources(x: da.Array) -> InputSources | None:
    """The tasks that make ``x``'s chunks, when each is made from nothing or from a few shared
    values; ``None`` when a chunk is held data, a future, made from other chunks, annotated,
    or made by a task that must not be fused (such as another rechunk's output)."""
    graph = x.__dask_graph__()
    if not isinstance(graph, HighLevelGraph):
        return None
    if any(layer.annotations for layer in graph.layers.values()):
        return None
    keys = list(flatten(x.__dask_keys__()))
    fused = optimize_blockwise(graph, keys=keys)
    layer = fused.layers.get(x.name)
    if layer is None:
        return None
    shared = {name: fused.layers[name] for name in fused.dependencies.get(x.name, ())}
    if not _small_roots(fused, shared):
        return None
    if isinstance(layer, Blockwise):
        return InputSources(layer, shared)
    if isinstance(layer, MaterializedLayer) and _made_by_tasks(layer, keys, shared):
        return InputSources(layer, shared)
    return None


def _small_roots(graph: HighLevelGraph, layers: Mapping[str, Layer]) -> bool:
    """Whether ``layers`` are a few values that depend on nothing (counted only for layers
    that are already materialised, so that no other layer is built here)."""
    if any(graph.dependencies.get(name) for name in layers):
        return False
    if not all(isinstance(layer, MaterializedLayer) for layer in layers.values()):
        return False
    return sum(len(layer) for layer in layers.values()) <= MAX_SHARED_KEYS


def _made_by_tasks(layer: Layer, keys: list, shared: Mapping[str, Layer]) -> bool:
    """Whether each of ``keys`` is a fusable task of ``layer`` reading only ``shared`` keys."""
    allowed = {key for shared_layer in shared.values() for key in shared_layer}
    for key in keys:
        node = layer.get(key)
        if not isinstance(node, Task) or node.block_fusion:
            return False
        if not node.dependencies <= allowed:
            return False
    return True
