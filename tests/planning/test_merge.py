"""Merging thin input chunks before the shuffle: the chunks stay valid and partials stay small."""

from __future__ import annotations

import itertools

import dask
import dask.array as da
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import rechunk_p2p
from rechunk_p2p.planning.axes import axis_groups, boundaries
from rechunk_p2p.planning.merge import merge_inputs


@st.composite
def two_chunkings(draw):
    ndim = draw(st.integers(1, 3))
    old, new = [], []
    for _ in range(ndim):
        n = draw(st.integers(0, 30))
        for target in (old, new):
            cuts = sorted(draw(st.sets(st.integers(1, max(n - 1, 1)), max_size=8)) - {n})
            edges = [0, *[c for c in cuts if c < n], n]
            target.append(tuple(b - a for a, b in itertools.pairwise(edges)) or (0,))
    return tuple(old), tuple(new)


@settings(max_examples=200, deadline=None)
@given(chunkings=two_chunkings(), limit=st.integers(1, 5000), shard=st.none() | st.integers(1, 500))
def test_merged_chunks_are_valid_and_respect_partials(chunkings, limit, shard):
    old, new = chunkings
    merged = merge_inputs(old, new, itemsize=4, limit=limit, shard_bytes=shard)
    for o, m, n in zip(old, merged, new):
        assert sum(m) == sum(o)
        # merged boundaries are old boundaries: merging only concatenates neighbours
        assert set(boundaries(m)) <= set(boundaries(o))
        # no merge crosses a boundary old and new share: partials are not made bigger
        shared = set(boundaries(o)) & set(boundaries(n))
        assert shared <= set(boundaries(m))
        assert len(axis_groups(m, n)) == len(axis_groups(o, n))


def test_map_to_time_series_merges_time_steps():
    x = da.ones((1536, 512, 512), chunks=(1, 512, 512), dtype="f4")
    plan = rechunk_p2p.plan(x, (1536, 32, 32), n_workers=2)
    assert plan.merged
    assert plan.old_chunks[0] == (16,) * 96  # 16 steps x 4 KiB tiles = 64 KiB shards
    assert plan.n_shards == 96 * 256
    assert "merged" in repr(plan)


def test_small_arrays_and_merges_that_do_not_pay_are_left_alone():
    small = da.ones((60, 40), chunks=(1, 40))
    assert not rechunk_p2p.plan(small, (60, 1)).merged
    wide = da.ones((1024, 1024), chunks=(1024, 16), dtype="f8")
    with dask.config.set({"rechunk-p2p.merge.min-array-bytes": 0}):
        assert not rechunk_p2p.plan(wide, (512, 8)).merged  # new chunks are shorter
        assert rechunk_p2p.plan(wide, (16, 1024)).merged  # 16 x 16 shards: merge columns


def test_merged_rechunk_gives_the_same_result():
    x = da.random.default_rng(5).random((64, 40, 12), chunks=(1, 40, 12))
    with dask.config.set(
        {"rechunk-p2p.merge.min-array-bytes": 0, "rechunk-p2p.merge.shard-bytes": 512}
    ):
        y = rechunk_p2p.rechunk(x, (64, 10, 3))
        assert rechunk_p2p.plan(x, (64, 10, 3)).merged
    assert y.chunks == x.rechunk((64, 10, 3), method="tasks").chunks
    with dask.config.set(scheduler="sync"):
        np.testing.assert_array_equal(y.compute(), x.compute())
