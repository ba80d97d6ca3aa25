"""Which arrays' chunks transfer tasks may make themselves (rechunk_p2p.sources)."""

from __future__ import annotations

import dask
import dask.array as da
import numpy as np
import pytest
import zarr

import rechunk_p2p
from rechunk_p2p.sources import MAX_SHARED_KEYS, find_sources
from rechunk_p2p.zarr_reads import read_box_blocking


def _generated() -> da.Array:
    return da.map_blocks(
        lambda block_info=None: np.full((2, 10), block_info[None]["chunk-location"][0]),
        chunks=((2,) * 5, (10,)),
        dtype=int,
    )


def _random(seed: int = 0) -> da.Array:
    return da.random.default_rng(seed).random((20, 10), chunks=(2, 10))


def _zarr_array(tmp_path) -> zarr.Array:
    z = zarr.open_array(tmp_path / "a.zarr", mode="w", shape=(20, 10), chunks=(2, 10), dtype="f4")
    z[:] = np.arange(200, dtype="f4").reshape(20, 10)
    return z


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda tmp: _generated(), id="map_blocks"),
        pytest.param(lambda tmp: da.ones((20, 10), chunks=(2, 10)), id="ones"),
        pytest.param(
            lambda tmp: da.random.default_rng(0).random((20, 10), chunks=(2, 10)), id="random"
        ),
        pytest.param(lambda tmp: da.arange(200, chunks=20), id="arange"),
        pytest.param(lambda tmp: da.from_zarr(_zarr_array(tmp)), id="from_zarr"),
        pytest.param(
            lambda tmp: (da.from_zarr(_zarr_array(tmp)) * 2 + 1).astype("f8"),
            id="from_zarr-then-elementwise",
        ),
        # generated data is no blockwise layer, so dask's fusion leaves steps on top apart
        pytest.param(lambda tmp: _random().astype("f4"), id="random-then-astype"),
        pytest.param(lambda tmp: _random() * 0.01 + 273.15, id="random-then-scale-offset"),
        pytest.param(
            lambda tmp: da.where(_random() > 0.5, _random(), 0).clip(0.1, 0.9),
            id="random-then-where-and-clip",
        ),
        pytest.param(
            lambda tmp: _generated().map_blocks(np.negative).astype("f8"),
            id="map_blocks-then-map_blocks",
        ),
        pytest.param(lambda tmp: _random() + _random(1), id="two-generated-inputs"),
    ],
)
def test_chunks_made_from_nothing_or_a_store_are_found(make, tmp_path):
    x = make(tmp_path)
    sources = find_sources(x)
    assert sources is not None
    keys = list(dask.core.flatten(x.__dask_keys__()))
    for key in keys:
        task = sources.task(key)
        # each task reads only the shared values (a zarr store's array, or nothing)
        assert task.dependencies <= {k for layer in sources.shared.values() for k in layer}
    assert sum(len(layer) for layer in sources.shared.values()) <= MAX_SHARED_KEYS


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: da.from_array(np.ones((20, 10)), chunks=(2, 10)), id="held-data"),
        pytest.param(
            lambda: da.ones((20, 10), chunks=(2, 10)).persist(scheduler="sync"), id="persisted"
        ),
        pytest.param(
            lambda: da.ones((20, 10), chunks=(2, 10)) + da.ones((20, 10), chunks=(2, 10)).sum(),
            id="reads-other-chunks",
        ),
        pytest.param(
            lambda: da.ones((20, 10), chunks=(2, 10))[::-1] + 1,
            id="reads-chunks-of-a-slice",
        ),
        pytest.param(
            lambda: rechunk_p2p.rechunk(da.ones((20, 10), chunks=(2, 10)), (20, 1)),
            id="another-rechunk",
        ),
        pytest.param(lambda: _random() - _random().mean(axis=0), id="anomalies-of-generated"),
        pytest.param(lambda: _random()[::-1] * 2, id="a-step-on-a-reversed-slice"),
        pytest.param(
            lambda: da.ones((20, 10), chunks=(2, 10)).persist(scheduler="sync").astype("f4"),
            id="a-step-on-a-persisted-array",
        ),
    ],
)
def test_held_or_derived_chunks_are_not_made_by_transfers(make):
    assert find_sources(make()) is None


def test_annotated_inputs_keep_their_own_tasks():
    with dask.annotate(retries=3):
        x = da.ones((20, 10), chunks=(2, 10)) + 1
    assert find_sources(x) is None


def test_a_plan_joins_only_inputs_made_in_the_transfers():
    made = da.ones((256, 16), chunks=(1, 16))
    held = made.persist(scheduler="sync")
    assert rechunk_p2p.plan(made, (256, 4), n_workers=2).groups is not None
    assert rechunk_p2p.plan(held, (256, 4), n_workers=2).groups is None
    with dask.config.set({"rechunk-p2p.transfer-group-bytes": 0}):
        assert rechunk_p2p.plan(made, (256, 4), n_workers=2).groups is None
    # fewer chunks than the fewest transfers a rechunk keeps: nothing to join
    assert rechunk_p2p.plan(made[:40], (40, 4), n_workers=2).groups is None


