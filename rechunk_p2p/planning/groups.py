"""Which neighbouring input chunks one transfer task makes and cuts together.

Where it runs: pure (no asyncio, no distributed).

When an array's chunks are computed from nothing or from a few shared values (generated data,
a zarr store's array), its transfer tasks can make them themselves: then a transfer task may
make several neighbouring chunks, join them and cut the joined block, so that the rechunk has
fewer tasks and fewer, larger pieces, while still no chunk travels before the shuffle.

Chunks are joined only along an axis where an output chunk spans several input chunks, and a
joined block never holds an output chunk boundary there: the boundaries that the input and
output chunkings share stay as they are, and with them the independent sub-shuffles.
"""

from __future__ import annotations

import bisect
import itertools
import math

from rechunk_p2p.planning.axes import Chunks, boundaries

Groups = tuple[tuple[int, ...], ...]
"""Per axis, how many consecutive input chunks each group holds, in order."""

#: Joining stops short of leaving a rechunk fewer transfer tasks than this (or than its input
#: chunks, if fewer): the input phase of a run stays spread over that many task threads.
MIN_TRANSFERS = 64


def transfer_groups(
    old: Chunks,
    new: Chunks,
    itemsize: int,
    limit_bytes: int,
    fixed_axes: tuple[int, ...] = (),
    min_transfers: int | None = None,
) -> Groups | None:
    """The groups of input chunks that each transfer task joins, up to ``limit_bytes``.

    ``None`` when no two chunks would be joined (a chunk is already larger than half the
    limit, no output chunk spans two input chunks along any axis but ``fixed_axes``, or the
    groups would be fewer than ``min_transfers``, default :data:`MIN_TRANSFERS`, and than
    the chunks). Along an axis, the chunks wholly inside one output chunk are split into two
    or more runs of nearly equal length; a chunk that crosses an output chunk boundary, or
    has no elements, stays alone. Where too few groups are left, the factor of the axis
    joined last falls to the largest that leaves enough (before, it was halved until enough
    were: 63 one-row chunks went 63, 31, 15, 7, 3, 1 and were never joined in pairs).

    >>> transfer_groups(((1,) * 8, (4,)), ((8,), (2, 2)), 4, 64, min_transfers=2)
    ((4, 4), (1,))
    >>> transfer_groups(((1,) * 8, (4,)), ((8,), (2, 2)), 4, 64, min_transfers=4)
    ((2, 2, 2, 2), (1,))
    >>> transfer_groups(((2, 2, 2), (4,)), ((3, 3), (4,)), itemsize=1, limit_bytes=64) is None
    True
    """
    runs = [_runs_inside(o, n) for o, n in zip(old, new)]
    longest = [max((len(r) for r in axis), default=0) for axis in runs]
    nbytes = math.prod(max(c, default=0) for c in old) * itemsize
    factors = [1] * len(old)
    order = sorted(range(len(old)), key=lambda a: -longest[a])
    for axis in order:
        if axis in fixed_axes or longest[axis] < 2 or nbytes == 0:
            continue
        factors[axis] = max(1, min(longest[axis], limit_bytes // nbytes))
        nbytes *= factors[axis]
    if min_transfers is None:
        min_transfers = MIN_TRANSFERS
    fewest = min(min_transfers, math.prod(len(o) for o in old))
    while True:
        groups = tuple(_split(axis, f) for axis, f in zip(runs, factors))
        if all(n == 1 for axis in groups for n in axis):
            return None
        if math.prod(len(g) for g in groups) >= fewest:
            return groups
        # too few transfers: the largest smaller factor of the last axis joined that gives
        # enough (1 if none does: then the axis joined before it gives way)
        axis = next(a for a in reversed(order) if factors[a] > 1)
        others = math.prod(len(g) for a, g in enumerate(groups) if a != axis)
        factors[axis] = _largest_factor(runs[axis], factors[axis] - 1, -(-fewest // others))


def group_members(groups: tuple[int, ...]) -> tuple[range, ...]:
    """The input chunk indices of each group along one axis.

    >>> group_members((2, 1, 3))
    (range(0, 2), range(2, 3), range(3, 6))
    """
    starts = boundaries(groups)
    return tuple(range(a, b) for a, b in itertools.pairwise(starts))


def grouped_chunks(old: tuple[int, ...], groups: tuple[int, ...]) -> tuple[int, ...]:
    """The sizes of the joined chunks along one axis.

    >>> grouped_chunks((1, 2, 3, 4), (2, 2))
    (3, 7)
    """
    return tuple(sum(old[r.start : r.stop]) for r in group_members(groups))


def _runs_inside(old: tuple[int, ...], new: tuple[int, ...]) -> list[list[int]]:
    """The input chunks along one axis as runs: chunks wholly inside the same output chunk
    share a run; any other chunk is a run of its own. Every index is in one run, in order."""
    new_bounds = boundaries(new)
    runs: list[list[int]] = []
    last = None  # the output chunk that the current run lies in
    for i, (start, size) in enumerate(zip(boundaries(old), old)):
        j = bisect.bisect_right(new_bounds, start) - 1
        inside = size > 0 and j + 1 < len(new_bounds) and start + size <= new_bounds[j + 1]
        if inside and last == j:
            runs[-1].append(i)
        else:
            runs.append([i])
            last = j if inside else None
    return runs


def _largest_factor(runs: list[list[int]], most: int, groups: int) -> int:
    """The largest factor up to ``most`` that splits ``runs`` into at least ``groups`` groups
    (1 if none does): the count falls as the factor grows, so a bisection finds it.

    >>> _largest_factor([list(range(63))], 62, 32)  # 63 chunks in 32 groups: pairs
    2
    """
    lo, hi = 1, max(most, 1)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(_split(runs, mid)) >= groups:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _split(runs: list[list[int]], factor: int) -> tuple[int, ...]:
    """Group sizes along one axis: each run cut into the fewest nearly equal groups of at most
    ``factor`` chunks, and into two at least: chunks that a shuffle exchanges stay shuffled
    (joined whole, a run would make output chunks that are slices of one block, built by
    plain tasks that fetch the block through distributed)."""
    sizes: list[int] = []
    for run in runs:
        n = max(-(-len(run) // factor), min(len(run), 2))
        base, extra = divmod(len(run), n)
        sizes.extend(base + (k < extra) for k in range(n))
    return tuple(sizes)
