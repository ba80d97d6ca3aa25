"""Rechunks whose transfer tasks make and join several input chunks (gen_cluster)."""

from __future__ import annotations

import math

import dask
import dask.array as da
import numpy as np
from distributed.utils_test import gen_cluster
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import rechunk_p2p
from rechunk_p2p.spec import JOINED_PREFIX, PLUGIN_NAME
from tests.conftest import assert_clean
from tests.engine_helpers import TWO, check_rechunk
from tests.planning.test_groups import coarsening


def _steps(nt: int = 256) -> da.Array:
    """Maps, one time step per chunk, each step's values telling where they belong."""
    return da.map_blocks(
        lambda block_info=None: np.arange(
            block_info[None]["array-location"][0][0] * 96,
            block_info[None]["array-location"][0][1] * 96,
            dtype="f4",
        ).reshape(-1, 8, 12),
        chunks=((1,) * nt, (8,), (12,)),
        dtype="f4",
    )


def _expected(nt: int = 256) -> np.ndarray:
    return np.arange(nt * 96, dtype="f4").reshape(nt, 8, 12)


def _joined_rechunk(x: da.Array, chunks: tuple) -> da.Array:
    """``x`` rechunked, by a plan that joins its chunks."""
    assert rechunk_p2p.plan(x, chunks, n_workers=2).groups is not None
    return rechunk_p2p.rechunk(x, chunks)


def _transfer_keys(graph) -> list:
    return [k for k in graph if isinstance(k, tuple) and "rechunk_p2p-transfer" in k[0]]


@gen_cluster(client=True, nthreads=TWO, config={"rechunk-p2p.transfer-group-bytes": "1536B"})
async def test_maps_to_time_series_with_joined_steps(c, s, a, b, storage):
    await rechunk_p2p.register(c)
    x = _steps()
    expected = _expected()
    plan = rechunk_p2p.plan(x, (256, 4, 4), n_workers=2)
    assert plan.groups == ((4,) * 64, (1,), (1,))  # 384 B steps, 1.5 KiB a group
    y = await check_rechunk(c, s, x, expected, (256, 4, 4))
    assert len(_transfer_keys(dict(y.__dask_graph__()))) == plan.n_transfers == 64
    await assert_clean(s, a, b)


@gen_cluster(client=True, nthreads=TWO, config={"rechunk-p2p.transfer-group-bytes": "1536B"})
async def test_steps_after_generated_maps_are_made_and_joined_in_the_transfers(c, s, a, b):
    """Generated data is no blockwise layer, so dask's fusion leaves an ``astype`` or a scale
    and offset on top of it apart: the transfers make the chunks, apply the steps and join
    them all the same (one transfer per chunk before, and the chunks moved between workers
    first)."""
    await rechunk_p2p.register(c)
    x = da.random.default_rng(3).random((256, 8, 12), chunks=(1, 8, 12))
    expected = x.compute(scheduler="sync")
    for y, want in [
        (x.astype("f4"), expected.astype("f4")),
        (x.astype("f4") * 0.01 + 273.15, expected.astype("f4") * 0.01 + 273.15),
    ]:
        plan = rechunk_p2p.plan(y, (256, 4, 4), n_workers=2)
        assert plan.groups is not None and plan.n_transfers == 64 < 256
        out = await check_rechunk(c, s, y, want, (256, 4, 4))
        assert len(_transfer_keys(dict(out.__dask_graph__()))) == 64
    await assert_clean(s, a, b)


@gen_cluster(client=True, nthreads=TWO)
async def test_the_input_computed_beside_its_joined_rechunk(c, s, a, b):
    await rechunk_p2p.register(c)
    x = _steps()
    y = _joined_rechunk(x, (256, 2, 3))
    total, result, again = await c.gather(c.compute([x.sum(), y, x]))
    expected = _expected()
    np.testing.assert_array_equal(result, expected)
    np.testing.assert_array_equal(again, expected)
    assert total == expected.sum()
    await assert_clean(s, a, b)


