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
from dask.core import flatten


@dataclass(frozen=True)
class HeldChunks:
    """**Immutable.** Where each chunk of a held input sat when the graph was built.

    ``where`` maps a chunk's index to the worker holding it (chunks without a holder are
    left out); ``threads`` is each worker's thread count.
    """

    where: dict[tuple[int, ...], str]
    threads: dict[str, int]


def find_held(x: da.Array) -> HeldChunks | None:
    """Where ``x``'s chunks sit, when every one is a future of a synchronous client (a
    persisted array); ``None`` otherwise, or when the scheduler cannot say."""
    try:
        from distributed import Future
    except ImportError:  # pragma: no cover (distributed is a dependency)
        return None
    keys = list(flatten(x.__dask_keys__()))
    graph = x.__dask_graph__()
    futures = [graph.get(k) for k in keys] if keys else []
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
    where = {tuple(k[1:]): holders[0] for k, holders in who.items() if holders}
    return HeldChunks(where, dict(threads))


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
