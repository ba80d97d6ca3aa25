"""Chunks a transfer made, cut without joining them first (rechunk_p2p.cutting.joined)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rechunk_p2p.cutting.joined import JoinedBlocks, copy_cut_blocking, join_blocks
from rechunk_p2p.cutting.regular import cut_regular_blocking
from rechunk_p2p.errors import RechunkInputError


@st.composite
def joined_cuts(draw):
    """Blocks in a grid, and regular pieces of the joined block, per axis."""
    ndim = draw(st.integers(1, 3))
    grid, sizes, pieces = [], [], []
    for _ in range(ndim):
        length = draw(st.integers(1, 4))
        n_pieces = draw(st.integers(1, 4))
        total = length * n_pieces
        # block boundaries: some piece boundaries, some cuts of their own
        cuts = draw(st.lists(st.integers(1, total - 1), max_size=3)) if total > 1 else []
        bounds = sorted({0, total, *cuts})
        sizes.append([b - a for a, b in itertools.pairwise(bounds)])
        grid.append(len(bounds) - 1)
        pieces.append([slice(i * length, (i + 1) * length) for i in range(n_pieces)])
    blocks = []
    counter = itertools.count()
    for index in np.ndindex(*grid):
        shape = tuple(sizes[a][i] for a, i in enumerate(index))
        start = next(counter) * 1000
        blocks.append(np.arange(start, start + int(np.prod(shape))).reshape(shape))
    return tuple(grid), tuple(blocks), pieces


@settings(max_examples=200, deadline=None)
@given(joined_cuts())
def test_a_cut_of_unjoined_blocks_equals_the_cut_of_the_joined_block(case):
    grid, blocks, pieces = case
    joined = JoinedBlocks(grid, blocks)
    whole = np.asarray(joined)
    assert whole.shape == joined.shape and joined.nbytes == whole.nbytes
    expected = cut_regular_blocking(whole, pieces)
    buffer = np.full(whole.nbytes + 8, 0xFF, dtype=np.uint8)
    got = cut_regular_blocking(joined, pieces, out=buffer)
    np.testing.assert_array_equal(got, expected)


def test_blocks_that_fit_the_pieces_are_copied_one_by_one():
    blocks = tuple(np.full((1, 4), i) for i in range(4))  # four rows, pieces of 2 x 2
    joined = JoinedBlocks((4, 1), blocks)
    dest = np.zeros((2, 2, 2, 2), dtype=int)
    assert copy_cut_blocking(joined, dest, [2, 2], [2, 2])
    np.testing.assert_array_equal(dest.reshape(-1, 2, 2)[0], [[0, 0], [1, 1]])
    # a block across a piece boundary does not fit: nothing is copied
    crossing = JoinedBlocks((2, 1), (np.ones((1, 4)), np.ones((3, 4))))
    untouched = np.zeros((2, 2, 2, 2))
    assert not copy_cut_blocking(crossing, untouched, [2, 2], [2, 2])
    assert not untouched.any()
    # mixed dtypes are joined first (numpy's promotion), not copied block by block
    mixed = JoinedBlocks((2, 1), (np.ones((2, 4), "i4"), np.ones((2, 4), "f8")))
    assert mixed.dtype == np.float64
    assert not copy_cut_blocking(mixed, np.zeros((2, 2, 2, 2)), [2, 2], [2, 2])


def test_join_blocks_and_grid_checks():
    np.testing.assert_array_equal(
        join_blocks((1, 2), (np.zeros((2, 1)), np.ones((2, 3)))), [[0, 1, 1, 1], [0, 1, 1, 1]]
    )
    with pytest.raises(RechunkInputError, match="holds 2 blocks, not 1"):
        JoinedBlocks((2,), (np.zeros(3),))