@gen_cluster(client=True, nthreads=TWO)
async def test_part_of_a_joined_rechunk(c, s, a, b):
    await rechunk_p2p.register(c)
    y = _joined_rechunk(_steps(), (256, 4, 4))
    expected = _expected()
    np.testing.assert_array_equal(await c.compute(y[:, :4, 4:]), expected[:, :4, 4:])
    np.testing.assert_array_equal(await c.compute(y[5:9, 1:7]), expected[5:9, 1:7])
    await assert_clean(s, a, b)


@gen_cluster(client=True, nthreads=TWO, config={"rechunk-p2p.transfer-group-bytes": "1KiB"})
async def test_a_partial_without_a_shuffle_reads_joined_groups(c, s, a, b):
    """One output chunk of 256 steps: a concatenation, of joined groups made by tasks of
    their own (no shuffle, no run)."""
    await rechunk_p2p.register(c)
    x = _steps()
    plan = rechunk_p2p.plan(x, (256, 8, 12), n_workers=2)
    assert plan.groups is not None and plan.n_shuffles == 0
    y = await check_rechunk(c, s, x, _expected(), -1)
    joined = [k for k in dict(y.__dask_graph__()) if str(k[0]).startswith(JOINED_PREFIX)]
    assert len(joined) == plan.n_transfers > 1
    assert not s.plugins[PLUGIN_NAME].active
    await assert_clean(s, a, b)


@gen_cluster(client=True, nthreads=TWO, config={"rechunk-p2p.transfer-group-bytes": 0})
async def test_joining_off_makes_one_transfer_per_chunk(c, s, a, b):
    await rechunk_p2p.register(c)
    x = _steps()
    assert rechunk_p2p.plan(x, (256, 4, 4), n_workers=2).groups is None
    y = rechunk_p2p.rechunk(x, (256, 4, 4))
    assert len(_transfer_keys(dict(y.__dask_graph__()))) == 256
    np.testing.assert_array_equal(await c.compute(y), _expected())
    with dask.config.set({"rechunk-p2p.transfer-group-bytes": "1MiB"}):
        assert rechunk_p2p.plan(x, (256, 4, 4), n_workers=2).groups is not None
    await assert_clean(s, a, b)


def _positions(shape: tuple[int, ...], chunks: tuple) -> da.Array:
    """Generated chunks whose every element holds its flat position in the array."""

    def fill(block_info=None):
        location = block_info[None]["array-location"]
        grids = np.meshgrid(*(np.arange(a, b) for a, b in location), indexing="ij")
        return np.ravel_multi_index(grids, shape)

    return da.map_blocks(fill, chunks=chunks, dtype=np.int64, meta=np.empty((0,) * len(shape)))


@settings(max_examples=60, deadline=None)
@given(coarsening(), st.integers(2, 8), st.sampled_from(["memory", "disk"]), st.integers(1, 4))
def test_joined_graphs_hold_what_the_plan_counts_and_the_right_values(case, times, storage, fewest):
    """Any rechunk whose chunks are joined (the fewest transfers lowered to join small ones):
    the graph holds as many tasks as the plan counts, and computed without distributed
    (dask's synchronous scheduler) every element lands in its place."""
    from unittest import mock

    shape, old, new = case
    assume(len(shape) > 0 and all(shape))
    x = _positions(shape, old)
    limit = math.prod(max(c) for c in old) * 8 * times
    settings_ = {"rechunk-p2p.transfer-group-bytes": limit, "rechunk-p2p.storage": storage}
    with (
        mock.patch("rechunk_p2p.planning.groups.MIN_TRANSFERS", fewest),
        dask.config.set(settings_),
    ):
        plan = rechunk_p2p.plan(x, new, n_workers=2)
        assume(plan.groups is not None)
        y = rechunk_p2p.rechunk(x, new)
    layer = y.__dask_graph__().layers[y.name]
    assert len(layer) == plan.n_tasks
    result = y.compute(scheduler="sync")
    np.testing.assert_array_equal(result, np.arange(math.prod(shape)).reshape(shape))
