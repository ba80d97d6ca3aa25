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
import numpy as np
from dask._task_spec import Task
from dask.blockwise import optimize_blockwise
from dask.core import flatten
from dask.highlevelgraph import HighLevelGraph

from rechunk_p2p.planning import Partial
from rechunk_p2p.planning.axes import Chunks
from rechunk_p2p.planning.groups import MIN_TRANSFERS, Groups, group_members, transfer_groups
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

    def joined(self, groups: Groups) -> HeldChunks:
        """Where each group of chunks (``groups``, as :func:`held_groups` makes them) sits:
        its first chunk's worker, keyed by the group's index. Its ``tasks`` are ``None``."""
        members = [group_members(g) for g in groups]
        where = {}
        for index in np.ndindex(*(len(m) for m in members)):
            first = tuple(m[i].start for m, i in zip(members, index))
            if first in self.where:
                where[tuple(map(int, index))] = self.where[first]
        return HeldChunks(where, self.threads)


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
    futures: list[Any] = [graph.get(k) for k in keys]
    if not all(isinstance(f, Future) for f in futures):
        made = _derived_tasks(x, graph, keys, Future)
        if made is None:
            return None
        futures = [graph.get(next(iter(own))) for own, _ in made.values()]
    if not futures or not all(isinstance(f, Future) for f in futures):
        return None
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
    groups: list[tuple[int, ...]] = list(alone)
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


def group_holders(partial: Partial, groups: Sequence[Sequence[int]], held: HeldChunks) -> list[Any]:
    """Where each transfer group of ``partial`` (flat inputs, as :func:`partial_transfers`
    makes them) sits: its first chunk's worker, or ``("alone", g)`` for group ``g`` whose
    place is unknown. The graph gives each of these one held task (:func:`rechunk_p2p.tasks.
    held`)."""
    return [
        held.where.get(partial.input_index(flats[0]), ("alone", g))
        for g, flats in enumerate(groups)
    ]


def held_groups(
    old: Chunks,
    new: Chunks,
    itemsize: int,
    limit_bytes: int,
    held: HeldChunks,
    min_transfers: int = MIN_TRANSFERS,
) -> Groups | None:
    """The groups of neighbouring held chunks that each transfer task joins and cuts as one
    block: :func:`~rechunk_p2p.planning.groups.transfer_groups`, further split along each
    axis wherever two neighbouring chunks sit on different workers (or one sits nowhere
    known), so that a group's chunks are all on one worker. At least ``min_transfers``
    groups, and two per thread of the cluster. ``None`` when no two chunks would be joined.

    Cutting a joined block makes one piece per output chunk where each chunk made one: a
    million pieces of a few bytes (persisted one-row chunks into column strips) become a few
    thousand.

    >>> where = {(i, 0): "ab"[i // 4] for i in range(8)}
    >>> held_groups(((1,) * 8, (4,)), ((8,), (2, 2)), 8, 128, HeldChunks(where, {"a": 1}), 2)
    ((4, 4), (1,))
    >>> where[(1, 0)] = "b"
    >>> held_groups(((1,) * 8, (4,)), ((8,), (2, 2)), 8, 128, HeldChunks(where, {"a": 1}), 2)
    ((1, 1, 2, 4), (1,))
    """
    fewest = max(min_transfers, 2 * sum(held.threads.values()))
    base = transfer_groups(old, new, itemsize, limit_bytes, min_transfers=fewest)
    if base is None:
        return None
    names = {w: i for i, w in enumerate(sorted(set(held.where.values())))}
    holders = np.full(tuple(len(c) for c in old), -1, dtype=np.int64)
    for index, worker in held.where.items():
        holders[index] = names[worker]
    groups = []
    for axis, sizes in enumerate(base):
        if len(sizes) == len(old[axis]):
            groups.append(sizes)
            continue
        along = np.moveaxis(holders, axis, 0).reshape(len(old[axis]), -1)
        moves = (along[1:] != along[:-1]) | (along[1:] < 0) | (along[:-1] < 0)
        cuts = set((1 + np.flatnonzero(moves.any(axis=1))).tolist())
        groups.append(_cut_at(sizes, cuts))
    if all(n == 1 for axis in groups for n in axis):
        return None
    return tuple(groups)


def _cut_at(sizes: tuple[int, ...], cuts: set[int]) -> tuple[int, ...]:
    """Group sizes along one axis, each group also cut before every chunk index in ``cuts``.

    >>> _cut_at((4, 4), {2, 3, 4})
    (2, 1, 1, 4)
    """
    out: list[int] = []
    for members in group_members(sizes):
        start = members.start
        for i in members[1:]:
            if i in cuts:
                out.append(i - start)
                start = i
        out.append(members.stop - start)
    return tuple(out)
