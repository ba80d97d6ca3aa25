"""Groups of input chunks that one transfer task joins: checked against brute force."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rechunk_p2p.errors import RechunkInputError
from rechunk_p2p.planning import RechunkPlan, make_partials
from rechunk_p2p.planning.groups import (
    MIN_TRANSFERS,
    group_members,
    grouped_chunks,
    transfer_groups,
)

from .strategies import axis_chunking, brute_piece_pairs, chunks_from_cuts, rechunks, shapes

SETTINGS = settings(max_examples=300, deadline=None)


@st.composite
def coarsening(draw: st.DrawFn) -> tuple:
    """Rechunks whose output chunks mostly span several input chunks (where joining pays):
    the output boundaries are some of the input's, plus a few cuts of their own."""
    shape = draw(shapes(max_ndim=3, max_length=30))
    old, new = [], []
    for length in shape:
        size = draw(st.integers(1, 3))
        regular = chunks_from_cuts(length, list(range(size, length, size)))
        o = draw(st.one_of(st.just(regular), axis_chunking(length, 16)))
        bounds = list(itertools.accumulate(o))[:-1]
        kept = [b for b in bounds if draw(st.integers(0, 3)) == 0]
        extra = draw(st.lists(st.integers(0, length), max_size=2))
        old.append(o)
        new.append(chunks_from_cuts(length, sorted(kept + extra)))
    return tuple(shape), tuple(old), tuple(new)


any_rechunk = st.one_of(rechunks(), coarsening(), coarsening())


def starts(chunks: tuple[int, ...]) -> list[int]:
    return [0, *itertools.accumulate(chunks)]


def limit_for(old, itemsize: int, times: int, extra: int) -> int:
    """A limit of about ``times`` of the largest chunks (so that joining is possible)."""
    return math.prod(max(c, default=0) for c in old) * itemsize * times + extra


@SETTINGS
@given(
    any_rechunk,
    st.sampled_from([1, 2, 4, 8]),
    st.integers(0, 12),
    st.integers(0, 7),
    st.integers(1, 8),
)
def test_groups_cover_the_chunks_and_never_hold_an_output_boundary(
    case, itemsize, times, extra, fewest
):
    _, old, new = case
    limit = limit_for(old, itemsize, times, extra)
    groups = transfer_groups(old, new, itemsize, limit, min_transfers=fewest)
    if groups is None:
        return
    n_chunks = math.prod(len(o) for o in old)
    assert math.prod(len(g) for g in groups) >= min(fewest, n_chunks)
    assert len(groups) == len(old)
    joined_any = False
    for o, n, g in zip(old, new, groups):
        assert sum(g) == len(o) and 0 not in g
        new_starts = set(starts(n))
        for members in group_members(g):
            if len(members) == 1:
                continue
            joined_any = True
            lo, hi = starts(o)[members.start], starts(o)[members.stop]
            # wholly inside one output chunk: no output boundary strictly inside the group
            assert not any(lo < b < hi for b in new_starts)
            assert all(o[i] > 0 for i in members)
    assert joined_any
    # a run of chunks inside one output chunk is never joined whole (it stays shuffled)
    for o, n, g in zip(old, new, groups):
        for members in group_members(g):
            if len(members) > 1:
                lo, hi = starts(o)[members.start], starts(o)[members.stop]
                inside = [
                    i
                    for i, s in enumerate(starts(o)[:-1])
                    if o[i] and _within(s, s + o[i], n, lo, hi)
                ]
                assert len(inside) > len(members)
    # the joined block is within the limit (counted with the largest chunk of every axis)
    largest = math.prod(max(c, default=0) for c in old) * itemsize
    assert largest * math.prod(max(g) for g in groups) <= max(limit, largest)


def _within(lo: int, hi: int, new: tuple[int, ...], glo: int, ghi: int) -> bool:
    """Whether [lo, hi) lies inside the output chunk that holds [glo, ghi)."""
    for a, b in itertools.pairwise(starts(new)):
        if a <= glo and ghi <= b:
            return a <= lo and hi <= b
    return False


@SETTINGS
@given(any_rechunk, st.integers(0, 12))
def test_joining_keeps_the_partials_and_every_element_in_its_place(case, times):
    shape, old, new = case
    groups = transfer_groups(old, new, 1, limit_for(old, 1, times, 0), min_transfers=1)
    if groups is None:
        return
    joined = tuple(grouped_chunks(o, g) for o, g in zip(old, groups))
    before, after = make_partials(old, new), make_partials(joined, new)
    # the same boxes of the array, with the same output chunks
    assert [(p.new_offset, p.new_chunks) for p in before] == [
        (p.new_offset, p.new_chunks) for p in after
    ]
    assert [tuple(starts(o)[i] for o, i in zip(old, p.old_offset)) for p in before] == [
        tuple(starts(j)[i] for j, i in zip(joined, p.old_offset)) for p in after
    ]
    # every output chunk is made of the same elements: each (joined input, output) pair
    # covers exactly the original pairs of the inputs in the group
    pairs = brute_piece_pairs(shape, joined, new)
    members = [group_members(g) for g in groups]
    expanded = {
        (tuple(chunk), out)
        for index, out in pairs
        for chunk in itertools.product(*(m[i] for m, i in zip(members, index)))
    }
    assert {out for _, out in expanded} == {out for _, out in pairs}
    assert brute_piece_pairs(shape, old, new) <= expanded


