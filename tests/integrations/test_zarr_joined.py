"""A zarr input read inside the transfer tasks, several chunks a task (multi-process cluster)."""

from __future__ import annotations

import dask.array as da
import numpy as np
import zarr

import rechunk_p2p
from tests.conftest import assert_clean_sync


def test_a_zarr_input_is_read_inside_the_transfers(p2p_client, tmp_path):
    z = zarr.open_array(tmp_path / "in.zarr", mode="w", shape=(256, 6, 10), chunks=(1, 6, 10))
    values = np.random.default_rng(0).random((256, 6, 10))
    z[:] = values
    x = da.from_zarr(z)
    plan = rechunk_p2p.plan(x, (256, 3, 5), n_workers=2)
    assert plan.groups is not None and plan.n_transfers < plan.n_input_chunks
    y = rechunk_p2p.rechunk(x, (256, 3, 5))
    transfers = [k for k in dict(y.__dask_graph__()) if "rechunk_p2p-transfer" in str(k)]
    assert len(transfers) == plan.n_transfers
    runs = p2p_client.run_on_scheduler(
        lambda dask_scheduler: dask_scheduler.plugins["rechunk-p2p"].runs_created
    )
    np.testing.assert_array_equal(y.compute(), values)
    after = p2p_client.run_on_scheduler(
        lambda dask_scheduler: dask_scheduler.plugins["rechunk-p2p"].runs_created
    )
    assert after - runs == plan.n_shuffles == 1
    assert_clean_sync(p2p_client)
