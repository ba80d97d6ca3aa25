"""Per-axis planning: how the old chunks of one axis map onto its new chunks.

Where it runs: pure (no asyncio, no distributed); used on the client, the scheduler and in
task threads.

Two chunkings of one axis, ``old`` and ``new``, are tuples of chunk lengths with equal sums.
Their *pieces* are the non-empty intersections of an old chunk with a new chunk; their *groups*
are the maximal runs of chunks between boundaries that the two chunkings share. Pieces never
cross a group, so groups along every axis combine into independent sub-shuffles (partials).
"""

from __future__ import annotations

import bisect
import itertools
from typing import NamedTuple

import numpy as np

from rechunk_p2p.errors import RechunkInputError

Chunks = tuple[tuple[int, ...], ...]
"""Chunk sizes per axis, as dask normalises them."""


def element_bytes(dtype: np.dtype) -> int:
    """Bytes one element counts for in plans: a pointer's 8 for objects, at least 1.

    >>> element_bytes(np.dtype("f4")), element_bytes(np.dtype("O")), element_bytes(np.dtype("V0"))
    (4, 8, 1)
    """
    return 8 if dtype.hasobject else max(dtype.itemsize, 1)


class AxisPiece(NamedTuple):
    """**Immutable.** The intersection of old chunk ``old`` with new chunk ``new`` on one axis.

    ``old_start:old_stop`` is the piece within the old chunk and ``new_start:new_stop`` the
    same elements within the new chunk.
    """

    old: int
    new: int
    old_start: int
    old_stop: int
    new_start: int
    new_stop: int

    @property
    def old_slice(self) -> slice:
        """The piece as a slice of the old chunk."""
        return slice(self.old_start, self.old_stop)

    @property
    def new_slice(self) -> slice:
        """The piece as a slice of the new chunk."""
        return slice(self.new_start, self.new_stop)


class AxisGroup(NamedTuple):
    """**Immutable.** Ranges of old and new chunk indices that exchange data only among
    themselves on one axis."""

    old: range
    new: range


def boundaries(chunks: tuple[int, ...]) -> tuple[int, ...]:
    """Return the start of every chunk followed by the total length.

    >>> boundaries((2, 3, 0, 1))
    (0, 2, 5, 5, 6)
    """
    return (0, *itertools.accumulate(chunks))


def axis_pieces(old: tuple[int, ...], new: tuple[int, ...]) -> tuple[AxisPiece, ...]:
    """Return every non-empty intersection of an old chunk with a new chunk, in order.

    >>> [tuple(p) for p in axis_pieces((4, 2), (3, 3))]
    [(0, 0, 0, 3, 0, 3), (0, 1, 3, 4, 0, 1), (1, 1, 0, 2, 1, 3)]
    >>> axis_pieces((0,), (0,))
    ()
    """
    _check_same_length(old, new)
    old_bounds, new_bounds = boundaries(old), boundaries(new)
    pieces = []
    i = j = 0
    while i < len(old) and j < len(new):
        lo = max(old_bounds[i], new_bounds[j])
        hi = min(old_bounds[i + 1], new_bounds[j + 1])
        if hi > lo:
            pieces.append(
                AxisPiece(
                    i,
                    j,
                    lo - old_bounds[i],
                    hi - old_bounds[i],
                    lo - new_bounds[j],
                    hi - new_bounds[j],
                )
            )
        if old_bounds[i + 1] <= new_bounds[j + 1]:
            i += 1
        else:
            j += 1
    return tuple(pieces)


def axis_groups(old: tuple[int, ...], new: tuple[int, ...]) -> tuple[AxisGroup, ...]:
    """Split one axis into independent groups at the boundaries both chunkings share.

    Zero-length chunks join the group that starts at their position (the last group at the
    end of the axis), so every chunk index belongs to exactly one group.

    >>> axis_groups((2, 2, 2), (4, 2))
    (AxisGroup(old=range(0, 2), new=range(0, 1)), AxisGroup(old=range(2, 3), new=range(1, 2)))
    >>> axis_groups((3,), (1, 2))
    (AxisGroup(old=range(0, 1), new=range(0, 2)),)
    """
    _check_same_length(old, new)
    old_bounds, new_bounds = boundaries(old), boundaries(new)
    total = old_bounds[-1]
    cuts = sorted(set(old_bounds[:-1]) & set(new_bounds[:-1]) - {total}) or [0]
    old_of = _members(old_bounds, cuts)
    new_of = _members(new_bounds, cuts)
    return tuple(AxisGroup(o, n) for o, n in zip(old_of, new_of))


def _members(bounds: tuple[int, ...], cuts: list[int]) -> list[range]:
    """Chunk index ranges per group: chunk k belongs to the last cut at or before its start."""
    groups = [bisect.bisect_right(cuts, start) - 1 for start in bounds[:-1]]
    ranges = []
    for g in range(len(cuts)):
        lo = bisect.bisect_left(groups, g)
        hi = bisect.bisect_right(groups, g)
        ranges.append(range(lo, hi))
    return ranges


def _check_same_length(old: tuple[int, ...], new: tuple[int, ...]) -> None:
    if sum(old) != sum(new):
        raise RechunkInputError(f"Chunks {old} and {new} do not cover the same length")
