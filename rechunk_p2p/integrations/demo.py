"""The demo behind ``rechunk-p2p demo``: a synthetic daily air temperature on a 1° grid.

Where it runs: client (creating zarr metadata, building and submitting graphs). The values
are computed in worker task threads by the pure function :func:`temperature_values`, once
to write the source and again to verify the target, so the check reads each store only in
its own chunks.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import dask.array as da
import numpy as np
import zarr
from dask.utils import format_bytes

from rechunk_p2p.errors import RechunkRunError
from rechunk_p2p.integrations.zarr import ZarrRechunkReport, rechunk_zarr
from rechunk_p2p.integrations.zarr_input import dimension_names

N_LAT, N_LON = 180, 360
#: Spatial chunks of the time series, finest last; the first that keeps chunks small wins.
SPATIAL_CHUNKS = ((30, 60), (15, 30), (10, 20), (5, 10))
MAX_OUTPUT_CHUNK_BYTES = 64 * 2**20
VARIABLE = "temperature"


@dataclass(frozen=True)
class DemoSource:
    """**Immutable.** Where the demo's source store is and how big it is."""

    path: str
    n_time: int

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.n_time, N_LAT, N_LON)

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def target_chunks(self) -> dict[str, int]:
        """Time series: the whole time axis, and a spatial tile small enough."""
        for lat, lon in SPATIAL_CHUNKS:
            if self.n_time * lat * lon * 4 <= MAX_OUTPUT_CHUNK_BYTES:
                break
        return {"time": -1, "lat": lat, "lon": lon}

    def describe(self) -> str:
        t, y, x = self.shape
        return (
            f"{format_bytes(self.n_elements * 4)} of float32 {VARIABLE} "
            f"(time={t}, lat={y}, lon={x}) in {self.path}, one chunk per time step"
        )