def test_maps_to_time_series_join_time_steps_up_to_the_limit():
    old = ((1,) * 64, (512,), (512,))
    new = ((64,), (32,) * 16, (32,) * 16)
    groups = transfer_groups(old, new, itemsize=4, limit_bytes=16 * 2**20, min_transfers=4)
    assert groups == ((16,) * 4, (1,), (1,))
    assert transfer_groups(old, new, 4, 2**21 - 1, min_transfers=4) is None
    # a fixed axis is never joined
    assert transfer_groups(old, new, 4, 2**30, fixed_axes=(0,), min_transfers=1) is None


def test_joining_leaves_at_least_the_fewest_transfers():
    old, new = ((1,) * 6144, (512,), (512,)), ((6144,), (32,) * 16, (32,) * 16)
    assert transfer_groups(old, new, 4, 16 * 2**20) == ((16,) * 384, (1,), (1,))
    # 1,024 maps: 16 a group would leave 64 transfers, the fewest allowed by default
    old, new = ((1,) * 1024, (512,), (512,)), ((1024,), (32,) * 16, (32,) * 16)
    assert len(transfer_groups(old, new, 4, 16 * 2**20)[0]) == MIN_TRANSFERS == 64
    # fewer chunks than that: joining would only take threads away from the input phase
    old, new = ((1,) * 40, (512,), (512,)), ((40,), (32,) * 16, (32,) * 16)
    assert transfer_groups(old, new, 4, 16 * 2**20) is None
    # 160 chunks: groups as large as leave 64 or more transfers
    old, new = ((1,) * 160, (512,), (512,)), ((160,), (32,) * 16, (32,) * 16)
    assert transfer_groups(old, new, 4, 16 * 2**20) == ((2,) * 80, (1,), (1,))
    # the largest factor that leaves enough, not a halving: 63 one-row chunks in two
    # columns join in pairs (32 x 2 transfers), where halving went 63, 31, 15, 7, 3, 1
    old, new = ((1,) * 63, (4, 4), (6,)), ((63,), (2,) * 4, (3, 3))
    assert transfer_groups(old, new, 8, 16 * 2**20) == ((2,) * 31 + (1,), (1, 1), (1,))


def test_runs_are_split_into_nearly_equal_groups():
    old = ((1,) * 10, (4,))
    new = ((10,), (4,))
    assert transfer_groups(old, new, 1, 16, min_transfers=1) == ((4, 3, 3), (1,))
    # never one group for a whole output chunk's inputs: they would no longer be shuffled
    assert transfer_groups(old, new, 1, 2**20, min_transfers=1) == ((5, 5), (1,))
    assert transfer_groups(((1, 1), (4,)), ((2,), (2, 2)), 1, 2**20, min_transfers=1) is None


def test_plan_counts_the_joined_inputs():
    old, new = ((1,) * 8, (6,)), ((8,), (3, 3))
    plain = RechunkPlan((8, 6), "f8", old, new)
    joined = RechunkPlan((8, 6), "f8", old, new, groups=((4, 4), (1,)))
    assert transfer_groups(old, new, 8, 2**20, min_transfers=2) == joined.groups
    assert joined.input_chunks == ((4, 4), (6,))
    assert (joined.n_input_chunks, joined.n_transfers) == (8, 2)
    assert (plain.n_transfers, plain.n_pieces, joined.n_pieces) == (8, 16, 4)
    assert joined.n_tasks == 2 + 1 + 2  # two transfers, a barrier, two outputs
    assert "2 groups of up to 4 input chunks" in repr(joined)
    assert "joined" not in repr(plain)
    with pytest.raises(RechunkInputError, match="do not cover"):
        RechunkPlan((8, 6), "f8", old, new, groups=((4, 3), (1,)))


def test_join_places_blocks_in_c_order():
    from rechunk_p2p.tasks import join

    whole = np.arange(7 * 5).reshape(7, 5)
    rows, cols = (slice(0, 3), slice(3, 7)), (slice(0, 2), slice(2, 5))
    blocks = [whole[r, c] for r in rows for c in cols]
    np.testing.assert_array_equal(join((2, 2), *blocks), whole)
    assert join((1, 1), blocks[0]) is blocks[0]
