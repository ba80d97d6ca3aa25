"""Neighbouring input chunks that one transfer task made, cut without joining them first.

Where it runs: task threads (numpy copies only).

A transfer task that makes several neighbouring input chunks (see
:mod:`rechunk_p2p.planning.groups`) hands them over as :class:`JoinedBlocks`. A regular cut
copies each block straight to its place among the pieces (:func:`copy_cut_blocking`): one copy
of every byte, where joining the blocks into one array first and cutting that would be two.
Anything else reads the blocks joined (``np.asarray``).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from rechunk_p2p.errors import RechunkInputError


def join_blocks(grid: tuple[int, ...], blocks: tuple[np.ndarray, ...]) -> np.ndarray:
    """``blocks``, given in C order over ``grid``, as one array (a single block as it is).

    >>> join_blocks((2, 1), (np.zeros((1, 2)), np.ones((2, 2)))).tolist()
    [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
    """
    return blocks[0] if len(blocks) == 1 else np.asarray(JoinedBlocks(grid, blocks))


class JoinedBlocks:
    """**Immutable.** Neighbouring chunks, in C order over ``grid``, that form one block.

    Has the joined block's ``shape``, ``dtype``, ``size``, ``ndim`` and ``nbytes``;
    ``np.asarray`` joins them (a copy).
    """

    __slots__ = ("blocks", "dtype", "grid", "shape", "starts")

    def __init__(self, grid: tuple[int, ...], blocks: tuple[np.ndarray, ...]) -> None:
        if math.prod(grid) != len(blocks):
            raise RechunkInputError(
                f"A grid of {grid} holds {math.prod(grid)} blocks, not {len(blocks)}"
            )
        self.grid = tuple(grid)
        self.blocks = tuple(np.asarray(b) for b in blocks)
        steps = [math.prod(grid[a + 1 :]) for a in range(len(grid))]
        sizes = [[self.blocks[i * steps[a]].shape[a] for i in range(n)] for a, n in enumerate(grid)]
        self.starts = [(0, *itertools.accumulate(s)) for s in sizes]
        self.shape = tuple(int(s[-1]) for s in self.starts)
        self.dtype = np.result_type(*self.blocks)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def placed(self) -> list[tuple[np.ndarray, tuple[int, ...]]]:
        """Each block with its start in the joined block."""
        return [
            (block, tuple(int(s[i]) for s, i in zip(self.starts, index)))
            for block, index in zip(self.blocks, np.ndindex(*self.grid))
        ]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = np.empty(self.shape, dtype=self.dtype if dtype is None else dtype)
        for block, start in self.placed():
            out[tuple(slice(s, s + n) for s, n in zip(start, block.shape))] = block
        return out


def copy_cut_blocking(
    joined: JoinedBlocks, dest: np.ndarray, counts: list[int], lengths: list[int]
) -> bool:
    """Copy ``joined`` into ``dest``, the pieces of a regular cut laid out as
    ``(*counts, *lengths)`` (piece index per axis, then position within the piece), block by
    block. ``False``, having copied nothing, when some block neither lies within one piece
    nor covers whole pieces along an axis, or has a dtype other than the joined block's."""
    if any(block.dtype != joined.dtype for block in joined.blocks):
        return False
    plans = []
    for block, start in joined.placed():
        plan = _block_plan(block.shape, start, lengths)
        if plan is None:
            return False
        plans.append((block, plan))
    ndim = len(counts)
    order = [2 * a for a in range(ndim)] + [2 * a + 1 for a in range(ndim)]
    for block, (split, where) in plans:
        np.copyto(dest[where], block.reshape(split).transpose(order), casting="equiv")
    return True


def _block_plan(
    shape: tuple[int, ...], start: tuple[int, ...], lengths: list[int]
) -> tuple[list[int], tuple[slice, ...]] | None:
    """How a block at ``start`` splits into (pieces, positions) per axis, and where that
    lands in the cut's ``(*counts, *lengths)`` layout; ``None`` when it does not fit."""
    split: list[int] = []
    pieces: list[slice] = []
    within: list[slice] = []
    for n, s, length in zip(shape, start, lengths):
        piece, offset = divmod(s, length)
        if offset + n <= length:  # within one piece
            split += [1, n]
            pieces.append(slice(piece, piece + 1))
            within.append(slice(offset, offset + n))
        elif offset == 0 and n % length == 0:  # whole pieces
            split += [n // length, length]
            pieces.append(slice(piece, piece + n // length))
            within.append(slice(None))
        else:
            return None
    return split, (*pieces, *within)
