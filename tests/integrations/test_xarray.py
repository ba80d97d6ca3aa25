"""rechunk_xarray on real xarray objects, and xarray's own zarr workflow through the engine."""

from __future__ import annotations

import dask
import dask.array as da
import numpy as np
import pytest
import xarray as xr
import zarr

import rechunk_p2p
from rechunk_p2p.errors import RechunkInputError, RechunkTypeError
from rechunk_p2p.integrations.xarray import rechunk_xarray
from tests.conftest import assert_clean_sync

from .stores import SHAPE, temperature

T, Y, X = SHAPE


def make_dataset() -> xr.Dataset:
    """Several variables of different dimensionality, dask- and numpy-backed, with
    coordinates (index and not), attributes and zarr-like encoding."""
    ds = xr.Dataset(
        {
            "temperature": (
                ("time", "lat", "lon"),
                da.from_array(temperature(), chunks=(1, Y, X)),
                {"units": "K", "long_name": "air temperature"},
            ),
            "precip": (("time", "lat"), np.arange(T * Y, dtype="int16").reshape(T, Y)),
            "orography": (("lat", "lon"), np.ones((Y, X)), {"units": "m"}),
            "version": ((), 3),
        },
        coords={
            "time": np.arange(T),
            "lat": np.linspace(-90, 90, Y),
            "lon": np.linspace(0, 330, X),
            "area": (("lat", "lon"), np.full((Y, X), 2.0), {"units": "km2"}),
        },
        attrs={"title": "test", "history": "made for a test"},
    )
    ds["temperature"].encoding = {
        "dtype": "float32",
        "_FillValue": np.nan,
        "chunks": (1, Y, X),
        "preferred_chunks": {"time": 1, "lat": Y, "lon": X},
        "compressors": (zarr.codecs.ZstdCodec(level=3),),
    }
    ds["orography"].encoding = {"dtype": "float64", "chunks": (Y, X)}
    return ds


def p2p_layers(obj) -> list[str]:
    return [name for name in obj.__dask_graph__().layers if name.startswith("rechunk-p2p")]


def test_dataset_keeps_names_coords_attrs_and_encoding():
    ds = make_dataset()

    out = rechunk_xarray(ds, {"time": -1, "lat": 5})

    assert isinstance(out, xr.Dataset)
    assert out["temperature"].chunks == ((T,), (5, 5), (X,))
    assert out["precip"].chunks == ((T,), (5, 5))
    assert out["orography"].chunks == ((5, 5), (X,))  # in memory before: chunked like .chunk()
    assert out["area"].chunks == ((5, 5), (X,))
    assert out["version"].chunks is None  # 0-d stays as it is
    for index in ("time", "lat", "lon"):
        assert out[index].variable.chunks is None  # index coordinates stay in memory
    assert list(out.data_vars) == list(ds.data_vars)
    assert set(out.coords) == set(ds.coords)
    assert out.attrs == ds.attrs
    assert out["temperature"].attrs == ds["temperature"].attrs
    assert out["area"].attrs == {"units": "km2"}
    enc = out["temperature"].encoding
    assert enc["compressors"] == ds["temperature"].encoding["compressors"]
    assert enc["dtype"] == "float32" and np.isnan(enc["_FillValue"])
    assert enc["chunks"] == (T, 5, X)  # layout keys describe the new chunks
    assert enc["preferred_chunks"] == {"time": T, "lat": 5, "lon": X}
    assert out["orography"].encoding == {"dtype": "float64", "chunks": (5, X)}
    assert p2p_layers(out["temperature"].data)  # the engine's graph, not dask's
    xr.testing.assert_identical(out.compute(), ds.compute())


def test_dataarray_with_positional_and_single_specs():
    arr = make_dataset()["temperature"]

    out = rechunk_xarray(arr, (6, -1, 4))
    assert out.name == "temperature"
    assert out.chunks == ((6,) * 4, (Y,), (4, 4, 4))
    assert out.coords["area"].chunks == ((Y,), (4, 4, 4))
    xr.testing.assert_identical(out.compute(), arr.compute())

    assert rechunk_xarray(arr, 6).chunks == ((6,) * 4, (6, 4), (6, 6))


def test_api_rechunk_hands_xarray_objects_to_rechunk_xarray():
    ds = make_dataset()
    out = rechunk_p2p.rechunk(ds, {"time": 12})
    assert isinstance(out, xr.Dataset)
    assert out["temperature"].chunks[0] == (12, 12)
    assert p2p_layers(out["temperature"].data)


