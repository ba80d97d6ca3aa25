"""The engine's matrix on in-process clusters (gen_cluster).

Shapes from 0-d to 5-D with regular, irregular and zero-size chunks, every dtype family, every
chunk specification form, 1 to 3 workers, disk and memory storage; rechunks inside bigger
graphs, concurrent and persisted rechunks, culling; and cleanup after failures and
cancellation. Results are compared with numpy (values and dtype) and chunks with dask's own
``method="tasks"``; every test ends with :func:`tests.conftest.assert_clean`.

Several cases share one cluster where they need the same one, to keep the run short.
"""

from __future__ import annotations

import asyncio
import threading
import time
from unittest import mock

import dask
import dask.array as da
import numpy as np
import pytest
from distributed import wait
from distributed.utils_test import gen_cluster

import rechunk_p2p
from tests.conftest import assert_clean, spill_files
from tests.engine_helpers import (
    ONE,
    PLUGIN,
    THREE,
    TWO,
    assert_storage_used,
    check_graph,
    check_many,
    check_rechunk,
    check_result,
    sample_arrays,
)

# (shape, input chunks, output chunks)
SHAPE_CASES = [
    ((30,), 7, 4),
    ((30,), ((3, 10, 2, 15),), ((15, 15),)),
    ((30,), ((3, 10, 2, 15),), ((1, 8, 8, 13),)),
    ((7,), ((3, 0, 4),), ((2, 0, 5),)),
    ((7,), ((3, 0, 4),), (7,)),
    ((7,), ((7,),), ((0, 3, 0, 4, 0),)),
    ((5,), ((0, 5, 0),), ((2, 3),)),
    ((4, 0), ((2, 2), (0,)), ((1, 3), (0,))),
    ((4, 0, 3), (2, 0, 1), (1, 0, 3)),
    ((0, 5), ((0,), (2, 3)), ((0,), (5,))),
    ((10, 12), (2, 12), (10, 3)),
    ((10, 12), ((1, 4, 5), (7, 5)), ((5, 5), (2, 2, 8))),
    ((6, 4), ((3, 0, 3), (2, 2)), ((2, 0, 4), (1, 3))),
    ((6, 5, 4), (1, 5, 4), (6, 1, 2)),
    ((4, 3, 5, 2), (1, 3, 5, 1), (4, 1, 2, 2)),
    ((3, 4, 2, 3, 2), (1, 4, 2, 3, 1), (3, 1, 1, 3, 2)),
    ((3, 4, 2, 3, 2), (1, 1, 2, 1, 2), (3, 4, 1, 3, 1)),
]


async def _shapes(c, s, workers, storage):
    cases = []
    for shape, old, new in SHAPE_CASES:
        expected = np.arange(int(np.prod(shape)), dtype="i8").reshape(shape)
        x = da.from_array(expected, chunks=old)
        cases.append((x, expected, new, {}))
    await check_many(c, s, cases)  # all at once
    await assert_clean(s, *workers)
    for x, expected, new, _ in cases[::3]:  # and some one by one
        await check_rechunk(c, s, x, expected, new)
    await assert_clean(s, *workers)
    assert_storage_used(storage, *workers)


@gen_cluster(client=True, nthreads=ONE, allow_unclosed=False)
async def test_shapes_one_worker(c, s, a, storage):
    await rechunk_p2p.register(c)
    await _shapes(c, s, [a], storage)


@gen_cluster(client=True, nthreads=TWO, allow_unclosed=False)
async def test_shapes_two_workers(c, s, a, b, storage):
    await rechunk_p2p.register(c)
    await _shapes(c, s, [a, b], storage)


@gen_cluster(client=True, nthreads=THREE, allow_unclosed=False)
async def test_shapes_three_workers(c, s, a, b, w3, storage):
    await rechunk_p2p.register(c)
    await _shapes(c, s, [a, b, w3], storage)


@gen_cluster(client=True, nthreads=TWO, allow_unclosed=False)
async def test_dtypes(c, s, a, b, storage):
    await rechunk_p2p.register(c)
    cases = []
    for expected in sample_arrays().values():
        cases.append((da.from_array(expected, chunks=(1, 8)), expected, (6, 2), {}))
        x = da.from_array(expected, chunks=((2, 4), (3, 1, 4)))
        cases.append((x, expected, ((1, 5), (5, 3)), {}))
    await check_many(c, s, cases)
    await assert_clean(s, a, b)
    assert_storage_used(storage, a, b)


