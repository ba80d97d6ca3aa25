"""Per-axis planning (pieces and groups) against brute force and against dask's own mapping."""

from __future__ import annotations

import importlib
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rechunk_p2p.planning.axes import AxisPiece, axis_groups, axis_pieces, boundaries

from .strategies import brute_pieces, chunk_pair

# ``dask.array.rechunk`` is shadowed by the function of the same name; fetch the module.
dask_rechunk = importlib.import_module("dask.array.rechunk")

SETTINGS = settings(max_examples=200, deadline=None)
lengths = st.integers(0, 40)
pairs = lengths.flatmap(chunk_pair)


def group_spans(groups, chunks):
    """Element span (start, stop) of every group along the axis, from its chunk ranges."""
    bounds = boundaries(chunks)
    return [(bounds[g.start], bounds[g.stop]) for g in groups]


@SETTINGS
@given(pairs)
def test_axis_pieces_match_brute_force(pair):
    old, new = pair
    pieces = axis_pieces(old, new)
    assert [tuple(p) for p in pieces] == brute_pieces(old, new)
    for p in pieces:
        assert isinstance(p, AxisPiece)
        assert p.old_stop - p.old_start == p.new_stop - p.new_start > 0
        assert p.old_slice == slice(p.old_start, p.old_stop)
        assert p.new_slice == slice(p.new_start, p.new_stop)
    # The pieces tile both chunkings: every old and every new chunk is covered exactly.
    for chunks, attr, lo, hi in ((old, "old", 2, 3), (new, "new", 4, 5)):
        for k, length in enumerate(chunks):
            mine = [p for p in pieces if getattr(p, attr) == k]
            sizes = [p[hi] - p[lo] for p in mine]
            assert sum(sizes) == length
            assert [p[lo] for p in mine] == [0, *itertools.accumulate(sizes)][:-1]


@SETTINGS
@given(pairs)
def test_axis_groups_partition_and_are_maximal(pair):
    old, new = pair
    groups = axis_groups(old, new)
    assert len(groups) >= 1
    # Contiguous, in order, disjoint and covering every chunk index of both chunkings.
    for chunks, attr in ((old, "old"), (new, "new")):
        ranges = [getattr(g, attr) for g in groups]
        assert all(r.step == 1 for r in ranges)
        assert ranges[0].start == 0
        assert ranges[-1].stop == len(chunks)
        assert all(a.stop == b.start for a, b in itertools.pairwise(ranges))
    # Each group spans the same elements in both chunkings, and the spans tile the axis.
    old_spans = group_spans([g.old for g in groups], old)
    new_spans = group_spans([g.new for g in groups], new)
    assert old_spans == new_spans
    assert old_spans[0][0] == 0 and old_spans[-1][1] == sum(old)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(old_spans))
    # Maximal: the groups split exactly at the interior boundaries both chunkings share.
    total = sum(old)
    shared = set(boundaries(old)) & set(boundaries(new))
    interior = sorted(b for b in shared if 0 < b < total)
    assert [start for start, _ in old_spans[1:]] == interior
    # Every group except on an axis without elements holds elements and at least one chunk
    # of each chunking (when that chunking has chunks).
    if total:
        assert all(stop > start for start, stop in old_spans)
        assert all(len(g.old) and len(g.new) for g in groups)


@SETTINGS
@given(pairs)
def test_pieces_never_cross_groups(pair):
    old, new = pair
    groups = axis_groups(old, new)
    group_of_old = {i: k for k, g in enumerate(groups) for i in g.old}
    group_of_new = {j: k for k, g in enumerate(groups) for j in g.new}
    for p in axis_pieces(old, new):
        assert group_of_old[p.old] == group_of_new[p.new]


@SETTINGS
@given(pairs)
def test_zero_length_chunks_join_the_group_starting_at_their_position(pair):
    old, new = pair
    groups = axis_groups(old, new)
    spans = group_spans([g.old for g in groups], old)
    starts = [s for s, _ in spans]
    for chunks, attr in ((old, "old"), (new, "new")):
        bounds = boundaries(chunks)
        for k, length in enumerate(chunks):
            if length:
                continue
            group = next(i for i, g in enumerate(groups) if k in getattr(g, attr))
            # The last group whose span starts at or before the chunk's position.
            expected = max(i for i, s in enumerate(starts) if s <= bounds[k])
            assert group == expected


def dask_pieces(old, new):
    """Our piece tuples rebuilt from ``dask.array.rechunk.old_to_new`` for one axis."""
    (mapping,) = dask_rechunk.old_to_new((old,), (new,))
    assert len(mapping) == len(new)
    out = []
    for j, sources in enumerate(mapping):
        position = 0
        for i, sl in sources:
            length = sl.stop - sl.start
            if length > 0:
                out.append((i, j, sl.start, sl.stop, position, position + length))
            position += length
        assert position == new[j]
    return sorted(out)


def components(pieces, old, new):
    """Connected groups of non-empty chunks, linked by the pieces (union-find)."""
    parent = {("o", i): ("o", i) for i, c in enumerate(old) if c}
    parent.update({("n", j): ("n", j) for j, c in enumerate(new) if c})

    def find(x):
        while parent[x] != x:
            x = parent[x]
        return x

    for p in pieces:
        parent[find(("o", p[0]))] = find(("n", p[1]))
    groups = {}
    for node in parent:
        groups.setdefault(find(node), set()).add(node)
    return sorted(sorted(g) for g in groups.values())


@SETTINGS
@given(pairs.filter(lambda p: p[0] and p[1]))
def test_pieces_and_groups_agree_with_dask_old_to_new(pair):
    old, new = pair
    from_dask = dask_pieces(old, new)
    assert [tuple(p) for p in axis_pieces(old, new)] == from_dask
    # Partial boundaries: our groups, restricted to non-empty chunks, are exactly the
    # connected components of dask's old -> new mapping.
    ours = sorted(
        sorted([("o", i) for i in g.old if old[i]] + [("n", j) for j in g.new if new[j]])
        for g in axis_groups(old, new)
    )
    assert [g for g in ours if g] == components(from_dask, old, new)


@pytest.mark.parametrize(
    "old, new, expected",
    [
        ((2, 2, 2), (4, 2), [(range(0, 2), range(0, 1)), (range(2, 3), range(1, 2))]),
        ((3,), (1, 2), [(range(0, 1), range(0, 2))]),
        ((0, 2, 0, 2, 0), (2, 2), [(range(0, 2), range(0, 1)), (range(2, 5), range(1, 2))]),
        ((0,), (0, 0), [(range(0, 1), range(0, 2))]),
        ((), (0,), [(range(0, 0), range(0, 1))]),
        ((1, 1, 1), (1, 1, 1), [(range(i, i + 1), range(i, i + 1)) for i in range(3)]),
    ],
)
def test_axis_groups_examples(old, new, expected):
    assert [tuple(g) for g in axis_groups(old, new)] == expected


def test_mismatched_lengths_raise():
    with pytest.raises(ValueError, match="same length"):
        axis_pieces((2, 2), (3,))
    with pytest.raises(ValueError, match="same length"):
        axis_groups((2, 2), (5,))
