"""Whole rechunks on in-process clusters (gen_cluster): results, storage, cleanup."""

from __future__ import annotations

import dask
import dask.array as da
import numpy as np
import pytest
from distributed.utils_test import gen_cluster

import rechunk_p2p
from tests.conftest import assert_clean

NTHREADS_2 = [("127.0.0.1", 1), ("127.0.0.1", 1)]


async def _check(c, s, workers, x, chunks):
    await rechunk_p2p.register(c)
    y = rechunk_p2p.rechunk(x, chunks)
    expected = x.rechunk(chunks, method="tasks")
    assert y.chunks == expected.chunks
    result = await c.compute(y)
    np.testing.assert_array_equal(result, await c.compute(x))
    assert result.dtype == x.dtype
    await assert_clean(s, *workers)
    return y


@gen_cluster(client=True, nthreads=NTHREADS_2)
async def test_rows_to_columns(c, s, a, b, storage):
    x = da.random.default_rng(0).random((60, 50), chunks=(6, 50))
    await _check(c, s, [a, b], x, (60, 5))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_single_worker(c, s, a, storage):
    x = da.arange(1000, chunks=7).reshape(20, 50).rechunk((3, 50))
    await _check(c, s, [a], x, (20, 3))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3)
async def test_three_workers_3d(c, s, a, b, w3, storage):
    x = da.random.default_rng(1).random((12, 10, 8), chunks=(1, 10, 8)).astype("f4")
    await _check(c, s, [a, b, w3], x, (12, 3, 4))