@gen_cluster(client=True, nthreads=TWO, allow_unclosed=False)
async def test_zero_dimensional_and_empty_arrays_are_returned_unchanged(c, s, a, b):
    await rechunk_p2p.register(c)
    for expected in (np.array(3.5), np.array("text"), np.array(None, dtype=object)):
        x = da.from_array(expected)
        for chunks in ((), "auto", {}, -1):
            y = await check_rechunk(c, s, x, expected, chunks)
            assert y is x
    for shape, old, new in [((0,), (0,), (5,)), ((0, 0), (0, 0), (2, 2))]:
        expected = np.zeros(shape, dtype="f4")
        x = da.from_array(expected, chunks=old)
        assert await check_rechunk(c, s, x, expected, new) is x
    assert s.plugins[PLUGIN].runs_created == 0
    await assert_clean(s, a, b)


# (chunks, keyword arguments) on an array of shape (12, 10, 8) with chunks (1, 10, 8)
SPEC_CASES = [
    ((6, 5, 4), {}),
    ([6, 5, 4], {}),
    ({0: 6}, {}),
    ({0: -1, 1: 3}, {}),
    ({0: None, 1: 3}, {}),
    ({-1: 3, 0: 4}, {}),
    (-1, {}),
    (4, {}),
    ((None, 2, None), {}),
    ((-1, "auto", None), {"block_size_limit": 2000}),
    ("auto", {"block_size_limit": 4000}),
    ({0: "auto", 2: 2}, {"block_size_limit": 1000}),
    ("auto", {}),
    (((5, 7), (3, 3, 4), (8,)), {}),
    (((12,), (10,), (1,) * 8), {}),
    ((5, 3, 8), {"balance": True}),
    ((7, 4, 3), {"balance": True}),
    ((6, 5, 4), {"threshold": 2}),
]


@gen_cluster(client=True, nthreads=TWO, allow_unclosed=False)
async def test_chunk_specification_forms(c, s, a, b):
    await rechunk_p2p.register(c)
    expected = np.random.default_rng(0).random((12, 10, 8))
    x = da.from_array(expected, chunks=(1, 10, 8))
    cases = [(x, expected, chunks, kwargs) for chunks, kwargs in SPEC_CASES]
    for y, (chunks, kwargs) in zip(await check_many(c, s, cases), SPEC_CASES):
        assert y is not x, (chunks, kwargs)
    await assert_clean(s, a, b)


@gen_cluster(client=True, nthreads=TWO, allow_unclosed=False)
async def test_same_chunks_return_the_input_unchanged(c, s, a, b):
    await rechunk_p2p.register(c)
    x = da.from_array(np.arange(120).reshape(12, 10), chunks=((5, 7), (3, 3, 4)))
    same = [
        x.chunks,
        ((5, 7), (3, 3, 4)),
        {0: (5, 7)},
        {1: None},
        (None, None),
        {},
        (None, (3, 3, 4)),
    ]
    for chunks in same:
        assert rechunk_p2p.rechunk(x, chunks) is x, chunks
    regular = da.ones((12, 10), chunks=(4, 5))
    for chunks in [(4, 5), {0: 4}, ((4, 4, 4), 5), {1: 5}]:
        assert rechunk_p2p.rechunk(regular, chunks) is regular, chunks
    assert not s.tasks
    assert s.plugins[PLUGIN].runs_created == 0
    await assert_clean(s, a, b)


