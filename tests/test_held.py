"""Held inputs: one transfer task cuts several chunks that sit on the same worker."""

from __future__ import annotations

import itertools

import dask.array as da
import numpy as np
import pytest
from distributed import wait
from hypothesis import given, settings
from hypothesis import strategies as st

import rechunk_p2p
from rechunk_p2p.holders import HeldChunks, find_held, held_groups, held_transfers
from rechunk_p2p.planning.groups import group_members
from tests.conftest import assert_clean_sync


def _transfer_groups(y: da.Array) -> tuple[tuple[int, ...], ...] | None:
    graph = y.__dask_graph__()
    barriers = [k for k in graph if str(k).startswith("rechunk_p2p-barrier-")]
    (barrier,) = barriers
    return graph[barrier].spec.transfer_groups


@settings(max_examples=200, deadline=None)
@given(
    workers=st.lists(st.sampled_from(["a", "b", "c", None]), min_size=1, max_size=60),
    per_task=st.integers(1, 20),
    threads=st.integers(1, 4),
)
def test_each_input_is_cut_once_by_a_task_of_its_worker(workers, per_task, threads):
    flats = list(range(0, 3 * len(workers), 3))
    groups = held_transfers(flats, workers, per_task, {"a": threads, "b": 1})
    members = [f for g in groups for f in g]
    assert sorted(members) == flats  # every input exactly once
    assert list(groups) == sorted(groups) and all(list(g) == sorted(g) for g in groups)
    where = dict(zip(flats, workers))
    for g in groups:
        assert len({where[f] for f in g}) == 1  # one worker's chunks
        assert where[g[0]] is not None or len(g) == 1  # an input of unknown place alone
    for worker, n_threads in (("a", threads), ("b", 1), ("c", 1)):
        mine = [g for g in groups if where[g[0]] == worker]
        n = sum(len(g) for g in mine)
        assert len(mine) >= min(n, 2 * n_threads)  # work for every thread
        assert all(len(g) <= max(per_task, -(-n // (2 * n_threads))) for g in mine)


@settings(max_examples=200, deadline=None)
@given(
    holders=st.lists(st.sampled_from(["a", "b", None]), min_size=2, max_size=80),
    out_rows=st.integers(1, 40),
    limit_rows=st.integers(1, 30),
)
def test_joined_held_chunks_sit_on_one_worker_inside_one_output(holders, out_rows, limit_rows):
    n = len(holders)
    old = ((1,) * n, (8,))
    new_rows = [out_rows] * (n // out_rows) + ([n % out_rows] if n % out_rows else [])
    where = {(i, 0): w for i, w in enumerate(holders) if w is not None}
    groups = held_groups(
        old, (tuple(new_rows), (4, 4)), 8, limit_rows * 64, HeldChunks(where, {}), 2
    )
    if groups is None:
        return
    assert groups[1] == (1,) and sum(groups[0]) == n
    ends = set(itertools.accumulate(new_rows))
    for members in group_members(groups[0]):
        assert len(members) <= max(limit_rows, 1)
        if len(members) > 1:
            assert len({holders[i] for i in members}) == 1 and holders[members[0]] is not None
            # never across an output boundary
            assert not any(i in ends for i in range(members.start + 1, members.stop))


def test_a_persisted_input_is_cut_by_fewer_tasks_with_the_same_result(client):
    a = np.random.default_rng(0).random((96, 64))
    x = client.persist(da.from_array(a, chunks=(1, 64)))
    wait(x)
    held = find_held(x)
    assert held is not None and len(held.where) == 96
    assert set(held.where.values()) <= set(client.nthreads())
    y = rechunk_p2p.rechunk(x, (96, 4))
    groups = _transfer_groups(y)
    assert groups is not None and 2 <= len(groups) < 96
    plan = rechunk_p2p.plan(x, (96, 4))  # the plan counts the graph's tasks
    assert plan.held_transfers == len(groups)
    assert plan.n_tasks == len(y.__dask_graph__().layers[y.name])
    assert f"{len(groups)} transfer tasks cut the chunks on a worker" in repr(plan)
    np.testing.assert_array_equal(y.compute(), a)
    np.testing.assert_array_equal(y[:5, 8:20].compute(), a[:5, 8:20])  # culled
    assert_clean_sync(client)


def test_each_held_chunk_has_two_dependents_so_ordering_does_not_walk_it(client):
    """dask's ordering walks every root x every output it reaches; a held chunk read by two
    tasks (its transfer and its worker's held task) is no root there."""
    x = client.persist(da.from_array(np.ones((64, 32)), chunks=(1, 32)))
    wait(x)
    y = rechunk_p2p.rechunk(x, (64, 2))
    groups = _transfer_groups(y)
    assert groups is not None
    tasks = y.__dask_graph__().layers[y.name]
    readers: dict = {}
    for key in tasks:
        for dep in tasks[key].dependencies:
            readers.setdefault(dep, set()).add(key)
    held = {k for k in tasks if str(k[0]).startswith("rechunk_p2p-held-")}
    # one held task per worker that holds chunks, before every transfer of that worker
    assert len(held) == len(set(find_held(x).where.values())) == 2 < len(groups)
    for i in range(64):
        (transfer,) = {k for k in readers[(x.name, i, 0)] if k not in held}
        (marker,) = readers[(x.name, i, 0)] & held
        assert "rechunk_p2p-transfer-" in transfer[0]
        assert marker in tasks[transfer].dependencies  # the transfer runs after it
    assert rechunk_p2p.plan(x, (64, 2)).n_tasks == len(tasks)


def test_held_chunks_of_one_worker_are_joined_before_they_are_cut(client):
    """Neighbouring held one-row chunks of one worker are cut as one block (one piece per
    output chunk), held or derived, whole or culled, with the values of the input."""
    a = np.random.default_rng(1).random((1024, 256))
    x = client.persist(da.from_array(a, chunks=(1, 256)))
    wait(x)
    plan = rechunk_p2p.plan(x, (1024, 4))
    assert plan.groups is not None and len(plan.groups[0]) < 1024
    held = find_held(x)
    for members in group_members(plan.groups[0]):
        assert len({held.where[(i, 0)] for i in members}) == 1
    y = rechunk_p2p.rechunk(x, (1024, 4))
    assert plan.n_tasks == len(y.__dask_graph__().layers[y.name])
    np.testing.assert_array_equal(y.compute(), a)
    np.testing.assert_array_equal(y[100:300, 8:20].compute(), a[100:300, 8:20])
    m = x.min(axis=0)
    d = rechunk_p2p.rechunk(x - m + m, (1024, 4))
    np.testing.assert_array_equal(d.compute(), a)
    assert_clean_sync(client)


def test_chunks_that_moved_after_the_graph_was_built_are_fetched(client):
    a = np.arange(64 * 32, dtype="f8").reshape(64, 32)
    x = client.persist(da.from_array(a, chunks=(2, 32)))
    wait(x)
    y = rechunk_p2p.rechunk(x, (64, 4))
    assert _transfer_groups(y) is not None
    client.rebalance(x)  # (may move nothing; either way the result is the same)
    workers = list(client.nthreads())
    client.replicate(x, n=len(workers))
    np.testing.assert_array_equal(y.compute(), a)
    assert_clean_sync(client)


def test_chunks_derived_from_held_ones_are_computed_inside_grouped_transfers(client):
    """Anomalies of a persisted array (each chunk from its held chunk and one reduction over
    all of them): the held chunks' places decide the groups, and the derived chunks are
    computed inside the transfers."""
    a = np.arange(48 * 16, dtype="f8").reshape(48, 16)
    x = client.persist(da.from_array(a, chunks=(1, 16)))
    wait(x)
    derived = x - x.mean(axis=0)
    held = find_held(derived)
    assert held is not None and held.tasks is not None and len(held.tasks) == 48
    y = rechunk_p2p.rechunk(derived, (48, 2))
    groups = _transfer_groups(y)
    assert groups is not None and len(groups) < 48
    np.testing.assert_allclose(y.compute(), a - a.mean(axis=0))
    assert_clean_sync(client)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda c: da.ones((16, 8), chunks=(1, 8)), id="made"),
        pytest.param(
            lambda c: (
                c.persist(da.ones((16, 8), chunks=(1, 8)))
                + c.persist(da.zeros((16, 8), chunks=(1, 8)))
            ),
            id="two-held-chunks-a-chunk",
        ),
    ],
)
def test_inputs_not_held_whole_are_not_grouped(client, make):
    x = make(client)
    assert find_held(x) is None
    y = rechunk_p2p.rechunk(x, (16, 1))
    assert _transfer_groups(y) is None
    np.testing.assert_array_equal(y.compute(), x.compute())