def test_a_joined_rechunk_reads_no_chunk_of_its_input():
    x = da.ones((256, 16), chunks=(1, 16)) * 3
    y = rechunk_p2p.rechunk(x, (256, 4))
    graph = dict(y.__dask_graph__())
    assert not any(isinstance(k, tuple) and k[0] == x.name for k in graph)
    plan = rechunk_p2p.plan(x, (256, 4), n_workers=2)
    transfers = [k for k in graph if isinstance(k, tuple) and "rechunk_p2p-transfer" in k[0]]
    assert len(transfers) == plan.n_transfers < plan.n_input_chunks
    np.testing.assert_array_equal(y.compute(scheduler="sync"), np.full((256, 16), 3.0))


def _getters(node) -> int:
    """How many reads of an array object (dask's ``getter``, or the engine's read of a box)
    a task holds, nested ones included."""
    from dask._task_spec import Task

    if not isinstance(node, Task):
        return 0
    own = node.func in (da.core.getter, read_box_blocking)
    return own + sum(_getters(a) for a in (*node.args, *node.kwargs.values()))


def test_a_joined_group_of_array_slices_is_read_in_one_call(tmp_path):
    z = zarr.open_array(tmp_path / "s.zarr", mode="w", shape=(64, 8, 6), chunks=(1, 4, 6))
    z[:] = np.arange(z.size, dtype="f8").reshape(z.shape)
    x = da.from_zarr(z)
    y = rechunk_p2p.rechunk(x, (64, 2, 3))
    plan = rechunk_p2p.plan(x, (64, 2, 3), n_workers=2)
    assert plan.groups is not None and len(plan.groups[0]) < 64  # time steps joined
    graph = dict(y.__dask_graph__())
    transfers = [v for k, v in graph.items() if "rechunk_p2p-transfer" in str(k)]
    # one read of the store per transfer task, for all the chunks it joins
    assert sum(_getters(t) for t in transfers) == len(transfers) == plan.n_transfers
    np.testing.assert_array_equal(y.compute(scheduler="sync"), z[:])


def test_slices_that_do_not_tile_a_box_are_read_one_by_one():
    from dask._task_spec import DataNode, Task, TaskRef

    from rechunk_p2p.sources import read_together

    def get(*box, **kwargs):
        return Task(None, da.core.getter, TaskRef("a"), DataNode(None, box), **kwargs)

    rows = [get(slice(0, 2), slice(0, 5)), get(slice(2, 4), slice(0, 5))]
    one = read_together(rows, (2, 1))
    assert one is not None and one.args[1].value == (slice(0, 4), slice(0, 5))
    assert one.func is read_box_blocking
    gap = [get(slice(0, 2), slice(0, 5)), get(slice(3, 4), slice(0, 5))]
    other = [
        rows[0],
        Task(None, da.core.getter, TaskRef("b"), DataNode(None, rows[1].args[1].value)),
    ]
    locked = [rows[0], get(slice(2, 4), slice(0, 5), lock=True)]
    swapped = [rows[1], rows[0]]
    for made in (gap, other, locked, swapped):
        assert read_together(made, (2, 1)) is None


def _calls(node, func) -> int:
    """How many calls of ``func`` a task holds, in nested tasks and fused subgraphs."""
    from dask._task_spec import Task

    if isinstance(node, dict):
        return sum(_calls(v, func) for v in node.values())
    if not isinstance(node, Task):
        return 0
    own = node.func is func
    return own + sum(_calls(a, func) for a in (*node.args, *node.kwargs.values()))


#: Chains of elementwise steps users put before a rechunk, with dtype changes and scalars
STEPS = {
    "astype": lambda x: x.astype("f4"),
    "scale-offset": lambda x: x * 0.01 + 273.15,
    "where-clip": lambda x: da.where(x > 100, x, 0).clip(10, 150),
    "fillna-sqrt": lambda x: np.sqrt(da.where(da.isnan(x), 0.0, x)),
    "compare": lambda x: (x >= 50).astype("i1") - 1,
}


def _transfers(y) -> list:
    return [v for k, v in dict(y.__dask_graph__()).items() if "rechunk_p2p-transfer" in str(k)]