@gen_cluster(client=True, nthreads=TWO, allow_unclosed=False)
async def test_chained_inside_a_bigger_graph(c, s, a, b, storage):
    await rechunk_p2p.register(c)
    arr = np.random.default_rng(1).random((24, 18))
    x = da.from_array(arr, chunks=(2, 18))
    y = rechunk_p2p.rechunk(x, (24, 3))
    z = y.map_blocks(np.sqrt) * 2 + x.rechunk((24, 3), method="tasks")
    w = rechunk_p2p.rechunk(z, (5, 9))
    check_graph(z, w, (5, 9))
    total, column_sums = await c.gather(c.compute([w.sum(), w.sum(axis=0)]))
    want = np.sqrt(arr) * 2 + arr
    np.testing.assert_allclose(total, want.sum())
    np.testing.assert_allclose(column_sums, want.sum(axis=0))
    # a rechunk of a rechunk, then a transpose and a matrix product
    v = rechunk_p2p.rechunk(rechunk_p2p.rechunk(x, (3, 6)), (8, 4))
    np.testing.assert_allclose(await c.compute(v.T @ v), arr.T @ arr)
    await assert_clean(s, a, b)
    assert_storage_used(storage, a, b)


@gen_cluster(client=True, nthreads=TWO, allow_unclosed=False)
async def test_concurrent_rechunks_of_one_input(c, s, a, b, storage):
    await rechunk_p2p.register(c)
    arr = np.arange(24 * 18).reshape(24, 18)
    x = da.from_array(arr, chunks=(2, 18))
    y1 = rechunk_p2p.rechunk(x, (24, 3))
    y2 = rechunk_p2p.rechunk(x, (3, 6))
    assert y1.name != y2.name
    # computed together, in one graph
    r1, r2 = await c.gather(c.compute([y1, y2]))
    check_result(r1, arr)
    check_result(r2, arr)
    # computed in parallel by two compute calls, including the very same rechunk twice
    y1_again = rechunk_p2p.rechunk(x, (24, 3))
    assert y1_again.name == y1.name
    results = await asyncio.gather(c.compute(y1), c.compute(y2), c.compute(y1_again))
    for result in results:
        check_result(result, arr)
    await assert_clean(s, a, b)
    assert_storage_used(storage, a, b)


@gen_cluster(client=True, nthreads=TWO, allow_unclosed=False)
async def test_persisted_output_is_reused(c, s, a, b, storage):
    await rechunk_p2p.register(c)
    plugin = s.plugins[PLUGIN]
    arr = np.arange(24 * 18, dtype="f8").reshape(24, 18)
    x = da.from_array(arr, chunks=(2, 18))
    y = c.persist(rechunk_p2p.rechunk(x, (24, 3)))
    await wait(y)
    # the runs are gone once every output chunk was assembled, the output stays
    await assert_clean(s, a, b)
    runs = plugin.runs_created
    assert runs == 1
    check_result(await c.compute(y), arr)
    np.testing.assert_allclose(await c.compute((y + 1).sum(axis=1)), (arr + 1).sum(axis=1))
    check_result(await c.compute(rechunk_p2p.rechunk(y, (6, 18))), arr)
    assert plugin.runs_created == runs + 1  # only the new rechunk of y ran a shuffle
    del y
    await assert_clean(s, a, b)
    assert_storage_used(storage, a, b)


@gen_cluster(
    client=True, nthreads=TWO, allow_unclosed=False, config={"rechunk-p2p.partial-bytes": 0}
)
async def test_culling_runs_only_the_partials_needed(c, s, a, b):
    """Partials as they are (none joined): a slice runs only the partials it touches."""
    await rechunk_p2p.register(c)
    plugin = s.plugins[PLUGIN]
    arr = np.arange(40 * 40).reshape(40, 40)
    x = da.from_array(arr, chunks=(5, 10))
    y = rechunk_p2p.rechunk(x, (10, 5))
    plan = rechunk_p2p.plan(x, (10, 5))
    assert plan.n_partials == plan.n_shuffles == 16  # 4 x 4 independent sub-shuffles
    cases = [
        (y[:10], arr[:10], 4),  # one row of partials
        (y[12:17, 3:9], arr[12:17, 3:9], 1),  # inside one partial
        (y[:, :5], arr[:, :5], 0),  # one output of each partial: plain concatenations
        (y[25:], arr[25:], 8),
    ]
    for sliced, want, n_partials in cases:
        before = plugin.runs_created
        check_result(await c.compute(sliced), want)
        assert plugin.runs_created - before == n_partials
        await assert_clean(s, a, b)
        while s.tasks:  # the next slice defines some of the same output keys differently
            await asyncio.sleep(0.01)
    before = plugin.runs_created
    check_result(await c.compute(y), arr)
    assert plugin.runs_created - before == 16
    await assert_clean(s, a, b)


