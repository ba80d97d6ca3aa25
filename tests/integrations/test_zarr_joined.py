"""A zarr input read inside the transfer tasks, several chunks a task (multi-process cluster)."""

from __future__ import annotations

import dask.array as da
import numpy as np
import zarr

import rechunk_p2p
from tests.conftest import assert_clean_sync


def _runs_created(client) -> int:
    """Runs the scheduler's plugin has made; 0 before the first rechunk registers it (the
    module's cluster is new when a parallel test process starts with any of its tests)."""

    def count(dask_scheduler) -> int:
        plugin = dask_scheduler.plugins.get("rechunk-p2p")
        return 0 if plugin is None else plugin.runs_created

    return client.run_on_scheduler(count)


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
    runs = _runs_created(p2p_client)
    np.testing.assert_array_equal(y.compute(), values)
    after = _runs_created(p2p_client)
    assert after - runs == plan.n_shuffles == 1
    assert_clean_sync(p2p_client)


def test_rechunk_zarr_joins_within_its_memory_budget(p2p_client, tmp_path):
    """Without a budget the store's chunks are read several to a transfer; ``max_mem``
    bounds what a transfer joins to an eighth of it (here: less than two chunks, so none)."""
    from rechunk_p2p.integrations.zarr import rechunk_zarr

    group = zarr.open_group(tmp_path / "src.zarr", mode="w", zarr_format=3)
    values = np.random.default_rng(1).random((256, 6, 10))
    arr = group.create_array(
        "v", shape=values.shape, chunks=(1, 6, 10), dtype="f8", dimension_names=("t", "y", "x")
    )
    arr[...] = values
    chunks = {"t": -1, "y": 3}
    free = rechunk_zarr(tmp_path / "src.zarr", tmp_path / "a.zarr", chunks, compute=False)
    assert free.plan["v"].groups is not None
    tight = rechunk_zarr(
        tmp_path / "src.zarr", tmp_path / "b.zarr", chunks, compute=False, max_mem="4KiB"
    )
    assert tight.plan["v"].groups is None  # 512 B a transfer: one 480 B chunk
    for lazy, name in ((free, "a.zarr"), (tight, "b.zarr")):
        lazy.execute()
        out = zarr.open_group(tmp_path / name, mode="r")["v"]
        assert out.chunks == (256, 3, 10)
        np.testing.assert_array_equal(out[...], values)
    assert_clean_sync(p2p_client)


def test_xarray_open_zarr_chunk_joins_through_the_installed_engine(p2p_client, tmp_path):
    """xarray's own workflow (open_zarr, Dataset.chunk, to_zarr) with dask's rechunk routed to
    the engine: the store's time steps are read several to a transfer task."""
    import dask
    import xarray as xr

    values = np.random.default_rng(2).random((256, 6, 10)).astype("f4")
    ds = xr.Dataset({"v": (("time", "y", "x"), values)}, coords={"time": np.arange(256)})
    ds.chunk({"time": 1}).to_zarr(tmp_path / "maps.zarr", zarr_format=3, consolidated=False)
    before = _runs_created(p2p_client)
    with rechunk_p2p.installed(), dask.config.set({"array.rechunk.method": "p2p"}):
        opened = xr.open_zarr(tmp_path / "maps.zarr", consolidated=False)
        assert rechunk_p2p.plan(opened["v"].data, (256, 3, 5), n_workers=2).groups is not None
        rechunked = opened.chunk({"time": -1, "y": 3, "x": 5})
        graph = dict(rechunked["v"].data.__dask_graph__())
        transfers = [k for k in graph if "rechunk_p2p-transfer" in str(k)]
        assert 0 < len(transfers) < 256
        for var in rechunked.variables.values():
            var.encoding.pop("chunks", None)
            var.encoding.pop("preferred_chunks", None)
        rechunked.to_zarr(tmp_path / "series.zarr", zarr_format=3, consolidated=False)
    after = _runs_created(p2p_client)
    assert after > before
    out = xr.open_zarr(tmp_path / "series.zarr", consolidated=False)
    assert out["v"].encoding["chunks"] == (256, 3, 5)
    np.testing.assert_array_equal(out["v"].values, values)
    assert_clean_sync(p2p_client)