@pytest.mark.parametrize(
    "obj, chunks, error, message",
    [
        ("ds", {"level": 2}, RechunkInputError, "'level'.*dimensions are"),
        ("ds", (1, 2, 3), RechunkInputError, "ambiguous for a Dataset"),
        ("da", (1, 2), RechunkInputError, "give 2 dimension.*has 3"),
        ("da", {"time": 1, "height": 2}, RechunkInputError, "'height'"),
        ("np", {"time": 1}, RechunkTypeError, "Dataset or DataArray"),
    ],
)
def test_bad_input(obj, chunks, error, message):
    ds = make_dataset()
    target = {"ds": ds, "da": ds["temperature"], "np": np.zeros(3)}[obj]
    with pytest.raises(error, match=message):
        rechunk_xarray(target, chunks)


@pytest.mark.filterwarnings("ignore:Consolidated metadata:UserWarning")
def test_open_zarr_chunk_to_zarr_through_the_engine(p2p_client, tmp_path):
    """xarray's own workflow, with dask's rechunk routed to the P2P engine."""
    ds = make_dataset().chunk({"time": 1})
    ds.to_zarr(tmp_path / "maps.zarr", zarr_format=3, consolidated=True)
    before = rechunk_p2p.cluster_statistics(p2p_client)

    with rechunk_p2p.installed(), dask.config.set({"array.rechunk.method": "p2p"}):
        opened = xr.open_zarr(tmp_path / "maps.zarr")
        rechunked = opened.chunk({"time": -1, "lat": 5})
        assert p2p_layers(rechunked["temperature"].data)
        for var in rechunked.variables.values():  # the source's chunks, not the new ones
            var.encoding.pop("chunks", None)
            var.encoding.pop("preferred_chunks", None)
        rechunked.to_zarr(tmp_path / "series.zarr", zarr_format=3)

    after = rechunk_p2p.cluster_statistics(p2p_client)
    assert after["runs"] > before["runs"]
    assert after["seconds_cut"] > before["seconds_cut"]  # the engine timed its phases
    assert after["seconds_assemble"] > before["seconds_assemble"]
    out = xr.open_zarr(tmp_path / "series.zarr")
    assert out["temperature"].encoding["chunks"] == (T, 5, X)
    xr.testing.assert_identical(out.compute(), ds.compute())
    assert_clean_sync(p2p_client)


def test_rechunk_xarray_then_to_zarr_writes_the_new_layout(p2p_client, tmp_path):
    ds = make_dataset()
    del ds["temperature"].encoding["compressors"]  # format 3 codecs; let format 2 choose
    ds.chunk({"time": 1}).to_zarr(tmp_path / "maps.zarr", zarr_format=2)
    opened = xr.open_zarr(tmp_path / "maps.zarr")

    rechunked = rechunk_xarray(opened, {"time": -1, "lon": 6})
    rechunked.to_zarr(tmp_path / "series.zarr", zarr_format=2)

    out = xr.open_zarr(tmp_path / "series.zarr")
    assert out["temperature"].encoding["chunks"] == (T, Y, 6)
    assert out["orography"].encoding["chunks"] == (Y, 6)
    xr.testing.assert_identical(out.compute(), opened.compute())
    assert_clean_sync(p2p_client)


def test_plan_of_a_dataset_has_a_plan_per_variable_and_totals():

    ds = xr.Dataset(
        {
            "t": (("time", "lat", "lon"), np.zeros((40, 6, 8), "f4")),
            "p": (("time", "lat"), np.zeros((40, 6))),
            "mask": (("lat", "lon"), np.ones((6, 8), bool)),
        },
        coords={"time": np.arange(40), "lat": np.arange(6.0), "lon": np.arange(8.0)},
    ).chunk({"time": 1})
    plan = rechunk_p2p.plan(ds, {"time": -1, "lat": 3})
    assert set(plan.plans) == {"t", "p", "mask"}  # mask: lat 6 -> 3
    assert plan.nbytes == sum(p.nbytes for p in plan.plans.values())
    assert plan.plans["t"].new_chunks == ((40,), (3, 3), (8,))
    assert "total" in repr(plan) and "pieces" in repr(plan)
    assert plan._repr_html_().count("<tr>") == 4
    same = rechunk_p2p.plan(ds, {"lon": 8})
    assert not same.plans  # nothing changes


@pytest.mark.parametrize("chunks", [{"time": 0}, {"lat": -4}, {"time": "0MiB"}])
def test_dataset_errors_name_the_variable_and_dimension(chunks):
    """The variable's name, never dask's name of its array, which the user never saw."""

    ds = xr.Dataset({"t": (("time", "lat"), np.zeros((10, 6)))}).chunk({"time": 1})
    ((dim, size),) = chunks.items()
    for entry in (rechunk_p2p.plan, rechunk_p2p.rechunk):
        with pytest.raises(ValueError) as info:
            entry(ds, chunks)
        message = str(info.value)
        assert f"Chunk size {size!r} along dimension {dim!r}" in message
        assert "of variable 't' is not" in message and ds.t.data.name not in message
        assert "\n" not in message and len(message) < 200
