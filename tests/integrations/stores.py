"""Small zarr stores and data for the workflow tests."""

from __future__ import annotations

import os
import warnings

import numpy as np
import zarr

#: Shape of the small climate-like test data: (time, lat, lon).
SHAPE = (24, 10, 12)


def temperature(shape=SHAPE) -> np.ndarray:
    """Deterministic float32 data with a few NaNs (missing values)."""
    values = np.arange(np.prod(shape), dtype="float32").reshape(shape) / 7.0
    values[3, 2:4, 5] = np.nan
    return values


def make_climate_group(path: str | os.PathLike, zarr_format: int, *, consolidated: bool = True):
    """A group like xarray writes it: 3-D, 2-D and 1-D arrays with dimension names, a
    subgroup with an array without dimension names, and a 0-d array. Map chunks
    (one per time step)."""
    t, y, x = SHAPE
    group = zarr.open_group(
        path, mode="w-", zarr_format=zarr_format, attributes={"title": "test", "n": 1}
    )

    def array(name, values, chunks, dims, attrs, **kwargs):
        if zarr_format == 3:
            kwargs["dimension_names"] = dims
        elif dims is not None:
            attrs = {**attrs, "_ARRAY_DIMENSIONS": list(dims)}
        arr = group.create_array(
            name,
            shape=values.shape,
            chunks=chunks,
            dtype=values.dtype,
            attributes=attrs,
            **kwargs,
        )
        arr[...] = values
        return arr

    zstd = (
        zarr.codecs.ZstdCodec(level=7)
        if zarr_format == 3
        else __import__("numcodecs").Zstd(level=7)
    )
    array(
        "temperature",
        temperature(),
        (1, y, x),
        ("time", "lat", "lon"),
        {"units": "K"},
        fill_value=np.nan,
        compressors=zstd,
    )
    array(
        "orography",
        np.arange(y * x, dtype="float64").reshape(y, x),
        (y, x),
        ("lat", "lon"),
        {"units": "m"},
        fill_value=-1.0,
    )
    array(
        "time",
        np.arange(t, dtype="int32"),
        (t,),
        ("time",),
        {"units": "days since 2000-01-01"},
        fill_value=0,
    )
    array(
        "lat", np.linspace(-90, 90, y), (y,), ("lat",), {"units": "degrees_north"}, fill_value=0.0
    )
    array("lon", np.linspace(0, 330, x), (x,), ("lon",), {"units": "degrees_east"}, fill_value=0.0)
    array("version", np.array(3, dtype="int64"), (), None, {"note": "0-d"}, fill_value=0)
    group.create_group("meta", attributes={"source": "synthetic"})
    array("meta/station_ids", np.arange(7, dtype="int64") * 11, (3,), None, {}, fill_value=0)
    if consolidated:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", zarr.errors.ZarrUserWarning)
            zarr.consolidate_metadata(path, zarr_format=zarr_format)
    return group


def arrays_of(path) -> dict[str, zarr.Array]:
    """Every array under the group at ``path``, by relative name."""
    group = zarr.open_group(path, mode="r")
    return {n: a for n, a in group.members(max_depth=None) if isinstance(a, zarr.Array)}


def assert_same_values(a: zarr.Array, b: zarr.Array) -> None:
    """Element for element, NaN equal to NaN."""
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(a[...], b[...])
