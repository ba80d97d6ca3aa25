"""Hypothesis strategies and brute-force oracles for the planning tests.

Where it runs: pure (test helpers only).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
from hypothesis import strategies as st

Chunks = tuple[tuple[int, ...], ...]

# Caps on the size of one example, so that the oracle (which touches every element and every
# pair of chunks) stays fast: at most this many elements and chunks along all axes together.
MAX_ELEMENTS = 3000
MAX_CHUNKS = 400


@st.composite
def cut_points(draw: st.DrawFn, length: int, max_cuts: int, prefer: tuple[int, ...] = ()) -> list:
    """Sorted interior positions in ``0..length``; repeats make zero-length chunks."""
    position = st.integers(0, length)
    if prefer:
        position = st.one_of(st.sampled_from(prefer), position)
    return sorted(draw(st.lists(position, max_size=max_cuts)))


def chunks_from_cuts(length: int, cuts: list[int]) -> tuple[int, ...]:
    """Chunk lengths between consecutive cut points (and the two ends of the axis)."""
    bounds = [0, *cuts, length]
    return tuple(b - a for a, b in itertools.pairwise(bounds))


@st.composite
def axis_chunking(
    draw: st.DrawFn, length: int, max_cuts: int, prefer: tuple[int, ...] = ()
) -> tuple[int, ...]:
    """One chunking of an axis of ``length`` elements.

    Regular chunks (dask's usual layout), random irregular chunks with zero-length chunks
    anywhere, or a single chunk; ``prefer`` biases cut points towards positions that another
    chunking already uses, so that shared boundaries (and several partials) are common. An axis
    of length zero may also have no chunks at all.
    """
    kind = draw(st.sampled_from(["regular", "cuts", "single", "empty"]))
    if kind == "regular" and length > 0:
        size = draw(st.integers(max(1, -(-length // (max_cuts + 1))), length))
        return (size,) * (length // size) + ((length % size,) if length % size else ())
    if kind == "single":
        return (length,)
    if kind == "empty" and length == 0:
        return ()
    return chunks_from_cuts(length, draw(cut_points(length, max_cuts, prefer)))


@st.composite
def shapes(draw: st.DrawFn, max_ndim: int = 5, max_length: int = 40) -> tuple[int, ...]:
    """Shapes with 0..max_ndim axes of length 0..max_length and at most MAX_ELEMENTS elements."""
    ndim = draw(st.integers(0, max_ndim))
    shape = []
    budget = MAX_ELEMENTS
    for _ in range(ndim):
        empty = draw(st.integers(0, 9)) == 0  # rare: one empty axis empties the array
        length = 0 if empty else draw(st.integers(1, min(max_length, budget)))
        shape.append(length)
        budget = max(1, budget // max(length, 1))
    return tuple(shape)


@st.composite
def chunk_pair(draw: st.DrawFn, length: int, max_cuts: int = 8) -> tuple:
    """Old and new chunkings of one axis of ``length`` elements."""
    old = draw(axis_chunking(length, max_cuts))
    old_bounds = tuple(itertools.accumulate(old))
    new = draw(axis_chunking(length, max_cuts, prefer=old_bounds))
    return old, new


@st.composite
def rechunks(draw: st.DrawFn, max_ndim: int = 5) -> tuple[tuple[int, ...], Chunks, Chunks]:
    """A shape with old and new chunks for it."""
    shape = draw(shapes(max_ndim))
    old, new = [], []
    budget = MAX_CHUNKS
    for length in shape:
        max_cuts = max(0, min(8, math.isqrt(budget) - 1))
        o, n = draw(chunk_pair(length, max_cuts))
        old.append(o)
        new.append(n)
        budget = max(1, budget // max(len(o), len(n), 1))
    return shape, tuple(old), tuple(new)


def brute_pieces(old: tuple[int, ...], new: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every (old, new, old_start, old_stop, new_start, new_stop) with a non-empty overlap."""
    old_starts = [0, *itertools.accumulate(old)]
    new_starts = [0, *itertools.accumulate(new)]
    out = []
    for i, j in itertools.product(range(len(old)), range(len(new))):
        lo = max(old_starts[i], new_starts[j])
        hi = min(old_starts[i + 1], new_starts[j + 1])
        if hi > lo:
            o, n = old_starts[i], new_starts[j]
            out.append((i, j, lo - o, hi - o, lo - n, hi - n))
    return out


def chunk_slices(chunks: Chunks) -> dict[tuple[int, ...], tuple[slice, ...]]:
    """Global chunk index -> slices of the whole array, for every chunk."""
    per_axis = []
    for axis in chunks:
        starts = [0, *itertools.accumulate(axis)]
        per_axis.append([slice(a, b) for a, b in itertools.pairwise(starts)])
    return {
        index: tuple(axis[i] for axis, i in zip(per_axis, index, strict=True))
        for index in itertools.product(*(range(len(a)) for a in chunks))
    }


def brute_piece_pairs(
    shape: tuple[int, ...], old: Chunks, new: Chunks
) -> set[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Global (input index, output index) pairs whose chunks share at least one element.

    Element by element: label every element with the input chunk it lives in, then read the
    labels inside every output chunk.
    """
    inputs = list(chunk_slices(old))
    label = np.full(shape, -1, dtype=np.int64)
    for k, (index, slices) in enumerate(chunk_slices(old).items()):
        assert index == inputs[k]
        label[slices] = k
    assert (label >= 0).all()
    return {
        (inputs[k], out_index)
        for out_index, slices in chunk_slices(new).items()
        for k in np.unique(label[slices]).tolist()
    }
