"""The workloads' own checks can fail: wrong data, wrong placement, wrong sizes (no cluster)."""

from __future__ import annotations

import dask
import numpy as np
import pytest

from integration.workloads import (
    DEFAULT_BYTES,
    all_workloads,
    checked,
    expected_block,
    input_array,
    many_small,
    rows_to_columns,
    rows_to_columns_8mib,
    size_from_env,
    source_array,
    time_to_space,
    workload_graph,
)


@pytest.fixture(autouse=True)
def _sync_scheduler():
    with dask.config.set(scheduler="sync"):
        yield


def test_check_accepts_a_correct_rechunk_and_rejects_wrong_ones() -> None:
    w = time_to_space(2 * 2**20)
    x = source_array(w)
    assert checked(x.rechunk(w.target_chunks, method="tasks"), w).compute()
    # A moved element, a swapped pair of time steps and a cast all fail the check.
    bad = x.rechunk(w.target_chunks, method="tasks").copy()
    assert not checked(bad.map_blocks(lambda b: np.roll(b, 1, axis=0)), w).compute()
    swapped = x[[1, 0, *range(2, w.shape[0])]].rechunk(w.target_chunks, method="tasks")
    assert not checked(swapped, w).compute()
    assert not checked(x.astype("float64").rechunk(w.target_chunks, method="tasks"), w).compute()


@pytest.mark.parametrize("impl", ["rechunk_p2p", "dask-tasks"])
def test_a_made_then_mapped_input_is_checked_against_mapped_values(impl: str) -> None:
    """A ``made+map`` input's rechunk holds the step's values, bit for bit, through either
    implementation; the plain values, or the step applied twice, fail its check."""
    from dataclasses import replace

    w = replace(time_to_space(2 * 2**20), origin="made+map")
    x = input_array(w)
    assert x.dtype == np.float32 and float(x[1, 0, 0].compute()) != float(source_array(w)[1, 0, 0])
    y, ok = workload_graph(impl, w, x)
    assert ok.compute()
    assert not checked(source_array(w).rechunk(w.target_chunks, method="tasks"), w).compute()
    assert not checked(y * 0.01 + 273.15, w).compute()
    assert w.label == f"{w.name}/made+map"


def test_values_are_distinct_and_exact() -> None:
    block = expected_block((64, 64), [(0, 64), (0, 64)], "float32")
    assert len(np.unique(block)) == block.size
    assert np.array_equal(block, block.astype(np.int64))


def test_workload_shapes() -> None:
    w = many_small(DEFAULT_BYTES["many"])
    assert w.n_source_chunks >= 10_000 and w.n_target_chunks >= 10_000
    assert np.prod(w.source_chunks) * 8 == 64 * 2**10
    a = rows_to_columns(DEFAULT_BYTES["2d"])
    assert a.source_chunks[1] == a.shape[1] and a.target_chunks[0] == a.shape[0]
    b = time_to_space(DEFAULT_BYTES["3d"])
    assert b.source_chunks[0] == 1 and b.target_chunks[0] == b.shape[0]
    d = rows_to_columns_8mib(2**30)
    assert d.n_source_chunks == d.n_target_chunks == 128
    assert 7.5 * 2**20 < np.prod(d.source_chunks) * 8 < 8.5 * 2**20  # about 8 MiB at 1 GiB
    assert [x.name for x in all_workloads()] == [a.name, b.name, w.name, d.name]


def test_sizes_from_environment() -> None:
    assert size_from_env({"RECHUNK_P2P_BENCH_SIZE": "1.5GiB"})["many"] == int(1.5 * 2**30)
    assert size_from_env({"RECHUNK_P2P_BENCH_SCALE": "2"})["2d"] == 2 * DEFAULT_BYTES["2d"]
    assert size_from_env({}) == DEFAULT_BYTES


def test_graph_rejects_wrong_chunks() -> None:
    w = rows_to_columns(2**20)
    y, ok = workload_graph("dask-tasks", w)
    assert ok.compute()
    assert y.chunks[1] == (w.target_chunks[1],) * (w.shape[1] // w.target_chunks[1])
    with pytest.raises(ValueError, match="unknown implementation"):
        workload_graph("nope", w)


@pytest.mark.parametrize(
    ("shape", "location"),
    [
        ((1024, 512, 512), [(5, 6), (0, 512), (0, 512)]),
        ((1024, 512, 512), [(1000, 1024), (480, 512), (64, 96)]),
        ((11585, 11585), [(11500, 11585), (7, 11585)]),
        ((3, 5, 7, 11), [(1, 3), (0, 5), (2, 6), (10, 11)]),
        ((2**20,), [(2**20 - 9, 2**20)]),
        ((70_000, 70_000), [(69_990, 70_000), (69_000, 69_003)]),  # indices past 2**32
    ],
)
def test_values_match_the_hash_of_each_global_index(shape, location) -> None:
    index = np.zeros([hi - lo for lo, hi in location], dtype=object)
    stride = 1
    for axis in reversed(range(len(shape))):
        lo, hi = location[axis]
        ax = np.arange(lo, hi, dtype=object) * stride
        index = index + ax.reshape([-1 if a == axis else 1 for a in range(len(shape))])
        stride *= shape[axis]
    want = (index * 2654435761 + 12345) % 2**24
    for dtype in ("float32", "float64", "int32"):
        got = expected_block(shape, location, dtype)
        assert got.dtype == dtype and got.shape == want.shape
        assert np.array_equal(got, want.astype(dtype))
