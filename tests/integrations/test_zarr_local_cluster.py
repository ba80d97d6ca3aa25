"""rechunk_zarr without a client: it starts a LocalCluster for the call and closes it."""

from __future__ import annotations

import distributed
import numpy as np
import pytest
import zarr

from rechunk_p2p.integrations.zarr import rechunk_zarr


def test_without_client_runs_on_its_own_local_cluster(tmp_path):
    with pytest.raises(ValueError):
        distributed.get_client()  # no client: rechunk_zarr must bring its own cluster
    data = np.arange(40 * 6, dtype="float64").reshape(40, 6)
    arr = zarr.create_array(
        tmp_path / "src.zarr",
        shape=data.shape,
        chunks=(1, 6),
        dtype=data.dtype,
        dimension_names=("time", "x"),
    )
    arr[:] = data

    report = rechunk_zarr(arr, tmp_path / "tgt.zarr", {"time": -1, "x": 2}, progress=False)

    out = zarr.open_array(tmp_path / "tgt.zarr", mode="r")
    assert tuple(out.chunks) == (40, 2)
    np.testing.assert_array_equal(out[:], data)
    assert report.statistics["runs"] >= 1
    with pytest.raises(ValueError):
        distributed.get_client()  # the cluster was closed with its client
