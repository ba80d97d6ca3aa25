"""Checks run with dask's array query planning on (``array.query-planning: True``).

Where it runs: a pytest subprocess started by ``tests/test_query_planning.py`` with
``DASK_ARRAY__QUERY_PLANNING=True`` (dask.array reads the setting once, at import), against an
in-process cluster.
"""

from __future__ import annotations

import dask
import dask.array as da
import numpy as np
import pytest
from distributed import Client, LocalCluster

import rechunk_p2p
from rechunk_p2p.spec import BARRIER_PREFIX, OUTPUT_PREFIX


@pytest.fixture(scope="module")
def client():
    assert dask.config.get("array.query-planning") is True
    assert da.Array.__module__.startswith("dask.array._array_expr")
    with (
        LocalCluster(
            processes=False, n_workers=2, threads_per_worker=1, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as c,
    ):
        yield c


def _engine_ran(y) -> bool:
    graph = dict(y.__dask_graph__())
    return any(str(k).startswith(BARRIER_PREFIX) for k in graph)


def test_engine_on_expression_arrays(client):
    a = np.random.default_rng(0).uniform(size=(10, 10, 5))
    x = da.from_array(a, chunks=(1, 5, 1))
    y = rechunk_p2p.rechunk(x, (5, 3, -1))
    assert type(y.expr).__name__ == "P2PRechunk"
    assert y.name.startswith(OUTPUT_PREFIX)
    assert y.chunks == x.rechunk((5, 3, -1), method="tasks").chunks
    assert _engine_ran(y)
    np.testing.assert_array_equal(y.compute(), a)


def test_slices_are_pushed_into_the_shuffle(client):
    """A slice of the output builds only the output chunks it reads: fewer transfers."""
    a = np.random.default_rng(1).uniform(size=(10, 10, 5))
    x = da.from_array(a, chunks=(1, 5, 1))
    y = rechunk_p2p.rechunk(x, (5, 3, -1))

    def transfers(z):
        graph = dict(z.expr.optimize().__dask_graph__())
        return sum("rechunk_p2p-transfer" in str(k) for k in graph)

    assert transfers(y) == 100
    assert transfers(y[:5, 1:5]) == 50  # output chunks (0, 0) and (0, 1): first partial only
    np.testing.assert_array_equal(y[:5, 1:5].compute(), a[:5, 1:5])
    np.testing.assert_array_equal(y[7:, ::2].compute(), a[7:, ::2])


def test_install_routes_method_and_dask_choice(client):
    b = np.random.default_rng(2).uniform(size=(100, 100))
    x = da.from_array(b, chunks=(100, 1))
    new = ((1,) * 100, (100,))
    with pytest.raises(NotImplementedError):  # dask itself has no P2P here
        x.rechunk(new, method="p2p").compute()
    with rechunk_p2p.installed():
        for y in (x.rechunk(new, method="p2p"), x.rechunk(new), da.rechunk(x, new)):
            assert type(y.expr).__name__ == "P2PRechunk"
            np.testing.assert_array_equal(y.compute(), b)
        assert type(x.rechunk(new, method="tasks").expr).__name__ == "Rechunk"
    assert type(x.rechunk(new, method="p2p").expr).__name__ == "Rechunk"  # restored


def test_unknown_chunk_sizes(client):
    a = np.arange(100).reshape(10, 10)
    x = da.from_array(a, chunks=(5, 5))
    unknown = ((np.nan, np.nan), (5, 5))
    y = x.map_blocks(lambda block: block, chunks=unknown, dtype=x.dtype)
    z = rechunk_p2p.rechunk(y, (None, (3, 7)))
    assert _engine_ran(z)
    # dask's expressions cannot concatenate chunks of unknown size (compute() fails there with
    # method="tasks" too): gather the blocks instead
    from distributed import futures_of

    blocks = client.gather(futures_of(client.persist(z)))
    rows = sorted({b.shape[0] for b in blocks})
    assert rows == [5] and len(blocks) == 4
    assert sorted(b.shape[1] for b in blocks) == [3, 3, 7, 7]
    assert sum(int(b.sum()) for b in blocks) == int(a.sum())