@pytest.mark.parametrize("step", STEPS)
def test_a_chain_of_elementwise_steps_on_a_store_reads_each_group_once(tmp_path, step):
    """The box of a transfer's chunks is read in one call and the steps applied to it once;
    the values are dask's own."""
    from dask._task_spec import _execute_subgraph

    z = zarr.open_array(tmp_path / "s.zarr", mode="w", shape=(64, 8, 6), chunks=(1, 4, 6))
    z[:] = np.arange(z.size, dtype="f8").reshape(z.shape)
    x = STEPS[step](da.from_zarr(z))
    y = rechunk_p2p.rechunk(x, (64, 2, 3))
    transfers = _transfers(y)
    plan = rechunk_p2p.plan(x, (64, 2, 3), n_workers=2)
    assert len(transfers) == plan.n_transfers < plan.n_input_chunks
    assert [_calls(t, read_box_blocking) for t in transfers] == [1] * len(transfers)
    # the chain of one chunk, once a transfer (not once a chunk of its group)
    chain = _calls(find_sources(x).task((x.name, 0, 0, 0)), _execute_subgraph)
    assert [_calls(t, _execute_subgraph) for t in transfers] == [chain] * len(transfers)
    got = y.compute(scheduler="sync")
    assert got.dtype == x.dtype
    np.testing.assert_array_equal(got, x.rechunk((64, 2, 3)).compute(scheduler="sync"))


@pytest.mark.parametrize("step", ["none", *STEPS])
def test_a_store_read_is_joined_without_making_a_task_a_chunk(tmp_path, monkeypatch, step):
    """The box a transfer reads from ``from_zarr`` (any elementwise chain) is known from the
    layer's slices: no input chunk's task is made one by one, and the values are dask's
    own."""
    from rechunk_p2p.sources import InputSources

    z = zarr.open_array(tmp_path / "s.zarr", mode="w", shape=(64, 8, 6), chunks=(1, 4, 6))
    z[:] = np.arange(z.size, dtype="f8").reshape(z.shape)
    source = STEPS.get(step, lambda a: a)(da.from_zarr(z))
    want = source.rechunk((64, 2, 3)).compute(scheduler="sync")

    def one_by_one(self, key):
        raise AssertionError(f"chunk {key} made one by one")

    monkeypatch.setattr(InputSources, "task", one_by_one)
    y = rechunk_p2p.rechunk(source, (64, 2, 3))
    transfers = _transfers(y)
    assert 1 < len(transfers) < source.npartitions
    assert [_calls(t, read_box_blocking) for t in transfers] == [1] * len(transfers)
    got = y.compute(scheduler="sync")
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("step", STEPS)
def test_a_chain_of_elementwise_steps_on_generated_data_runs_once_a_group(step):
    """Generated chunks are made, joined into the transfer's box, and the steps applied to
    the box once (one join a transfer); the values are dask's own."""
    from rechunk_p2p import tasks

    x = STEPS[step](da.random.default_rng(0).random((256, 16), chunks=(1, 16)) * 200)
    y = rechunk_p2p.rechunk(x, (256, 4))
    transfers = _transfers(y)
    assert len(transfers) < 256
    assert [_calls(t, tasks.join) for t in transfers] == [1] * len(transfers)
    got = y.compute(scheduler="sync")
    assert got.dtype == x.dtype
    np.testing.assert_array_equal(got, x.rechunk((256, 4)).compute(scheduler="sync"))


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda x: x.map_blocks(lambda b: b[::-1]), id="map_blocks"),
        pytest.param(lambda x: x * np.arange(16.0), id="a-broadcast-constant"),
    ],
)
def test_steps_not_known_elementwise_run_chunk_by_chunk(make):
    """A function the engine cannot tell elementwise (here one that is not) is applied to
    each chunk as dask would, inside the transfer: no box is joined for it."""
    from rechunk_p2p import tasks

    x = make(da.random.default_rng(0).random((256, 16), chunks=(1, 16)))
    y = rechunk_p2p.rechunk(x, (256, 4))
    assert sum(_calls(t, tasks.join) for t in _transfers(y)) == 0
    np.testing.assert_array_equal(
        y.compute(scheduler="sync"), x.rechunk((256, 4)).compute(scheduler="sync")
    )


@pytest.mark.parametrize(
    ("make", "origin"),
    [
        (lambda: _random() * 0.01 + 273.15, "made inside the transfer tasks"),
        (
            lambda: _random() - _random().mean(axis=0),
            "before the transfers: step 'sub' reads the results of other computations (mean",
        ),
        (
            lambda: _random().map_overlap(lambda b: b, depth=1),
            "before the transfers: its chunks (overlap) are computed from other tasks' results",
        ),
        (
            lambda: da.from_array(np.ones((20, 10)), chunks=(2, 10)) + 1,
            "before the transfers: its chunks (array) are held data",
        ),
    ],
)
def test_the_plan_says_where_the_input_comes_from_and_why(make, origin):
    plan = rechunk_p2p.plan(make(), (20, 1), n_workers=2)
    assert origin in plan.origin
    assert f"  input        {plan.origin}" in repr(plan).splitlines()


def test_the_plan_names_a_setting_that_keeps_chunks_apart():
    with dask.config.set({"rechunk-p2p.transfer-group-bytes": 0}):
        plan = rechunk_p2p.plan(_random(), (20, 1), n_workers=2)
    assert plan.origin.endswith("transfer-group-bytes is 0")