@gen_cluster(client=True, nthreads=TWO, allow_unclosed=False)
async def test_small_partials_are_joined_into_one_run(c, s, a, b):
    """At defaults the 16 sub-shuffles above are one (each is far below partial-bytes)."""
    await rechunk_p2p.register(c)
    plugin = s.plugins[PLUGIN]
    arr = np.arange(40 * 40).reshape(40, 40)
    x = da.from_array(arr, chunks=(5, 10))
    assert rechunk_p2p.plan(x, (10, 5)).n_partials == 1
    before = plugin.runs_created
    check_result(await c.compute(rechunk_p2p.rechunk(x, (10, 5))), arr)
    assert plugin.runs_created - before == 1
    await assert_clean(s, a, b)
    # 16 partials of 800 B; joined along the last axis first (a row of 3.2 KB), then in
    # pairs of rows: 2 of 6.4 KB
    with dask.config.set({"rechunk-p2p.partial-bytes": "4KiB"}):
        assert rechunk_p2p.plan(x, (10, 5)).n_partials == 2
        before = plugin.runs_created
        check_result(await c.compute(rechunk_p2p.rechunk(x, (10, 5))), arr)
        assert plugin.runs_created - before == 2
    await assert_clean(s, a, b)
    # Each partial has 2 outputs: at most 4 outputs a run joins them in pairs.
    with mock.patch("rechunk_p2p.arrays.PARTIAL_OUTPUTS", 4):
        plan = rechunk_p2p.plan(x, (10, 5))
        assert plan.n_partials == 8 and {p.n_outputs for p in plan.partials} == {4}
        before = plugin.runs_created
        check_result(await c.compute(rechunk_p2p.rechunk(x, (10, 5))), arr)
        assert plugin.runs_created - before == 8
    await assert_clean(s, a, b)


@gen_cluster(
    client=True, nthreads=TWO, allow_unclosed=False, config={"rechunk-p2p.partial-bytes": 0}
)
async def test_culling_transfers_only_the_inputs_needed(c, s, a, b):
    """Finer than a partial: a slice of the output transfers only the input chunks that hold
    a piece of it, and sends only the pieces it needs (distributed's overlapping case)."""
    arr = np.random.default_rng(0).uniform(size=(10, 10, 5))
    x = da.from_array(arr, chunks=(1, 5, 1))
    y = rechunk_p2p.rechunk(x, (5, 3, -1))
    assert rechunk_p2p.plan(x, (5, 3, -1)).n_partials == 2

    def inputs(z):  # input chunks read, fused with their transfers or not
        (dsk,) = dask.optimize(z)
        keys = dsk.dask.get_all_dependencies()
        return {k[1:] for k in keys if isinstance(k, tuple) and k[0].startswith("array-")}

    assert len(inputs(y)) == 100
    assert len(inputs(y[:5, :2])) == 25  # one output chunk: 5 x 1 x 5 input chunks
    assert len(inputs(y[:5])) == 50
    assert len(inputs(y[:5, 3:6])) == 50  # one output chunk over both input columns
    check_result(await c.compute(y[:5, :2]), arr[:5, :2])  # one output chunk: no shuffle
    assert PLUGIN not in s.plugins
    await rechunk_p2p.register(c)
    check_result(await c.compute(y[:5, 1:5]), arr[:5, 1:5])  # output chunks (0, 0), (0, 1)
    assert s.plugins[PLUGIN].runs_created == 1
    sent = sum(w.plugins[PLUGIN].totals().bytes_sent for w in (a, b))
    assert 0 < sent <= arr[:5, :6].nbytes  # only pieces of output chunks (0, 0) and (0, 1)
    await assert_clean(s, a, b)


def _fail_on_block(index):
    def fail(block, block_info=None):
        if block_info[0]["chunk-location"] == index:
            raise ZeroDivisionError(f"failing on purpose in block {index}")
        return block

    return fail


