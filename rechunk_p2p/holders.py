"""Where a held input's chunks sit, so that one transfer task cuts several of them.

Where it runs: the client, while a rechunk's graph is built (one request to the scheduler for
a persisted input; nothing else is computed or submitted); :func:`held_transfers` is pure.

A transfer task costs distributed about a millisecond (the scheduler's transitions and
messages, the worker's bookkeeping around the task thread), whatever it cuts. An input held in
worker memory in many small chunks (persisted thin rows, say) paid that per chunk, more than
cutting them. Chunks that already sit on one worker can be cut by one task there: its
dependencies are all local, so nothing travels before the shuffle, and the scheduler and the
workers handle a task where they handled dozens. Where a chunk is when the task runs is
distributed's business: one that moved (a worker left, data was rebalanced) is fetched as any
dependency is, and the result is the same.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import dask.array as da
from dask._task_spec import Task
from dask.blockwise import optimize_blockwise
from dask.core import flatten
from dask.highlevelgraph import HighLevelGraph

from rechunk_p2p.planning import Partial
from rechunk_p2p.sources import MAX_SHARED_KEYS


@dataclass(frozen=True)
class HeldChunks:
    """**Immutable.** Where each chunk of a held input sat when the graph was built.

    ``where`` maps a chunk's index to the worker holding it (or holding the held chunk it is
    computed from; chunks without a holder are left out); ``threads`` is each worker's
    thread count. ``tasks``, for an input derived from held chunks, maps a chunk's index to
    the task that computes it (run inside the transfer); ``None`` for held chunks.
    """

    where: dict[tuple[int, ...], str]
    threads: dict[str, int]
    tasks: dict[tuple[int, ...], Task] | None = None


def find_held(x: da.Array) -> HeldChunks | None:
    """Where ``x``'s chunks sit, when every one is a future of a synchronous client (a
    persisted array), or is computed by a task from one such future and a few values all
    chunks share (``x - x.mean(axis=0)`` on a persisted ``x``, a slice of it); ``None``
    otherwise, or when the scheduler cannot say."""
    try:
        from distributed import Future
    except ImportError:  # pragma: no cover (distributed is a dependency)
        return None
    keys = list(flatten(x.__dask_keys__()))
    graph = x.__dask_graph__()
    if not keys or not isinstance(graph, HighLevelGraph):
        return None
    made = None
    futures = [graph.get(k) for k in keys]
    if not all(isinstance(f, Future) for f in futures):
        made = _derived_tasks(x, graph, keys, Future)
        if made is None:
            return None
        futures = [graph.get(next(iter(own))) for own, _ in made.values()]
    client: Any = futures[0].client
    if getattr(client, "asynchronous", True) or getattr(client, "status", None) != "running":
        return None  # (an asynchronous client cannot answer while the graph is built)
    try:
        who = client.who_has(futures)
        threads = client.nthreads()
    except Exception:  # the cluster cannot say: one transfer a chunk, as without it
        return None
    holder = {f.key: who.get(f.key) for f in futures}
    indices = [tuple(k[1:]) for k in keys]
    where = {i: holder[f.key][0] for i, f in zip(indices, futures) if holder[f.key]}
    tasks = None if made is None else {tuple(k[1:]): made[k][1] for k in keys}
    return HeldChunks(where, dict(threads), tasks)


def _derived_tasks(
    x: da.Array, graph: HighLevelGraph, keys: list, future_type: type
) -> dict[Any, tuple[set, Task]] | None:
    """Chunk key -> (its own held key, the task computing it) when every chunk of ``x`` is
    computed by a fusable task from exactly one future of its own and at most
    :data:`MAX_SHARED_KEYS` keys every chunk reads; ``None`` otherwise."""
    if any(layer.annotations for layer in graph.layers.values()):
        return None
    fused = optimize_blockwise(graph, keys=keys)
    layer = fused.layers.get(x.name)
    if layer is None:
        return None
    nodes = [layer.get(k) for k in keys]
    if not all(isinstance(n, Task) and not n.block_fusion for n in nodes):
        return None
    shared = set.intersection(*(set(n.dependencies) for n in nodes))
    if len(shared) > MAX_SHARED_KEYS:
        return None
    out = {}
    for key, node in zip(keys, nodes):
        own = set(node.dependencies) - shared
        if len(own) != 1 or not isinstance(graph.get(next(iter(own))), future_type):
            return None
        out[key] = (own, node)
    return out


def held_transfers(
    flats: Sequence[int],
    workers: Sequence[str | None],
    per_task: int,
    threads: dict[str, int],
) -> tuple[tuple[int, ...], ...]:
    """The inputs ``flats`` (held by ``workers``, ``None`` where unknown) in transfer
    tasks: those of one worker in order, at most ``per_task`` a task but at least two tasks
    per thread of their worker (so every thread has work), an input of unknown place alone.
    Tasks are ordered by their first input.

    >>> held_transfers([0, 1, 2, 3, 4, 5], ["a", "b", "a", "a", None, "a"], 2, {"a": 1})
    ((0, 2), (1,), (3, 5), (4,))
    >>> held_transfers(range(8), ["a"] * 8, 8, {"a": 1})
    ((0, 1, 2, 3), (4, 5, 6, 7))
    """
    by_worker: dict[str, list[int]] = {}
    alone = []
    for flat, worker in zip(flats, workers):
        if worker is None:
            alone.append((flat,))
        else:
            by_worker.setdefault(worker, []).append(flat)
    groups = list(alone)
    for worker, members in by_worker.items():
        n = len(members)
        count = min(n, max(math.ceil(n / max(per_task, 1)), 2 * threads.get(worker, 1)))
        groups += [tuple(members[k * n // count : (k + 1) * n // count]) for k in range(count)]
    return tuple(sorted(groups))


def partial_transfers(
    partial: Partial,
    inputs: Sequence[int],
    held: HeldChunks,
    group_bytes: int,
    chunk_bytes: int,
) -> tuple[tuple[int, ...], ...]:
    """:func:`held_transfers` of ``partial``'s ``inputs`` (flat indices), placed as
    ``held`` says, with chunks of up to ``chunk_bytes`` and up to ``group_bytes`` a task."""
    where = [held.where.get(partial.input_index(i)) for i in inputs]
    per_task = group_bytes // max(chunk_bytes, 1)
    return held_transfers(inputs, where, per_task, held.threads)
