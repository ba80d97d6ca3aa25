"""Merging small input chunks before the shuffle.

Where it runs: pure (no asyncio, no distributed).

Every shard costs the same bookkeeping whatever its size, so a rechunk from many thin chunks
to long ones (map to time series: one chunk per time step to the whole time axis) pays for
hundreds of thousands of tiny shards. Along each axis where the new chunks are longer than
the old ones, neighbouring input chunks are first merged by plain concatenation tasks, up to
the new chunk length and a byte limit on the merged block, so the shuffle moves a few large
shards instead. Merges never cross a boundary that the old and new chunks share, so the
independent sub-shuffles stay as small as they were.
"""

from __future__ import annotations

import math

from rechunk_p2p.planning.axes import Chunks, boundaries


def merge_inputs(
    old: Chunks, new: Chunks, itemsize: int, limit: int, shard_bytes: int | None = None
) -> Chunks:
    """The input chunks to shuffle from: ``old`` with neighbours merged where it pays.

    Parameters
    ----------
    old, new
        The chunks before and after the rechunk.
    itemsize
        Bytes per element.
    limit
        Largest merged block, in bytes (a block that is larger already is left alone).
    shard_bytes
        Merge only until a shard (a merged input's piece of one output chunk) reaches about
        this size; ``None``: up to the new chunk length.

    Examples
    --------
    >>> merge_inputs(((1,) * 6, (4,)), ((6,), (2, 2)), itemsize=1, limit=12)
    ((3, 3), (4,))
    >>> merge_inputs(((2, 2), (4,)), ((2, 2), (1, 1, 1, 1)), itemsize=8, limit=1000)
    ((2, 2), (4,))
    >>> merge_inputs(((1,) * 6, (4,)), ((6,), (2, 2)), itemsize=1, limit=12, shard_bytes=4)
    ((2, 2, 2), (4,))
    """
    merged = list(old)
    for axis in range(len(old)):
        longest_new = max(new[axis], default=0)
        if longest_new <= max(old[axis], default=0):
            continue
        rest = math.prod(max(c, default=0) for i, c in enumerate(merged) if i != axis)
        if rest == 0:
            continue
        item = max(itemsize, 1)
        target = min(longest_new, max(limit // (rest * item), 1))
        if shard_bytes is not None:
            shard_rest = math.prod(
                min(max(c, default=0), max(n, default=0))
                for i, (c, n) in enumerate(zip(merged, new))
                if i != axis
            )
            target = min(target, max(-(-shard_bytes // max(shard_rest * item, 1)), 1))
        if target > max(old[axis], default=0):
            merged[axis] = _group(old[axis], new[axis], target)
    return tuple(merged)


def _group(old: tuple[int, ...], new: tuple[int, ...], target: int) -> tuple[int, ...]:
    """Merge neighbouring chunks up to ``target`` elements, restarting at shared boundaries.

    >>> _group((1, 1, 1, 1, 1), (5,), 2)
    (2, 2, 1)
    >>> _group((1, 1, 1, 1), (2, 2), 4)
    (2, 2)
    """
    shared = set(boundaries(old)) & set(boundaries(new))
    groups: list[int] = []
    current = 0
    position = 0
    for chunk in old:
        if (groups or current) and (position in shared or current + chunk > target):
            groups.append(current)
            current = 0
        current += chunk
        position += chunk
    groups.append(current)
    return tuple(groups)