@gen_cluster(client=True, nthreads=TWO, allow_unclosed=False)
async def test_failures_before_and_after_leave_nothing_behind(c, s, a, b, storage):
    await rechunk_p2p.register(c)
    arr = np.arange(40 * 40).reshape(40, 40)
    x = da.from_array(arr, chunks=(1, 40))
    y = rechunk_p2p.rechunk(x, (40, 1))
    downstream = y.map_blocks(_fail_on_block((0, 7)), dtype=y.dtype)
    with pytest.raises(ZeroDivisionError, match="on purpose"):
        await c.compute(downstream)
    await assert_clean(s, a, b)
    upstream = rechunk_p2p.rechunk(x.map_blocks(_fail_on_block((30, 0)), dtype=x.dtype), (40, 1))
    with pytest.raises(ZeroDivisionError, match="on purpose"):
        await c.compute(upstream)
    await assert_clean(s, a, b)
    # the cluster still rechunks afterwards
    check_result(await c.compute(y), arr)
    await assert_clean(s, a, b)
    assert_storage_used(storage, a, b)


def _slow(block):
    time.sleep(0.02)
    return block


@pytest.mark.parametrize("how", ["cancel", "release"])
@gen_cluster(client=True, nthreads=TWO, allow_unclosed=False)
async def test_stopped_mid_way_leaves_nothing_behind(c, s, a, b, how, storage):
    await rechunk_p2p.register(c)
    arr = np.arange(60 * 40).reshape(60, 40)
    x = da.from_array(arr, chunks=(1, 40)).map_blocks(_slow, dtype=arr.dtype)
    y = rechunk_p2p.rechunk(x, (60, 1))
    fut = c.compute(y)
    transfers_done = 0
    while transfers_done < 4:
        await asyncio.sleep(0.005)
        transfers_done = sum(
            ts.state == "memory" and "rechunk_p2p-transfer" in ts.group_key
            for ts in s.tasks.values()
        )
    assert s.plugins[PLUGIN].active, "the run must be in progress when it is stopped"
    assert not fut.done()
    if storage == "disk":
        assert any(spill_files(w.local_directory) for w in (a, b))
    if how == "cancel":
        await fut.cancel()
    else:
        del fut
    await assert_clean(s, a, b)
    while s.tasks:
        await asyncio.sleep(0.01)
    # and the same rechunk runs to the end afterwards
    check_result(await c.compute(y), arr)
    await assert_clean(s, a, b)


@gen_cluster(client=True, nthreads=TWO, allow_unclosed=False)
async def test_released_while_unpacking_leaves_nothing_behind(c, s, a, b, storage):
    """Stopped after the barrier, with output chunks still buffered on the workers."""
    await rechunk_p2p.register(c)
    arr = np.arange(60 * 40).reshape(60, 40)
    y = rechunk_p2p.rechunk(da.from_array(arr, chunks=(1, 40)), (60, 1))
    fut = c.compute(y.map_blocks(_slow, dtype=y.dtype))
    while not any(
        ts.state == "memory" and ts.key[0] == y.name
        for ts in s.tasks.values()
        if isinstance(ts.key, tuple)
    ):
        await asyncio.sleep(0.005)
    assert s.plugins[PLUGIN].active and not fut.done()
    buffered = [
        r.statistics().bytes_buffered for w in (a, b) for r in w.plugins[PLUGIN].runs.values()
    ]
    assert sum(buffered) > 0
    await fut.cancel()
    del fut
    await assert_clean(s, a, b)
    assert_storage_used(storage, a, b)


@gen_cluster(client=True, nthreads=TWO, allow_unclosed=False)
async def test_cancelling_one_of_two_computations_sharing_a_rechunk(c, s, a, b):
    await rechunk_p2p.register(c)
    arr = np.arange(60 * 40).reshape(60, 40)
    x = da.from_array(arr, chunks=(1, 40)).map_blocks(_slow, dtype=arr.dtype)
    y = rechunk_p2p.rechunk(x, (60, 1))
    first = c.compute(y.sum(axis=0))
    second = c.compute((y * 2).max(axis=0))
    while not s.plugins[PLUGIN].active:
        await asyncio.sleep(0.005)
    await first.cancel()
    np.testing.assert_array_equal(await second, (arr * 2).max(axis=0))
    assert s.plugins[PLUGIN].runs_created == 1  # the run went on for the other computation
    del first, second
    await assert_clean(s, a, b)


#: 2 of a worker's 5 output chunks of 960 bytes fit a budget of 2,400 bytes (of 2 GiB)
_TWO_OUTPUTS = 2400 / 2**31