@contextlib.contextmanager
def workspace() -> Iterator[str]:
    """A temporary directory for the demo's stores, removed at the end (also on failure)."""
    path = tempfile.mkdtemp(prefix="rechunk-p2p-demo-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def generate(work: str, size: int) -> DemoSource:
    """Write about ``size`` bytes of temperature maps, one chunk per day, with coordinates.

    The maps are computed and written by the cluster of the current client.
    """
    source = DemoSource(os.path.join(work, "maps.zarr"), n_time=max(2, size // (N_LAT * N_LON * 4)))
    group = zarr.open_group(
        source.path,
        mode="w-",
        zarr_format=3,
        attributes={
            "title": "rechunk-p2p demo: synthetic daily near-surface air temperature",
            "Conventions": "CF-1.10",
        },
    )
    _coordinates(group, source.n_time)
    maps = group.create_array(
        VARIABLE,
        shape=source.shape,
        chunks=(1, N_LAT, N_LON),
        dtype="float32",
        fill_value=np.nan,
        dimension_names=("time", "lat", "lon"),
        attributes={
            "units": "K",
            "long_name": "near-surface air temperature",
            "standard_name": "air_temperature",
        },
    )
    values = _expected(source.shape, maps.chunks)
    da.store(values, cast(Any, maps), lock=False)  # (a zarr array takes the blocks)
    with warnings.catch_warnings():  # consolidated metadata is not yet in the v3 spec
        warnings.simplefilter("ignore", zarr.errors.ZarrUserWarning)
        zarr.consolidate_metadata(source.path)
    return source


def rechunk(source: DemoSource, work: str, *, storage: str | None = None) -> ZarrRechunkReport:
    """Rechunk the maps to time series with :func:`rechunk_zarr` on the current cluster."""
    target = os.path.join(work, "timeseries.zarr")
    report = rechunk_zarr(source.path, target, source.target_chunks, storage=storage)
    assert isinstance(report, ZarrRechunkReport)  # (computed: not a lazy ZarrRechunk)
    return report


def verify(source: DemoSource, target: str) -> None:
    """Check the target element for element, and its coordinates, attributes and chunks.

    Raises
    ------
    RechunkRunError
        Anything differs.
    """
    src = zarr.open_group(source.path, mode="r")
    tgt = zarr.open_group(target, mode="r")
    problems = []
    for name in ("time", "lat", "lon", VARIABLE):
        a, b = _array(src, name), _array(tgt, name)
        if dict(a.attrs) != dict(b.attrs) or dimension_names(a) != dimension_names(b):
            problems.append(f"{name}: attributes or dimension names differ")
    for name in ("time", "lat", "lon"):
        if not np.array_equal(_array(src, name)[:], _array(tgt, name)[:]):
            problems.append(f"coordinate {name} differs")
    chunks = source.target_chunks
    want = (source.n_time, chunks["lat"], chunks["lon"])
    variable = _array(tgt, VARIABLE)
    if tuple(variable.chunks) != want:
        problems.append(f"{VARIABLE} has chunks {variable.chunks}, not {want}")
    in_source, in_target = da.compute(_mismatches(_array(src, VARIABLE)), _mismatches(variable))
    if in_source or in_target:
        problems.append(
            f"{in_target:,} values of the target and {in_source:,} of the source "
            "differ from the generated data"
        )
    if problems:
        raise RechunkRunError("demo verification failed: " + "; ".join(problems))


def _mismatches(arr: zarr.Array) -> da.Array:
    """Number of elements of ``arr`` that differ from the generated data (lazy)."""
    stored = da.from_zarr(arr)
    return (stored != _expected(arr.shape, arr.chunks)).sum()


def _array(group: zarr.Group, name: str) -> zarr.Array:
    """The array ``name`` of ``group``; a group there fails the check."""
    node = group[name]
    if not isinstance(node, zarr.Array):
        raise RechunkRunError(f"{name} is a group, not an array")
    return node


def _coordinates(group: zarr.Group, n_time: int) -> None:
    coords: dict[str, tuple[np.ndarray, dict[str, Any]]] = {
        "time": (
            np.arange(n_time, dtype="int32"),
            {
                "units": "days since 2000-01-01",
                "calendar": "proleptic_gregorian",
                "standard_name": "time",
            },
        ),
        "lat": (
            -89.5 + np.arange(N_LAT, dtype="float64"),
            {"units": "degrees_north", "standard_name": "latitude"},
        ),
        "lon": (
            -179.5 + np.arange(N_LON, dtype="float64"),
            {"units": "degrees_east", "standard_name": "longitude"},
        ),
    }
    for name, (values, attrs) in coords.items():
        arr = group.create_array(
            name,
            shape=values.shape,
            chunks=values.shape,
            dtype=values.dtype,
            dimension_names=(name,),
            attributes=attrs,
        )
        arr[:] = values


def _expected(shape: tuple[int, ...], chunks: tuple[int, ...]) -> da.Array:
    """The generated data as a lazy dask array in ``chunks``."""
    template = da.empty(shape, chunks=chunks, dtype="float32")
    return template.map_blocks(_block, dtype="float32", meta=np.empty((0, 0, 0), "float32"))


def _block(template: np.ndarray, block_info: Any = None) -> np.ndarray:
    (t0, t1), (i0, i1), (j0, j1) = block_info[None]["array-location"]
    return temperature_values(t0, t1, i0, i1, j0, j1, n_time=block_info[None]["shape"][0])


def temperature_values(
    t0: int, t1: int, i0: int, i1: int, j0: int, j1: int, *, n_time: int
) -> np.ndarray:
    """Temperature (K) of days ``t0:t1``, latitudes ``i0:i1``, longitudes ``j0:j1``.

    Pure and exact: each element depends only on its indices, whatever block it is
    computed in (the trigonometry is evaluated on whole axes, then sliced; the rest is
    elementwise arithmetic), so verification can demand equality.
    """
    lat = np.deg2rad(-89.5 + np.arange(N_LAT))
    lon = np.deg2rad(-179.5 + np.arange(N_LON))
    season = np.cos(2 * np.pi * (np.arange(n_time) - 196) / 365.25)
    climate = (258.0 + 40.0 * np.cos(lat))[i0:i1, None] + (
        3.0 * np.cos(lat)[:, None] * np.sin(2 * lon)[None, :]
    )[i0:i1, j0:j1]
    seasonal = season[t0:t1, None, None] * (15.0 * np.sin(lat))[None, i0:i1, None]
    t = np.arange(t0, t1, dtype=np.uint64)[:, None, None]
    i = np.arange(i0, i1, dtype=np.uint64)[None, :, None]
    j = np.arange(j0, j1, dtype=np.uint64)[None, None, :]
    noise = ((t * 73856093) ^ (i * 19349663) ^ (j * 83492791)) % 1024 / 512.0 - 1.0
    return (climate[None] + seasonal + noise).astype(np.float32)