@pytest.mark.parametrize(
    ("fraction", "expected"),
    [(0.25, "memory"), (_TWO_OUTPUTS, "memory+disk"), (1e-9, "disk")],
)
@gen_cluster(
    client=True,
    nthreads=TWO,
    worker_kwargs={"memory_limit": "2GiB"},
    config={"rechunk-p2p.storage": "auto"},
    allow_unclosed=False,
)
async def test_auto_storage_follows_the_memory_budget(c, s, a, b, fraction, expected):
    """``auto`` keeps pieces in memory only within the budget, and the engine's own
    statistics show what it held: each worker at most the pieces of its own outputs (half
    the array), within ``storage-memory-fraction`` of its memory limit. Past the budget, the
    outputs that fit it are still filled in memory and only the others' pieces spilled."""
    from rechunk_p2p.worker import tuning as tuning_module

    malloc = tuning_module.PROCESS_TUNING.malloc
    holds = []
    hold = malloc.hold
    malloc.hold = lambda: (holds.append(1), hold())
    await rechunk_p2p.register(c)
    arr = np.arange(40 * 30).reshape(40, 30)
    x = da.from_array(arr, chunks=(1, 30))
    try:
        with dask.config.set({"rechunk-p2p.storage-memory-fraction": fraction}):
            check_result(await c.compute(rechunk_p2p.rechunk(x, (40, 3))), arr)
    finally:
        del malloc.hold
    await assert_clean(s, a, b)
    # freed memory kept for the run where pieces stay in memory, not for a run on disk
    assert bool(holds) == (expected != "disk")
    assert not malloc.held
    totals = [w.plugins[PLUGIN].totals() for w in (a, b)]
    held = [t.max_bytes_stored_in_memory for t in totals]
    spilled = [t.bytes_spilled for t in totals]
    assert all(0 < h <= arr.nbytes // 2 for h in held), held  # 5 of the 10 outputs each
    output = 40 * 3 * arr.itemsize
    if expected == "memory":
        assert spilled == [0, 0]
        assert all(h <= fraction * 2 * 2**30 for h in held)
    elif expected == "disk":
        assert spilled == [5 * output] * 2
    else:  # 2 outputs in memory, the pieces of the other 3 spilled
        assert spilled == [3 * output] * 2


@gen_cluster(client=True, nthreads=TWO, allow_unclosed=False)
async def test_close_overtaking_the_run_reply_leaves_nothing_behind(c, s, a, b):
    """The scheduler closes a run while its reply to one worker is still on the way: the
    close message arrives first, and the late reply must not open the run there."""
    await rechunk_p2p.register(c)
    get_or_create = b.scheduler.rechunk_p2p_get_or_create
    replied, release = asyncio.Event(), asyncio.Event()

    async def delayed_reply(**kwargs):
        response = await get_or_create(**kwargs)
        replied.set()
        await release.wait()
        return response

    b.scheduler.rechunk_p2p_get_or_create = delayed_reply  # injects the delay on b only
    arr = np.arange(60 * 40).reshape(60, 40)
    x = da.from_array(arr, chunks=(1, 40)).map_blocks(_slow, dtype=arr.dtype)
    y = rechunk_p2p.rechunk(x, (60, 1))
    fut = c.compute(y)
    await replied.wait()
    (run,) = s.plugins[PLUGIN].active.values()
    assert b.address in run.participants
    await fut.cancel()
    del fut
    while s.plugins[PLUGIN].active:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)  # let the close message reach b
    release.set()
    await assert_clean(s, a, b)
    b.scheduler.rechunk_p2p_get_or_create = get_or_create
    check_result(await c.compute(y), arr)
    await assert_clean(s, a, b)


_GATE = threading.Event()  # gen_cluster workers run in this process


def _gated(block):
    assert _GATE.wait(20)
    return block


@gen_cluster(client=True, nthreads=TWO, allow_unclosed=False)
async def test_outputs_requested_while_the_run_is_on(c, s, a, b):
    """A second computation asks for outputs the first one culled, while the run is active:
    its unpack tasks were not pinned when the run started, and still find their pieces."""
    await rechunk_p2p.register(c)
    _GATE.clear()
    arr = np.arange(40 * 40).reshape(40, 40)
    y = rechunk_p2p.rechunk(da.from_array(arr, chunks=(1, 40)), (40, 1))
    # the worker owning these outputs soon waits at the gate, with more unpacks to run
    first = c.compute(y[:, :20].map_blocks(_gated, meta=np.empty((0, 0), y.dtype)))
    while not any(ts.state == "memory" and ts.key[0] == y.name for ts in _tuple_tasks(s)):
        await asyncio.sleep(0.005)
    second = c.compute(y)
    while not any(ts.key == (y.name, 0, 39) for ts in _tuple_tasks(s)):
        await asyncio.sleep(0.005)
    assert s.plugins[PLUGIN].active
    _GATE.set()
    check_result(await second, arr)
    check_result(await first, arr[:, :20])
    # the culled first computation is a sub-shuffle of its own (its outputs only)
    assert s.plugins[PLUGIN].runs_created == 2
    del first, second
    await assert_clean(s, a, b)


def _tuple_tasks(s):
    return [ts for ts in s.tasks.values() if isinstance(ts.key, tuple)]


@gen_cluster(
    client=True,
    nthreads=TWO,
    config={"rechunk-p2p.storage": "disk", "rechunk-p2p.disk-direct-io": True},
)
async def test_disk_storage_unbuffered(c, s, a, b):
    """``disk-direct-io: true``: the workers' stores write and read their files with
    O_DIRECT (the engine's own buffers: 64 MiB of write buffer, outputs of 4 KiB pieces),
    and the result is the same."""
    from rechunk_p2p.store import direct

    writes, reads = [], []
    write, read = direct.DirectFile.write_blocking, direct.DirectFile.read_blocking

    def counted_write(self, views, offset):
        writes.append(offset)
        return write(self, views, offset)

    def counted_read(self, offsets, sizes, place):
        reads.append(len(offsets))
        return read(self, offsets, sizes, place)

    direct.DirectFile.write_blocking, direct.DirectFile.read_blocking = counted_write, counted_read
    try:
        await rechunk_p2p.register(c)
        arr = np.arange(64 * 48 * 32, dtype="f4").reshape(64, 48, 32)
        x = da.from_array(arr, chunks=(1, 48, 32))
        check_result(await c.compute(rechunk_p2p.rechunk(x, (64, 16, 16))), arr)
    finally:
        direct.DirectFile.write_blocking, direct.DirectFile.read_blocking = write, read
    await assert_clean(s, a, b)
    assert writes and all(offset % direct.ALIGNMENT == 0 for offset in writes)
    assert len(reads) == 6  # one per output chunk


@gen_cluster(
    client=True,
    nthreads=TWO,
    config={"rechunk-p2p.storage": "disk", "rechunk-p2p.disk-direct-io": "auto"},
)
async def test_auto_direct_io_follows_the_hosts_spill(c, s, a, b):
    """``disk-direct-io: auto``: unbuffered when the bytes the host's workers spill outgrow
    the page cache's writeback threshold, through the page cache when they fit it."""
    from rechunk_p2p.store import direct
    from rechunk_p2p.worker import storage_choice as choice_module

    writes = []
    write, threshold = direct.DirectFile.write_blocking, choice_module.writeback_threshold_bytes

    def counted_write(self, views, offset):
        writes.append(offset)
        return write(self, views, offset)

    await rechunk_p2p.register(c)
    arr = np.arange(128 * 48 * 32, dtype="f4").reshape(128, 48, 32)
    x = da.from_array(arr, chunks=(1, 48, 32))
    seen = []
    direct.DirectFile.write_blocking = counted_write
    try:
        for limit in (arr.nbytes - 1, arr.nbytes):  # both workers on this host: all of it
            choice_module.writeback_threshold_bytes = lambda limit=limit: limit
            check_result(await c.compute(rechunk_p2p.rechunk(x, (128, 16, 16))), arr)
            await assert_clean(s, a, b)
            seen.append(len(writes))
    finally:
        direct.DirectFile.write_blocking = write
        choice_module.writeback_threshold_bytes = threshold
    assert seen[0] > 0 and seen[1] == seen[0]  # unbuffered first, then through the cache
